"""Every parallel method, through the worker pool, on the embedded tiny model, against its serial forward.

Why through the pool and ComfyUI's own model: that is the path a prompt takes (worker processes,
NCCL or gloo, the shared-memory weight transport, the ComfyUI-native build, the attention seam),
so a pass here means the nodes work on this machine, not only the maths. The model is ComfyUI's
MMDiT (SD3 family) with four heads and four joint blocks, written by the pack's tiny-checkpoint
builder and loaded by ComfyUI's UNETLoader path in each precision checked; inputs are fresh
random tensors, on a latent that splits evenly over the ranks and one that does not.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

from ..nodes.vae_node import native_vae_spec
from ..parallel import ParallelConfig
from ..parallel.loop import run_loop
from ..parallel.pipefusion import flow
from ..workers.bridge.spec import check_native_pipefusion, check_native_tp, family_adapter, native_spec
from ..workers.pool import WorkerPool
from . import tiny_checkpoints as tiny
from .machine import median_ms
from .tiny_checkpoints import TINY_CONTEXT_DIM, TINY_POOLED_DIM

STEPS = 3            # PipeFusion loop length (warmup = all steps: the exact schedule)
CFG_SCALE = 3.0
SIZES = ((9, 13), (8, 12))  # latent rows x cols: 63 and 48 patch tokens (odd splits, even splits)


@dataclass(frozen=True)
class Mesh:
    name: str
    degrees: dict = field(default_factory=dict)
    kind: str = "forward"  # forward | loop (the loop job: PipeFusion, or any method in loop mode) | stale
                           # (DistriFusion) | vae (Parallel VAE Decode)

    @property
    def world(self) -> int:
        return ParallelConfig(**self.degrees).world_size


MESHES = (
    Mesh("degree 1"),
    Mesh("ulysses 2", {"ulysses_degree": 2}),
    Mesh("ring 2", {"ring_degree": 2}),
    Mesh("cfg 2", {"cfg_degree": 2}),
    Mesh("data 2", {"dp_degree": 2}),
    Mesh("tensor 2", {"tp_degree": 2}),
    Mesh("pipefusion 2", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": STEPS}, "loop"),
    Mesh("distrifusion 2", {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1}, "stale"),
    Mesh("ulysses 2, loop mode", {"ulysses_degree": 2}, "loop"),
    Mesh("patch vae decode 2", {"ulysses_degree": 2}, "vae"),
    Mesh("ulysses 2, sharded weights", {"ulysses_degree": 2, "shard_weights": "sequence"}),
    Mesh("ulysses 4", {"ulysses_degree": 4}),
    Mesh("ulysses 2 x ring 2", {"ulysses_degree": 2, "ring_degree": 2}),
    Mesh("tensor 2 x ulysses 2", {"tp_degree": 2, "ulysses_degree": 2}),
    Mesh("cfg 2 x ulysses 2", {"cfg_degree": 2, "ulysses_degree": 2}),
    Mesh("cfg 2 x ulysses 2, sharded weights", {"cfg_degree": 2, "ulysses_degree": 2, "shard_weights": "all"}),
    Mesh("pipefusion 2 x ulysses 2", {"pp_degree": 2, "num_pipeline_patch": 2, "ulysses_degree": 2,
                                      "warmup_steps": STEPS}, "loop"),
    Mesh("patch vae decode 4", {"ulysses_degree": 4}, "vae"),
    Mesh("ulysses 4 x ring 2", {"ulysses_degree": 4, "ring_degree": 2}),
    Mesh("cfg 2 x ulysses 2 x ring 2", {"cfg_degree": 2, "ulysses_degree": 2, "ring_degree": 2}),
)


def meshes_for(gpus: int, max_cpu_world: int, quick: bool = False, share: bool = False) -> list:
    """(mesh, "cuda"|"cpu") for every mesh that fits: on the GPUs when it fits them, else on CPU workers.
    share: ranks share the GPUs (parallel/staged.py), so every mesh runs its CUDA code on them."""
    plan = []
    for m in MESHES:
        if quick and m.world > 2:
            continue
        if m.world <= gpus or (share and gpus):
            plan.append((m, "cuda"))
        elif m.world <= max_cpu_world:
            plan.append((m, "cpu"))
    return plan


def _load(path, precision: str):
    """ComfyUI's ModelPatcher for the checkpoint in `precision`, as UNETLoader loads it (weight_dtype)."""
    import comfy.sd
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8_e4m3fn": torch.float8_e4m3fn,
              "fp8_e4m3fn_fast": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
    if precision not in dtypes:
        raise ValueError(f"unknown precision {precision!r}; choose from {', '.join(dtypes)}")
    # fp32 named explicitly: left to itself ComfyUI stores the weights in fp16/bf16 on a GPU
    options = {"dtype": dtypes[precision]}
    if precision == "fp8_e4m3fn_fast":
        options["fp8_optimizations"] = True
    return comfy.sd.load_diffusion_model(str(path), model_options=options)


def _inputs(base, seed: int, size, batch: int = 2) -> dict:
    """SD3 inputs as BaseModel._apply_model hands them to the diffusion model ([cond, uncond] batch)."""
    g = torch.Generator().manual_seed(seed)
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    d = {"x": torch.randn(batch, 16, *size, generator=g), "context": torch.randn(batch, 7, TINY_CONTEXT_DIM, generator=g),
         "y": torch.randn(batch, TINY_POOLED_DIM, generator=g)}
    d = {k: v.to(dtype) for k, v in d.items()}
    d["timestep"] = torch.rand(batch, generator=g) * 1000
    return d


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rel(a, b) -> float:
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


def _bound(base, mesh: Mesh):
    """Degree 1 must be bitwise; exact methods 1e-5 where ComfyUI computes in fp32; 2e-2 where it computes in
    bf16/fp16 itself (another attention split rounds differently in that dtype)."""
    if mesh.world == 1:
        return 0.0
    compute = base.manual_cast_dtype or base.diffusion_model.dtype
    return 1e-5 if compute == torch.float32 else 2e-2


class _Case:
    """One precision of the tiny model: ComfyUI's model in this process and how the pool gets it."""

    def __init__(self, path, precision: str):
        self.precision = precision
        self.patcher = _load(path, precision)
        self.base = self.patcher.model
        self.dm = self.base.diffusion_model
        self.family = family_adapter(self.dm).family
        self.key = f"doctor:{precision}"
        self.compute = self.base.manual_cast_dtype or self.dm.dtype

    def on(self, device: torch.device) -> "_Case":
        self.dm.to(device)
        self.device = device
        return self

    def spec(self, kind: str):
        spec = native_spec(self.base)
        if kind == "cpu":  # CPU workers beside a GPU driver: ComfyUI in them must pick the CPU too
            runtime = spec.runtime
            spec = replace(spec, runtime=replace(runtime, comfy_args={**runtime.comfy_args, "cpu": True}))
        return spec

    def serial(self, inp: dict) -> torch.Tensor:
        inp = {k: v.to(self.device) for k, v in inp.items()}
        rest = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
        with torch.no_grad():
            return self.dm(inp["x"], inp["timestep"], transformer_options={}, **rest)

    def serial_loop(self, inp: dict, sigmas, noise) -> torch.Tensor:
        cond = {k: v.to(self.device) for k, v in inp.items() if k not in ("x", "timestep")}
        fwd = lambda h, t, kw: self.dm(h, t, transformer_options={}, **kw)  # noqa: E731
        with torch.no_grad():
            return run_loop(self.dm, cond, sigmas.to(self.device), noise.to(self.device), convention=flow(1000.0),
                            sampler="euler", cfg_scale=CFG_SCALE, forward=fwd,
                            dtype=self.base.manual_cast_dtype or self.dm.dtype, timestep_dtype=torch.float32)


def _sync(device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def _run_forward(pool, config, case: _Case, mesh: Mesh, kind: str) -> dict:
    rels = []
    values = {"key": case.key, "structure": {"transformer_options": {}}}
    for i, size in enumerate(SIZES):  # the last (even) size is the one timed below
        inp = _inputs(case.base, seed=1000 + 10 * i + len(mesh.name), size=size)
        ref = case.serial(inp)
        calls = (0, 1) if mesh.kind == "stale" else (None,)  # DistriFusion: the synchronous step, then a stale one
        for call in calls:
            v = dict(values, call_index=call) if call is not None else values
            got = pool.submit(config, "forward", v, dict(inp)).tensors["out"]
            if got.shape != ref.shape or got.dtype != ref.dtype:
                raise AssertionError(f"output {tuple(got.shape)} {got.dtype} != serial {tuple(ref.shape)} {ref.dtype}")
            rels.append(0.0 if torch.equal(got, ref.cpu()) else _rel(got, ref))
    return {"rel": max(rels), "serial_ms": median_ms(lambda: case.serial(inp), sync=_sync(case.device)),
            "ms": median_ms(lambda: pool.submit(config, "forward", v, dict(inp)))}


def _run_loop(pool, config, case: _Case, mesh: Mesh, kind: str) -> dict:
    """PipeFusion runs the whole sampling loop on the workers: compare the final latent with the serial loop.
    The latent must sit on the patch grid (ComfyUI pads before the model; the loop job takes it as is)."""
    size = SIZES[1]
    inp = _inputs(case.base, seed=2000 + len(mesh.name), size=size)
    g = torch.Generator().manual_seed(2001)
    noise = torch.randn(1, 16, *size, generator=g)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    ref = case.serial_loop(inp, sigmas, noise)
    cond = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
    values = {"key": case.key, "structure": {"transformer_options": {}}, "sampler": "euler", "cfg_scale": CFG_SCALE,
              "convention": {"kind": "flow", "timestep_scale": 1000.0}}
    tensors = {**cond, "noise": noise, "sigmas": sigmas}
    got = pool.submit(config, "loop", values, dict(tensors)).tensors["out"]
    sync = _sync(case.device)
    return {"rel": 0.0 if torch.equal(got, ref.cpu()) else _rel(got, ref),
            "serial_ms": median_ms(lambda: case.serial_loop(inp, sigmas, noise), sync=sync) / STEPS,
            "ms": median_ms(lambda: pool.submit(config, "loop", values, dict(tensors))) / STEPS}


def _vae(tmp):
    """A small KL VAE in ComfyUI's format, loaded as VAELoader does (ComfyUI's own VAE model: what Parallel VAE Decode
    runs on the ranks), seeded."""
    import comfy.sd
    import comfy.utils
    path = tmp / "doctor_kl_vae.safetensors"
    if not path.exists():
        tiny.write_kl_vae(path, style="sd", seed=7)
    return comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)), dtype=torch.float32)


def _run_vae(pool, config, vae) -> dict:
    """Parallel VAE Decode (halo exchange, group norm statistics across ranks, the mid attention's gathered keys)
    against ComfyUI's own decode of the same model, on latent heights that split evenly over the ranks and one that
    does not. Small latents (72 x 56 and 64 x 48 pixels): every band still holds two or more latent rows at 4 ranks, and
    a decode stays well under a second on a CPU core."""
    model, dtype = vae.first_stage_model, vae.vae_dtype
    device = next(model.parameters()).device

    def serial(latent):
        with torch.no_grad():
            return model.decode(latent.to(device, dtype))
    rels = []
    for i, size in enumerate(((9, 7), (8, 6))):
        latent = torch.randn(1, 4, *size, generator=torch.Generator().manual_seed(50 + i))
        ref = serial(latent)
        got = pool.vae_decode(config, "doctor:vae", latent.to(dtype))
        rels.append(0.0 if torch.equal(got, ref.cpu()) else _rel(got, ref))
    sync = _sync(device)
    return {"rel": max(rels), "serial_ms": median_ms(lambda: serial(latent), sync=sync),
            "ms": median_ms(lambda: pool.vae_decode(config, "doctor:vae", latent.to(dtype)))}


def _vae_row(pool, config, mesh, kind, tmp, progress) -> dict:
    row = {"method": mesh.name, "degrees": config.describe(), "world": mesh.world, "device": kind,
           "precision": "fp32", "weights": "float32", "compute": "float32"}
    try:
        vae = _vae(tmp)
        first = vae.first_stage_model
        t = time.perf_counter()
        pool.ensure_model(config, "doctor:vae", "vae_comfy", native=native_vae_spec(vae),
                          state_dict=lambda: {k: v.detach().cpu() for k, v in first.state_dict().items()})
        row["load_s"] = round(time.perf_counter() - t, 2)
        row.update(_run_vae(pool, config, vae), bound=1e-5)
        row["ok"] = row["rel"] <= 1e-5
        if not row["ok"]:
            row["error"] = f"relative error {row['rel']:.2e} over the bound 1e-05"
    except Exception as e:  # noqa: BLE001 - one failing method must not hide the others
        row.update(ok=False, error=f"{type(e).__name__}: {e}")
    progress(_line(row))
    return row


def check_methods(plan, precisions, tmp, progress=print, share_devices: bool = False) -> list:
    """Run every (mesh, device) of `plan` in every precision; one row each (ok, rel, bound, timings, error).
    share_devices: the GPU ranks share the GPUs over staged gloo (parallel/staged.py; the GPU suite on one GPU)."""
    path = tmp / "doctor_sd3.safetensors"
    tiny.write_sd3(path, depth=4, pos_embed_max_size=32, seed=31)
    cases = [_Case(path, p) for p in precisions]
    pools, rows = {}, []
    try:
        for mesh, kind in plan:
            device = torch.device("cuda", 0) if kind == "cuda" else torch.device("cpu")
            if kind not in pools:
                pools[kind] = WorkerPool(device=kind, max_models=len(cases) + 1, share_devices=share_devices)
            pool = pools[kind]
            config = ParallelConfig(**mesh.degrees)
            if mesh.kind == "vae":  # one VAE, decoded in fp32 whatever the DiT's precisions
                rows.append(_vae_row(pool, config, mesh, kind, tmp, progress))
                continue
            for case in cases:
                row = {"method": mesh.name, "degrees": config.describe(), "world": mesh.world, "device": kind,
                       "precision": case.precision, "weights": _name(case.dm.dtype), "compute": _name(case.compute)}
                if kind == "cpu" and case.precision == "fp8_e4m3fn_fast":
                    # the model was set up for the GPU's fp8 matmuls; CPU workers cannot run those
                    row.update(ok=True, skipped="fp8 matmuls are a GPU feature (this mesh runs on CPU workers)")
                    progress(_line(row))
                    rows.append(row)
                    continue
                try:
                    case.on(device)
                    bound = _bound(case.base, mesh)
                    check_native_tp(case.dm, config)
                    check_native_pipefusion(case.dm, config, (1, 16, *SIZES[1]))
                    t = time.perf_counter()  # the first precision of a mesh pays the world's start
                    pool.ensure_model(config, case.key, case.family, native=case.spec(kind),
                                      state_dict=lambda c=case: {k: t.detach() for k, t in c.dm.state_dict().items()})
                    row["load_s"] = round(time.perf_counter() - t, 2)
                    run = _run_loop if mesh.kind == "loop" else _run_forward
                    row.update(run(pool, config, case, mesh, kind), bound=bound)
                    row["ok"] = row["rel"] <= bound
                    if not row["ok"]:
                        row["error"] = ("not bitwise equal to the serial forward" if bound == 0 else
                                        f"relative error {row['rel']:.2e} over the bound {bound:.0e}")
                except Exception as e:  # noqa: BLE001 - one failing method must not hide the others
                    row.update(ok=False, error=f"{type(e).__name__}: {e}")
                progress(_line(row))
                rows.append(row)
    finally:
        for p in pools.values():
            p.close()
    return rows


def _line(r: dict) -> str:
    bound = "bitwise" if r.get("bound") == 0 else (f"{r['bound']:.0e}" if "bound" in r else "-")
    rel = f"{r['rel']:.1e}" if "rel" in r else "-"
    ms = (f"{r['serial_ms']:8.1f} {r['ms']:8.1f} {r['serial_ms'] / r['ms']:5.2f}x" if "ms" in r
          else f"{'-':>8s} {'-':>8s} {'-':>6s}")
    result = ("skipped: " + r["skipped"] if r.get("skipped") else "ok" if r.get("ok") else
              "FAIL: " + str(r.get("error", "")).strip().splitlines()[-1][:160])
    dtypes = f"{r.get('weights', '-')}/{r.get('compute', '-')}"
    load = f"{r['load_s']:6.2f}" if "load_s" in r else f"{'-':>6s}"
    return (f"{r['method']:34s} {r.get('world', '-')!s:>5s} {r.get('device', '-'):5s} {r.get('precision', '-'):16s} "
            f"{dtypes:22s} {rel:>8s} {bound:>8s} {load} {ms}  {result}")


def method_table(rows) -> str:
    head = (f"{'method':34s} {'world':>5s} {'dev':5s} {'precision':16s} {'weights/compute':22s} {'rel err':>8s} {'bound':>8s} "
            f"{'load s':>6s} {'serial':>8s} {'parallel':>8s} {'speed':>6s}  result   (load: world start + weights; "
            f"serial/parallel: ms per step)")
    return "\n".join([head] + [_line(r) for r in rows])
