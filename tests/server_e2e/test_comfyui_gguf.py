"""GGUF weights in a real ComfyUI: a GGUF loader's quantized model on the pool, against KSampler with the same loader.

Why: GGUF (ComfyUI-GGUF) is how many people fit Flux, Wan and Qwen-Image on consumer GPUs. Its weights are a tensor
subclass over the file's quantized blocks, dequantized by the loader's own operations at each call, and its LoRA
patches stay on the tensor (workers/bridge/loader_types.py). The loader here is the tests' (tests/hp_gguf_loader, ComfyUI-
GGUF's contract); the files are the session's tiny SD3 quantized with gguf-py: all Q8_0, and mixed Q8_0 + Q4_K (as
a Q4_K_M file mixes types). Odd latent (13 x 9), batch 2 so data parallel splits it. Where ComfyUI-GGUF itself is
installed in the server (by hand: HP_THIRDPARTY_DIR, scripts/setup_thirdparty.sh; or HP_COMFYUI_GGUF naming a checkout),
the tests run on its own loader node, UnetLoaderGGUFAdvanced, instead.
"""

import pytest

from comfy_server import assert_ok, error_text, latent, on_pool, rel, workflow
from conftest import third_party

pytestmark = pytest.mark.comfy

W, H = 104, 72
BOUND = 1e-5
Q8, MIXED = "tiny_sd3_q8_0.gguf", "tiny_sd3_q8_0_q4_k.gguf"


# ComfyUI-GGUF's own loader where it is installed (CI), else the tests' stand-in of its contract
LOADERS = ["ComfyUI-GGUF"] if any(p.name == "ComfyUI-GGUF" for p in third_party()) else ["hp_test"]


@pytest.fixture(scope="module", params=LOADERS)
def loader(request):
    return request.param


@pytest.fixture(scope="module")
def gguf_files(server):
    from gguf_files import gguf_from_safetensors
    unet = server.base / "models" / "diffusion_models"
    src = unet / "tiny_sd3.safetensors"
    kinds = {Q8: gguf_from_safetensors(src, unet / Q8, "sd3", qtypes=("Q8_0",)),
             MIXED: gguf_from_safetensors(src, unet / MIXED, "sd3", qtypes=("Q8_0", "Q4_K"), float_type="F16")}
    assert {"Q8_0", "Q4_K", "F16"} <= set(kinds[MIXED].values()), kinds[MIXED]
    return kinds


def _graph(tag, unet, degrees=None, node="model", lora=None, dequant="default", batch=2, loader="hp_test"):
    g = workflow(None, tag, W, H, family="sd3", steps=2, batch=batch, lora=lora)
    for k in ("6", "7", "8", "11"):  # the latent is what is compared
        g.pop(k, None)
    if loader == "hp_test":
        g["1"] = {"class_type": "HPTestUnetLoaderGGUF", "inputs": {"unet_name": unet, "dequant_dtype": dequant,
                                                                  "patch_on_device": False}}
    else:
        g["1"] = {"class_type": "UnetLoaderGGUFAdvanced", "inputs": {"unet_name": unet, "dequant_dtype": dequant,
                                                                    "patch_dtype": "default",
                                                                    "patch_on_device": False}}
    return g if degrees is None else on_pool(g, degrees, node)


def _equal_ksampler(server, tag, unet, cases, loader, **kw):
    tag = f"{loader}_{tag}"
    assert_ok(server, server.run(_graph(f"{tag}_ref", unet, loader=loader, **kw)))
    ref = latent(server, f"{tag}_ref")
    for name, degrees, node in cases:
        assert_ok(server, server.run(_graph(f"{tag}_{name}", unet, degrees, node, loader=loader, **kw)))
        err = rel(latent(server, f"{tag}_{name}"), ref)
        print(f"GGUF {tag} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= BOUND, (name, err)
    return ref


def test_gguf_loader_settings_travel(server, gguf_files, loader):
    """The loader's dequant_dtype is a class attribute of its Linear (set when it loads): float16 dequantization
    changes the result, and the workers dequantize as the driver's class says at each run."""
    f16 = _equal_ksampler(server, "q8_f16", Q8, [("cfg2", {"cfg_degree": 2}, "model")], loader, dequant="float16")
    f32 = _equal_ksampler(server, "q8_f32", Q8, [("cfg2", {"cfg_degree": 2}, "model")], loader, dequant="float32")
    assert rel(f16, f32) > 1e-7, "float16 dequantization changed nothing: the test proves nothing"


def test_gguf_weights_equal_ksampler(server, gguf_files, loader):
    """Mixed Q8_0 / Q4_K / F16 file: Parallel Model cfg 2, data parallel 2, Hybrid Sampler ulysses 2, ulysses 2
    with the weights sharded as raw bytes, Hybrid Sampler ulysses 2 with the loop in the workers, each against
    KSampler on the same GGUF model (the batch splits first: the world the test above left running, then one
    2-rank world that intercepts attention, which the LoRA test below keeps)."""
    ref = _equal_ksampler(server, "mixed", MIXED, [
        ("cfg2", {"cfg_degree": 2}, "model"), ("dp2", {"dp_degree": 2}, "model"),
        ("u2", {"ulysses_degree": 2}, "sampler"),
        ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "model"),
        ("u2_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler")],
        loader)
    # the quantization is real: the GGUF model is not the fp32 checkpoint it was made from
    g = workflow(None, "mixed_fp32", W, H, family="sd3", steps=2, batch=2)
    for k in ("6", "7", "8", "11"):
        g.pop(k, None)
    assert_ok(server, server.run(g))
    assert rel(ref, latent(server, "mixed_fp32")) > 1e-3


def test_gguf_lora_equals_ksampler(server, gguf_files, loader):
    """A LoRA on the Q8_0 file's quantized attention weights, applied on the workers by the loader's own patcher (the
    patches ride on the quantized tensor, dequantized with it at each call), at two strengths (the second patched in
    place on the resident model), against KSampler with the same loader."""
    assert_ok(server, server.run(_graph(f"{loader}_q8_nolora", Q8, loader=loader)))
    for strength in (1.0, 0.5):
        ref = _equal_ksampler(server, f"q8_lora{strength}", Q8, [("u2", {"ulysses_degree": 2}, "model")], loader,
                              lora=("tiny_lora.safetensors", strength))
        assert rel(ref, latent(server, f"{loader}_q8_nolora")) > 1e-3, "the LoRA changed nothing: the test proves nothing"


def test_tensor_parallel_on_gguf_is_refused(server, gguf_files, loader):
    entry = server.run(_graph(f"{loader}_q8_tp", Q8, {"tp_degree": 2}, loader=loader))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "tensor parallel" in msg and "quantized" in msg and "ulysses/ring/cfg/dp" in msg, msg
