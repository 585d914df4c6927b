"""Hybrid Sampler in this process on ComfyUI's own model: ComfyUI's copy never goes to its load device,
and a MODEL the workers cannot carry is refused before any worker starts."""
from __future__ import annotations

import sys

import pytest
import torch

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    from comfy_env import comfy_nodes, setup_comfy
    comfy_dir = setup_comfy()
    comfy_nodes(comfy_dir)  # ComfyUI's top-level `nodes` (common_ksampler)
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from safetensors.torch import load_file, save_file
    from test_native_pool import _scaled_fp8
    path = tmp_path_factory.mktemp("nodes_ckpt") / "sd3.safetensors"
    tc.write_sd3(path, depth=2, pos_embed_max_size=32, seed=31)
    scaled = path.with_name("sd3_scaled_fp8.safetensors")  # ComfyUI's scaled-fp8 layout of the same weights
    save_file(_scaled_fp8(load_file(str(path))), str(scaled))
    return lambda scaled_fp8=False, **opts: comfy.sd.load_diffusion_model(str(scaled if scaled_fp8 else path),
                                                                           model_options=opts)


def _hp(**degrees):
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    kw = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
              warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")
    kw.update(degrees)
    return ParallelConfigNode().build(**kw)["result"][0]


def _conds(seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 7, 32, generator=g), {"pooled_output": torch.randn(1, 24, generator=g)}]]


class _NoPool:
    def __call__(self, device):
        raise AssertionError("a worker pool was started for a MODEL that must be refused first")


def test_comfyui_copy_stays_off_its_load_device(comfy, monkeypatch):
    """The MODEL claims cuda:0 as its load device (as on a GPU machine). KSampler would load it there;
    Hybrid Sampler must make ComfyUI load it to the offload device only (this machine has no CUDA, so a
    load to cuda:0 fails the run), and its result still equals KSampler's bitwise at degree 1."""
    import comfy.model_management as mm
    import nodes as comfy_nodes  # ComfyUI's top-level module

    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler

    latent = {"samples": torch.zeros(1, 16, 9, 13)}
    pos, neg = _conds(1), _conds(2)
    ref = comfy_nodes.common_ksampler(comfy(), 3, 2, 4.0, "euler", "normal", pos, neg, latent)[0]["samples"]

    model = comfy()
    model.load_device = torch.device("cuda", 0)  # what ComfyUI sets on a GPU machine
    seen = []
    real = mm.load_models_gpu

    def spy(models, *a, **kw):
        seen.extend(str(m.load_device) for m in models)
        return real(models, *a, **kw)
    monkeypatch.setattr(mm, "load_models_gpu", spy)
    runtime = Runtime()
    HybridSampler.runtime = runtime
    try:
        out = HybridSampler().sample(model, 3, 2, 4.0, "euler", "normal", pos, neg, latent, _hp())[0]["samples"]
    finally:
        runtime.stop()
        HybridSampler.runtime = None
    assert seen and all(d == "cpu" for d in seen), seen
    assert all(p.device.type == "cpu" for p in model.model.diffusion_model.parameters())
    assert torch.equal(out, ref), ((out - ref).abs().max())


class _Wrapped(torch.Tensor):
    """Stands for a custom loader's tensor type (GGUF and the like; those the workers rebuild:
    tests/driver/test_gguf_weights.py)."""


def _refused(model, match: str, latent=(1, 16, 8, 8), **degrees) -> None:
    """Hybrid Sampler refuses `model` with NotCarried matching `match`, and no worker pool is ever created."""
    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler

    HybridSampler.runtime = Runtime(make_pool=_NoPool())
    try:
        with pytest.raises(NotCarried, match=match):
            HybridSampler().sample(model, 0, 1, 1.0, "euler", "normal", _conds(1), _conds(2),
                                   {"samples": torch.zeros(latent)}, _hp(**degrees))
    finally:
        HybridSampler.runtime = None


def test_tensor_subclass_weights_refused_before_workers(comfy):
    model = comfy()
    """A loader's tensor subclass is carried as its bytes plus its class and plain attributes; one holding anything
    else, or whose class the workers cannot import (defined inside a function), is refused naming why."""
    dm = model.model.diffusion_model
    w = dm.final_layer.linear.weight
    dm.final_layer.linear.weight = torch.nn.Parameter(w.data.as_subclass(_Wrapped), requires_grad=False)
    dm.final_layer.linear.weight.codebook = object()
    _refused(model, "weight 'final_layer.linear.weight' is a _Wrapped whose 'codebook' holds a value of type "
                    "object.*ComfyUI's own loaders", ulysses_degree=2)

    class Local(torch.Tensor):
        pass
    model = comfy()
    dm = model.model.diffusion_model
    dm.final_layer.linear.weight = torch.nn.Parameter(w.data.as_subclass(Local), requires_grad=False)
    _refused(model, "Local is defined inside a function, so the workers cannot import it", ulysses_degree=2)


def test_model_without_adapter_refused_before_workers(comfy):
    class UnknownDiT(torch.nn.Module):
        dtype = torch.float32

    model = comfy()
    model.model.diffusion_model = UnknownDiT()
    # only the batch splits for it: the message names the class, what runs it, what runs everything, the recipe
    _refused(model, "UnknownDiT has no family adapter, so only CFG parallel and data parallel run it.*ulysses2"
                    ".*cfg_degree 2.*Flux.*docs/adding-a-model.md", ulysses_degree=2)
    for degrees in (dict(tp_degree=2), dict(pp_degree=2, num_pipeline_patch=2), dict(ulysses_degree=2, method="distrifusion"),
                    dict(cfg_degree=2, sampling_mode="loop")):
        model = comfy()
        model.model.diffusion_model = UnknownDiT()
        _refused(model, "UnknownDiT has no family adapter", **degrees)


def test_an_unchecked_subclass_of_a_supported_class_does_not_inherit_its_plan(comfy):
    """Wan's S2V, HuMo, Camera and Animate models subclass WanModel and add inputs the Wan plan does not split with the
    tokens (ulysses crashed mid-run on VACE before it had a plan of its own): a subclass no adapter lists runs CFG /
    data parallel only,
    and anything else is refused before any worker starts, saying it is a variant nobody checked."""
    from comfy.ldm.wan.model import HumoWanModel, WanModel
    from comfy.ops import disable_weight_init

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel.models import ANY, adapter_for, plan_for, unchecked_base

    kw = dict(model_type="t2v", patch_size=(1, 2, 2), dim=128, ffn_dim=256, num_heads=1, num_layers=1,
              in_dim=16, out_dim=16, text_dim=32, device="meta",
              operations=disable_weight_init)
    base, vace = WanModel(**kw), HumoWanModel(**kw)
    assert adapter_for(base).family == "wan" and family_adapter(base).family == "wan"
    assert adapter_for(vace) is None and family_adapter(vace) is ANY and unchecked_base(vace).family == "wan"
    with pytest.raises(ValueError, match="HumoWanModel is not supported.*CFG / data parallel"):
        plan_for(vace)
    model = comfy()
    model.model.diffusion_model = vace
    _refused(model, "HumoWanModel is a variant of Wan 2.1/2.2's WanModel whose forward.*not checked.*cfg_degree",
             ulysses_degree=2)


def test_pipefusion_on_a_family_without_stages_refused_before_workers(comfy, tmp_path):
    """Wan VACE declares no PipeFusion stages (its hint blocks run beside the blocks on the control tokens): pp_degree
    2 is refused with that reason before any worker starts, fp8 or not; Wan itself passes the same check."""
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.workers.bridge.spec import check_declared
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    path = tmp_path / "wan_vace.safetensors"
    tc.write_wan(path, seed=32, model_type="vace")
    for dtype in (None, torch.float8_e4m3fn):
        model = comfy.sd.load_diffusion_model(str(path), model_options={} if dtype is None else {"dtype": dtype})
        _refused(model, r"PipeFusion \(pp_degree=2\) is not available for Wan 2.1 VACE: PipeFusion is not declared "
                        r"for Wan VACE's hint blocks; use ulysses", latent=(1, 16, 2, 8, 8), pp_degree=2,
                 num_pipeline_patch=2)
    tc.write_wan(tmp_path / "wan.safetensors", seed=33, num_layers=2)
    wan = comfy.sd.load_diffusion_model(str(tmp_path / "wan.safetensors"))
    check_declared(wan.model.diffusion_model, ParallelConfig(pp_degree=2))
    # a video latent's token rows run through every frame: 2 frames x 4 rows here
    _refused(wan, "num_pipeline_patch=9 but the image has only 8 token rows", latent=(1, 16, 2, 8, 8), pp_degree=2,
             num_pipeline_patch=9)
    _refused(wan, r"latent 8x7 is not a multiple of the patch size 2x2", latent=(1, 16, 2, 8, 7), pp_degree=2,
             num_pipeline_patch=2)


def test_tp_degree_the_model_cannot_split_refused_before_workers(comfy):
    """Tensor parallel runs on ComfyUI's own model (fp8 included); a degree that does not divide its heads is
    refused from the driver's copy before any worker starts, naming the degrees that work."""
    from comfyui_hybrid_parallel.workers.bridge.spec import check_declared
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    model = comfy(dtype=torch.float8_e4m3fn)
    check_declared(model.model.diffusion_model, ParallelConfig(tp_degree=2))
    _refused(model, r"tp_degree=4 does not divide the model's 2 attention heads; use a tp_degree in \[1, 2\]",
             tp_degree=4)


def test_patches_from_other_nodes_refused_before_workers(comfy):
    """A block replacement installed by another node is a Python callable in ComfyUI's process: it cannot run on
    the workers, so Hybrid Sampler says so instead of silently ignoring it."""
    model = comfy()
    model.set_model_patch_replace(lambda args, extra: extra["original_block"](args), "dit", "double_block", 0)
    _refused(model, "patches_replace.*dit", ulysses_degree=2)


@pytest.mark.parametrize("degrees,latent,match", [
    (dict(pp_degree=3, num_pipeline_patch=3), (1, 16, 8, 8), "pp_degree=3 but the model has only 2 transformer blocks"),
    (dict(pp_degree=2, num_pipeline_patch=2, warmup_steps=0), (1, 16, 8, 8), "warmup_steps >= 1"),
    (dict(pp_degree=2, num_pipeline_patch=6), (1, 16, 8, 8), "num_pipeline_patch=6 but the image has only 4 token rows"),
    (dict(pp_degree=2, num_pipeline_patch=4, ulysses_degree=2), (1, 16, 8, 2), "patch of 1 tokens cannot be split"),
], ids=["more-stages-than-blocks", "warmup0", "more-patches-than-rows", "patch-smaller-than-sp"])
def test_pipefusion_config_the_model_cannot_run_refused_before_workers(comfy, degrees, latent, match):
    """PipeFusion on ComfyUI's own model: what the stages would find at run start is found from the driver's
    copy and the latent before any worker starts."""
    _refused(comfy(), match, latent=latent, **degrees)


def test_a_config_the_devices_cannot_hold_is_refused_before_workers(comfy, monkeypatch):
    """The memory planner (parallel/memory.py) from the node: ranks that would need more than the device holds are
    refused with the numbers and the fix before any worker starts. The capacity is made small (these models are
    tiny): DistriFusion's K/V buffers exceed it while USP on the same ranks fits."""
    from comfyui_hybrid_parallel.workers.bridge import spec as native
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    from comfyui_hybrid_parallel.parallel.memory import rank_memory
    model = comfy()
    latent = (1, 16, 48, 48)
    shape = shape_from_module(model.model.diffusion_model)
    weights = sum(t.numel() * t.element_size() for t in model.model.diffusion_model.state_dict().values())
    usp = rank_memory(shape, weights, ParallelConfig(ulysses_degree=2), latent, 7, 2, 4)
    df = rank_memory(shape, weights, ParallelConfig(ulysses_degree=2, method="distrifusion"), latent, 7, 2, 4)
    assert df.total > usp.total * 1.5
    capacity = int(usp.total / 0.92) + 1  # one GPU-like device that just holds the USP rank
    monkeypatch.setattr(native, "device_capacity", lambda hp: (capacity, "cuda:0 (test device)", 1))
    _refused(model, r"ulysses2 needs about .* for each rank on cuda:0 \(test device\).*DistriFusion K/V buffers.*"
                    r"method 'usp'", latent=latent, ulysses_degree=2, method="distrifusion")
    native.check_memory(model, _hp(ulysses_degree=2), latent, _conds(1), 2.0)  # USP: fits, no error


def test_parallel_model_refuses_what_the_devices_cannot_hold_before_any_load_in_hybrid_samplers_words(comfy,
                                                                                                   monkeypatch):
    """Parallel Model checks the memory plan when its sampler starts (the latent and the cfg known), as Hybrid
    Sampler does before its run: a model the ranks cannot hold is refused with the same message, no pool made."""
    import nodes as comfy_nodes
    from comfyui_hybrid_parallel.workers.bridge import spec as native
    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    from comfyui_hybrid_parallel.parallel.memory import rank_memory
    model, latent = comfy(), (1, 16, 40, 24)
    shape = shape_from_module(model.model.diffusion_model)
    weights = sum(t.numel() * t.element_size() for t in model.model.diffusion_model.state_dict().values())
    need = rank_memory(shape, weights, ParallelConfig(ulysses_degree=2), latent, 7, 2, 4).total
    monkeypatch.setattr(native, "device_capacity", lambda hp: (int(need * 0.5), "cuda:0 (test device)", 1))
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    HybridSampler.runtime = ParallelModel.runtime = Runtime(make_pool=_NoPool())
    try:
        with pytest.raises(NotCarried, match=r"ulysses2 needs about .* for each rank on cuda:0 \(test device\)") as e:
            HybridSampler().sample(model, 0, 1, 2.0, "euler", "normal", _conds(1), _conds(2),
                                   {"samples": torch.zeros(latent)}, _hp(ulysses_degree=2))
        (patched,) = ParallelModel().patch(model, _hp(ulysses_degree=2))
        with pytest.raises(NotCarried) as refused:
            comfy_nodes.common_ksampler(patched, 0, 1, 2.0, "euler", "normal", _conds(1), _conds(2),
                                        {"samples": torch.zeros(latent)})
    finally:
        HybridSampler.runtime = ParallelModel.runtime = None
    assert str(refused.value) == str(e.value), (refused.value, e.value)


@pytest.mark.parametrize("mode", ["step", "loop"])
def test_previews_render_on_the_models_own_device(comfy, monkeypatch, mode):
    """ComfyUI's copy of the weights stays on the host (its load device set to the offload device), but the latent
    previews (TAESD / TAEHV) render where KSampler renders them: the MODEL's load device, cuda:0 on a GPU machine -
    not on the CPU, where a Wan step gained seconds. Recorded here from ComfyUI's own previewer lookup."""
    import latent_preview

    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    asked = []
    monkeypatch.setattr(latent_preview, "get_previewer", lambda device, fmt: asked.append(str(device)))
    model = comfy()
    model.load_device = torch.device("cuda", 0)  # what ComfyUI sets on a GPU machine
    runtime = Runtime()
    HybridSampler.runtime = runtime
    try:
        HybridSampler().sample(model, 3, 2, 4.0, "euler", "normal", _conds(1), _conds(2),
                               {"samples": torch.zeros(1, 16, 8, 8)}, _hp(sampling_mode=mode))
    finally:
        runtime.stop()
        HybridSampler.runtime = None
    assert asked == ["cuda:0"], asked


def _lora(hidden: int, blocks: int, seed: int = 9) -> dict:
    """A rank-4 LoRA on every joint block's image qkv (ComfyUI's generic key format), plus a diff-style patch on one
    block's proj (LyCORIS .diff): two kinds of patch data."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(blocks):
        k = f"diffusion_model.joint_blocks.{i}.x_block.attn.qkv"
        sd[f"{k}.lora_up.weight"] = torch.randn(3 * hidden, 4, generator=g) * 0.2
        sd[f"{k}.lora_down.weight"] = torch.randn(4, hidden, generator=g) * 0.2
        sd[f"{k}.alpha"] = torch.tensor(3.0)
    sd["diffusion_model.joint_blocks.0.x_block.attn.proj.diff"] = torch.randn(hidden, hidden, generator=g) * 0.01
    return sd


@pytest.mark.parametrize("precision", ["fp32", "fp8_e4m3fn", "scaled_fp8"])
def test_a_lora_strength_change_moves_only_the_patch_and_equals_ksampler(comfy, precision):
    """LoRA on the workers (workers/bridge/patches.py): the base weights travel once; each strength then moves only
    the patch tensors (counted), the ranks patch their base copy with ComfyUI's own code in place of the previous
    version, and every strength equals KSampler with the same LoRA. ComfyUI's own copy stays unpatched meanwhile.
    The two CPU ranks split the keys and each computes its share where the other maps it (fp32 in place, fp8 rounded
    into it); scaled fp8 layers store their own form (the ops' set_weight) and are written after."""
    import comfy.sd as comfy_sd
    import nodes as comfy_nodes

    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    from comfyui_hybrid_parallel.workers.transport import nbytes
    opts = {"fp32": {}, "fp8_e4m3fn": {"dtype": torch.float8_e4m3fn}, "scaled_fp8": {"scaled_fp8": True}}[precision]
    base = comfy(**opts)
    dm = base.model.diffusion_model
    from comfyui_hybrid_parallel.parallel.shard import is_wrapper
    if precision == "scaled_fp8" and any(is_wrapper(m.weight) for m in dm.modules()
                                         if isinstance(getattr(m, "weight", None), torch.Tensor)):
        # ComfyUI >= 0.33 loads the file as quantized tensors: LoRA on them is checked against KSampler in a real
        # server (tests/server_e2e/test_comfyui_quantized.py::test_lora_on_quantized_weights_equals_ksampler). Here the model is
        # loaded outside inference mode, where ComfyUI's own KSampler fails on it ("Cannot set version_counter for
        # inference tensor"), so there is no reference to compare with in this library test
        pytest.skip("quantized tensors (ComfyUI >= 0.33): LoRA checked in a real server, test_comfyui_quantized.py")
    hidden = dm.joint_blocks[0].x_block.attn.qkv.in_features
    lora = _lora(hidden, len(dm.joint_blocks))
    clean = {k: v.clone() for k, v in dm.state_dict().items() if "attn" in k}
    latent = {"samples": torch.zeros(1, 16, 9, 13)}
    pos, neg = _conds(1), _conds(2)
    runtime = Runtime()
    HybridSampler.runtime = runtime
    moved, in_place, outs, rewritten = [], [], [], []
    try:
        for strength in (0.5, 0.8, 0.3):
            model = comfy_sd.load_lora_for_models(base, None, lora, strength, 0)[0]
            with torch.inference_mode():  # as ComfyUI executes every node
                ref = comfy_nodes.common_ksampler(model, 5, 2, 4.0, "euler", "normal", pos, neg, latent)[0]["samples"]
                out = HybridSampler().sample(model, 5, 2, 4.0, "euler", "normal", pos, neg, latent,
                                             _hp(ulysses_degree=2))[0]["samples"]
            rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            assert rel <= 1e-5, (strength, rel)
            outs.append(out)
            moved.append(runtime._pool.last_load_bytes)
            rewritten.append(runtime._pool.last_load.get("pages_rewritten"))
            h = runtime._pool.health()
            in_place.append([r["layouts"] for r in h])
            # ComfyUI's own copy is left unpatched by Hybrid Sampler's run (KSampler had patched it)
            assert all(torch.equal(v, clean[k]) for k, v in dm.state_dict().items() if k in clean)
    finally:
        runtime.stop()
        HybridSampler.runtime = None
    from comfyui_hybrid_parallel.workers.bridge.patches import encode
    patch_bytes = nbytes(encode(comfy_sd.load_lora_for_models(base, None, lora, 0.8, 0)[0].patches)[1])
    weight_bytes = sum(v.numel() * v.element_size() for v in dm.state_dict().values())
    assert moved[0] >= weight_bytes and moved[1] == moved[2] == patch_bytes, (moved, patch_bytes, weight_bytes)
    assert in_place == [[1, 1]] * 3  # one resident version per rank: the old one was patched over, not kept
    # the 2nd and 3rd versions patch the same keys: their owners rewrite the pages both ranks map (fp32, fp8); a
    # scaled-fp8 layer stores its own form, so its keys travel through new files
    lora_keys = len(comfy_sd.load_lora_for_models(base, None, lora, 0.8, 0)[0].patches)  # the weights it patches
    assert rewritten[1:] == ([0, 0] if precision == "scaled_fp8" else [lora_keys, lora_keys]), (rewritten, lora_keys)
    for a, b in zip(outs, outs[1:]):  # each strength really changed the result
        assert ((a.double() - b.double()).norm() / b.double().norm()).item() > 1e-3


def test_every_comfyui_subclass_of_a_supported_class_runs_cfg_dp_only(comfy):
    """Every subclass ComfyUI 0.3.75 ships of a class an adapter declares (VACE, Camera, S2V, HuMo and Animate Wan
    models, Chroma Radiance, ...) is refused sequence parallel before any worker starts, with the reason - unless
    its adapter lists it as checked."""
    import importlib
    import pkgutil

    import comfy.ldm

    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried, check_any_model, family_adapter
    from comfyui_hybrid_parallel.parallel.models import ADAPTERS, ANY
    for info in pkgutil.walk_packages(comfy.ldm.__path__, "comfy.ldm."):
        try:
            importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - a module needing an optional dependency (torchaudio...)
            pass
    bases = {a.comfy_class: a for a in ADAPTERS.values()}
    found = []

    def walk(cls, a):
        for sub in cls.__subclasses__():
            found.append((sub, a))
            walk(sub, a)
    for cls in {c for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("comfy.ldm")
                for c in vars(m).values() if isinstance(c, type) and c.__name__ in bases
                and bases[c.__name__].declares(c)}:  # (SD3's MMDiT is not AuraFlow's)
        walk(cls, bases[cls.__name__])
    names = {sub.__name__ for sub, _ in found}
    assert {"VaceWanModel", "CameraWanModel", "WanModel_S2V", "HumoWanModel", "AnimateWanModel",
            "ChromaRadiance"} <= names, names
    assert ADAPTERS["wan_vace"].declares(next(sub for sub, _ in found if sub.__name__ == "VaceWanModel"))
    for sub, a in found:
        if sub.__name__ in a.comfy_subclasses or sub.__name__ in bases:
            continue
        dm = sub.__new__(sub)  # no __init__: only the class is read
        assert family_adapter(dm) is ANY, sub
        with pytest.raises(NotCarried, match=f"{sub.__name__} is a variant of .*not checked"):
            check_any_model(dm, _hp(ulysses_degree=2))
        check_any_model(dm, _hp(cfg_degree=2))  # the batch split runs it


def test_torch_compile_options_travel_and_what_cannot_is_refused_before_workers(comfy):
    """TorchCompileModel's options go to the workers (which compile their model); a callable backend and loop mode
    are refused before any worker starts, naming the fix."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    from comfyui_hybrid_parallel.workers.bridge.prepare import compile_spec
    model = comfy()
    assert compile_spec(model, _hp()) is None
    set_torch_compile_wrapper(model, backend="inductor", mode="max-autotune", dynamic=False)
    assert compile_spec(model, _hp(ulysses_degree=2)) == {"backend": "inductor", "options": None,
                                                         "mode": "max-autotune", "fullgraph": False, "dynamic": False}
    _refused(model, "TorchCompileModel.*own loop runs their model uncompiled.*sampling_mode to step", ulysses_degree=2,
             sampling_mode="loop")
    model = comfy()
    set_torch_compile_wrapper(model, backend=lambda gm, inputs: gm)
    _refused(model, "backend that is not a name", ulysses_degree=2)


def test_a_patch_version_that_fails_is_not_kept(comfy):
    """A patch version the ranks cannot apply leaves no half-patched model behind: the version it was to replace is
    dropped (its weights may be half rewritten), the job fails with the rank's error, the world stays, and the next
    load of a good version rebuilds from the base weights - equal to ComfyUI's own patched forward."""
    import comfy.sd as comfy_sd

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.patches import encode
    from comfyui_hybrid_parallel.workers.pool import WorkerError, WorkerPool
    from test_native_pool import comfy_forward, inputs, rel
    base = comfy()
    dm = base.model.diffusion_model
    lora = _lora(dm.joint_blocks[0].x_block.attn.qkv.in_features, len(dm.joint_blocks))
    v1, v2 = (comfy_sd.load_lora_for_models(base, None, lora, s, 0)[0] for s in (0.5, 0.8))
    family, spec = family_adapter(dm).family, native_spec(base.model)
    config = ParallelConfig(ulysses_degree=2)
    weights = lambda: {k: v.detach() for k, v in dm.state_dict().items()}  # noqa: E731
    pool = WorkerPool(device="cpu")
    try:
        pool.ensure_model(config, "v1", family, native=spec, lineage="L", patches=encode(v1.patches),
                          state_dict=weights)
        bad_spec, bad_tensors = encode(v2.patches)
        bad_spec["diffusion_model.no_such.weight"] = next(iter(bad_spec.values()))
        with pytest.raises(WorkerError, match="no such base weight"):
            pool.ensure_model(config, "v2", family, native=spec, lineage="L", patches=(bad_spec, bad_tensors),
                              state_dict=weights)
        assert all(r["resident"] == [] for r in pool.health()), pool.health()  # v1 was not kept
        pool.ensure_model(config, "v2", family, native=spec, lineage="L", patches=encode(v2.patches),
                          state_dict=weights)
        assert pool.last_load_bytes > sum(v.numel() * v.element_size() for v in dm.state_dict().values())
        inp = inputs("sd3", base.model, seed=3)
        out = pool.submit(config, "forward", {"key": "v2", "structure": {"transformer_options": {}}},
                          dict(inp)).tensors["out"]
    finally:
        pool.close()
    v2.patch_model()
    try:
        ref = comfy_forward(base.model, inp)
    finally:
        v2.unpatch_model()
    assert rel(out, ref) <= 1e-5, rel(out, ref)
