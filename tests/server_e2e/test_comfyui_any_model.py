"""Models no family adapter knows - SD1.5 and SDXL - in a real ComfyUI: CFG and data parallel, against KSampler.

Why: CFG parallel and data parallel split only the batch, so every model ComfyUI loads can run them, each rank
holding the whole model (parallel/models/any_model.py). The tiny checkpoints are ComfyUI's own UNet classes that
its detection maps to SD15 and to an SDXL model class (KOALA-700M's depths at width 320: SDXL's conditioning, its
size embeddings included), saved fp16. The latent is odd (9 x 7) and the batch of 3 splits 2 + 1 over dp 2.
LoRA (patches that travel and are applied on the workers) and a ControlNet (residuals ComfyUI computes in the
driver, split with the batch) are checked on SD1.5, and sequence parallel is refused before any worker starts.
"""
import pytest

from comfy_server import FAMILIES, assert_ok, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 72, 56
BOUND = 1e-5
LORA = "tiny_sd15_lora.safetensors"
CN, HINT = "tiny_sd15_controlnet.safetensors", "hp_sd15_hint.png"


@pytest.fixture(scope="module")
def unets(server):
    """The tiny SD1.5 and SDXL UNets, the SD VAE, a LoRA on SD1.5's attention and an SD1.5 ControlNet."""
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.doctor import tiny_controlnets as tcn
    models = server.base / "models"
    for family, xl, seed in (("sd15", False, 41), ("sdxl", True, 42)):
        path = models / "diffusion_models" / FAMILIES[family]["unet"]
        if not path.exists():
            tc.write_unet(path, xl=xl, seed=seed)
    if not (models / "vae" / "tiny_kl4.safetensors").exists():
        tc.write_kl_vae(models / "vae" / "tiny_kl4.safetensors", style="sd", seed=6)
    _write_lora(models / "loras" / LORA)
    tcn.write_sd15_controlnet(models / "controlnet" / CN, seed=43)
    from test_comfyui_controlnet import _write_hint
    _write_hint(server.base / "input" / HINT)


def _write_lora(path):
    """A rank-4 LoRA on SD1.5's self- and cross-attention queries (ComfyUI's generic key format)."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(44)
    sd = {}
    for block in ("input_blocks.1.1", "middle_block.1", "output_blocks.0.1"):
        for attn in ("attn1", "attn2"):
            k = f"diffusion_model.{block}.transformer_blocks.0.{attn}.to_q"
            sd[f"{k}.lora_up.weight"] = torch.randn(320, 4, generator=g) * 0.3
            sd[f"{k}.lora_down.weight"] = torch.randn(4, 320, generator=g) * 0.3
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def _graph(family, tag, degrees=None, node="model", batch=1, lora=None, control=None):
    g = workflow(None, tag, W, H, family=family, steps=2, batch=batch, lora=lora)
    for k in ("7", "8", "11"):  # the latent is what is compared
        g.pop(k, None)
    if control is not None:
        g["30"] = {"class_type": "LoadImage", "inputs": {"image": HINT}}
        g["31"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CN}}
        g["32"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
            "positive": ["2", 0], "negative": ["3", 0], "control_net": ["31", 0], "image": ["30", 0],
            "strength": control, "start_percent": 0.0, "end_percent": 1.0}}
        g["5"]["inputs"].update(positive=["32", 0], negative=["32", 1])
    return g if degrees is None else on_pool(g, degrees, node)


def _equal_ksampler(server, family, tag, cases, **kw):
    assert_ok(server, server.run(_graph(family, f"{tag}_ref", **kw)))
    ref = latent(server, f"{tag}_ref")
    for name, degrees, node in cases:
        assert_ok(server, server.run(_graph(family, f"{tag}_{name}", degrees, node, **kw)))
        assert server.get("/hybrid_parallel/pool")["mesh"].startswith(name[:3]), server.get("/hybrid_parallel/pool")
        err = rel(latent(server, f"{tag}_{name}"), ref)
        print(f"{tag} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= BOUND, (name, err)
    return ref


def test_sd15_cfg_and_data_parallel_equal_ksampler(server, unets):
    _equal_ksampler(server, "sd15", "sd15", [("cfg2", {"cfg_degree": 2}, "sampler"),
                                             ("dp2", {"dp_degree": 2}, "model"),
                                             ("cfg2_model", {"cfg_degree": 2}, "model")], batch=3)


def test_sdxl_cfg_and_data_parallel_equal_ksampler(server, unets):
    _equal_ksampler(server, "sdxl", "sdxl", [("cfg2", {"cfg_degree": 2}, "model"),
                                             ("dp2", {"dp_degree": 2}, "sampler")], batch=2)


def test_sd15_lora_equals_ksampler(server, unets):
    """The LoRA changes the result, and the pool follows it and a new strength exactly."""
    plain = _graph("sd15", "sd15_nolora")
    assert_ok(server, server.run(plain))
    for strength in (1.0, 0.5):
        ref = _equal_ksampler(server, "sd15", f"sd15_lora{strength}", [("cfg2", {"cfg_degree": 2}, "model")],
                              lora=(LORA, strength))
        assert rel(ref, latent(server, "sd15_nolora")) > 1e-3, "the LoRA changed nothing: the test proves nothing"


def test_sd15_controlnet_equals_ksampler(server, unets):
    """ComfyUI computes the ControlNet's residuals in the driver for the whole batch; each rank takes its rows."""
    ref = _equal_ksampler(server, "sd15", "sd15_cn", [("cfg2", {"cfg_degree": 2}, "model"),
                                                      ("dp2", {"dp_degree": 2}, "model")], batch=3, control=0.9)
    assert_ok(server, server.run(_graph("sd15", "sd15_cn_off", batch=3, control=0.0)))
    assert rel(latent(server, "sd15_cn_off"), ref) > 1e-2, "the ControlNet changed nothing"


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2}])
def test_sequence_parallel_on_sd15_is_refused_naming_cfg_and_dp(server, unets, degrees):
    entry = server.run(_graph("sd15", "sd15_refused", degrees))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "UNetModel has no family adapter" in msg and "cfg_degree 2" in msg and "dp_degree" in msg, msg
    assert "docs/adding-a-model.md" in msg, msg


def test_parallel_gpus_auto_splits_the_cfg_of_sd15(server, unets):
    """Degrees auto on a model with no cost model: CFG parallel when ComfyUI batches an uncond half."""
    g = _graph("sd15", "sd15_auto")
    g["9"] = {"class_type": "HybridParallelGPUs", "inputs": {"devices": "2", "preset": "auto"}}
    g["5"]["inputs"]["model"] = ["40", 0]
    g["40"] = {"class_type": "HybridParallelModel", "inputs": {"model": ["1", 0], "parallel_config": ["9", 0]}}
    assert_ok(server, server.run(g))
    assert_ok(server, server.run(_graph("sd15", "sd15_auto_ref")))
    assert rel(latent(server, "sd15_auto"), latent(server, "sd15_auto_ref")) <= BOUND
    auto = server.get("/hybrid_parallel/mesh?degrees=auto")["auto"]
    assert auto["batch_only"] and auto["model"] == "UNetModel" and auto["chosen"] == "cfg2", auto


@pytest.mark.slow
@pytest.mark.parametrize("compile_first", [True, False], ids=["compile-then-parallel", "parallel-then-compile"])
def test_torch_compile_model_compiles_on_the_workers(server, unets, compile_first):
    """ComfyUI's TorchCompileModel (inductor) with the pool, in either order of the two nodes: the workers compile
    their model, the result equals KSampler's uncompiled one, and a second prompt compiles nothing new."""
    assert_ok(server, server.run(_graph("sd15", "sd15_compile_ref")))
    ref = latent(server, "sd15_compile_ref")
    for run in range(2):
        g = _graph("sd15", f"sd15_compiled{run}", {"cfg_degree": 2})
        if compile_first:
            g["60"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["1", 0], "backend": "inductor"}}
            g["40"]["inputs"]["model"] = ["60", 0]
        else:
            g["60"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["40", 0], "backend": "inductor"}}
            g["5"]["inputs"]["model"] = ["60", 0]
        g["5"]["inputs"]["seed"] = 42
        assert_ok(server, server.run(g))
        err = rel(latent(server, f"sd15_compiled{run}"), ref)
        print(f"TorchCompileModel ({'first' if compile_first else 'after'}) run {run}: rel {err:.2e}")
        assert err <= BOUND, err
