"""Tiny random-init diffusers transformers of each family, and fresh random inputs for them.

Models are seeded so every rank of a test world builds the same weights; inputs
are drawn from a generator seeded by the test, so each test uses fresh inputs
that all ranks agree on.
"""
from __future__ import annotations

import torch

HEADS = 4


def build(family: str, heads: int = HEADS, seed: int = 0, dtype=torch.float32):
    from diffusers import (FluxTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel,
                           WanTransformer3DModel)

    torch.manual_seed(seed)
    if family == "flux":
        m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=heads, joint_attention_dim=24,
                                   pooled_projection_dim=12, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    elif family == "sd3":
        m = SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                  num_attention_heads=heads, joint_attention_dim=24, caption_projection_dim=8 * heads,
                                  pooled_projection_dim=12, out_channels=4, pos_embed_max_size=24,
                                  dual_attention_layers=(0,))
    elif family == "pixart":
        m = PixArtTransformer2DModel(sample_size=16, patch_size=2, in_channels=4, out_channels=8, num_layers=2,
                                     num_attention_heads=heads, attention_head_dim=8, cross_attention_dim=8 * heads,
                                     caption_channels=24, use_additional_conditions=False)
    elif family == "wan":
        m = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=8,
                                  in_channels=4, out_channels=4, text_dim=24, freq_dim=32, ffn_dim=32,
                                  num_layers=2, rope_max_seq_len=64)
    else:
        raise ValueError(family)
    return (m if dtype == torch.float32 else m.to(dtype)).eval()


def inputs(family: str, seed: int, batch: int = 1, h: int = 6, w: int = 5, text: int = 7, frames: int = 3,
           dtype=torch.float32) -> dict:
    """Keyword arguments for one forward. h, w are latent sizes (Flux: token grid, packed already)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    t = torch.rand(batch, generator=g)
    if family == "flux":
        ids = torch.zeros(h, w, 3)
        ids[..., 1] = torch.arange(h)[:, None]
        ids[..., 2] = torch.arange(w)[None, :]
        return dict(hidden_states=r(batch, h * w, 8), encoder_hidden_states=r(batch, text, 24),
                    pooled_projections=r(batch, 12), timestep=t.to(dtype), guidance=(1 + 3 * t).to(dtype),
                    img_ids=ids.reshape(-1, 3).to(dtype), txt_ids=torch.zeros(text, 3, dtype=dtype))
    if family == "sd3":
        return dict(hidden_states=r(batch, 4, h, w), encoder_hidden_states=r(batch, text, 24),
                    pooled_projections=r(batch, 12), timestep=(t * 1000).to(dtype))
    if family == "pixart":
        return dict(hidden_states=r(batch, 4, h, w), encoder_hidden_states=r(batch, text, 24),
                    timestep=(t * 1000).to(dtype), added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    if family == "wan":
        return dict(hidden_states=r(batch, 4, frames, h, w), encoder_hidden_states=r(batch, text, 24),
                    timestep=(t * 1000).to(dtype))
    raise ValueError(family)


def forward(model, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**kw, return_dict=False)[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
