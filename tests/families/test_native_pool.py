"""ComfyUI's own diffusion model on real gloo workers, against the same model called in this process.

Each case loads a tiny ComfyUI-format checkpoint with ComfyUI's own loader (comfy.sd.load_diffusion_model,
what UNETLoader calls) in one of the precisions ComfyUI offers — fp32, bf16, fp16, the fp8 weight
dtypes (fp8_e4m3fn, fp8_e4m3fn_fast, fp8_e5m2) and a scaled-fp8 checkpoint — makes it resident on the
pool through the native path (workers/bridge/spec.py -> workers/bridge/build.py) and compares one forward
with fresh random inputs against ComfyUI's own forward here:

* world size 1: bitwise equal (same class, same ops, same weights, same attention kernel);
* Ulysses / Ring / USP / CFG: ≤ 1e-5 relative where ComfyUI computes in fp32 (manual cast on CPU),
  a measured bound where it computes in bf16/fp16 itself (the attention kernel differs in rounding).

Sizes that do not divide by the degree are included (13 x 9 latents: 35 or 63 tokens on 2 ranks).
One pool per mesh, reused across families and precisions (module scope).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.comfy

PRECISIONS = ["fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2", "scaled_fp8"]
MESHES = {"d1": {}, "u2": {"ulysses_degree": 2}, "r2": {"ring_degree": 2}, "cfg2": {"cfg_degree": 2},
          "u2r2": {"ulysses_degree": 2, "ring_degree": 2}, "t2": {"tp_degree": 2},
          "t2u2": {"tp_degree": 2, "ulysses_degree": 2}}
MESHES.update({f"{m}+": MESHES[m] for m in ("d1", "u2", "u2r2", "t2")})  # the rest of those meshes' matrix (slow)
SLOW_MESHES = {"t2u2", "d1+", "u2+", "u2r2+", "t2+"}


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd  # noqa: F401
    # one folder for the session: every module that loads these seeded checkpoints (engine/test_shard,
    # families/test_native_refs, ...) reads the files the first one wrote (Flux's 531M take 9 s to write)
    folder = tmp_path_factory.getbasetemp() / "native_ckpt"
    folder.mkdir(exist_ok=True)
    return folder


def _scaled_fp8(sd: dict) -> dict:
    """ComfyUI's scaled-fp8 checkpoint layout: 2-D Linear weights stored fp8 with a per-layer scale_weight,
    and the `scaled_fp8` marker key (its dtype is the fp8 format)."""
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2 and "embed" not in k:
            scale = v.float().abs().max() / 448.0
            out[k] = (v.float() / scale).to(torch.float8_e4m3fn)
            out[k[: -len("weight")] + "scale_weight"] = scale.reshape(())
        else:
            out[k] = v
    out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return out


_CKPT_ARGS = {
    "sd3": lambda tc, p: tc.write_sd3(p, depth=2, pos_embed_max_size=32, seed=21),
    "wan": lambda tc, p: tc.write_wan(p, dim=256, ffn_dim=256, seed=22),
    "wan2": lambda tc, p: tc.write_wan(p, dim=256, ffn_dim=256, num_layers=2, seed=23),  # two PipeFusion stages
    "pixart": lambda tc, p: tc.write_pixart(p, depth=2, seed=23),  # two blocks: one per PipeFusion stage
    # ComfyUI fixes Flux.1's width at 3072: one block of each kind is 531M parameters (tested in fp8 here)
    "flux": lambda tc, p: tc.write_flux(p, guidance=True, seed=24),
}


def load_model(tmp, family: str, precision: str):
    """A ComfyUI ModelPatcher for the family's tiny checkpoint in `precision`, as UNETLoader would load it."""
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from safetensors.torch import load_file, save_file

    path = tmp / f"{family}.safetensors"
    if not path.exists():
        _CKPT_ARGS[family](tc, path)
    options = {}
    if precision == "scaled_fp8":
        scaled = tmp / f"{family}_scaled_fp8.safetensors"
        if not scaled.exists():
            save_file(_scaled_fp8(load_file(str(path))), str(scaled))
        path = scaled
    elif precision != "fp32":
        options["dtype"] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3fn": torch.float8_e4m3fn,
                            "fp8_e4m3fn_fast": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[precision]
        if precision == "fp8_e4m3fn_fast":
            options["fp8_optimizations"] = True
    return comfy.sd.load_diffusion_model(str(path), model_options=options)


def inputs(family: str, base, seed: int, batch: int = 2, odd: bool = True) -> dict:
    """Fresh random inputs as BaseModel._apply_model hands them to the diffusion model (cast, scaled)."""
    g = torch.Generator().manual_seed(seed)
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    h, w = (9, 13) if odd else (8, 12)
    if family == "sd3":
        d = {"x": torch.randn(batch, 16, h, w, generator=g), "context": torch.randn(batch, 7, 32, generator=g),
             "y": torch.randn(batch, 24, generator=g)}
    elif family == "flux":
        d = {"x": torch.randn(batch, 16, h, w, generator=g), "context": torch.randn(batch, 7, 32, generator=g),
             "y": torch.randn(batch, 24, generator=g), "guidance": torch.full((batch,), 3.5)}
    elif family == "wan":
        d = {"x": torch.randn(batch, 16, 2, h, w, generator=g), "context": torch.randn(batch, 7, 4096, generator=g)}
    else:  # PixArt: ComfyUI needs even sides with (H + W) // 2 >= 33
        d = {"x": torch.randn(batch, 4, 34, 36 if odd else 32, generator=g),
             "context": torch.randn(batch, 8, 4096, generator=g)}
    d = {k: v.to(dtype) for k, v in d.items()}
    d["timestep"] = torch.rand(batch, generator=g) * (1 if family == "flux" else 1000)
    return d


def comfy_forward(base, inp: dict) -> torch.Tensor:
    """ComfyUI's own forward as its executor runs a prompt: under inference mode (execution.py) - its quantized
    layers compute otherwise under plain no_grad."""
    rest = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
    with torch.inference_mode():
        return base.diffusion_model(inp["x"], inp["timestep"], transformer_options={}, **rest)


def pool_forward(pool, config, key: str, base, inp: dict) -> torch.Tensor:
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    dm = base.diffusion_model
    # the weights as Runtime.ensure_native sends them: as the layers hold them (not state_dict(), which ComfyUI's
    # mixed-precision ops write in their file form); a quantized weight as its inner tensors
    pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base),
                      state_dict=lambda: {k: raw(v) for k, v in host_tensors(dm).items()})
    res = pool.submit(config, "forward", {"key": key, "structure": {"transformer_options": {}}}, dict(inp))
    return res.tensors["out"]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def tolerance(base) -> float:
    """fp32 compute (fp32 weights, or manual cast from fp8 on CPU): the exact-method bound. ComfyUI computing
    in bf16/fp16 itself: the rounding of a different attention kernel in that dtype (measured ~1e-3)."""
    compute = base.manual_cast_dtype or base.diffusion_model.dtype
    return 1e-5 if compute == torch.float32 else 2e-2


@pytest.fixture(scope="module")
def pool(forks):
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    p = WorkerPool(device="cpu", forks=forks)
    yield p
    p.close()


# Each mesh's cases: CI runs every precision of SD3 at degree 1, three at Ulysses 2 (fp32, bf16, fp8) and at least one
# case of each family per mesh, every weight format on more than one rank; the rest of the matrix (the "<mesh>+" cases)
# runs with the slow set. Flux (531M: its width is fixed) runs in fp32 in CI, under tensor parallel here (its own
# TP plan) - fp8 casts all its weights at every call on a CPU, on every rank; its degree 1 and Ulysses run with the
# slow set (15 and 5 s here): ComfyUI's Flux under u2 / r2 / cfg2 is in CI through the pool in
# tests/families/test_native_refs.py (with reference latents), degree 1 is the same call on every family.
def _cases(mesh):
    if mesh == "d1":
        return [("sd3", p) for p in PRECISIONS] + [("wan", "fp32"), ("wan", "bf16"), ("wan", "scaled_fp8"),
                                                   ("pixart", "fp16"), ("pixart", "fp8_e4m3fn_fast"),
                                                   ("pixart", "fp8_e5m2")]
    if mesh == "d1+":
        return [("wan", p) for p in PRECISIONS if p not in ("fp32", "bf16", "scaled_fp8")] + \
            [("pixart", p) for p in PRECISIONS if p not in ("fp16", "fp8_e4m3fn_fast", "fp8_e5m2")] + \
            [("flux", "fp32"), ("flux", "fp8_e4m3fn"), ("flux", "scaled_fp8")]
    if mesh == "u2":
        return [("sd3", p) for p in ("fp32", "bf16", "fp8_e4m3fn")] + [("wan", "fp32"), ("pixart", "bf16")]
    if mesh == "u2+":  # SD3's other formats on two ranks stay in CI elsewhere: fp16 and fp8_e5m2 in r2 (pixart fp16,
        # sd3 fp8_e5m2), fp8_e4m3fn_fast and scaled_fp8 in t2 (sd3); each format's load is proven bitwise by d1
        return [("sd3", "fp16"), ("sd3", "fp8_e4m3fn_fast"), ("sd3", "fp8_e5m2"), ("sd3", "scaled_fp8"),
                ("wan", "fp8_e4m3fn"), ("pixart", "fp32"), ("pixart", "scaled_fp8"), ("flux", "fp32"),
                ("flux", "fp8_e4m3fn"), ("flux", "scaled_fp8")]
    if mesh == "r2":
        return [("sd3", "fp32"), ("sd3", "fp8_e5m2"), ("wan", "scaled_fp8"), ("pixart", "fp16")]
    if mesh == "cfg2":
        return [("sd3", "bf16"), ("wan", "fp32")]
    if mesh == "t2":
        return [("sd3", "fp32"), ("sd3", "bf16"), ("sd3", "fp8_e4m3fn_fast"), ("sd3", "scaled_fp8"), ("wan", "fp32"),
                ("wan", "fp8_e4m3fn"), ("flux", "fp32"), ("pixart", "fp32"), ("pixart", "fp8_e4m3fn")]
    if mesh == "t2+":
        return [("flux", "fp8_e4m3fn")]
    if mesh == "t2u2":
        return [("sd3", "fp16"), ("wan", "scaled_fp8"), ("flux", "scaled_fp8"), ("pixart", "bf16")]
    if mesh == "u2r2":
        return [("sd3", "fp32"), ("wan", "fp8_e4m3fn")]
    return [("flux", "fp8_e5m2")]  # u2r2+


def test_native_distrifusion_stale_step(comfy, pool):
    """DistriFusion on ComfyUI's own model: step 0 is synchronous (equals ComfyUI's forward); step 1 is
    stale, and on the same inputs the stale K/V of step 0 are the fresh ones, so it equals it too - this
    exercises the stale buffers and their asynchronous refresh, not only the warmup path."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(ulysses_degree=2, method="distrifusion", warmup_steps=1)
    for family, precision in (("sd3", "fp8_e4m3fn"), ("wan", "fp32")):
        base = load_model(comfy, family, precision).model
        inp = inputs(family, base, seed=77)
        ref = comfy_forward(base, inp)
        key = f"df:{family}:{precision}"
        pool_forward(pool, config, key, base, inp)  # loads the model
        for step in (0, 1):
            res = pool.submit(config, "forward", {"key": key, "call_index": step,
                                                  "structure": {"transformer_options": {}}}, dict(inp))
            err = rel(res.tensors["out"], ref)
            print(f"distrifusion {family} {precision} step {step}: rel {err:.2e}")
            assert err <= 1e-5, (family, step, err)
        # and the stale step really is stale: after a step 0 on other inputs, step 1 sees their K/V
        other = inputs(family, base, seed=78)
        pool.submit(config, "forward", {"key": key, "call_index": 0, "structure": {"transformer_options": {}}},
                    dict(other))
        res = pool.submit(config, "forward", {"key": key, "call_index": 1,
                                              "structure": {"transformer_options": {}}}, dict(inp))
        stale = rel(res.tensors["out"], ref)
        print(f"distrifusion {family} {precision} step 1 after other inputs: rel {stale:.2e}")
        assert stale > 1e-4, stale


# t2u2 (66 s on 2 cores) and the rest of d1 / u2 / u2r2's matrix run with the slow set: tensor parallel (t2) and
# Ulysses (u2) each stay in CI
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.slow) if m in SLOW_MESHES else m for m in MESHES])
def test_native_forward_equals_comfyui(comfy, pool, mesh):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(**MESHES[mesh])
    failures = []
    for i, (family, precision) in enumerate(_cases(mesh)):
        patcher = load_model(comfy, family, precision)
        base = patcher.model
        for odd in (True, False):
            inp = inputs(family, base, seed=100 + i * 2 + odd, odd=odd)
            ref = comfy_forward(base, inp)
            out = pool_forward(pool, config, f"{mesh}:{family}:{precision}", base, inp)
            assert out.dtype == ref.dtype and out.shape == ref.shape
            err = rel(out, ref)
            print(f"{mesh} {family} {precision} {'odd' if odd else 'even'}: rel {err:.2e}")
            if mesh.startswith("d1"):
                if not torch.equal(out, ref):
                    failures.append(f"{family} {precision}: not bitwise at degree 1 (rel {err:.2e})")
            elif err > tolerance(base):
                failures.append(f"{family} {precision} {'odd' if odd else 'even'}: rel {err:.2e} > {tolerance(base)}")
    assert not failures, failures


def test_ulysses_ranks_run_the_drivers_kernel(comfy, pool):
    """A sequence-parallel worker imports ComfyUI with its pytorch kernel (PixArt's attention must be
    interceptable), yet its Ulysses attention runs the kernel ComfyUI picked in the driver (here, on a CPU
    without flags, sub-quadratic): the worker resolves it by ComfyUI's registry name and reports which it runs.
    tests/engine/test_attention_kernel.py shows the Ulysses attention really is that kernel's output."""
    from comfyui_hybrid_parallel.workers.bridge.spec import comfy_runtime, family_adapter, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    import comfy.ldm.modules.attention as attention
    name = comfy_runtime().attention
    assert name is not None and attention.get_attention_function(name) is attention.optimized_attention
    config = ParallelConfig(ulysses_degree=2)
    base = load_model(comfy, "sd3", "fp32").model
    dm = base.diffusion_model
    loaded = pool.ensure_model(config, "kernel:sd3", family_adapter(dm).family, native=native_spec(base),
                               state_dict=lambda: dict(dm.state_dict()))
    assert loaded["attention"] == name, (loaded, name)
    inp = inputs("sd3", base, seed=9, odd=True)
    err = rel(pool_forward(pool, config, "kernel:sd3", base, inp), comfy_forward(base, inp))
    assert err <= 1e-5, err


def test_fp8_stays_fp8_on_the_workers(comfy, pool):
    """Per-rank weight bytes equal ComfyUI's for that precision: the workers report what they hold."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(ulysses_degree=2)
    base = load_model(comfy, "sd3", "fp8_e4m3fn").model
    sd = base.diffusion_model.state_dict()
    assert any(v.dtype == torch.float8_e4m3fn for v in sd.values())
    want = sum(v.numel() * v.element_size() for v in sd.values())
    pool_forward(pool, config, "fp8-bytes", base, inputs("sd3", base, seed=5))
    res = pool.submit(config, "model_bytes", {"key": "fp8-bytes"})
    for r in res.per_rank:
        assert r["bytes"] == want, (r, want)
        assert r["dtypes"].get("float8_e4m3fn", 0) > 0


def test_tp_shards_stay_fp8(comfy, pool):
    """Tensor parallel on ComfyUI's own fp8 Flux: each rank holds its shard of the fp8 weights, in fp8 (half
    the block weights per rank at tp 2; the modulation, embedders and final layer stay replicated)."""
    from comfyui_hybrid_parallel.workers.bridge.spec import check_declared
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(tp_degree=2)
    base = load_model(comfy, "flux", "fp8_e4m3fn").model
    check_declared(base.diffusion_model, config)
    sd = base.diffusion_model.state_dict()
    want = {}
    for v in sd.values():
        name = str(v.dtype).removeprefix("torch.")
        want[name] = want.get(name, 0) + v.numel() * v.element_size()
    blocks = sum(v.numel() * v.element_size() for k, v in sd.items()
                 if ("_attn." in k or "_mlp." in k or ".linear1." in k or ".linear2." in k) and k.endswith("weight"))
    full = sum(want.values())
    pool_forward(pool, config, "tp-fp8-bytes", base, inputs("flux", base, seed=6))
    res = pool.submit(config, "model_bytes", {"key": "tp-fp8-bytes"})
    for r in res.per_rank:
        print("tp2 rank bytes", r["bytes"], "of", full, r["dtypes"])
        assert set(r["dtypes"]) == set(want), (r["dtypes"], want)  # no dtype appears that ComfyUI does not hold
        assert r["dtypes"]["float8_e4m3fn"] < want["float8_e4m3fn"]
        assert abs(r["bytes"] - (full - blocks / 2)) <= 0.01 * full, (r["bytes"], full, blocks)


def test_clean_stop_exits_the_workers_without_a_kill(comfy):
    """After real work (ComfyUI imported, a model resident, gloo joined) a stop releases what each worker owns and
    ends it at once: exit code 0 (the pool SIGKILLs stragglers after its grace period, which every stop used
    to reach: ~3.1 s in the outside probe; bench/bench_reliability.py prints the figure)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.launch import STOP_GRACE_S
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    import time
    base = load_model(comfy, "sd3", "fp32").model
    p = WorkerPool(device="cpu")
    try:
        pool_forward(p, ParallelConfig(ulysses_degree=2), "stop", base, inputs("sd3", base, seed=9))
        procs = list(p.world.procs)
        t = time.monotonic()
        p.stop()
        took = time.monotonic() - t
        print(f"clean stop took {took:.2f} s")
        assert [q.returncode for q in procs] == [0, 0]
        assert took < STOP_GRACE_S
    finally:
        p.close()


def record_loads(pool) -> list:
    """A list that gets, per load_model job the pool submits from now on, whether weights travelled with it."""
    carried = []
    submit = pool.submit

    def recording(config, kind, values=None, tensors=None, **kw):
        if kind == "load_model":
            carried.append(bool(tensors or kw.get("written")))
        return submit(config, kind, values, tensors, **kw)
    pool.submit = recording
    return carried


def test_config_change_keeps_the_workers(comfy):
    """A config change that keeps the world size keeps the worker processes (no restart, ComfyUI stays imported):
    each rank builds the new mesh's process groups and the model's layout for it from the weights it already holds
    (nothing travels again), and drops the layout of the old mesh (one copy of the weights per rank). Every mesh still equals ComfyUI's forward,
    and going back to an earlier mesh works (its groups are kept)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    base = load_model(comfy, "sd3", "fp32").model
    want = sum(v.numel() * v.element_size() for v in base.diffusion_model.state_dict().values())
    with WorkerPool(device="cpu") as pool:
        pool.split_kernel_worlds = False  # as when ComfyUI's own kernel is pytorch's: cfg/dp share the workers too
        carried = record_loads(pool)  # per load_model job: did weights travel?
        pids = gen = None
        for i, mesh in enumerate(("u2", "r2", "cfg2", "u2", "sharded")):
            config = (ParallelConfig(ulysses_degree=2, shard_weights="all") if mesh == "sharded"
                      else ParallelConfig(**MESHES[mesh]))
            inp = inputs("sd3", base, seed=300 + i)
            err = rel(pool_forward(pool, config, "switch", base, inp), comfy_forward(base, inp))
            print(f"config change -> {mesh}: rel {err:.2e}, world generation {pool.generation}")
            assert err <= 1e-5, (mesh, err)
            health = pool.health()
            assert all(h["resident"] == ["switch"] and h["layouts"] == 1 for h in health), health
            if pids is None:
                pids, gen = [h["pid"] for h in health], pool.generation
            assert pool.generation == gen and [h["pid"] for h in health] == pids, mesh
            held = pool.submit(config, "model_bytes", {"key": "switch"}).per_rank
            if mesh == "sharded":
                assert all(r["bytes"] < want for r in held), held
            else:
                assert all(r["bytes"] == want for r in held), (held, want)
        # the weights travelled once: each later mesh was built on the workers from the weights they held
        assert carried[0] and not any(carried[1:]), carried


def test_step_inputs_cross_once_per_run(comfy, pool, monkeypatch):
    """Step mode sends a run's unchanged conditioning once: later calls carry the latent and timestep only (the
    workers reuse their copy), and the output equals a call that sends everything. Changed conditioning is sent
    again; a call naming a previous call the workers do not hold fails clearly and the pool stays usable. (The
    protocol is the family's business not at all: the tiny SD3, not the 531M Flux - 2 min on 2 cores.) On the module's
    pool: its run and its key ("once") are this test's own."""
    from comfyui_hybrid_parallel.workers.driver.step import submit_once
    from comfyui_hybrid_parallel.workers.messages import ForwardJob
    from comfyui_hybrid_parallel.workers.driver.run_record import RunPlan, RunRecord
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerError
    base = load_model(comfy, "sd3", "fp8_e4m3fn").model
    config = ParallelConfig(ulysses_degree=2)
    sent = []
    submit = pool.submit

    def recording(config, kind, values=None, tensors=None, **kw):
        if kind == "forward":
            sent.append(sorted(tensors or {}))
        return submit(config, kind, values, tensors, **kw)
    monkeypatch.setattr(pool, "submit", recording)  # the module's pool: its own submit again after this test
    state, calls, outs = RunRecord(RunPlan(key="once", lineage="once", native={})), [], []
    first = inputs("sd3", base, seed=400)
    pool_forward(pool, config, "once", base, first)  # resident
    sent.clear()
    for call in range(4):
        inp = inputs("sd3", base, seed=410 + call)  # a new latent and timestep every step
        cond = {k: (v if call < 3 else v + 1).clone() for k, v in first.items() if k not in ("x", "timestep")}
        inp.update(cond)  # the same conditioning in new tensors (as ComfyUI hands it), changed at call 3
        values = ForwardJob(key="once", call_index=call, structure={"transformer_options": {}})
        outs.append(submit_once(pool, config, values, dict(inp), state, ("x", "timestep")).tensors["out"])
        calls.append((values, inp))
    once = list(sent)
    for out, (values, inp) in zip(outs, calls):  # every tensor sent, after the run
        assert torch.equal(out, pool.submit(config, "forward", values.message(), dict(inp)).tensors["out"])
        assert rel(out, comfy_forward(base, inp)) <= 1e-5
    print("sent per call:", once)
    assert once[0] == sorted(first) and once[1] == once[2] == ["timestep", "x"], once
    assert set(once[3]) == set(first), once  # changed conditioning travels again
    with pytest.raises(WorkerError, match="does not hold"):
        submit(config, "forward", {"key": "once", "call_index": 9, "run": "other", "previous_call": 8,
                                   "reuse": ["context"], "structure": {"transformer_options": {}}},
               {"x": first["x"], "timestep": first["timestep"]})
    assert torch.equal(submit(config, "forward", {"key": "once", "structure": {"transformer_options": {}}},
                              dict(first)).tensors["out"], pool_forward(pool, config, "once", base, first))


def test_ranks_sharing_devices_talk_through_staged_copies(comfy):
    """share_devices (parallel/staged.py): what lets one GPU run every multi-rank method's CUDA code (the GPU
    suite). On CPU every tensor is staged, so a result not copied back would show here: Ulysses, ring and CFG
    through staged gloo equal ComfyUI's own forward."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    pool = WorkerPool(device="cpu", share_devices=True)
    try:
        for degrees, family in ((dict(ulysses_degree=2), "sd3"), (dict(ring_degree=2), "wan"),
                                (dict(cfg_degree=2), "sd3")):
            config = ParallelConfig(**degrees)
            base = load_model(comfy, family, "fp32").model
            inp = inputs(family, base, seed=31)
            out = pool_forward(pool, config, f"staged-{family}", base, inp)
            assert rel(out, comfy_forward(base, inp)) <= 1e-5, (degrees, family)
        assert [h["staged"] for h in pool.health()] == [True, True]
    finally:
        pool.close()


def test_a_method_change_on_the_same_ranks_gets_its_own_model(comfy, pool):
    """USP and DistriFusion on the same ranks share process groups, not a parallelized model: a model built for
    DistriFusion (stale K/V hooks) served the next USP loop before (0.21 relative error), and a USP model served
    DistriFusion (no stale activations at all). The resident layout is keyed by mesh and method. On the module's pool
    (a 2-rank world as its own was): the model's key (doctor:fp32) is this test's own, none of it resident before."""
    from comfyui_hybrid_parallel.doctor import methods as m
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    path = comfy / "method_switch.safetensors"
    tiny.write_sd3(path, depth=4, pos_embed_max_size=32, seed=31)
    case = m._Case(path, "fp32").on(torch.device("cpu"))
    loads = []
    for degrees, kind in (({"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1}, "stale"),
                          ({"ulysses_degree": 2}, "loop"),
                          ({"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1}, "stale")):
        config = ParallelConfig(**degrees)
        loads.append(pool.ensure_model(config, case.key, case.family, native=case.spec("cpu"),
                                       state_dict=lambda: dict(case.dm.state_dict()))["loaded"])
        run = m._run_loop if kind == "loop" else m._run_forward
        assert run(pool, config, case, m.Mesh("x", degrees, kind), "cpu")["rel"] <= 1e-5, degrees
    assert loads == [True, True, True]  # each method built its own layout (from the weights the ranks hold)


def test_ranks_of_given_or_probed_speeds_share_the_sequence_by_speed(comfy):
    """HP_BALANCE / WorkerPool(balance=): speeds given per rank, or probed at world start, reach every rank; the
    sequence split follows them and the output still equals ComfyUI's (tests/engine/test_uneven_ranks.py has the split
    itself). A speeds list that does not match the world is refused before any worker starts."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    base = load_model(comfy, "sd3", "fp32").model
    inp = inputs("sd3", base, seed=41)
    ref = comfy_forward(base, inp)
    for balance in ([1.0, 3.0], "probe"):
        pool = WorkerPool(device="cpu", balance=balance)
        try:
            for config in (ParallelConfig(ulysses_degree=2), ParallelConfig(ring_degree=2)):
                assert rel(pool_forward(pool, config, "balanced", base, inp), ref) <= 1e-5, (balance, config)
            speeds = [h["speeds"] for h in pool.health()]
            assert speeds[0] == speeds[1] and len(speeds[0]) == 2 and min(speeds[0]) > 0
            if balance != "probe":
                assert speeds[0] == [1.0, 3.0]
        finally:
            pool.close()
    pool = WorkerPool(device="cpu", balance="1,2,3")
    with pytest.raises(ValueError, match="lists 3 rank speeds but ulysses2 has 2 ranks"):
        pool.ensure_world(ParallelConfig(ulysses_degree=2))
    assert pool.world is None
    pool.close()


def test_two_experts_and_a_vae_stay_resident_and_a_new_patch_version_replaces_the_old(comfy):
    """max_models counts diffusion models only: a Wan 2.2-like prompt (two experts, a VAE) alternating on a pool of
    max_models=2 loads each once. A new patch version of one expert (same lineage, new key - a LoRA strength
    change) replaces the old one on the workers before it loads."""
    from comfyui_hybrid_parallel.doctor.methods import _vae
    from comfyui_hybrid_parallel.workers.bridge.vae import native_vae_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    config = ParallelConfig(ulysses_degree=2)
    high, low = load_model(comfy, "sd3", "fp32").model, load_model(comfy, "wan", "fp32").model
    vae = _vae(comfy)  # ComfyUI's own KL VAE, as Parallel VAE Decode loads it
    pool = WorkerPool(device="cpu", max_models=2)
    try:
        def load(key, base, lineage):
            from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
            dm = base.diffusion_model
            return pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base),
                                     lineage=lineage, state_dict=lambda: dict(dm.state_dict()))["loaded"]
        loaded = []
        for _ in range(3):  # three prompts: high expert, low expert, decode
            loaded += [load("high:p0", high, "high"), load("low:p0", low, "low")]
            loaded.append(pool.ensure_model(config, "vae", "vae_comfy", native=native_vae_spec(vae),
                                            state_dict=lambda: dict(vae.first_stage_model.state_dict()))["loaded"])
        assert loaded == [True] * 3 + [False] * 6
        assert load("high:p1", high, "high")  # the high expert with another LoRA strength
        health = pool.health()
        assert all(sorted(h["resident"]) == ["high:p1", "low:p0", "vae"] for h in health), health
        assert all(h["evicted"] == ["high:p0@mesh=1-1-1-1-2-1-()-none-usp"] for h in health), health
    finally:
        pool.close()



def test_model_description_reads_only_what_this_comfyui_declares(comfy, caplog):
    """The model's description for the workers reads config names of several ComfyUI versions (scaled_fp8 and
    layer_quant_config before 0.33, quant_config since); ComfyUI 0.33's model config logs "you accessed ... which
    doesn't exist" for each name it lacks - twice per prompt in the user's console until the pack asked first."""
    import logging
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    base = load_model(comfy, "sd3", "fp8_e4m3fn").model
    with caplog.at_level(logging.WARNING):
        spec = native_spec(base)
    assert not [r.getMessage() for r in caplog.records if "you accessed" in r.getMessage()]
    assert spec.ops.weight_dtype is not None
