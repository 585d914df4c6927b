"""Flux.1 (dev / schnell): ComfyUI state dict -> diffusers FluxTransformer2DModel, and the input
conventions that make diffusers' forward equal ComfyUI's `Flux.forward` (comfy/ldm/flux/model.py).

ComfyUI's diffusion model takes the latent image (B, 16, H, W), pads it circularly to the 2x2
patch, packs 2x2 patches into 64-channel tokens, and positions them with img_ids [0, row, col];
diffusers takes those packed tokens and ids directly. Both scale timestep and guidance by 1000
inside, so they pass through unchanged (ComfyUI's timestep for Flux is sigma).
"""
from __future__ import annotations

import torch
from diffusers.loaders.single_file_utils import convert_flux_transformer_checkpoint_to_diffusers

from ._util import CheckpointError, as_batch_timestep, check_consumed, count_blocks, need, pad_to_patch

CLASS_NAME = "FluxTransformer2DModel"
PATCH = 2
# Fixed by Flux.1 (and by ComfyUI's detection, and assumed by diffusers' converter): head dim 128
# split over the RoPE axes (16, 56, 56), 3072 hidden, MLP ratio 4.
HEAD_DIM = 128
AXES_DIMS_ROPE = (16, 56, 56)
HIDDEN = 3072


def is_flux(sd) -> bool:
    return any(f"double_blocks.0.img_attn.norm.key_norm.{s}" in sd for s in ("scale", "weight")) and "img_in.weight" in sd


def _norm_scales(sd) -> dict:
    """ComfyUI 0.33's RMSNorm names its parameter `weight` where 0.3.75 (and diffusers' converter) say `scale`."""
    return {(k[: -len("weight")] + "scale" if k.endswith(("query_norm.weight", "key_norm.weight")) else k): v
            for k, v in sd.items()}


def config_from_state_dict(sd) -> dict:
    """The diffusers config, read from the weights' shapes."""
    if "double_stream_modulation_img.lin.weight" in sd:
        raise CheckpointError("this is a Flux.2 checkpoint; only Flux.1 (dev/schnell) is supported")
    if any(k.startswith("distilled_guidance_layer.") for k in sd):
        raise CheckpointError("this is a Chroma checkpoint; only Flux.1 (dev/schnell) is supported")
    img_in = need(sd, "img_in.weight", "flux")
    hidden, in_ch = img_in.shape
    if hidden != HIDDEN:
        raise CheckpointError(f"Flux.1 hidden size must be {HIDDEN} (24 heads x 128), the weights have {hidden}")
    mlp = need(sd, "double_blocks.0.img_mlp.0.weight", "flux").shape[0]
    if mlp != 4 * hidden:
        raise CheckpointError(f"Flux.1 MLP width must be 4 x hidden = {4 * hidden}, the weights have {mlp}")
    depth = count_blocks(sd, "double_blocks.")
    depth_single = count_blocks(sd, "single_blocks.")
    if depth_single == 0:
        raise CheckpointError("Flux checkpoint has no single_blocks; diffusers' converter needs at least one")
    if "vector_in.in_layer.weight" not in sd:
        raise CheckpointError("Flux checkpoint has no vector_in (pooled text) layer; not a Flux.1 model")
    out = need(sd, "final_layer.linear.weight", "flux").shape[0]
    return {
        "patch_size": 1,  # diffusers sees tokens already packed 2x2
        "in_channels": int(in_ch),
        "out_channels": int(out),
        "num_layers": depth,
        "num_single_layers": depth_single,
        "attention_head_dim": HEAD_DIM,
        "num_attention_heads": hidden // HEAD_DIM,
        "joint_attention_dim": int(need(sd, "txt_in.weight", "flux").shape[1]),
        "pooled_projection_dim": int(sd["vector_in.in_layer.weight"].shape[1]),
        "guidance_embeds": "guidance_in.in_layer.weight" in sd,
        "axes_dims_rope": AXES_DIMS_ROPE,
    }


def convert(sd) -> tuple[str, dict, dict]:
    sd = _norm_scales(sd)
    config = config_from_state_dict(sd)
    work = dict(sd)  # diffusers' converter pops what it consumes
    out = convert_flux_transformer_checkpoint_to_diffusers(work)
    check_consumed(work, "flux")
    return CLASS_NAME, config, out


def latent_to_hidden_states(x: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """ComfyUI's (B, C, H, W) latent as Flux's packed 2x2 tokens (B, N, 4C), padded circularly as ComfyUI does."""
    b, c = x.shape[:2]
    xp = pad_to_patch(x, (PATCH, PATCH))
    hl, wl = xp.shape[-2] // PATCH, xp.shape[-1] // PATCH
    return xp.reshape(b, c, hl, PATCH, wl, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(b, hl * wl, c * PATCH * PATCH)


def comfy_to_diffusers_inputs(x: torch.Tensor, timestep, context: torch.Tensor, *, y: torch.Tensor,
                              guidance=None, config: dict | None = None) -> dict:
    """kwargs for FluxTransformer2DModel.forward from ComfyUI's diffusion-model arguments.

    x: (B, C, H, W) latent, any H/W; timestep: what ComfyUI passes (sigma); context: (B, T, D);
    y: pooled text (B, >= pooled_projection_dim); guidance: (B,) or scalar, required when the
    model has a guidance embedder (Flux dev).
    """
    if x.ndim != 4:
        raise ValueError(f"Flux expects a 4-D latent (B, C, H, W), got shape {tuple(x.shape)}")
    b = x.shape[0]
    tokens = latent_to_hidden_states(x)
    hl, wl = -(-x.shape[-2] // PATCH), -(-x.shape[-1] // PATCH)
    img_ids = torch.zeros(hl, wl, 3, device=x.device, dtype=torch.float32)
    img_ids[..., 1] = torch.arange(hl, device=x.device, dtype=torch.float32)[:, None]
    img_ids[..., 2] = torch.arange(wl, device=x.device, dtype=torch.float32)[None, :]
    txt_ids = torch.zeros(context.shape[1], 3, device=x.device, dtype=torch.float32)
    if config is not None:
        y = y[:, : config["pooled_projection_dim"]]
        if config["guidance_embeds"] and guidance is None:
            raise ValueError("this Flux model has a guidance embedder (dev): pass guidance= (ComfyUI's "
                             "FluxGuidance value, 3.5 by default)")
        if not config["guidance_embeds"]:
            guidance = None
    kwargs = {
        "hidden_states": tokens,
        "encoder_hidden_states": context,
        "pooled_projections": y,
        "timestep": as_batch_timestep(timestep, b, x.device),
        "img_ids": img_ids.reshape(-1, 3),
        "txt_ids": txt_ids,
        "return_dict": False,
    }
    if guidance is not None:
        kwargs["guidance"] = as_batch_timestep(guidance, b, x.device)
    return kwargs


def diffusers_to_comfy_output(out, x_shape) -> torch.Tensor:
    """Unpack diffusers' (B, N, C*4) tokens back to ComfyUI's (B, C, H, W), cropping the padding."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    b, _, h, w = x_shape
    hl, wl = -(-h // PATCH), -(-w // PATCH)
    c = out.shape[-1] // (PATCH * PATCH)
    img = out.reshape(b, hl, wl, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5).reshape(b, c, hl * PATCH, wl * PATCH)
    return img[:, :, :h, :w]
