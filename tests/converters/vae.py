"""VAEs: ComfyUI (LDM-layout) KL VAE -> diffusers AutoencoderKL, Wan 2.1 and Wan 2.2 VAEs ->
AutoencoderKLWan, TAESD -> AutoencoderTiny, and the decode conventions that make diffusers' decode equal
ComfyUI's `VAE.decode`.

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

TAESD (comfy/taesd/taesd.py; taesd, taesdxl with 4 latent channels, taesd3, taef1 with 16) is the one
exception to "the latent passes through unchanged": ComfyUI's TAESD.decode computes
decoder((z - vae_shift) * vae_scale) * 2 - 1 with two scalar parameters of its state dict (the tiny
decoder was trained on the diffusion-space latent, ComfyUI hands it the raw one). diffusers'
AutoencoderTiny.decode is decoder(z) * 2 - 1 with the same Clamp/conv/ReLU/block/nearest-x2 stack, so
`taesd_latent_in` applies that affine to the latent before it goes to the twin; the twin itself holds
only the encoder and decoder convolutions (ComfyUI's Sequential indices shifted past its weightless Clamp).
"""
from __future__ import annotations

import re

import torch
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint, convert_wan_vae_to_diffusers

from ._util import CheckpointError, check_consumed, count_blocks, need

KL_CLASS_NAME = "AutoencoderKL"
WAN_CLASS_NAME = "AutoencoderKLWan"
TAESD_CLASS_NAME = "AutoencoderTiny"
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


def is_taesd_vae(sd) -> bool:
    """ComfyUI's own test (comfy/sd.py): the tiny decoder's first convolution."""
    return "taesd_decoder.1.weight" in sd


# What each index of ComfyUI's TAESD Sequentials holds: a conv ("conv"), a Block ("block") or a weightless module
# (Clamp, ReLU, Upsample: "-"); read from the weight names, so a layout other than diffusers' is refused by name.
def _kinds(sd, prefix: str) -> list:
    last = max((int(k[len(prefix):].split(".", 1)[0]) for k in sd if k.startswith(prefix)), default=-1)
    return ["conv" if f"{prefix}{i}.weight" in sd else "block" if f"{prefix}{i}.conv.0.weight" in sd else "-"
            for i in range(last + 1)]


def _decoder_layout(blocks) -> list:
    """ComfyUI's Decoder Sequential: Clamp, conv, ReLU, then per stage its blocks and, except after the last, a
    nearest x2 upsample and a conv; a final conv to the image. diffusers' DecoderTiny.layers is the same list
    without the Clamp (its forward applies it)."""
    out = ["-", "conv", "-"]
    for i, n in enumerate(blocks):
        out += ["block"] * n + (["-"] if i < len(blocks) - 1 else []) + ["conv"]
    return out


def _encoder_layout(blocks) -> list:
    """ComfyUI's Encoder / diffusers' EncoderTiny (same indices): per stage a conv (stride 2 after the first) and its
    blocks; a final conv to the latent."""
    return [k for n in blocks for k in ["conv"] + ["block"] * n] + ["conv"]


def _stage_blocks(kinds: list, skip: int) -> list:
    """Blocks per stage: the runs of "block" between the convs after the first `skip` entries."""
    runs, n = [], 0
    for k in kinds[skip:]:
        if k == "conv":
            runs.append(n)
            n = 0
        elif k == "block":
            n += 1
    return runs


def taesd_config_from_state_dict(sd) -> dict:
    """AutoencoderTiny's config from ComfyUI's TAESD weights: channels and widths from the shapes, blocks per stage
    from the Sequential indices (ComfyUI builds (3, 3, 3, 1) decoder and (1, 3, 3, 3) encoder stages, 64 wide); a
    state dict whose index layout is not diffusers' is refused here, before any weights travel."""
    dec_kinds, enc_kinds = _kinds(sd, "taesd_decoder."), _kinds(sd, "taesd_encoder.")
    dec_blocks = _stage_blocks(dec_kinds, 3)
    enc_blocks = _stage_blocks(enc_kinds, 1)
    if not dec_blocks or _decoder_layout(dec_blocks) != dec_kinds:
        raise CheckpointError(f"TAESD decoder layout {dec_kinds} is not the tiny decoder diffusers' AutoencoderTiny "
                              f"builds (Clamp, conv, ReLU, blocks / upsample / conv stages, final conv)")
    if not enc_blocks or _encoder_layout(enc_blocks) != enc_kinds:
        raise CheckpointError(f"TAESD encoder layout {enc_kinds} is not the tiny encoder diffusers' AutoencoderTiny "
                              f"builds (conv and blocks per stage, final conv)")
    first = need(sd, "taesd_decoder.1.weight", "vae_taesd")
    enc_first = need(sd, "taesd_encoder.0.weight", "vae_taesd")
    return {
        "in_channels": int(enc_first.shape[1]),
        "out_channels": int(sd[f"taesd_decoder.{len(dec_kinds) - 1}.weight"].shape[0]),
        "encoder_block_out_channels": [int(enc_first.shape[0])] * len(enc_blocks),
        "decoder_block_out_channels": [int(first.shape[0])] * len(dec_blocks),
        "act_fn": "relu",
        "upsample_fn": "nearest",
        "upsampling_scaling_factor": 2,
        "latent_channels": int(first.shape[1]),
        "num_encoder_blocks": enc_blocks,
        "num_decoder_blocks": dec_blocks,
    }


_TAESD_KEY = re.compile(r"^taesd_(encoder|decoder)\.(\d+)\.(.+)$")


def convert_taesd(sd) -> tuple[str, dict, dict]:
    """ComfyUI's `taesd_decoder.{i}.*` is diffusers' `decoder.layers.{i-1}.*` (diffusers' Clamp is in the forward,
    not a layer); `taesd_encoder.{i}.*` is `encoder.layers.{i}.*`. The encoder travels too: the workers load the twin
    strictly, which a wrong index would fail loudly. `vae_scale` / `vae_shift` are not weights of the twin: see
    `taesd_latent_in`."""
    config = taesd_config_from_state_dict(sd)
    out, rest = {}, {}
    for k, v in sd.items():
        m = _TAESD_KEY.match(k)
        if m is None:
            rest[k] = v
            continue
        side, i, tail = m.groups()
        out[f"{side}.layers.{int(i) - (side == 'decoder')}.{tail}"] = v
    check_consumed({k: v for k, v in rest.items() if k not in ("vae_scale", "vae_shift")}, "vae_taesd")
    return TAESD_CLASS_NAME, config, out


def taesd_latent_in(latent: torch.Tensor, vae_scale, vae_shift) -> torch.Tensor:
    """The latent AutoencoderTiny.decode takes for a raw latent ComfyUI's TAESD decodes: (z - vae_shift) * vae_scale,
    ComfyUI's own expression (the same float ops, so fp32 agrees bit for bit); the scalars are the TAESD's
    parameters (ComfyUI's VAELoader sets them per model, e.g. 0.18215 / 0 for taesd, 0.3611 / 0.1159 for taef1)."""
    scale = torch.as_tensor(vae_scale).detach().to(latent.device, latent.dtype)
    shift = torch.as_tensor(vae_shift).detach().to(latent.device, latent.dtype)
    return (latent - shift) * scale


def decode(model, latent: torch.Tensor) -> torch.Tensor:
    """Raw decoder output x (roughly [-1, 1]) of a diffusers VAE for a raw latent, as ComfyUI's
    `first_stage_model.decode` gives it (Wan: (B, 16, T, h, w) -> (B, 3, 4T-3, 8h, 8w))."""
    return model.decode(latent, return_dict=False)[0]


def diffusers_to_comfy_images(x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's IMAGE from a decoder output: clamp((x + 1) / 2, 0, 1), channels last
    ((B, H, W, 3) for images, (B, T, H, W, 3) for video, as VAE.decode returns before the
    VAEDecode node folds T into the batch)."""
    return torch.clamp((x.float() + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1)
