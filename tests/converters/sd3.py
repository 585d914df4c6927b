"""SD3 / SD3.5 (MMDiT): ComfyUI state dict -> diffusers SD3Transformer2DModel, and the input
conventions that make diffusers' forward equal ComfyUI's MMDiT forward.

ComfyUI pads the latent circularly to the patch size and crops the output; diffusers does
neither, so we pad before and crop after. ComfyUI's timestep for SD3 is already sigma * 1000,
the scale diffusers expects, so it passes through.
"""
from __future__ import annotations

import math

import torch
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

from ._util import CheckpointError, as_batch_timestep, check_consumed, count_blocks, is_square, need, pad_to_patch

CLASS_NAME = "SD3Transformer2DModel"
HEAD_DIM = 64  # MMDiT: hidden = 64 * depth, heads = depth (ComfyUI's detection and SD3's design)


def is_sd3(sd) -> bool:
    return "joint_blocks.0.context_block.attn.qkv.weight" in sd


def config_from_state_dict(sd) -> dict:
    xw = need(sd, "x_embedder.proj.weight", "sd3")
    hidden, in_ch, patch = int(xw.shape[0]), int(xw.shape[1]), int(xw.shape[2])
    if hidden % HEAD_DIM:
        raise CheckpointError(f"SD3 hidden size must be a multiple of {HEAD_DIM}, the weights have {hidden}")
    if any(k.startswith("context_processor.") for k in sd):
        raise CheckpointError("this MMDiT has a context processor; only SD3 / SD3.5 are supported")
    pos = need(sd, "pos_embed", "sd3")
    if not is_square(pos.shape[1]):
        raise CheckpointError(f"SD3 pos_embed must hold a square grid, it has {pos.shape[1]} positions")
    ctx = need(sd, "context_embedder.weight", "sd3")
    layers = count_blocks(sd, "joint_blocks.")
    dual = sorted({int(k.split(".")[1]) for k in sd if k.startswith("joint_blocks.") and ".x_block.attn2." in k})
    return {
        "sample_size": 128,  # only sets the default grid; the loaded pos_embed replaces it
        "patch_size": patch,
        "in_channels": in_ch,
        "num_layers": layers,
        "attention_head_dim": HEAD_DIM,
        "num_attention_heads": hidden // HEAD_DIM,
        "joint_attention_dim": int(ctx.shape[1]),
        "caption_projection_dim": int(ctx.shape[0]),
        "pooled_projection_dim": int(need(sd, "y_embedder.mlp.0.weight", "sd3").shape[1]),
        "out_channels": int(need(sd, "final_layer.linear.weight", "sd3").shape[0]) // (patch * patch),
        "pos_embed_max_size": math.isqrt(int(pos.shape[1])),
        "dual_attention_layers": tuple(dual),
        "qk_norm": "rms_norm" if "joint_blocks.0.x_block.attn.ln_q.weight" in sd else None,
    }


def convert(sd) -> tuple[str, dict, dict]:
    config = config_from_state_dict(sd)
    work = dict(sd)
    out = convert_sd3_transformer_checkpoint_to_diffusers(work)
    check_consumed(work, "sd3")
    return CLASS_NAME, config, out


def latent_to_hidden_states(x: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """The latent padded circularly to the patch size, as ComfyUI's MMDiT does on every call."""
    patch = 2 if config is None else config["patch_size"]
    return pad_to_patch(x, (patch, patch))


def comfy_to_diffusers_inputs(x: torch.Tensor, timestep, context: torch.Tensor, *, y: torch.Tensor,
                              config: dict | None = None) -> dict:
    """kwargs for SD3Transformer2DModel.forward. timestep: what ComfyUI passes (sigma * 1000)."""
    if x.ndim != 4:
        raise ValueError(f"SD3 expects a 4-D latent (B, C, H, W), got shape {tuple(x.shape)}")
    return {
        "hidden_states": latent_to_hidden_states(x, config),
        "encoder_hidden_states": context,
        "pooled_projections": y,
        "timestep": as_batch_timestep(timestep, x.shape[0], x.device),
        "return_dict": False,
    }


def diffusers_to_comfy_output(out, x_shape) -> torch.Tensor:
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out[:, :, : x_shape[-2], : x_shape[-1]]
