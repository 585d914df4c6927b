"""A GGUF loader's weights on the workers (workers/bridge/loader_types.py), against ComfyUI's own forward of the same model.

The loader is the tests' (tests/hp_gguf_loader: ComfyUI-GGUF's tensor, ops and patcher contract), imported as ComfyUI
imports a custom node (its module named by its path); the model is a tiny SD3 quantized with gguf-py into a mixed
Q8_0 / Q4_K file. Checked here: the quantizer the files are made with, the workers' model against ComfyUI's forward
(odd and even latents; ulysses, cfg, sharded), the bytes that travel and that the ranks hold (the quantized blocks,
never a dequantized copy), ComfyUI's own copy becoming the workers' pages, LoRA applied by the loader's patcher and a
new strength patched in place, and the refusals."""
import importlib.util
import sys

import numpy as np
import pytest
import torch

from test_native_pool import comfy, comfy_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy

LOADER = __import__("pathlib").Path(__file__).resolve().parents[1] / "hp_gguf_loader"


def test_q4_k_blocks_read_back_by_gguf_py():
    """The tests' Q4_K writer against gguf-py's own dequantizer: every value within half a quantization step."""
    import gguf

    from gguf_files import quantize_q4_k
    x = np.random.default_rng(5).standard_normal((3, 512)).astype(np.float32) * 2
    q = quantize_q4_k(x)
    assert q.shape == (3, 2 * 144) and q.dtype == np.uint8
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_K)
    step = (x.reshape(-1, 32).max(1) - np.minimum(x.reshape(-1, 32).min(1), 0)) / 15
    assert (np.abs(back - x).reshape(-1, 32).max(1) <= step * 0.5 + 0.02 * np.abs(x).max()).all()


@pytest.fixture(scope="module")
def loader(comfy):  # noqa: F811
    """The tests' GGUF loader package, imported as ComfyUI imports a custom node folder (module named by its path)."""
    name = str(LOADER)
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, LOADER / "__init__.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


@pytest.fixture(scope="module")
def gguf_model(loader, tmp_path_factory):
    """(ModelPatcher, file's types) of a tiny SD3 in a mixed Q8_0 / Q4_K / F16 .gguf, loaded by the loader node."""
    import folder_paths

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from gguf_files import gguf_from_safetensors
    d = tmp_path_factory.mktemp("gguf")
    tc.write_sd3(d / "sd3.safetensors", depth=2, pos_embed_max_size=16, seed=31)
    kinds = gguf_from_safetensors(d / "sd3.safetensors", d / "sd3.gguf", "sd3", qtypes=("Q8_0", "Q4_K"),
                                  float_type="F16")
    folder_paths.folder_names_and_paths[loader.FOLDER] = ([str(d)], {".gguf"})
    patcher = loader.HPTestUnetLoaderGGUF().load_unet("sd3.gguf")[0]
    return patcher, kinds


def _inputs(h, w, seed):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2, 16, h, w, generator=g), "timestep": torch.rand(2, generator=g),
            "context": torch.randn(2, 5, 32, generator=g), "y": torch.randn(2, 24, generator=g)}


def _load(pool, config, key, base, **kw):
    from dataclasses import replace

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    dm = base.diffusion_model
    spec = replace(native_spec(base), **kw.pop("spec", {}))  # (the loader's patcher, as plan.pool_state adds it)
    return pool.ensure_model(config, key, family_adapter(dm).family, native=spec,
                             state_dict=lambda: {k: raw(v) for k, v in host_tensors(dm).items()}, **kw)


def _forward(pool, config, key, inp):
    return pool.submit(config, "forward", {"key": key, "structure": {"transformer_options": {}}}, dict(inp)).tensors["out"]


def test_gguf_model_on_the_pool_equals_comfyui(gguf_model, cpu_pool):
    """Ulysses 2, cfg 2 and ulysses 2 with the quantized bytes sharded, odd (9 x 13) and even latents, against
    ComfyUI's forward of the loader's model; the ranks hold the file's blocks (uint8), sharded: half of them."""
    from comfyui_hybrid_parallel.workers.bridge.spec import weight_bytes
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    patcher, kinds = gguf_model
    base, dm = patcher.model, patcher.model.diffusion_model
    quantized = sum(torch.Tensor.as_subclass(t, torch.Tensor).nbytes for t in dm.parameters()
                    if getattr(t, "tensor_type", None) is not None and t.tensor_type.name in ("Q8_0", "Q4_K"))
    assert quantized > 0 and weight_bytes(dm) < sum(t.numel() * 4 for t in dm.state_dict().values())
    for degrees in ({"ulysses_degree": 2}, {"cfg_degree": 2}, {"ulysses_degree": 2, "shard_weights": "sequence"}):
        config = ParallelConfig(**degrees)
        key = f"gguf:{config.describe()}"
        res = _load(cpu_pool, config, key, base)
        assert res["loaded"] and cpu_pool.last_load_bytes == weight_bytes(dm)  # the file's bytes, nothing more
        for h, w in ((9, 13), (8, 12)):
            inp = _inputs(h, w, 32 + h)
            ref = comfy_forward(base, inp)
            err = rel(_forward(cpu_pool, config, key, inp), ref)
            print(f"GGUF {config.describe()} {h}x{w}: rel {err:.2e}")
            assert err <= 1e-5, (degrees, h, w, err)
        held = cpu_pool.submit(config, "model_bytes", {"key": key}).per_rank[0]
        if "shard_weights" in degrees:
            s = held["sharding"]
            assert s["full_bytes"] >= weight_bytes(dm) and s["shard_bytes"] * 2 == s["full_bytes"], s
        else:
            assert held["dtypes"]["uint8"] == quantized and held["bytes"] == weight_bytes(dm), held


def test_comfyui_copy_becomes_the_workers_pages(loader, tmp_path, cpu_pool):
    """ComfyUI's own GGUF tensors are replaced by the shared pages the workers map (one host copy), staying the
    loader's tensors with their attributes, and the model computes the same."""
    import folder_paths

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.workers.bridge.host import adopter
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from gguf_files import gguf_from_safetensors
    tc.write_sd3(tmp_path / "sd3.safetensors", depth=2, pos_embed_max_size=16, seed=33)
    gguf_from_safetensors(tmp_path / "sd3.safetensors", tmp_path / "own.gguf", "sd3", qtypes=("Q8_0",))
    folder_paths.folder_names_and_paths[loader.FOLDER] = ([str(tmp_path)], {".gguf"})
    base = loader.HPTestUnetLoaderGGUF().load_unet("own.gguf")[0].model
    dm = base.diffusion_model
    inp = _inputs(8, 8, 34)
    before = comfy_forward(base, inp)
    w = dm.joint_blocks[0].x_block.attn.qkv.weight
    kind, shape, ptr = w.tensor_type, w.shape, w.untyped_storage().data_ptr()
    config = ParallelConfig(ulysses_degree=2)
    _load(cpu_pool, config, "gguf-adopt", base, adopt=adopter(dm))
    w = dm.joint_blocks[0].x_block.attn.qkv.weight
    assert type(w).__name__ == "QuantTensor" and w.tensor_type == kind and w.shape == shape
    assert w.untyped_storage().data_ptr() != ptr  # now the pages the workers map
    assert torch.equal(comfy_forward(base, inp), before)


def test_gguf_lora_is_applied_by_the_loader_patcher(gguf_model, cpu_pool):
    """The MODEL's LoRA patches travel and the loader's own patcher attaches them to the quantized weights on the
    workers; a second strength is patched in place (only the patches travel); both equal ComfyUI's own patching."""
    import comfy.lora
    import comfy.utils

    from comfyui_hybrid_parallel.workers.bridge.prepare import loader_patcher
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.patches import encode
    patcher, _ = gguf_model
    g = torch.Generator().manual_seed(35)
    lora = {}
    for i in range(2):
        k = f"diffusion_model.joint_blocks.{i}.x_block.attn.qkv"
        lora[f"{k}.lora_up.weight"] = torch.randn(3 * 128, 4, generator=g) * 0.2
        lora[f"{k}.lora_down.weight"] = torch.randn(4, 128, generator=g) * 0.2
    quantized = [dm_w for dm_w in (patcher.model.diffusion_model.joint_blocks[i].x_block.attn.qkv.weight
                                   for i in range(2))]
    assert all(w.tensor_type.name in ("Q8_0", "Q4_K") for w in quantized)  # the LoRA patches quantized weights
    keys = comfy.lora.model_lora_keys_unet(patcher.model, {})
    config = ParallelConfig(ulysses_degree=2)
    inp = _inputs(9, 13, 36)
    plain = comfy_forward(patcher.model, inp)
    for i, strength in enumerate((1.0, 0.5)):
        m = patcher.clone()
        m.add_patches(comfy.lora.load_lora(lora, keys), strength)
        desc = loader_patcher(m)
        assert desc is not None and desc["class"].endswith(":QuantModelPatcher"), desc
        res = _load(cpu_pool, config, f"gguf-lora{strength}", m.model, lineage="gguf-lora", patches=encode(m.patches),
                    spec={"patcher": desc})
        assert res.get("patched_in_place", False) == (i == 1), res
        m.patch_model()  # ComfyUI's own: the loader's patcher attaches the patches to the quantized weights
        try:
            ref = comfy_forward(m.model, inp)
        finally:
            m.unpatch_model()
        out = _forward(cpu_pool, config, f"gguf-lora{strength}", inp)
        err = rel(out, ref)
        print(f"GGUF LoRA {strength}: rel {err:.2e}")
        assert err <= 1e-5 and rel(ref, plain) > 1e-3, (strength, err)


def test_what_gguf_weights_cannot_run_is_refused(gguf_model):
    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried, check_loader_methods
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.loader_types import NotCarriable, describe
    dm = gguf_model[0].model.diffusion_model
    for degrees, words in (({"tp_degree": 2}, "tensor parallel"), ({"pp_degree": 2}, "PipeFusion")):
        with pytest.raises(NotCarried, match=f"{words}.*quantized.*ulysses/ring/cfg/dp"):
            check_loader_methods(dm, ParallelConfig(**degrees), patched=False)
    with pytest.raises(NotCarried, match="LoRA.*shard_weights none"):
        check_loader_methods(dm, ParallelConfig(ulysses_degree=2, shard_weights="sequence"), patched=True)
    check_loader_methods(dm, ParallelConfig(ulysses_degree=2, shard_weights="sequence"), patched=False)
    w = dm.joint_blocks[0].x_block.attn.qkv.weight
    w.extra = object()  # an attribute the workers could not rebuild
    try:
        with pytest.raises(NotCarriable, match="'extra' holds a value of type object"):
            describe(w, "qkv")
    finally:
        del w.extra


def test_gguf_wan_equals_comfyui(loader, tmp_path, cpu_pool):
    """Wan 2.1 (the family most GGUF users run, 14B in Q4_K / Q8_0) from a mixed Q8_0 / Q4_K file: ulysses 2 and
    ulysses 2 with the quantized bytes sharded, on a video latent whose 5 x 7 token grid and 2 frames do not divide
    evenly, against ComfyUI's forward of the loader's model."""
    import folder_paths

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from gguf_files import gguf_from_safetensors
    tc.write_wan(tmp_path / "wan.safetensors", dim=256, ffn_dim=512, seed=37)
    kinds = gguf_from_safetensors(tmp_path / "wan.safetensors", tmp_path / "wan.gguf", "wan",
                                  qtypes=("Q4_K", "Q8_0"))
    assert {"Q4_K", "Q8_0"} <= set(kinds.values())
    folder_paths.folder_names_and_paths[loader.FOLDER] = ([str(tmp_path)], {".gguf"})
    base = loader.HPTestUnetLoaderGGUF().load_unet("wan.gguf")[0].model
    assert type(base.diffusion_model).__name__ == "WanModel"
    g = torch.Generator().manual_seed(38)
    inp = {"x": torch.randn(1, 16, 2, 10, 14, generator=g), "timestep": torch.rand(1, generator=g),
           "context": torch.randn(1, 7, 4096, generator=g)}
    ref = comfy_forward(base, inp)
    for degrees in ({"ulysses_degree": 2}, {"ulysses_degree": 2, "shard_weights": "sequence"}):
        config = ParallelConfig(**degrees)
        _load(cpu_pool, config, f"gguf-wan:{config.describe()}", base)
        err = rel(_forward(cpu_pool, config, f"gguf-wan:{config.describe()}", inp), ref)
        print(f"GGUF Wan {config.describe()}: rel {err:.2e}")
        assert err <= 1e-5, (degrees, err)
