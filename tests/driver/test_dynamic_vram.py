"""The pack's nodes on a MODEL / VAE held by ComfyUI 0.33's DynamicVRAM patcher (ModelPatcherDynamic), in this process.

On NVIDIA with torch >= 2.8, ComfyUI 0.33 hands every loader's MODEL and VAE out on a ModelPatcherDynamic (main.py:
`CoreModelPatcher = ModelPatcherDynamic`, `aimdo_enabled`). Three of its traits meet the pack:
- it keeps per-device state (`dynamic_pins`) for its own load device only, and ComfyUI's prompt bookkeeping
  (PromptModelTracker) and its loader read that state under the patcher's `load_device` - the pack's "load to the
  offload device" clone was a KeyError as soon as Parallel Model returned it, and at every sampler's load;
- it never writes weight patches (LoRA) into the weights: they are applied as each layer is cast (LowVramPatch), so host
  weights read after a dynamic load are unpatched;
- its loaders keep each layer's tensor as the checkpoint stores it (zero-copy) and cast to the model's dtype (recorded
  as `weight_comfy_model_dtype`) only as the weight goes to the GPU - a bf16 VAE from an fp32 file is fp32 on the host.

This machine has no CUDA, so `--enable-dynamic-vram` cannot start here: the MODEL is built as ComfyUI builds it under
DynamicVRAM (its loader flag `aimdo_enabled` on while it loads) and handed to a ModelPatcherDynamic whose load device
is cuda:0, as on a GPU machine. The one piece of comfy-aimdo it reaches is its host buffer (an empty pinned-memory
arena per device, made at registration); that is stood in for (`_HostBuffer`). Anything reaching aimdo's device layer
(a VBAR, a pin) fails here - the pack must never load ComfyUI's copy dynamically. Where ComfyUI's dynamic copy must
be seen holding GPU memory (the KSampler -> pool switch), a stand-in VBAR records what ComfyUI frees of it.

References are KSampler / VAE Decode on the same weights loaded without DynamicVRAM (CPU): the model's dtype then
holds the rounded weights, as the GPU's cast makes them. On ComfyUI 0.3.x (no DynamicVRAM) the same flows run on the
loader's own MODEL: the feature detection must leave them as they were. The last test holds the workers' weight
patching (workers/bridge/patches.py) to this ComfyUI's own ModelPatcher: 0.33 patches in `lora_compute_dtype` and seeds
the fp8 rounding with comfy.utils.string_to_seed.
"""
from __future__ import annotations

import collections
import logging
import weakref

import pytest
import torch

pytestmark = pytest.mark.comfy

GPU = torch.device("cuda", 0)  # the load device ComfyUI gives its MODEL on a GPU machine


class _HostBuffer:
    """comfy_aimdo.host_buffer.HostBuffer without its native library: the empty arena a ModelPatcherDynamic makes
    for each device it registers (ModelPatcherDynamic.register_load_device)."""

    def __init__(self, size=0, prewarm=0, max_grow_size=0, mark_cold=True):
        self.size = int(size)

    def truncate(self, size, do_unregister=True):
        self.size = int(size)


class _VBar:
    """comfy_aimdo.model_vbar.ModelVBAR as ComfyUI's dynamic copy holds it after a KSampler run: `resident` bytes of
    the model on the GPU, given back by free_memory (ModelPatcherDynamic.partially_unload)."""

    def __init__(self, resident: int):
        self.resident = resident

    def loaded_size(self):
        return self.resident

    def free_memory(self, n):
        freed = int(min(n, self.resident))
        self.resident -= freed
        return freed


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from comfy_env import comfy_nodes, setup_comfy
    comfy_dir = setup_comfy()
    comfy_nodes(comfy_dir)  # ComfyUI's top-level `nodes` (common_ksampler)
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp_path_factory.mktemp("dynamic_ckpt") / "sd3.safetensors"
    tc.write_sd3(path, depth=2, pos_embed_max_size=32, seed=31)
    return path


@pytest.fixture
def aimdo(monkeypatch):
    """comfy-aimdo's host buffer stood in for (see the module's docstring); True where this ComfyUI has DynamicVRAM."""
    import comfy.model_patcher as mp
    if not hasattr(mp, "ModelPatcherDynamic"):
        return False
    import comfy_aimdo.host_buffer
    monkeypatch.setattr(comfy_aimdo.host_buffer, "HostBuffer", _HostBuffer)
    return True


@pytest.fixture(scope="module")
def runtime():
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    from comfyui_hybrid_parallel.nodes.vae_node import PatchVAEDecode
    rt = Runtime()
    ParallelModel.runtime = HybridSampler.runtime = PatchVAEDecode.runtime = rt
    yield rt
    ParallelModel.runtime = HybridSampler.runtime = PatchVAEDecode.runtime = None
    rt.stop()


def _loaded_as_dynamic_vram_does(fn):
    """Run ComfyUI's loader `fn` as it runs under DynamicVRAM (its `aimdo_enabled` flag on: layers keep the
    checkpoint's tensors as stored, the model dtype recorded beside them), the flag off again after."""
    import comfy.memory_management as cmm
    before = cmm.aimdo_enabled
    cmm.aimdo_enabled = True
    try:
        return fn()
    finally:
        cmm.aimdo_enabled = before


def _model(path, dynamic: bool, dtype=None):
    """The tiny SD3 MODEL: as Load Diffusion Model returns it on a GPU machine under DynamicVRAM (`dynamic`; on a
    ComfyUI without it, as its loader returns it), or as it returns it on this CPU (the references)."""
    import comfy.model_patcher as mp
    import comfy.sd
    opts = {} if dtype is None else {"dtype": dtype}
    if not dynamic or not hasattr(mp, "ModelPatcherDynamic"):
        return comfy.sd.load_diffusion_model(str(path), model_options=opts)
    from safetensors.torch import load_file
    plain = _loaded_as_dynamic_vram_does(lambda: comfy.sd.load_diffusion_model_state_dict(load_file(str(path)),
                                                                                        model_options=opts))
    model = mp.ModelPatcherDynamic(plain.model, GPU, plain.offload_device, plain.model_size())
    model.cached_patcher_init = plain.cached_patcher_init
    assert model.is_dynamic() and model.load_device == GPU
    if dtype is not None:  # the host holds the file's fp32 tensors; the model computes in `dtype`
        qkv = model.model.diffusion_model.joint_blocks[0].x_block.attn.qkv
        assert qkv.weight.dtype == torch.float32 and qkv.weight_comfy_model_dtype == dtype
    return model


def _hp(**kw):
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    degrees = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
                   warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")
    degrees.update(kw)
    return ParallelConfigNode().build(**degrees)["result"][0]


def _conds(seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, 7, 32, generator=g), {"pooled_output": torch.randn(1, 24, generator=g)}]]


LATENT = {"samples": torch.zeros(1, 16, 9, 13)}
POS, NEG = _conds(1), _conds(2)


def _ksampler(model, seed=3):
    import nodes as comfy_nodes  # ComfyUI's top-level module
    with torch.inference_mode():  # as ComfyUI executes every node
        return comfy_nodes.common_ksampler(model, seed, 2, 4.0, "euler", "normal", POS, NEG, LATENT)[0]["samples"]


def _hybrid(model, hp, seed=3):
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    with torch.inference_mode():
        return HybridSampler().sample(model, seed, 2, 4.0, "euler", "normal", POS, NEG, LATENT, hp)[0]["samples"]


@pytest.fixture
def loads(monkeypatch):
    """What ComfyUI's model management is asked to load during the test: (patcher class, load device) each."""
    import comfy.model_management as mm
    seen, real = [], mm.load_models_gpu

    def spy(models, *a, **kw):
        seen.extend((type(m).__name__, str(m.load_device)) for m in models)
        return real(models, *a, **kw)
    monkeypatch.setattr(mm, "load_models_gpu", spy)
    return seen


def _tracked(outputs):
    """ComfyUI's executor on a node's outputs (PromptModelTracker.add, at each node) and at the prompt's end and the
    next prompt's start (end(), start()); nothing where this ComfyUI has no tracker."""
    import comfy.model_patcher as mp
    if not hasattr(mp, "PromptModelTracker"):
        return
    tracker = mp.PromptModelTracker()
    tracker.start()
    tracker.add(outputs)
    tracker.end()
    tracker.start()


def test_parallel_model_under_dynamic_vram_is_tracked_sampled_and_unloaded(ckpt, aimdo, runtime, loads, monkeypatch):
    """Parallel Model's MODEL goes through ComfyUI's prompt bookkeeping and KSampler like any MODEL; ComfyUI loads
    its copy to the host with its own (non-dynamic) patcher, the workers get the weights in the model's dtype (fp16,
    not the file's fp32), the latent equals KSampler's on the fp16 model bitwise, and "Unload models" (ComfyUI's
    unload_all_models, which its /free route calls) runs through and releases the workers' models."""
    import comfy.model_management as mm

    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    ref = _ksampler(_model(ckpt, False, torch.float16))
    model = _model(ckpt, True, torch.float16)
    (out,) = ParallelModel().patch(model, _hp())
    _tracked((out,))
    got = _ksampler(out)
    assert loads and all(d == "cpu" and c != "ModelPatcherDynamic" for c, d in loads), loads
    assert torch.equal(got, ref), (got - ref).abs().max()
    fp16 = sum(t.numel() * 2 for t in model.model.diffusion_model.state_dict().values())
    assert runtime._pool.last_load_bytes == fp16, (runtime._pool.last_load_bytes, fp16)
    assert any(r["resident"] for r in runtime._pool.health())
    monkeypatch.setattr(mm, "unload_all_models", mm.unload_all_models)  # restored after the test
    runtime.follow_comfy_unload()
    mm.unload_all_models()
    assert all(r["resident"] == [] for r in runtime._pool.health())


@pytest.mark.parametrize("mode", ["step", "loop"])
def test_hybrid_sampler_lora_strengths_under_dynamic_vram(ckpt, aimdo, runtime, loads, mode):
    """Hybrid Sampler (step and loop mode) on a LoRA'd MODEL of ComfyUI's dynamic patcher: every strength equals
    KSampler with the same LoRA on the fp16 model, bitwise (one rank); the fp16 base weights travel once and a strength
    change moves only the patch (the workers' model is the same object's, patched in place); ComfyUI's copy is loaded
    to the host by a non-dynamic patcher only."""
    import comfy.sd

    from comfyui_hybrid_parallel.workers.bridge.patches import encode
    from comfyui_hybrid_parallel.workers.transport import nbytes
    from test_native_nodes import _lora
    base, dynamic = _model(ckpt, False, torch.float16), _model(ckpt, True, torch.float16)
    dm = dynamic.model.diffusion_model
    lora = _lora(dm.joint_blocks[0].x_block.attn.qkv.in_features, len(dm.joint_blocks))
    moved = []
    for strength in (0.5, 0.8):
        ref = _ksampler(comfy.sd.load_lora_for_models(base, None, lora, strength, 0)[0])
        model = comfy.sd.load_lora_for_models(dynamic, None, lora, strength, 0)[0]
        assert not aimdo or model.is_dynamic()
        _tracked((model,))
        got = _hybrid(model, _hp(sampling_mode=mode))
        assert torch.equal(got, ref), (strength, (got - ref).abs().max())
        moved.append(runtime._pool.last_load_bytes)
    assert loads and all(d == "cpu" and c != "ModelPatcherDynamic" for c, d in loads), loads
    fp16 = sum(t.numel() * 2 for t in dm.state_dict().values())
    patch = nbytes(encode(comfy.sd.load_lora_for_models(dynamic, None, lora, 0.8, 0)[0].patches)[1])
    assert moved == [fp16 + patch, patch], (moved, fp16, patch)


def _same(x):
    return x


def _with_function(patcher):
    """`patcher` with a Python function on every weight patch (the identity: the same weights). Such patches cannot
    travel to the workers: ComfyUI patches its own host copy and the patched weights travel."""
    patcher.patches = {k: [(sp, data, sm, off, _same) for sp, data, sm, off, _ in v]
                       for k, v in patcher.patches.items()}
    return patcher


def test_patches_comfyui_applies_on_the_host_under_dynamic_vram(ckpt, aimdo, runtime, loads):
    """Weight patches that cannot travel are applied by ComfyUI to its host copy and the patched weights travel: with
    ComfyUI's dynamic patcher they would never be written (it patches as each layer is cast on the GPU), so the
    workers would silently sample without the LoRA. The latent equals KSampler's with the LoRA bitwise."""
    import comfy.sd

    from comfyui_hybrid_parallel.workers.bridge.prepare import portable_patches
    from test_native_nodes import _lora
    base, dynamic = _model(ckpt, False), _model(ckpt, True)
    dm = dynamic.model.diffusion_model
    lora = _lora(dm.joint_blocks[0].x_block.attn.qkv.in_features, len(dm.joint_blocks))
    ref = _ksampler(_with_function(comfy.sd.load_lora_for_models(base, None, lora, 0.7, 0)[0]))
    model = _with_function(comfy.sd.load_lora_for_models(dynamic, None, lora, 0.7, 0)[0])
    assert portable_patches(model, _hp().config) is None
    got = _hybrid(model, _hp())
    assert loads and all(d == "cpu" and c != "ModelPatcherDynamic" for c, d in loads), loads
    without = _ksampler(base)
    assert not torch.equal(got, without), "the LoRA was left out"
    assert torch.equal(got, ref), (got - ref).abs().max()


def _dynamic_ksampler_loads(model):
    """What KSampler on ComfyUI's dynamic `model` does to ComfyUI's loaded models (this CPU cannot run its dynamic
    load): load_models_gpu drops every loaded clone of the same model object without unpatching it
    (ModelPatcher.detach(unpatch_all=False)), then ModelPatcherDynamic.load begins by putting back every weight a
    patcher replaced (restore_loaded_backups), and the dynamic copy is loaded: a stand-in VBAR holds the weights on
    cuda:0. Returns (ComfyUI's entry for it, the VBAR)."""
    import comfy.model_management as mm
    for lm in [lm for lm in mm.current_loaded_models if lm.model is not None and lm.model.model is model.model]:
        mm.current_loaded_models.remove(lm)
        lm.model.detach(unpatch_all=False)
        lm.model_finalizer.detach()
    copy = model.clone()
    copy.restore_loaded_backups()
    vbar = model.model.dynamic_vbars[GPU] = _VBar(copy.model_size())
    held = mm.LoadedModel(copy)
    held.real_model = weakref.ref(model.model)
    held.model_finalizer = weakref.finalize(model.model, mm.cleanup_models)
    mm.current_loaded_models.insert(0, held)
    return held, vbar


def _forget(held) -> bool:
    """Take a stand-in entry out of ComfyUI's loaded models if it is still there; whether it was."""
    import comfy.model_management as mm
    if not any(lm is held for lm in mm.current_loaded_models):
        return False
    mm.current_loaded_models.remove(held)
    held.model_finalizer.detach()
    return True


def test_ksampler_to_pool_switch_unloads_comfyuis_dynamic_copy(ckpt, aimdo, runtime):
    """KSampler ran first: ComfyUI's dynamic copy of the model is loaded on cuda:0 (a VBAR holding its weights there,
    a small layer force-loaded with its backup). Hybrid Sampler on the same model takes the GPU over: ComfyUI's own
    unload frees the VBAR and puts the weight back, the copy leaves ComfyUI's loaded models, and the latent equals
    KSampler's."""
    import comfy.utils
    ref = _ksampler(_model(ckpt, False))
    model = _model(ckpt, True)
    if not aimdo:  # ComfyUI 0.3.x: no dynamic copy to hand over; the run itself is unchanged
        assert torch.equal(_hybrid(model, _hp()), ref)
        return
    held, vbar = _dynamic_ksampler_loads(model)
    key = "diffusion_model.final_layer.linear.bias"  # a small layer: force-loaded to the GPU (patched, if patched)
    base = comfy.utils.get_attr(model.model, key)
    held.model.backup[key] = collections.namedtuple("Dimension", ["weight", "inplace_update"])(base, False)
    comfy.utils.set_attr_param(model.model, key, base + 1.0)  # the loaded stand-in (cuda:0 in ComfyUI)
    try:
        got = _hybrid(model, _hp())
    finally:
        still_loaded = _forget(held)
    assert vbar.resident == 0, "ComfyUI's dynamic copy still holds the GPU"
    assert not still_loaded, "ComfyUI's dynamic copy is still among its loaded models"
    assert torch.equal(comfy.utils.get_attr(model.model, key), base)  # ComfyUI's weight back (as mapped pages)
    assert torch.equal(got, ref), (got - ref).abs().max()


def test_pool_then_ksampler_then_pool_with_patches_comfyui_applies(ckpt, aimdo, runtime):
    """Hybrid Sampler with patches ComfyUI applies on the host, then KSampler on the same MODEL (ComfyUI's dynamic
    load puts the base weights back under the host copy's feet), then - the workers having dropped the model meanwhile
    - Hybrid Sampler again: ComfyUI's host copy must be patched again, not skipped as already patched (its layers'
    flag from the first run), and the second run equals KSampler's with the LoRA too."""
    import comfy.sd

    from test_native_nodes import _lora
    if not aimdo:
        return  # ComfyUI 0.3.x: no dynamic load to interleave (test_patches_comfyui_applies_on_the_host covers it)
    base, dynamic = _model(ckpt, False), _model(ckpt, True)
    dm = dynamic.model.diffusion_model
    lora = _lora(dm.joint_blocks[0].x_block.attn.qkv.in_features, len(dm.joint_blocks))
    ref = _ksampler(_with_function(comfy.sd.load_lora_for_models(base, None, lora, 0.6, 0)[0]))
    model = _with_function(comfy.sd.load_lora_for_models(dynamic, None, lora, 0.6, 0)[0])
    first = _hybrid(model, _hp())
    held, _ = _dynamic_ksampler_loads(model)
    runtime.release_models()  # the workers dropped it meanwhile (Unload models, other models): the weights travel again
    try:
        second = _hybrid(model, _hp())
    finally:
        _forget(held)
    assert torch.equal(first, ref), (first - ref).abs().max()
    assert torch.equal(second, ref), (second - ref).abs().max()


def test_comfyuis_mapping_of_the_checkpoint_file_is_not_swapped_for_the_workers_pages(ckpt, aimdo, runtime):
    """Once the weights are written for the workers, ComfyUI's own host tensors take the written pages (one copy for
    ComfyUI and the ranks) - except a tensor ComfyUI holds as its mapping of the checkpoint file (DynamicVRAM's
    zero-copy loader marks its storage with the file slice): the kernel can drop those pages and ComfyUI reads the
    weight back from the file, which the workers' pages would not allow."""
    from comfyui_hybrid_parallel.workers.bridge.host import file_backed
    model = _model(ckpt, True)
    dm = model.model.diffusion_model
    mapped, anonymous = dm.final_layer.linear.weight, dm.joint_blocks[0].x_block.attn.qkv.weight
    setattr(mapped.untyped_storage(), "_comfy_tensor_file_slice", object())  # as comfy.utils.load_safetensors marks
    assert file_backed(mapped) and not file_backed(anonymous)
    _hybrid(model, _hp())
    assert dm.final_layer.linear.weight is mapped  # ComfyUI's mapping of the file, kept
    assert dm.joint_blocks[0].x_block.attn.qkv.weight is not anonymous  # the workers' pages now
    assert torch.equal(dm.joint_blocks[0].x_block.attn.qkv.weight, anonymous)


def test_parallel_vae_decode_of_a_dynamic_vae(ckpt, aimdo, runtime, tmp_path):
    """A bf16 VAE from an fp32 file under DynamicVRAM: ComfyUI's host copy holds the file's fp32 tensors (it casts as
    it loads to the GPU). The workers get them in bf16 - half the bytes - and decode as VAE Decode does."""
    import comfy.model_patcher as mp
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.nodes.vae_node import PatchVAEDecode
    tc.write_kl_vae(tmp_path / "kl16.safetensors", style="flux", seed=42)
    sd = comfy.utils.load_torch_file(str(tmp_path / "kl16.safetensors"))
    ref_vae = comfy.sd.VAE(sd=dict(sd), dtype=torch.bfloat16)
    # odd: a 2/1 row split; 3 x 2, not larger: CPU bf16 convolutions are slow (5 x 4: ~10 s a decode on 2 cores)
    latent = torch.randn(1, 16, 3, 2, generator=torch.Generator().manual_seed(48))
    ref = ref_vae.decode(latent)
    if aimdo:
        core = mp.CoreModelPatcher
        mp.CoreModelPatcher = mp.ModelPatcherDynamic  # main.py under DynamicVRAM
        try:
            vae = _loaded_as_dynamic_vram_does(lambda: comfy.sd.VAE(sd=dict(sd), device=GPU, dtype=torch.bfloat16))
        finally:
            mp.CoreModelPatcher = core
        assert vae.patcher.is_dynamic()
        assert {t.dtype for t in vae.first_stage_model.state_dict().values()} == {torch.float32}
    else:
        vae = comfy.sd.VAE(sd=dict(sd), dtype=torch.bfloat16)
    _tracked((vae,))
    (got,) = PatchVAEDecode().decode({"samples": latent}, vae, _hp(ulysses_degree=2))
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err <= 2e-2, err  # bf16 (tests/families/test_patch_vae_native.py test_bf16_vae_decodes_in_bf16)
    bf16 = sum(t.numel() * 2 for t in ref_vae.first_stage_model.state_dict().values())
    assert runtime._pool.last_load_bytes == bf16, (runtime._pool.last_load_bytes, bf16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("lora_dtype", [None, torch.float16], ids=["default", "fp16"])
def test_workers_patch_as_this_comfyuis_model_patcher(ckpt, caplog, monkeypatch, dtype, lora_dtype):
    """The workers' patching (workers/bridge/patches.py) gives the weights this ComfyUI's ModelPatcher gives on the same
    device, bitwise: ComfyUI 0.33 patches in `lora_compute_dtype(device)` (float16 on a GPU that computes in half -
    here forced for the CPU), earlier ComfyUIs in float32; the fp8 rounding seeded by comfy.utils.string_to_seed
    where it lives now, without the warning its old place logs."""
    import comfy.model_management as mm
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.workers.bridge import patches as comfy_patches
    from test_native_nodes import _lora
    cpu = torch.device("cpu")
    if lora_dtype is not None:
        if not hasattr(mm, "lora_compute_dtype"):
            return  # ComfyUI 0.3.x patches in float32 on every device: the default case is the whole check
        monkeypatch.setitem(mm.LORA_COMPUTE_DTYPES, cpu, lora_dtype)
    base = comfy.sd.load_diffusion_model(str(ckpt), model_options={} if dtype == torch.float32 else {"dtype": dtype})
    dm = base.model.diffusion_model
    lora = _lora(dm.joint_blocks[0].x_block.attn.qkv.in_features, len(dm.joint_blocks))
    patched = comfy.sd.load_lora_for_models(base, None, lora, 0.8, 0)[0]
    weights = {k: v.clone() for k, v in dm.state_dict().items()}
    with caplog.at_level(logging.WARNING), torch.inference_mode():  # as ComfyUI executes nodes
        for key in patched.patches:
            patched.patch_weight_to_device(key, device_to=cpu)  # ComfyUI's own, into ComfyUI's copy
        want = {k: comfy.utils.get_attr(base.model, k).clone() for k in patched.patches}
        patched.unpatch_model()
        workers = comfy.sd.load_diffusion_model(str(ckpt), model_options={} if dtype == torch.float32 else
                                                {"dtype": dtype}).model.diffusion_model
        spec, tensors = comfy_patches.encode(patched.patches)
        done = comfy_patches.apply(workers, weights, comfy_patches.decode(spec, tensors), set(), cpu)
    assert done == set(want)
    for k, w in want.items():
        got = comfy.utils.get_attr(comfy_patches._Holder(workers), k)
        assert got.dtype == w.dtype and torch.equal(got, w), k
    assert not [r for r in caplog.records if "string_to_seed" in r.getMessage()], caplog.text
