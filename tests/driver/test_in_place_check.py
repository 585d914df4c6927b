"""The check that finds a model changed in place, outside ModelPatcher (workers/bridge/inplace.py), and the read-ahead
refusals for newer ComfyUI shapes (a checkpoint's own attention kernel, a patcher whose __init__ lacks fast_disk),
in process on ComfyUI 0.30's classes.

Each change is made here as the packs make it (ComfyUI-PuLID-Flux: a method on the instance and modules added to it;
BrushNet: ComfyUI's functions replaced module-wide; a method replaced on ComfyUI's class; a torch hook) and must be
found, named by where its code lives; the models as ComfyUI's own loader gives them - every family the tiny
checkpoints cover - must give no finding (what ComfyUI itself puts on its layers is no change). The server tests
(tests/server_e2e/test_in_place.py) check the refusal of each before any work, naming the node.
"""
import types

import pytest
import torch

from comfy_env import setup_comfy

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def comfy():
    setup_comfy()
    import comfy.sd
    return comfy


@pytest.fixture(scope="module")
def sd3(comfy, tmp_path_factory):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp_path_factory.mktemp("inplace") / "tiny_sd3.safetensors"
    tc.write_sd3(path, seed=5)
    return comfy.sd.load_diffusion_model(str(path))


def _findings(patcher):
    from comfyui_hybrid_parallel.workers.bridge.inplace import build_key, in_place_findings
    return [f.what for f in in_place_findings(patcher.model, build_key(patcher.model))]


# stand-ins of other packs' replacements: code from outside ComfyUI (this test file is the tests', not the pack's)
def _scaled(self, *args, **kwargs):
    return type(self).forward_core_with_concat(self, *args, **kwargs) * 1.01


def _replacement(*args, **kwargs):
    return None


# the big tiny files (Chroma, AuraFlow, Qwen-Image, Lumina 2: 11-21 s each on 2 cores, mostly writing the weights)
# run with the slow set; the check is one walk over any model, proven in CI on the other nine families
_BIG = pytest.mark.slow
@pytest.mark.parametrize("writer", ["write_sd3", "write_flux2_klein", "write_wan", "write_pixart", "write_unet",
                                    pytest.param("write_qwen_image", marks=_BIG), "write_ltxv", "write_hunyuan_video",
                                    pytest.param("write_lumina2", marks=_BIG), pytest.param("write_chroma", marks=_BIG),
                                    pytest.param("write_auraflow", marks=_BIG), "write_kandinsky5",
                                    "write_cosmos_predict2"])
def test_a_model_as_comfyui_loads_it_has_no_finding(comfy, tmp_path, writer):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp_path / f"{writer}.safetensors"
    getattr(tc, writer)(path)
    assert _findings(comfy.sd.load_diffusion_model(str(path))) == []


def test_each_in_place_change_is_found(sd3, monkeypatch):
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.samplers
    dm = sd3.model.diffusion_model
    assert _findings(sd3) == []
    dm.forward_core_with_concat = types.MethodType(_scaled, dm)  # PuLID-Flux's mechanism
    assert any("'forward_core_with_concat' replaced" in f and "_scaled" in f for f in _findings(sd3)), _findings(sd3)
    del dm.forward_core_with_concat
    dm.pulid_ca = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # its added modules
    assert any("a module 'pulid_ca'" in f for f in _findings(sd3)), _findings(sd3)
    del dm.pulid_ca
    dm.joint_blocks[0].register_buffer("extra", torch.zeros(2))  # a tensor added to one of ComfyUI's modules
    assert any("'extra'" in f for f in _findings(sd3)), _findings(sd3)
    del dm.joint_blocks[0].extra
    with monkeypatch.context() as m:  # a method replaced on ComfyUI's class
        m.setattr(mmdit.JointBlock, "forward", _replacement)
        assert any("JointBlock.forward replaced" in f for f in _findings(sd3)), _findings(sd3)
    with monkeypatch.context() as m:  # BrushNet's kind: ComfyUI's functions replaced module-wide
        m.setattr(attention, "optimized_attention", _replacement)
        m.setattr(comfy.samplers, "sample", _replacement)
        found = _findings(sd3)
        assert any("attention.optimized_attention replaced" in f for f in found), found
        assert any("comfy.samplers.sample replaced" in f for f in found), found
    qkv = dm.joint_blocks[0].x_block.attn.qkv  # ComfyUI's own code on a layer (its LoRA bypass injection does this)
    qkv.forward = types.MethodType(type(qkv).forward_comfy_cast_weights, qkv)
    assert _findings(sd3) == []
    del qkv.forward
    handle = dm.register_forward_hook(_replacement)
    assert any("a torch hook" in f for f in _findings(sd3))
    handle.remove()
    assert _findings(sd3) == []


def test_the_rules_refuse_where_the_change_would_be_lost(sd3, monkeypatch):
    """Model changes are refused in every mode; a replaced sampling function runs in ComfyUI's process in step mode
    (exact) and is refused in the workers' own loop; an attention swap says to pick the kernel with ComfyUI's flag."""
    import comfy.ldm.modules.attention as attention
    import comfy.samplers

    from comfyui_hybrid_parallel.workers.bridge.inplace import build_key, in_place_findings
    from comfyui_hybrid_parallel.workers.bridge.known import REFUSED
    with monkeypatch.context() as m:
        m.setattr(attention, "optimized_attention", _replacement)
        m.setattr(comfy.samplers, "sample", _replacement)
        found = {f.what.split(" replaced")[0]: f.rule for f in in_place_findings(sd3.model, build_key(sd3.model))}
    sampler = found["ComfyUI's comfy.samplers.sample"]
    assert sampler.verdict("step") != REFUSED and sampler.verdict("loop") == REFUSED
    kernel = found["ComfyUI's comfy.ldm.modules.attention.optimized_attention"]
    assert kernel.verdict("step") == REFUSED and "--use-" in kernel.fix


def test_libraries_installed_outside_the_interpreters_scheme_are_libraries(comfy, tmp_path, monkeypatch):
    """torch or einops from a `pip install --target` folder, the user site or an image's packages on PYTHONPATH (the
    GPU kit's environment) are libraries, not a node's code: a folder on sys.path holding distributions' records. A
    folder without them, or one under custom_nodes (a pack that put itself on sys.path), stays a node's."""
    import importlib

    from comfyui_hybrid_parallel.workers.bridge.inplace import Reader, library_folders
    target, loose = tmp_path / "target", tmp_path / "loose"
    pack = tmp_path / "custom_nodes" / "a_pack"
    for folder, name in ((target, "hp_t_lib"), (loose, "hp_t_loose"), (pack, "hp_t_pack")):
        folder.mkdir(parents=True)
        (folder / f"{name}.py").write_text("def f(x):\n    return x\n")
        monkeypatch.syspath_prepend(str(folder))
    (target / "hp_t_lib-1.0.dist-info").mkdir()
    (pack / "hp_t_pack-1.0.dist-info").mkdir()
    found = library_folders(None)
    assert str(target) in found and str(loose) not in found and str(pack) not in found, found
    reader = Reader()
    lib, node, packed = (importlib.import_module(n).f for n in ("hp_t_lib", "hp_t_loose", "hp_t_pack"))
    assert reader.foreign(lib) is None and reader.foreign(node) is node and reader.foreign(packed) is packed
    # ComfyUI's own tree on sys.path (its main.py puts it first) is ComfyUI's, whatever it holds
    assert not any(p == reader.comfy or p.startswith(reader.comfy + "/") for p in library_folders(reader.comfy))


def test_the_check_is_cheap(sd3):
    """Microseconds-to-a-millisecond per prompt on the tiny model (bench/bench_in_place.py measures a 12B Flux)."""
    import time
    _findings(sd3)
    t = time.perf_counter()
    for _ in range(20):
        _findings(sd3)
    per = (time.perf_counter() - t) / 20
    print(f"in-place check on the tiny SD3: {per * 1e6:.0f} us")


def test_a_checkpoint_asking_for_its_own_attention_kernel_is_refused(sd3, monkeypatch):
    """Newer ComfyUI's per-layer attention request (ComfyAttention, read in its attention.py): the workers cannot run
    the asked kernel - refused; a request the driver's device cannot serve (function None) runs the default kernel
    in ComfyUI too - no refusal. Faked on 0.30, which has no such class."""
    import comfy.ldm.modules.attention as attention

    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried, check_attention_requests

    class ComfyAttention(torch.nn.Module):  # the newer shape: a config and the kernel it resolved to
        def __init__(self, function):
            super().__init__()
            self.config, self.function = {"attention": "comfy_kitchen_int8"}, function

    monkeypatch.setattr(attention, "ComfyAttention", ComfyAttention, raising=False)
    dm = sd3.model.diffusion_model
    dm.joint_blocks[0].x_block.attn.comfy_attention = ComfyAttention(function=None)
    try:
        check_attention_requests(dm)
        dm.joint_blocks[0].x_block.attn.comfy_attention = ComfyAttention(function=_replacement)
        with pytest.raises(NotCarried, match="comfy_kitchen_int8.*1 layers"):
            check_attention_requests(dm)
    finally:
        del dm.joint_blocks[0].x_block.attn.comfy_attention


def test_a_patcher_whose_init_lacks_fast_disk_is_refused_before_clone():
    """Newer ComfyUI's clone() builds type(patcher)(..., fast_disk=...): a loader's subclass with the older __init__
    would fail mid-prompt - refused first, naming the class. ComfyUI 0.30's own patcher, a subclass that keeps
    ComfyUI's __init__ and one that takes **kwargs pass."""
    import comfy.model_patcher as mp

    from comfyui_hybrid_parallel.workers.bridge.prepare import check_clonable
    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried

    class Newer(mp.ModelPatcher):  # the newer ComfyUI's ModelPatcher.__init__
        pinned = frozenset()  # (what ComfyUI's __del__ reads)
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False, fast_disk=False):
            pass

    class OldLoader(Newer):
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            pass

    class Following(Newer):
        def __init__(self, *args, **kwargs):
            pass

    class Plain(Newer):
        pass

    for fine in (Newer, Following, Plain):
        check_clonable(object.__new__(fine), base=Newer)
    with pytest.raises(NotCarried, match="OldLoader.*fast_disk"):
        check_clonable(object.__new__(OldLoader), base=Newer)
    check_clonable(object.__new__(OldLoader))  # on 0.30 (no fast_disk in ComfyUI's __init__): nothing to refuse
