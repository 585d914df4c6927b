"""The demo model's networks: ComfyUI's own classes at demo size, and the checker's tiny classifier.

- Diffusion model: ComfyUI's MMDiT (the SD3 family) with depth 3, so hidden 192 and 3 heads of 64 (what
  ComfyUI's detection derives from the weights; 3 heads split unevenly over 2 Ulysses ranks), a 64-wide
  context and pooled vector (hp_example_nodes/demo_text.py), 16 latent channels. UNETLoader loads it as an
  SD3 model (flow matching, shift 3, SD3's latent scale and shift).
- VAE: ComfyUI's TAESD class with 16 latent channels (the layout of taesd3, SD3's tiny VAE; VAELoader reads
  the channel count from the weights), 8x down-sampling, 2.5M parameters; its encoder is set to a colour mosaic,
  its decoder trained (build_vae). ComfyUI's other 16-channel image VAE (the KL one) has a fixed width of 128
  and costs ~30x more to train on two cores; its video VAE (Wan 2.1, width read from the weights) needs 5-D
  latents, which VAE Decode cannot take from an SD3-family model.
- Classifier: a small CNN that names a picture's shape, colour and background (shapes.py's classes).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from hp_example_nodes import demo_text as text

DEPTH = 3
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
    """TAESD whose encoder is *set*, not trained: it computes a colour mosaic, the picture averaged over 4 x 4
    pixel cells (16 x 16 cells for 64 px), each 2 x 2 group of cells packed into 12 channels of one latent pixel,
    scaled to [-1, 1] (4 channels stay 0). Why: trained from scratch on two cores TAESD learnt shapes long before
    colour (its pictures stayed grey after 600 steps); with the colour in the latent by construction only the
    decoder is trained (the mosaic -> sharp picture), which learns colour at once, and the diffusion model sees
    latents whose channels are colours. Built from TAESD's own layers: identity residual blocks (their last conv
    zero; the activations are non-negative colours, so the ReLUs pass them), 2 x 2 averaging stride-2 convs,
    a last stride-2 conv that packs instead of averaging, and an affine output conv."""
    from comfy.taesd.taesd import Block, TAESD

    v = TAESD(latent_channels=16)
    _torch_init(v)
    with torch.no_grad():
        enc = v.taesd_encoder
        for p in enc.parameters():
            p.zero_()
        convs = [m for m in enc if isinstance(m, nn.Conv2d)]
        first, down, last = convs[0], convs[1:4], convs[4]
        for c in range(3):
            first.weight[c, c, 1, 1] = 1.0
        for conv in down[:2]:  # average the 2 x 2 pixels the stride-2 tap window starts at
            for c in range(3):
                conv.weight[c, c, 1:3, 1:3] = 0.25
        for k, (a, b) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):  # pack: channel 3k + c = cell (a, b)
            for c in range(3):
                down[2].weight[3 * k + c, c, 1 + a, 1 + b] = 1.0
        for ch in range(12):
            last.weight[ch, ch, 1, 1] = 2.0
            last.bias[ch] = -1.0
        for m in enc:
            if isinstance(m, Block):
                for p in m.parameters():
                    p.zero_()
    return v


def mosaic(images: torch.Tensor) -> torch.Tensor:
    """What build_vae's encoder computes, in plain torch (B, 3, H, W) in [0, 1] -> (B, 16, H/8, W/8)."""
    z = F.pixel_unshuffle(F.avg_pool2d(images, 4), 2) * 2 - 1  # channel c*4 + k: colour c, cell k
    b, _, h, w = z.shape
    z = z.view(b, 3, 4, h, w).transpose(1, 2).reshape(b, 12, h, w)  # channel 3k + c, as the encoder packs
    return torch.cat([z, z.new_zeros(b, 4, h, w)], 1)


def _torch_init(module: nn.Module) -> None:
    """ComfyUI's ops skip weight init (checkpoints overwrite it); training needs torch's own."""
    for mod in module.modules():
        for cls in type(mod).__mro__:
            if cls.__module__.startswith("torch.nn") and "reset_parameters" in cls.__dict__:
                cls.reset_parameters(mod)
                break


class Classifier(nn.Module):
    """Picture (B, 3, 64, 64) in [0, 1] -> logits for shape, colour and background. The last feature map (4 x 4)
    is flattened, not pooled, so where the colours are (shape or background) stays visible to the heads."""

    def __init__(self, n_shapes: int, n_colours: int, n_backgrounds: int):
        super().__init__()
        chans = (3, 32, 64, 128, 128)
        layers = []
        for a, b in zip(chans, chans[1:]):
            layers += [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*layers, nn.Flatten())
        self.hidden = nn.Sequential(nn.Linear(128 * 16, 256), nn.ReLU())
        self.shape = nn.Linear(256, n_shapes)
        self.colour = nn.Linear(256, n_colours)
        self.background = nn.Linear(256, n_backgrounds)

    def forward(self, x):
        f = self.hidden(self.features(x * 2 - 1))
        return self.shape(f), self.colour(f), self.background(f)


def new_classifier() -> Classifier:
    from . import shapes
    return Classifier(len(shapes.SHAPES), len(shapes.COLOURS), len(shapes.BACKGROUNDS))
