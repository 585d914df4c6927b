"""The demo model's networks: ComfyUI's own classes at demo size, and the checker's tiny classifier.

- Diffusion model: ComfyUI's MMDiT (the SD3 family) with depth 3, so hidden 192 and 3 heads of 64 (what
  ComfyUI's detection derives from the weights; 3 heads split unevenly over 2 Ulysses ranks), a 64-wide
  context and pooled vector (hp_example_nodes/demo_text.py), 16 latent channels. UNETLoader loads it as an SD3 model
  (flow matching, shift 3, SD3's latent scale and shift).
- VAE: ComfyUI's Wan 2.1 VAE class with base width 16 (VAELoader reads the width from the weights),
  8x down-sampling, 16 channels, trained on single images: for one frame its causal 3-D convolutions
  only ever see their last temporal tap (the taps before it meet zero padding), so training runs
  them as 2-D convolutions of that tap (`frame_convs`), about 3x cheaper and exactly equal.
- Classifier: a small CNN that names a picture's shape, colour and background (shapes.py's classes).
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_example_nodes import demo_text as text

DEPTH = 3
VAE_DIM = 16
POS_EMBED_MAX = 16  # latents up to 32 x 32 (256 px)


def build_dit(dtype=torch.float32) -> nn.Module:
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT, get_2d_sincos_pos_embed

    hidden = 64 * DEPTH
    m = MMDiT(in_channels=16, patch_size=2, out_channels=16, depth=DEPTH, input_size=None,
              adm_in_channels=text.DIM,
              context_embedder_config={"target": "torch.nn.Linear",
                                       "params": {"in_features": text.DIM, "out_features": hidden}},
              num_patches=POS_EMBED_MAX ** 2, pos_embed_max_size=POS_EMBED_MAX,
              operations=comfy.ops.disable_weight_init, dtype=dtype)
    _torch_init(m)
    pe = get_2d_sincos_pos_embed(hidden, POS_EMBED_MAX)
    m.pos_embed.copy_(torch.from_numpy(np.asarray(pe, dtype=np.float32)).unsqueeze(0))
    for name, mod in m.named_modules():  # adaLN-zero: every block starts as the identity, the output as zero
        if name.endswith("adaLN_modulation") or name == "final_layer.linear":
            for p in mod.parameters():
                nn.init.zeros_(p)
    return m


def build_vae() -> nn.Module:
    from comfy.ldm.wan.vae import WanVAE

    v = WanVAE(dim=VAE_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
               temperal_downsample=[False, True, True], dropout=0.0)
    _torch_init(v)
    with torch.no_grad():  # taps before the last never meet a single image; keep them zero
        for mod in v.modules():
            if isinstance(mod, nn.Conv3d) and mod.weight.shape[2] > 1:
                mod.weight[:, :, :-1].zero_()
    return v


def _torch_init(module: nn.Module) -> None:
    """ComfyUI's ops skip weight init (checkpoints overwrite it); training needs torch's own."""
    for mod in module.modules():
        for cls in type(mod).__mro__:
            if cls.__module__.startswith("torch.nn") and "reset_parameters" in cls.__dict__:
                cls.reset_parameters(mod)
                break


@contextlib.contextmanager
def frame_convs():
    """Run ComfyUI's causal 3-D convolutions on one frame as the 2-D convolution of their last temporal tap
    (what they compute for a first frame: the earlier taps meet zero padding). Restored on exit."""
    from comfy.ldm.wan import vae as wan_vae

    def forward(self, x, cache_x=None, cache_list=None, cache_idx=None):
        if x.shape[2] != 1:
            raise ValueError("frame_convs is for single images (one frame)")
        if cache_list is not None:
            cache_list[cache_idx] = None
        pad = self._padding[:4]
        y = F.conv2d(F.pad(x[:, :, 0], pad), self.weight[:, :, -1], self.bias, self.stride[1:], 0,
                     self.dilation[1:], self.groups)
        return y.unsqueeze(2)

    original = wan_vae.CausalConv3d.forward
    wan_vae.CausalConv3d.forward = forward
    try:
        yield
    finally:
        wan_vae.CausalConv3d.forward = original


class Classifier(nn.Module):
    """Picture (B, 3, 64, 64) in [0, 1] -> logits for shape, colour and background."""

    def __init__(self, n_shapes: int, n_colours: int, n_backgrounds: int):
        super().__init__()
        chans = (3, 32, 64, 64, 128)
        layers = []
        for a, b in zip(chans, chans[1:]):
            layers += [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.shape = nn.Linear(128, n_shapes)
        self.colour = nn.Linear(128, n_colours)
        self.background = nn.Linear(128, n_backgrounds)

    def forward(self, x):
        f = self.features(x * 2 - 1)
        return self.shape(f), self.colour(f), self.background(f)


def new_classifier() -> Classifier:
    from . import shapes
    return Classifier(len(shapes.SHAPES), len(shapes.COLOURS), len(shapes.BACKGROUNDS))
