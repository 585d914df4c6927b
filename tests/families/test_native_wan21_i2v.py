"""Wan 2.1 image-to-video (ComfyUI's WAN21 with CLIP-vision features) under every sequence method, vs ComfyUI.

Wan 2.1 I2V projects the CLIP-vision features of the start image (clip_fea, 257 tokens x 1280) into extra context
tokens that every cross-attention reads with its own image key/value projections; the start image's latent and
mask join x as channels (in_dim 36). The image tokens are split as for text-to-video; the CLIP-vision tokens, like
the text, are replicated (cross-attention needs no communication). Fresh random inputs, odd and even latents.
"""
import pytest
import torch

from test_native_pool import comfy, comfy_forward, pool_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2},
                                     {"cfg_degree": 2}, {"tp_degree": 2}],
                         ids=["u2", "r2", "u2r2", "cfg2", "tp2"])
def test_wan21_i2v_clip_vision_equals_comfyui(comfy, cpu_pool, degrees):  # noqa: F811
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = comfy / "wan21_i2v.safetensors"
    if not path.exists():
        tiny.write_wan(path, dim=256, ffn_dim=256, seed=43, in_dim=36, model_type="i2v")
    base = load_diffusion_model(str(path)).model
    assert type(base).__name__ == "WAN21" and base.diffusion_model.img_emb is not None
    config = ParallelConfig(**degrees)
    for odd in (True, False):
        g = torch.Generator().manual_seed(44 + odd)
        h, w = (9, 13) if odd else (8, 12)
        inp = {"x": torch.randn(2, 36, 2, h, w, generator=g), "timestep": torch.rand(2, generator=g) * 1000,
               "context": torch.randn(2, 7, 4096, generator=g), "clip_fea": torch.randn(2, 257, 1280, generator=g)}
        ref = comfy_forward(base, inp)
        out = pool_forward(cpu_pool, config, f"wan21i2v:{config.describe()}", base, inp)
        err = rel(out, ref)
        print(f"Wan 2.1 I2V {config.describe()} {'odd' if odd else 'even'}: rel {err:.2e}")
        assert out.shape == ref.shape and err <= 1e-5, err
        assert rel(comfy_forward(base, dict(inp, clip_fea=torch.zeros_like(inp["clip_fea"]))), ref) > 1e-3
