"""ComfyUI's quantized checkpoints (mixed-precision ops: a comfy-kitchen QuantizedTensor per quantized weight) on the
workers: carried as their quantized bytes and scales, rebuilt around them, never dequantized.

Since ComfyUI 0.33 every quantized checkpoint loads through `comfy.ops.mixed_precision_ops` (`quant_config`): the
per-layer `comfy_quant` files (fp8, int8, nvfp4, mxfp8) and every old scaled-fp8 file (`scaled_fp8` marker +
`scale_weight`, converted on load by comfy.utils.convert_old_quants). The files here are written by ComfyUI's and
comfy-kitchen's own code: the old scaled-fp8 form as the other tests write it (test_native_pool._scaled_fp8), and the
per-layer form from each layout's own `quantize` and the tensor's own `state_dict`, with the `comfy_quant` entry as
ComfyUI encodes it.

Checked: what travels is JSON plus the very inner tensors ComfyUI holds (no copy, nothing pickled); degree 1 on the
pool is ComfyUI's forward bitwise, ulysses / ring / cfg ≤ 1e-5 (ComfyUI computes in fp32 on CPU); shard_weights holds
exactly 1/N of the quantized bytes and scales per rank (in-process byte for byte, and on the pool); tensor parallel
splits tensorwise layouts (fp8, int8: the values sliced, the scale kept) and refuses block-scaled ones by name.
"""
from __future__ import annotations

import json

import pytest
import torch

from test_native_pool import comfy_forward, inputs, pool_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy

NEW = ["float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "nvfp4", "mxfp8"]  # per-layer comfy_quant formats
TENSORWISE = {"scaled_fp8", "float8_e4m3fn", "float8_e5m2", "int8_tensorwise"}
FP8_BYTES = {"scaled_fp8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8_tensorwise": 1}  # stored bytes per weight


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{form: path} of a tiny SD3 in each quantized form this ComfyUI loads as quantized tensors."""
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.supported_models_base
    if "quant_config" not in vars(comfy.supported_models_base.BASE):
        pytest.skip("this ComfyUI (< 0.33) loads scaled-fp8 files with its scaled-fp8 ops and per-layer quantized "
                    "files not at all: tests/families/test_native_pool.py covers scaled fp8 there")
    from safetensors.torch import load_file, save_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from test_native_pool import _scaled_fp8
    tmp = tmp_path_factory.mktemp("quantized")
    src = tmp / "sd3.safetensors"
    tc.write_sd3(src, depth=2, pos_embed_max_size=32, seed=21)
    sd = load_file(str(src))
    out = {"scaled_fp8": tmp / "sd3_scaled_fp8.safetensors",
           "names": {k for k, v in sd.items() if k.endswith(".weight") and v.ndim == 2 and "embed" not in k}}
    save_file(_scaled_fp8(sd), str(out["scaled_fp8"]))
    for fmt in NEW:
        out[fmt] = tmp / f"sd3_{fmt}.safetensors"
        save_file(_comfy_quant_file(sd, fmt), str(out[fmt]))
    return out


def _comfy_quant_file(sd: dict, fmt: str, only=None) -> dict:
    """ComfyUI's per-layer quantized form of `sd`: every 2-D Linear weight quantized by the layout ComfyUI loads
    `fmt` with (its own `quantize`, comfy-kitchen's kernels), written by the tensor's own `state_dict`, and the
    layer's `comfy_quant` entry encoded as comfy.utils.convert_old_quants encodes it. `only(key, weight)`: the layers
    to quantize, where a layout takes some shapes only (convrot_w4a4 / asym_w4a8_int8: input widths in groups of
    256) - a mixed file, as the tools that write them make."""
    import comfy.quant_ops as q
    kwargs = {"scale": "recalculate"} if fmt.startswith("float8") else {}
    if fmt == "int8_per_channel":  # int8 with a scale per output row: the int8 layout's own per-channel form
        fmt, kwargs = "int8_tensorwise", {"per_channel": True}
    layout = q.QUANT_ALGOS[fmt]["comfy_tensor_layout"]
    cls = q.get_layout_class(layout)
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2 and "embed" not in k and (only is None or only(k, v)):
            qdata, params = cls.quantize(v, **kwargs)
            out.update(q.QuantizedTensor(qdata, layout, params).state_dict(k))
            out[k[:-len("weight")] + "comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode("utf-8")),
                                                                   dtype=torch.uint8)
        else:
            out[k] = v
    return out


def tolerance(form: str, split_weights: bool = False) -> float:
    """The exact bound for every layout where each rank holds whole weights: under inference mode, as ComfyUI runs a
    prompt, its int8 forward is split-insensitive (it needed a measured 3e-2 while the ranks and the reference ran
    under no_grad: test_comfyui_computes_quantized_layers_by_grad_mode). Where the weights are split (tensor parallel,
    shard_weights="all" with cfg), int8 tensorwise stays measured, 3e-2 (seen 3.6e-4 and 1.1e-2): its activations are
    quantized per row of what the rank holds - open, docs/comfyui-versions.md."""
    return 3e-2 if split_weights and form == "int8_tensorwise" else 1e-5


def _load(files, form: str):
    import comfy.sd
    return comfy.sd.load_diffusion_model(str(files[form])).model


def _quantized(dm) -> dict:
    from comfyui_hybrid_parallel.parallel.shard import is_wrapper
    from comfyui_hybrid_parallel.workers.bridge.loader_types import module_tensors
    return {k: t for k, t in module_tensors(dm).items() if is_wrapper(t)}


def _worker_model(base):
    """What a worker builds (workers/bridge/build.build_native) from the spec, through JSON, and the weights as
    Runtime.ensure_native sends them (each cloned: the bytes as another process maps them)."""
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    from comfyui_hybrid_parallel.workers.bridge.build import build_native
    from comfyui_hybrid_parallel.workers.messages import NativeSpec
    from comfyui_hybrid_parallel.workers.bridge.loader_types import host_tensors, raw
    spec = NativeSpec.from_message(json.loads(json.dumps(native_spec(base).message())))
    weights = {k: raw(v).clone() for k, v in host_tensors(base.diffusion_model).items()}
    return build_native(spec, weights, torch.device("cpu"), sequence_parallel=False), spec, weights


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values as raw bytes (torch compares no fp8 tensors)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Base:  # what comfy_forward reads of a BaseModel
    def __init__(self, dm):
        self.diffusion_model = dm


@pytest.mark.parametrize("form", ["scaled_fp8"] + NEW)
def test_quantized_weights_travel_as_their_bytes_and_rebuild_bitwise(files, form):
    """The spec is JSON; what travels for a quantized weight is its inner tensors - the very tensors ComfyUI's
    QuantizedTensor holds (no dequantize, no copy) - under "<name>#<inner>"; its layout, the layout's other
    parameters and the layer's comfy_quant entry are JSON. A worker's model built from those (in this process)
    holds the same layouts around the bytes it was sent, set up by ComfyUI's own loader, and computes ComfyUI's
    forward bitwise."""
    from comfyui_hybrid_parallel.workers.bridge.spec import check_weights, native_spec, weight_bytes
    from comfyui_hybrid_parallel.workers.messages import NativeSpec
    from comfyui_hybrid_parallel.parallel.shard import wrapper_parts
    from comfyui_hybrid_parallel.workers.bridge.loader_types import host_tensors
    base = _load(files, form)
    dm = base.diffusion_model
    quantized = _quantized(dm)
    assert set(quantized) == files["names"], sorted(quantized)  # every layer the file quantizes, none other
    spec = native_spec(base)
    assert NativeSpec.from_message(json.loads(json.dumps(spec.message()))) == spec
    assert spec.ops.quant_config == base.model_config.quant_config
    assert set(spec.quantized) == set(quantized) and spec.tensors is None
    sent = host_tensors(dm)
    held_bytes = 0
    for name, t in quantized.items():
        parts, ctx = wrapper_parts(t)
        meta = spec.quantized[name]
        assert meta["layout"] == t._layout_cls == ctx["layout_cls"]
        assert meta["comfy_quant"]["format"] == getattr(dict(dm.named_modules())[name.rpartition(".")[0]],
                                                        "quant_format")
        for inner, p in parts.items():
            assert sent[f"{name}#{inner}"] is p, (name, inner)  # the tensor ComfyUI holds, not a copy
            held_bytes += p.numel() * p.element_size()
        if form in FP8_BYTES:
            assert parts["_qdata"].element_size() == FP8_BYTES[form] and parts["_qdata"].numel() == t.numel()
        assert name not in sent
    plain = sum(v.numel() * v.element_size() for k, v in sent.items() if "#" not in k)
    assert check_weights(dm) == weight_bytes(dm) == plain + held_bytes

    model, spec, weights = _worker_model(base)
    mine = _quantized(model)
    assert set(mine) == set(quantized)
    for name, t in mine.items():
        parts, ctx = wrapper_parts(t)
        assert isinstance(t, torch.nn.Parameter) and not t.requires_grad
        assert ctx == wrapper_parts(quantized[name])[1]  # layout, parameter class, orig_dtype, orig_shape
        for inner, p in parts.items():
            assert p is weights[f"{name}#{inner}"], (name, inner)  # around the bytes that travelled, not a copy
        owner = dict(model.named_modules())[name.rpartition(".")[0]]
        driver = dict(dm.named_modules())[name.rpartition(".")[0]]
        for attr in ("quant_format", "layout_type", "_full_precision_mm", "_full_precision_mm_config"):
            assert getattr(owner, attr) == getattr(driver, attr), (name, attr)  # set up by ComfyUI's own loader
    inp = inputs("sd3", base, seed=7)
    assert torch.equal(comfy_forward(_Base(model), inp), comfy_forward(base, inp))


def test_the_drivers_copy_can_take_the_mapped_pages(files):
    """loader_types.adopt_inner (for Runtime.adopter): each inner tensor of ComfyUI's QuantizedTensors replaced by its
    copy - as the pages written for the workers replace it - leaves the model holding those tensors and computing
    the same forward bitwise; a plain weight's name or a mismatching tensor changes nothing."""
    from comfyui_hybrid_parallel.parallel.shard import wrapper_parts
    from comfyui_hybrid_parallel.workers.bridge.loader_types import adopt_inner, host_tensors
    for form in ("scaled_fp8", "nvfp4"):
        base = _load(files, form)
        dm = base.diffusion_model
        inp = inputs("sd3", base, seed=21)
        want = comfy_forward(base, inp)
        owners = dict(dm.named_modules())
        mapped = {k: v.clone() for k, v in host_tensors(dm).items() if "#" in k}
        assert not adopt_inner(owners, "final_layer.linear.bias", torch.zeros(16))
        k0 = next(iter(mapped))
        assert not adopt_inner(owners, k0, torch.zeros(3))
        assert all(adopt_inner(owners, k, v) for k, v in mapped.items())
        held = host_tensors(dm)
        assert all(held[k] is v for k, v in mapped.items())
        assert all(isinstance(t, torch.nn.Parameter) for t in _quantized(dm).values())
        assert set(_quantized(dm)) == files["names"] and all(
            wrapper_parts(t)[1]["layout_cls"] == t._layout_cls for t in _quantized(dm).values())
        assert torch.equal(comfy_forward(base, inp), want), form


MESHES = {"d1": {}, "u2": {"ulysses_degree": 2}, "cfg2": {"cfg_degree": 2}, "r2": {"ring_degree": 2}}


@pytest.mark.parametrize("mesh", list(MESHES))
def test_pool_forward_equals_comfyui(files, cpu_pool, mesh):
    """Through the real pool: degree 1 equals ComfyUI's forward bitwise for every layout; ulysses / cfg / ring
    (the old scaled-fp8 file and the per-layer fp8 one, and on ulysses every layout) ≤ 1e-5 (int8: `tolerance`), on
    latents that split evenly and unevenly. Degree 1 also on a batch of one (KSampler at cfg 1): the layers' fp32
    tensors ComfyUI's loader maps start where the file puts them within a 64-byte line, and a CPU matmul's rounding
    follows that start on such a batch - the workers map them at the same start (transport.lead_of; 2.8e-7 apart,
    int8 tensorwise 1e-3, when their copies started at the line)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(**MESHES[mesh])
    forms = ["scaled_fp8"] + NEW if mesh in ("d1", "u2") else ["scaled_fp8", "float8_e4m3fn"]
    failures = []
    for i, form in enumerate(forms):
        base = _load(files, form)
        for odd, batch in ((True, 2), (False, 2)) + (((True, 1),) if mesh == "d1" else ()):
            inp = inputs("sd3", base, seed=500 + 2 * i + odd, odd=odd, batch=batch)
            ref = comfy_forward(base, inp)
            out = pool_forward(cpu_pool, config, f"q:{mesh}:{form}", base, inp)
            err = rel(out, ref)
            print(f"{config.describe()} {form} {'odd' if odd else 'even'} x{batch}: rel {err:.2e}")
            if mesh == "d1" and not torch.equal(out, ref):
                failures.append((form, odd, batch, "not bitwise", err))
            elif out.shape != ref.shape or err > tolerance(form):
                failures.append((form, odd, err))
    assert not failures, failures


def test_comfyui_computes_quantized_layers_by_grad_mode(files):
    """Why the workers run every job under inference mode (workers/jobs.py), as ComfyUI's executor runs a prompt:
    ComfyUI's quantized layers take another path under plain no_grad. There its int8 forward of a batch of 2 and of
    each sample alone differ by ~1e-2 (activations quantized per call) and fp8 differs from the inference-mode
    forward; under inference mode fp8 is split-insensitive to fp32 rounding, and int8 is on an Intel Xeon's kernels
    (an AMD EPYC's int8 kernels leave 3.1e-3 there: still closer than under no_grad, 8.8e-3)."""
    inp = inputs("sd3", _load(files, "scaled_fp8"), seed=600, odd=True)

    def forward(base, x, mode):
        rest = {k: v for k, v in x.items() if k not in ("x", "timestep")}
        with mode():
            return base.diffusion_model(x["x"], x["timestep"], transformer_options={}, **rest)
    for form in ("int8_tensorwise", "float8_e4m3fn"):
        base = _load(files, form)
        errs = {}
        for name, mode in (("inference", torch.inference_mode), ("no_grad", torch.no_grad)):
            whole = forward(base, inp, mode)
            alone = torch.cat([forward(base, {k: v[i:i + 1] for k, v in inp.items()}, mode) for i in range(2)])
            errs[name] = rel(alone, whole)
        print(f"ComfyUI {form}: batch of 2 vs one by one: {errs}")
        if form == "int8_tensorwise":  # the path a no_grad rank took: further from ComfyUI's numbers
            assert errs["no_grad"] >= 1e-3 and errs["inference"] < errs["no_grad"], (form, errs)
        else:
            assert errs["inference"] <= 1e-5, (form, errs)


def test_a_config_change_rebuilds_from_the_quantized_bytes_held(files):
    """A config change that keeps the workers rebuilds the model for the new mesh from the inner tensors each rank
    already holds (engine.source_weights: the plain tensors that travelled, regrouped into QuantizedTensors again) -
    ulysses, cfg, ring, tensor parallel - and each equals ComfyUI's forward; the quantized bytes travelled once."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    base = _load(files, "scaled_fp8")
    with WorkerPool(device="cpu") as pool:
        pool.split_kernel_worlds = False  # cfg / dp share the workers too
        from test_native_pool import record_loads
        carried = record_loads(pool)
        # (a layout that splits the weights - tp, shard_weights - keeps no source: it comes last, as for any model)
        for i, config in enumerate((ParallelConfig(ulysses_degree=2), ParallelConfig(cfg_degree=2),
                                    ParallelConfig(ring_degree=2), ParallelConfig(tp_degree=2))):
            inp = inputs("sd3", base, seed=800 + i)
            err = rel(pool_forward(pool, config, "qswitch", base, inp), comfy_forward(base, inp))
            print(f"config change -> {config.describe()}: rel {err:.2e}")
            assert err <= 1e-5, (config.describe(), err)
        assert carried[0] and not any(carried[1:]), carried


def test_pipefusion_stages_hold_their_quantized_blocks(files, cpu_pool):
    """PipeFusion on quantized weights (a stage frees the other stages' blocks through the layers' own _apply, which
    re-wraps a QuantizedTensor): the exact schedule (warmup = all steps) equals ComfyUI's model through the same loop
    in this process (≤ 1e-5), for a tensorwise and a block-scaled layout."""
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    from test_native_pipefusion import _convention, _serial_loop
    steps = 3
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    for form in ("scaled_fp8", "nvfp4"):
        base = _load(files, form)
        dm = base.diffusion_model
        inp = inputs("sd3", base, seed=905, batch=2, odd=False)
        noise = torch.randn(1, *inp["x"].shape[1:], generator=torch.Generator().manual_seed(904))
        ref = _serial_loop("sd3", base, inp, sigmas, noise, cfg_scale=3.0)
        config = ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=steps)
        key = f"qpf:{form}"
        cpu_pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base),
                              state_dict=lambda: {k: raw(v) for k, v in host_tensors(dm).items()})
        cond = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
        values = {"key": key, "structure": {"transformer_options": {}}, "sampler": "euler", "cfg_scale": 3.0,
                  "convention": _convention("sd3", sigmas)[1]}
        out = cpu_pool.submit(config, "loop", values, {**cond, "noise": noise, "sigmas": sigmas}).tensors["out"]
        err = rel(out, ref)
        print(f"PipeFusion pp2 {form}: rel {err:.2e}")
        assert err <= 1e-5, (form, err)


class _Axis:
    def __init__(self, size: int, rank: int):
        self.size, self.rank, self.group = size, rank, None


def test_each_rank_holds_exactly_its_share_of_the_quantized_bytes(files):
    """WeightSharding of ComfyUI's quantized SD3 on two ranks (in this process; no collective needed to shard): the
    quantized bytes and scales are regions of the flat buffer like any weight, each rank's shard is exactly its half
    of it, the two halves together are the driver's bytes byte for byte (padding zero), and the QuantizedTensors
    rebuilt around the gathered buffer compute ComfyUI's forward bitwise; released, a rank holds no weight whole."""
    from comfyui_hybrid_parallel.parallel.shard import SHARD_BUFFER, WeightSharding, is_wrapper, wrapper_parts
    from comfyui_hybrid_parallel.workers.bridge.loader_types import host_tensors
    for form in ("scaled_fp8", "int8_tensorwise", "nvfp4", "mxfp8"):
        ref = _load(files, form)
        inp = inputs("sd3", ref, seed=11)
        want = comfy_forward(ref, inp)
        original = {k: v.clone() for k, v in host_tensors(ref.diffusion_model).items()}
        quantized_bytes = sum(v.numel() * v.element_size() for k, v in original.items() if "#" in k)
        ranks = []
        for r in range(2):
            dm = _load(files, form).diffusion_model
            s = WeightSharding(dm, _Axis(2, r))
            s.remove()  # the hooks gather with a collective: driven by hand below
            ranks.append((dm, s))
        (dm, s0), (_, s1) = ranks
        assert s0.quantized_bytes == s1.quantized_bytes == quantized_bytes
        assert s0.quantized_shard_bytes + s1.quantized_shard_bytes == quantized_bytes
        paths = {id(m): p for p, m in dm.named_modules()}
        for u0, u1 in zip(s0.units, s1.units):
            per = u0.size // 2
            assert u0.shard.dtype == torch.uint8 and u0.shard.numel() == u1.shard.numel() == per  # exactly half
            full = torch.cat([u0.shard, u1.shard])
            covered = torch.zeros(u0.size, dtype=torch.bool)
            for e in u0.entries:
                key = f"{paths[id(e.owner)]}.{e.name}".lstrip(".")
                for inner, _, _, off, n in e.regions():
                    src = original[key if inner is None else f"{key}#{inner}"]
                    assert torch.equal(full[off:off + n], _bytes(src)), key
                    covered[off:off + n] = True
            assert not full[~covered].any()  # the rest is alignment padding
            u0.full = full
        for u in s0.units:
            s0._materialize(u)
        assert torch.equal(comfy_forward(_Base(dm), inp), want), form
        rebuilt = _quantized(dm)
        assert set(rebuilt) == files["names"] and all(
            wrapper_parts(t)[1] == wrapper_parts(_quantized(ref.diffusion_model)[k])[1] for k, t in rebuilt.items())
        for u in s0.units:
            s0._release(u)
        held = [t for m in dm.modules() for n, t in list(m._parameters.items()) + list(m._buffers.items())
                if t is not None and n != SHARD_BUFFER]
        assert not any(is_wrapper(t) for t in held) and all(t.numel() == 0 for t in held)


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2, "shard_weights": "sequence"},
                                     {"cfg_degree": 2, "shard_weights": "all"}], ids=["u2", "cfg2-all"])
def test_sharded_pool_forward_and_bytes(files, cpu_pool, degrees):
    """shard_weights on the pool: ≤ 1e-5 of ComfyUI's forward for every layout; each rank holds its share of the
    flat buffer as raw bytes (no weight whole, whatever its layout), and its shards' part of the quantized bytes
    and scales - the two ranks' parts adding up to exactly the bytes ComfyUI holds."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.loader_types import host_tensors
    config = ParallelConfig(**degrees)
    failures = []
    for i, form in enumerate(["scaled_fp8"] + NEW):
        base = _load(files, form)
        key = f"qs:{config.describe()}:{form}"
        inp = inputs("sd3", base, seed=600 + i, odd=True)
        err = rel(pool_forward(cpu_pool, config, key, base, inp), comfy_forward(base, inp))
        print(f"{config.describe()} {form}: rel {err:.2e}")
        if err > tolerance(form, split_weights=True):
            failures.append((form, err))
        sent = host_tensors(base.diffusion_model)
        full = sum(v.numel() * v.element_size() for v in sent.values())
        quantized_bytes = sum(v.numel() * v.element_size() for k, v in sent.items() if "#" in k)
        per_rank = cpu_pool.submit(config, "model_bytes", {"key": key}).per_rank
        for r in per_rank:
            s = r["sharding"]
            assert set(r["dtypes"]) == {"uint8"}, r["dtypes"]
            assert r["bytes"] == s["shard_bytes"] == s["full_bytes"] // 2, (r, s)
            assert 0 <= s["full_bytes"] - full <= 64 * (len(sent) + s["units"]), (s, full)  # alignment padding
            assert s["quantized_bytes"] == quantized_bytes, (s, quantized_bytes)
        assert sum(r["sharding"]["quantized_shard_bytes"] for r in per_rank) == quantized_bytes
    assert not failures, failures


def test_tensor_parallel_splits_tensorwise_layouts(files, cpu_pool):
    """Tensor parallel on a tensorwise layout (fp8, int8: one stored value per weight, one scale): each tp rank holds
    its slice of the stored values (half the quantized bytes) and the same scale, and the output is ComfyUI's
    (≤ 1e-5); a block-scaled layout (nvfp4, mxfp8) is refused before any weight is touched, by its name."""
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.tp import _pieces, _resolve, apply_tp, local_param_bytes, tp_problems
    from comfyui_hybrid_parallel.parallel.shard import wrapper_parts
    for form in ("nvfp4", "mxfp8"):
        dm = _load(files, form).diffusion_model
        problems = tp_problems(dm, family_adapter(dm).comfy_plan, 2)
        layout = next(iter(_quantized(dm).values()))._layout_cls
        assert len(problems) == 1 and f"tensor parallel does not split {layout} weights" in problems[0], problems
        assert "ulysses/ring/cfg/dp degrees or shard_weights" in problems[0]
    for form in ("scaled_fp8", "int8_tensorwise"):
        dm = _load(files, form).diffusion_model
        plan = family_adapter(dm).comfy_plan
        assert tp_problems(dm, plan, 2) == []
        whole = {k: wrapper_parts(t) for k, t in _quantized(dm).items()}
        styles = {f"{sh.path}.weight": (type(sh.style).__name__, sh.sizes) for sh in _resolve(dm, plan, 2)[0]}
        targets = {k: styles[k][0] for k in whole if k in styles}
        assert targets and set(targets.values()) == {"Colwise", "Rowwise"}, styles
        before = local_param_bytes(dm)
        apply_tp(dm, plan, _Axis(2, 1))
        sliced = {}
        for k, t in _quantized(dm).items():
            (parts, ctx), (full, full_ctx) = wrapper_parts(t), whole[k]
            assert ctx["layout_cls"] == full_ctx["layout_cls"] and torch.equal(parts["_param_scale"],
                                                                                full["_param_scale"])
            if parts["_qdata"].shape != full["_qdata"].shape:
                dim = 0 if targets.get(k) == "Colwise" else 1
                half = _pieces(full["_qdata"], dim, styles[k][1], 2, 1)  # rank 1's half of each packed block
                assert parts["_qdata"].numel() * 2 == full["_qdata"].numel(), k
                assert torch.equal(_bytes(parts["_qdata"]), _bytes(half)), k
                assert tuple(t.shape) == ctx["non_tensor_fields"]["orig_shape"] == tuple(parts["_qdata"].shape)
                sliced[k] = dim
        assert set(sliced) == set(targets), (sorted(sliced), sorted(targets))  # every quantized layer of the plan
        assert local_param_bytes(dm) < before
    config = ParallelConfig(tp_degree=2)
    failures = []
    for i, form in enumerate(["scaled_fp8", "float8_e4m3fn", "int8_tensorwise"]):
        base = _load(files, form)
        for odd in (True, False):
            inp = inputs("sd3", base, seed=700 + 2 * i + odd, odd=odd)
            err = rel(pool_forward(cpu_pool, config, f"qt:{form}", base, inp), comfy_forward(base, inp))
            print(f"tp2 {form} {'odd' if odd else 'even'}: rel {err:.2e}")
            if err > tolerance(form, split_weights=True):
                failures.append((form, odd, err))
    assert not failures, failures


def test_a_wrapper_made_of_something_else_is_refused_by_name():
    """A wrapper tensor whose inner tensor is not plain bytes (here a QuantizedTensor inside a QuantizedTensor, of
    comfy-kitchen's own fp8 layout) is refused where it would be split (shard_weights, naming the layout and what runs
    it) and carried (the driver's check, before any worker starts). No ComfyUI needed, but comfy-kitchen (which
    ComfyUI >= 0.33 installs; 0.3.75 has no quantized tensors to refuse)."""
    QuantizedTensor = pytest.importorskip("comfy_kitchen.tensor", reason="comfy-kitchen is not installed (ComfyUI "
                                          "0.3.75 has no quantized tensors)").QuantizedTensor

    from comfyui_hybrid_parallel.parallel.shard import WeightSharding
    from comfyui_hybrid_parallel.workers.bridge.loader_types import NotCarriable, quantized_tensors
    inner = QuantizedTensor.from_float(torch.randn(8, 16), "TensorCoreFP8Layout")
    outer = QuantizedTensor(inner, "TensorCoreFP8Layout", inner._params)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(outer, requires_grad=False)
    with pytest.raises(ValueError, match="shard_weights cannot split .*TensorCoreFP8Layout tensor holds _qdata "
                                         "as a QuantizedTensor.*shard_weights none"):
        WeightSharding(layer, _Axis(2, 0))
    with pytest.raises(NotCarriable, match="TensorCoreFP8Layout.*_qdata as a QuantizedTensor"):
        quantized_tensors(layer)
