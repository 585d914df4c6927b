"""PixArt-Σ: ComfyUI state dict -> diffusers PixArtTransformer2DModel (the key mapping is ours:
the pip diffusers has no PixArt single-file converter), and the input conventions that make
diffusers' forward equal ComfyUI's PixArtMS forward.

Position embeddings depend on the latent size in ComfyUI: it recomputes
pe = round(((H + W) // 2) / 64) on every call and uses base size 64 * pe / patch with
interpolation scale pe. In diffusers those are construction-time config (sample_size = 64 * pe,
interpolation_scale = pe), so `resolution_config` gives them for a latent size and
`set_resolution` re-targets an existing model without rebuilding it (the pos-embed table is
not part of the weights).
"""
from __future__ import annotations

import torch

from ._util import CheckpointError, as_batch_timestep, check_consumed, count_blocks, need

CLASS_NAME = "PixArtTransformer2DModel"
NUM_HEADS = 16  # fixed by PixArt (and ComfyUI's detection)

# (ComfyUI key, diffusers key) outside the blocks.
_BASIC = (
    ("x_embedder.proj.weight", "pos_embed.proj.weight"),
    ("x_embedder.proj.bias", "pos_embed.proj.bias"),
    ("t_embedder.mlp.0.weight", "adaln_single.emb.timestep_embedder.linear_1.weight"),
    ("t_embedder.mlp.0.bias", "adaln_single.emb.timestep_embedder.linear_1.bias"),
    ("t_embedder.mlp.2.weight", "adaln_single.emb.timestep_embedder.linear_2.weight"),
    ("t_embedder.mlp.2.bias", "adaln_single.emb.timestep_embedder.linear_2.bias"),
    ("t_block.1.weight", "adaln_single.linear.weight"),
    ("t_block.1.bias", "adaln_single.linear.bias"),
    ("y_embedder.y_proj.fc1.weight", "caption_projection.linear_1.weight"),
    ("y_embedder.y_proj.fc1.bias", "caption_projection.linear_1.bias"),
    ("y_embedder.y_proj.fc2.weight", "caption_projection.linear_2.weight"),
    ("y_embedder.y_proj.fc2.bias", "caption_projection.linear_2.bias"),
    ("final_layer.linear.weight", "proj_out.weight"),
    ("final_layer.linear.bias", "proj_out.bias"),
    ("final_layer.scale_shift_table", "scale_shift_table"),
)
# (ComfyUI suffix, diffusers suffix) inside block i, one-to-one.
_BLOCK = (
    ("scale_shift_table", "scale_shift_table"),
    ("attn.proj.weight", "attn1.to_out.0.weight"),
    ("attn.proj.bias", "attn1.to_out.0.bias"),
    ("cross_attn.q_linear.weight", "attn2.to_q.weight"),
    ("cross_attn.q_linear.bias", "attn2.to_q.bias"),
    ("cross_attn.proj.weight", "attn2.to_out.0.weight"),
    ("cross_attn.proj.bias", "attn2.to_out.0.bias"),
    ("mlp.fc1.weight", "ff.net.0.proj.weight"),
    ("mlp.fc1.bias", "ff.net.0.proj.bias"),
    ("mlp.fc2.weight", "ff.net.2.weight"),
    ("mlp.fc2.bias", "ff.net.2.bias"),
)
# The learned "empty caption" embedding, used only for classifier-free dropout in training.
_UNUSED = ("y_embedder.y_embedding",)


def is_pixart(sd) -> bool:
    return "t_block.1.weight" in sd


def pe_scale(height: int, width: int) -> int:
    """ComfyUI's pe_interpolation for a latent of (height, width): round(((H + W) // 2) / 64)
    (Python's round, half to even, as ComfyUI). 0 would divide by zero there: refuse it."""
    pe = round(((height + width) // 2) / 64.0)
    if pe < 1:
        raise ValueError(f"PixArt latent {height}x{width} is too small: ComfyUI needs (H + W) // 2 >= 33 "
                         f"(an image of about 264 px or more per side)")
    return int(pe)


def resolution_config(height: int, width: int) -> dict:
    """The diffusers config entries that depend on the latent size."""
    pe = pe_scale(height, width)
    return {"sample_size": 64 * pe, "interpolation_scale": pe}


def config_from_state_dict(sd, latent_size: tuple[int, int] = (128, 128)) -> dict:
    """The diffusers config; `latent_size` only sets the position-embedding scale (see module doc)."""
    if "ar_embedder.mlp.0.weight" in sd or "csize_embedder.mlp.0.weight" in sd:
        raise CheckpointError("this is a PixArt-α checkpoint (micro-conditioning); only PixArt-Σ is supported")
    xw = need(sd, "x_embedder.proj.weight", "pixart")
    hidden, in_ch, patch = int(xw.shape[0]), int(xw.shape[1]), int(xw.shape[2])
    if hidden % NUM_HEADS:
        raise CheckpointError(f"PixArt hidden size must be a multiple of {NUM_HEADS}, the weights have {hidden}")
    return {
        "num_attention_heads": NUM_HEADS,
        "attention_head_dim": hidden // NUM_HEADS,
        "in_channels": in_ch,
        "out_channels": int(need(sd, "final_layer.linear.weight", "pixart").shape[0]) // (patch * patch),
        "num_layers": count_blocks(sd, "blocks."),
        "cross_attention_dim": hidden,
        "patch_size": patch,
        "caption_channels": int(need(sd, "y_embedder.y_proj.fc1.weight", "pixart").shape[1]),
        "use_additional_conditions": False,
        "norm_type": "ada_norm_single",
        **resolution_config(*latent_size),
    }


def convert(sd, latent_size: tuple[int, int] = (128, 128)) -> tuple[str, dict, dict]:
    config = config_from_state_dict(sd, latent_size)
    work = dict(sd)
    out: dict[str, torch.Tensor] = {}
    for src, dst in _BASIC:
        out[dst] = need(work, src, "pixart")
        del work[src]
    for i in range(config["num_layers"]):
        src, dst = f"blocks.{i}.", f"transformer_blocks.{i}."
        for s, d in _BLOCK:
            out[dst + d] = need(work, src + s, "pixart")
            del work[src + s]
        for end in ("weight", "bias"):
            q, k, v = torch.chunk(need(work, f"{src}attn.qkv.{end}", "pixart"), 3, dim=0)
            out[f"{dst}attn1.to_q.{end}"], out[f"{dst}attn1.to_k.{end}"], out[f"{dst}attn1.to_v.{end}"] = q, k, v
            k, v = torch.chunk(need(work, f"{src}cross_attn.kv_linear.{end}", "pixart"), 2, dim=0)
            out[f"{dst}attn2.to_k.{end}"], out[f"{dst}attn2.to_v.{end}"] = k, v
            del work[f"{src}attn.qkv.{end}"], work[f"{src}cross_attn.kv_linear.{end}"]
    check_consumed(work, "pixart", ignorable=_UNUSED)
    return CLASS_NAME, config, out


def set_resolution(model, height: int, width: int) -> None:
    """Re-target a built PixArtTransformer2DModel's position embedding to a latent size, so that it
    matches ComfyUI for that size (same as rebuilding with `resolution_config(height, width)`)."""
    pe = pe_scale(height, width)
    embed = model.pos_embed
    base = 64 * pe // embed.patch_size
    if embed.base_size == base and embed.interpolation_scale == pe:
        return
    embed.base_size = base
    embed.interpolation_scale = pe
    # Forget the table cached for the construction size: diffusers recomputes it from base_size and
    # interpolation_scale whenever the token grid differs from (height, width) below.
    embed.height, embed.width = -1, -1


def latent_to_hidden_states(x: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """PixArt takes ComfyUI's latent as it is (even H and W; ComfyUI does not pad it)."""
    return x


def comfy_to_diffusers_inputs(x: torch.Tensor, timestep, context: torch.Tensor, *, config: dict | None = None) -> dict:
    """kwargs for PixArtTransformer2DModel.forward. timestep: ComfyUI's discrete timestep (0..999).

    Call set_resolution(model, H, W) before the forward when the latent size changes.
    """
    if x.ndim != 4:
        raise ValueError(f"PixArt expects a 4-D latent (B, C, H, W), got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if h % 2 or w % 2:
        raise ValueError(f"PixArt needs an even latent height and width (ComfyUI does not pad it), got {h}x{w}: "
                         "use an image size that is a multiple of 16")
    pe_scale(h, w)
    if context.ndim == 4:  # ComfyUI accepts (B, 1, T, D)
        context = context.squeeze(1)
    return {
        "hidden_states": x,
        "encoder_hidden_states": context,
        "timestep": as_batch_timestep(timestep, x.shape[0], x.device),
        "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False,
    }


def diffusers_to_comfy_output(out, x_shape) -> torch.Tensor:
    """ComfyUI returns only the noise prediction: the first C channels (the rest is learned sigma)."""
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out[:, : x_shape[1]]
