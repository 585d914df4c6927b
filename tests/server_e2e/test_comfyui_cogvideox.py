"""CogVideoX in a real ComfyUI (0.33+): ComfyUI's CogVideoXTransformer3DModel on the workers, against KSampler.

1.0 (Conv2d patches) and 1.5 (2-frame patches) with rotary embeddings, width 128 (2 heads), two blocks, on an odd
13 x 9 latent of 2 frames (70 / 35 video tokens + 7 text tokens, both split): Parallel Model + KSampler with
ulysses 2, ring 2, ulysses 2 x ring 2, Hybrid Sampler with cfg 2.
"""
import pytest

from comfy_server import PARTS, part_of
from comfy_server import equal_ksampler, error_text, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]


def _write(server, v15):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, f"tiny_cogvideox{'15' if v15 else ''}.safetensors", "comfy.ldm.cogvideo.model",
                     lambda p: tiny.write_cogvideox(p, v15=v15, seed=43))


def _graph(unet, tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="cogvideox", length=5, weight_dtype="fp8_e4m3fn", steps=2)
    g["1"]["inputs"]["unet_name"] = unet
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("v15", [False, True], ids=["1.0", "1.5"])
def test_cogvideox_equals_ksampler(server, v15, part):
    unet = _write(server, v15)
    equal_ksampler(server, lambda *a: _graph(unet, *a), f"cogvideox{'15' if v15 else ''}", part_of(CASES, part))


def test_cogvideox_tensor_parallel_is_refused_with_the_fix(server):
    entry = server.run(_graph(_write(server, False), "cogvideox_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "CogVideoX" in msg and "ulysses/ring/cfg" in msg, msg
