"""Wan 2.1 text-to-video: ComfyUI state dict -> diffusers WanTransformer3DModel, and the input
conventions that make diffusers' forward equal ComfyUI's WanModel forward.

ComfyUI pads (T, H, W) circularly to the (1, 2, 2) patch and crops the output; diffusers does
neither. ComfyUI's timestep for Wan is sigma * 1000, the scale diffusers expects.
"""
from __future__ import annotations

import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

from ._util import CheckpointError, as_batch_timestep, count_blocks, need, pad_to_patch

CLASS_NAME = "WanTransformer3DModel"
HEAD_DIM = 128  # ComfyUI's detection: heads = dim / 128
# Keys that mark Wan variants (image-to-video, VACE, camera, sound, ...) whose inputs differ from T2V.
_VARIANT_KEYS = ("img_emb.", "vace_", "control_adapter.", "casual_audio_encoder.", "audio_proj.",
                 "face_adapter.", "ref_conv.")


def is_wan(sd) -> bool:
    return "head.modulation" in sd and "patch_embedding.weight" in sd


def config_from_state_dict(sd) -> dict:
    variant = sorted({p for p in _VARIANT_KEYS for k in sd if k.startswith(p)})
    if variant:
        raise CheckpointError(f"this Wan checkpoint is not text-to-video (has {variant}); only Wan 2.1 T2V "
                              "is supported")
    dim = int(need(sd, "head.modulation", "wan").shape[-1])
    if dim % HEAD_DIM:
        raise CheckpointError(f"Wan dim must be a multiple of {HEAD_DIM}, the weights have {dim}")
    pe = need(sd, "patch_embedding.weight", "wan")
    patch = tuple(int(s) for s in pe.shape[2:])
    return {
        "patch_size": patch,
        "num_attention_heads": dim // HEAD_DIM,
        "attention_head_dim": HEAD_DIM,
        "in_channels": int(pe.shape[1]),
        "out_channels": int(need(sd, "head.head.weight", "wan").shape[0]) // (patch[0] * patch[1] * patch[2]),
        "text_dim": int(need(sd, "text_embedding.0.weight", "wan").shape[1]),
        "freq_dim": int(need(sd, "time_embedding.0.weight", "wan").shape[1]),
        "ffn_dim": int(need(sd, "blocks.0.ffn.0.weight", "wan").shape[0]),
        "num_layers": count_blocks(sd, "blocks."),
        "cross_attn_norm": "blocks.0.norm3.weight" in sd,
        "qk_norm": "rms_norm_across_heads" if "blocks.0.self_attn.norm_q.weight" in sd else None,
        "eps": 1e-6,
        "rope_max_seq_len": 1024,
    }


def convert(sd) -> tuple[str, dict, dict]:
    config = config_from_state_dict(sd)
    work = dict(sd)
    out = convert_wan_transformer_to_diffusers(work)
    return CLASS_NAME, config, out


def latent_to_hidden_states(x: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The (B, C, T, H, W) latent padded circularly to the patch size, as ComfyUI's WanModel does."""
    patch = (1, 2, 2) if config is None else tuple(config["patch_size"])
    return pad_to_patch(x, patch)


def comfy_to_diffusers_inputs(x: torch.Tensor, timestep, context: torch.Tensor, *, config: dict | None = None) -> dict:
    """kwargs for WanTransformer3DModel.forward. x: (B, C, T, H, W); timestep: sigma * 1000."""
    if x.ndim != 5:
        raise ValueError(f"Wan expects a 5-D latent (B, C, T, H, W), got shape {tuple(x.shape)}")
    return {
        "hidden_states": latent_to_hidden_states(x, config),
        "timestep": as_batch_timestep(timestep, x.shape[0], x.device),
        "encoder_hidden_states": context,
        "return_dict": False,
    }


def diffusers_to_comfy_output(out, x_shape) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out[:, :, : x_shape[-3], : x_shape[-2], : x_shape[-1]]
