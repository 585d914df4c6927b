"""VAEs: ComfyUI (LDM-layout) KL VAE -> diffusers AutoencoderKL, Wan 2.1 and Wan 2.2 VAEs ->
AutoencoderKLWan, and the decode conventions that make diffusers' decode equal ComfyUI's `VAE.decode`.

The Wan 2.2 VAE (comfy/ldm/wan/vae2_2.py: 48 latent channels, 16x spatial) is diffusers'
AutoencoderKLWan with `is_residual=True` and `patch_size=2`: residual down/up blocks whose
shortcuts average (AvgDown3D) or duplicate (DupUp3D) pixels, and 2x2 pixels folded into 12
channels at the encoder's input / unfolded at the decoder's output. Its blocks nest one level
deeper in ComfyUI (`decoder.upsamples.{i}.upsamples.{j}`) than in diffusers
(`decoder.up_blocks.{i}.resnets.{j}` / `.upsampler`), which diffusers' single-file converter
(Wan 2.1 only) does not map: `_wan22_block_key` does.

Both sides decode raw VAE latents (ComfyUI's latent_format scaling happens in the sampler, the
diffusers pipeline's scaling_factor outside `decode`), so the latent passes through unchanged.
ComfyUI's VAE.decode maps the decoder output x to images clamp((x + 1) / 2, 0, 1), channels last;
diffusers' Wan VAE already clamps x to [-1, 1] inside decode, which that mapping makes harmless.
"""
from __future__ import annotations

import re

import torch
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint, convert_wan_vae_to_diffusers

from ._util import CheckpointError, count_blocks, need

KL_CLASS_NAME = "AutoencoderKL"
WAN_CLASS_NAME = "AutoencoderKLWan"
KL_NORM_GROUPS = 32  # ComfyUI's (and LDM's) Normalize() in comfy/ldm/modules/diffusionmodules/model.py
# Fixed by ComfyUI for the Wan 2.1 VAE (comfy/sd.py); only the base width is read from the weights.
WAN_DIM_MULT = [1, 2, 4, 4]
WAN_NUM_RES_BLOCKS = 2
WAN_TEMPORAL_DOWNSAMPLE = [False, True, True]
WAN22_PATCH = 2  # the Wan 2.2 VAE folds 2x2 pixels into channels: 3 colours -> 12 channels
WAN22_PATCH_CHANNELS = 3 * WAN22_PATCH * WAN22_PATCH


def is_kl_vae(sd) -> bool:
    w = sd.get("decoder.conv_in.weight")
    return w is not None and w.ndim == 4 and "decoder.mid.block_1.norm1.weight" in sd


def is_wan_vae(sd) -> bool:
    return "decoder.middle.0.residual.0.gamma" in sd


def kl_config_from_state_dict(sd) -> dict:
    if "decoder.mid.block_1.mix_factor" in sd:
        raise CheckpointError("this is a temporal (SVD) VAE decoder; only the image KL VAE is supported")
    if "bn.running_mean" in sd:
        raise CheckpointError("this KL VAE has a batch-norm latent (Flux.2 style); not supported")
    z = int(need(sd, "decoder.conv_in.weight", "vae_kl").shape[1])
    levels = count_blocks(sd, "decoder.up.")
    if levels == 0:
        raise CheckpointError("KL VAE has no decoder.up.* blocks")
    # decoder.up.{i} works at width ch * ch_mult[i]; its first resnet's conv2 outputs that width.
    widths = [int(need(sd, f"decoder.up.{i}.block.0.conv2.weight", "vae_kl").shape[0]) for i in range(levels)]
    layers = count_blocks(sd, "decoder.up.0.block.") - 1  # the decoder has one more resnet per level
    if "encoder.down.0.block.0.conv1.weight" in sd:
        enc_levels = count_blocks(sd, "encoder.down.")
        if enc_levels != levels:
            raise CheckpointError(f"KL VAE encoder has {enc_levels} levels but the decoder {levels}")
    out_ch = int(need(sd, "decoder.conv_out.weight", "vae_kl").shape[0])
    return {
        "in_channels": int(sd["encoder.conv_in.weight"].shape[1]) if "encoder.conv_in.weight" in sd else out_ch,
        "out_channels": out_ch,
        "down_block_types": ["DownEncoderBlock2D"] * levels,
        "up_block_types": ["UpDecoderBlock2D"] * levels,
        "block_out_channels": widths,
        "layers_per_block": layers,
        "latent_channels": z,
        "norm_num_groups": KL_NORM_GROUPS,
        "use_quant_conv": "quant_conv.weight" in sd,
        "use_post_quant_conv": "post_quant_conv.weight" in sd,
        "mid_block_add_attention": "decoder.mid.attn_1.q.weight" in sd,
    }


def convert_kl(sd) -> tuple[str, dict, dict]:
    config = kl_config_from_state_dict(sd)
    return KL_CLASS_NAME, config, convert_ldm_vae_checkpoint(dict(sd), config)


def is_wan22_vae(sd) -> bool:
    """ComfyUI's own test (comfy/sd.py): the residual up blocks nest their resnets one level deeper."""
    return "decoder.upsamples.0.upsamples.0.residual.2.weight" in sd


def wan_config_from_state_dict(sd) -> dict:
    if is_wan22_vae(sd):
        return wan22_config_from_state_dict(sd)
    return {"base_dim": int(need(sd, "decoder.head.0.gamma", "vae_wan").shape[0]), **_wan_fixed(sd)}


def _wan_fixed(sd) -> dict:
    """What the Wan 2.1 and 2.2 VAE configs share: the latent width from the weights, the rest fixed by ComfyUI."""
    return {
        "z_dim": int(need(sd, "conv2.weight", "vae_wan").shape[0]),
        "dim_mult": list(WAN_DIM_MULT),
        "num_res_blocks": WAN_NUM_RES_BLOCKS,
        "attn_scales": [],
        "temperal_downsample": list(WAN_TEMPORAL_DOWNSAMPLE),
        "dropout": 0.0,
    }


def wan22_config_from_state_dict(sd) -> dict:
    """ComfyUI fixes the Wan 2.2 VAE (dim 160, decoder width 256, z 48); the widths are read from the weights
    anyway, so a smaller model built from ComfyUI's own class converts the same way (the tests use one)."""
    fixed = _wan_fixed(sd)
    z = fixed["z_dim"]
    return {
        "base_dim": int(need(sd, "encoder.conv1.weight", "vae_wan").shape[0]),
        "decoder_base_dim": int(need(sd, "decoder.head.0.gamma", "vae_wan").shape[0]),
        **fixed,
        "is_residual": True,
        "in_channels": WAN22_PATCH_CHANNELS,
        "out_channels": WAN22_PATCH_CHANNELS,
        "patch_size": WAN22_PATCH,
        "scale_factor_spatial": 16,
        # the latent's scaling lives in ComfyUI's latent format (applied by the sampler), not in the VAE: neutral
        # values of the right length instead of diffusers' 16-channel Wan 2.1 defaults
        "latents_mean": [0.0] * z,
        "latents_std": [1.0] * z,
    }


_WAN22_RESNET = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                 "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                 "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                 "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_WAN22_BLOCK = re.compile(r"^(encoder|decoder)\.(?:downsamples|upsamples)\.(\d+)\.(?:downsamples|upsamples)\.(\d+)\.(.+)$")


def _wan22_block_key(key: str):
    """diffusers' name for a key inside one of the Wan 2.2 VAE's residual down/up blocks (None for other keys):
    a ResidualBlock's weights go to `resnets.{j}`, the block's Resample (its last entry) to `downsampler` /
    `upsampler`; the avg/dup shortcuts have no weights."""
    m = _WAN22_BLOCK.match(key)
    if m is None:
        return None
    side, i, j, rest = m.groups()
    blocks, resample = ("down_blocks", "downsampler") if side == "encoder" else ("up_blocks", "upsampler")
    if rest in _WAN22_RESNET:
        return f"{side}.{blocks}.{i}.resnets.{j}.{_WAN22_RESNET[rest]}"
    if rest.startswith(("resample.", "time_conv.")):
        return f"{side}.{blocks}.{i}.{resample}.{rest}"
    raise CheckpointError(f"Wan 2.2 VAE weight {key!r} is not one the converter knows; this variant is not supported")


def convert_wan(sd) -> tuple[str, dict, dict]:
    config = wan_config_from_state_dict(sd)
    if not config.get("is_residual"):
        return WAN_CLASS_NAME, config, convert_wan_vae_to_diffusers(dict(sd))
    blocks = {k: _wan22_block_key(k) for k in sd}
    out = {new: sd[k] for k, new in blocks.items() if new is not None}
    # the stem, middle blocks, heads and quant convs have the same names as in Wan 2.1: diffusers' converter
    out.update(convert_wan_vae_to_diffusers({k: v for k, v in sd.items() if blocks[k] is None}))
    return WAN_CLASS_NAME, config, out


def decode(model, latent: torch.Tensor) -> torch.Tensor:
    """Raw decoder output x (roughly [-1, 1]) of a diffusers VAE for a raw latent, as ComfyUI's
    `first_stage_model.decode` gives it (Wan: (B, 16, T, h, w) -> (B, 3, 4T-3, 8h, 8w))."""
    return model.decode(latent, return_dict=False)[0]


def diffusers_to_comfy_images(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's IMAGE from a decoder output: clamp((x + 1) / 2, 0, 1), channels last
    ((B, H, W, 3) for images, (B, T, H, W, 3) for video, as VAE.decode returns before the
    VAEDecode node folds T into the batch)."""
    return torch.clamp((x.float() + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)
