"""Kandinsky 5 in a real ComfyUI (0.33+): ComfyUI's Kandinsky5 on the workers, against KSampler.

Video (Lite / Pro layout, width 256, two visual blocks) on a 14 x 10 latent of 2 frames (70 tokens; ComfyUI's
Kandinsky 5 fails on odd sides), and Image Lite (ComfyUI detects it by width 2560 only: two visual blocks,
~0.13B parameters) on a 14 x 10 latent (35 tokens: odd splits): Parallel Model + KSampler with ulysses 2, ring 2,
ulysses 2 x ring 2, Hybrid Sampler with cfg 2. The tokens are split at the first visual block and gathered at the
last (parallel/models/kandinsky5.py); the text blocks run whole on every rank.
"""
import pytest

from comfy_server import PARTS, part_of
from comfy_server import FAMILIES, equal_ksampler, error_text, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

W, H = 112, 80  # even latent sides: ComfyUI's Kandinsky 5 pads odd ones and does not crop its output back
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]


def _write(server, family):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, FAMILIES[family]["unet"], "comfy.ldm.kandinsky5.model",
                     lambda p: tiny.write_kandinsky5(p, image=family == "kandinsky5_image", seed=37))


def _graph(family, tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family=family, length=5, weight_dtype="fp8_e4m3fn", steps=2)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("family", ["kandinsky5", "kandinsky5_image"])
def test_kandinsky5_equals_ksampler(server, family, part):
    _write(server, family)
    extra = [("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler"),
             # DistriFusion with every step synchronous (warmup = steps): the stale-K/V path's plumbing, exact
             ("df_u2", {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 2}, "sampler")]
    equal_ksampler(server, lambda *a: _graph(family, *a), family,
                   part_of(CASES + (extra if family == "kandinsky5" else []), part))


def test_kandinsky5_tensor_parallel_is_refused_with_the_fix(server):
    _write(server, "kandinsky5")
    entry = server.run(_graph("kandinsky5", "kandinsky5_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "Kandinsky 5" in msg and "ulysses/ring/cfg" in msg, msg
