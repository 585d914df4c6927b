"""`patch_decode`: one VAE decode split by rows over the ranks of an axis, equal to the serial decode.

Each rank takes its rows of the latent (`split_sizes`, larger patches on top),
runs diffusers' own `vae.decode` on them with the row-mixing modules swapped
for patch-aware ones (plan.py), and the decoded rows are gathered at the end.
No rank ever holds more than its share of the decoder's activations (plus
one-row halos and, in the attention block, the lowest-resolution K/V).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..comm import all_gather_uneven, split_sizes
from ..config import ConfigError
from ..context import world_axis  # noqa: F401  (re-exported)
from .native import gather_rows
from .plan import build_plan, swapped


def max_patch_degree(latent_height: int, min_rows: int = 1) -> int:
    """The most ranks a latent of this height can be split over (each needs `min_rows` rows)."""
    return max(1, latent_height // max(1, min_rows))


def _unscale(vae, latent: torch.Tensor) -> torch.Tensor:
    cfg = vae.config
    if hasattr(cfg, "latents_mean") and latent.dim() == 5:  # Wan: z * std + mean per channel
        shape = (1, -1, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean, dtype=latent.dtype, device=latent.device).view(shape)
        std = torch.tensor(cfg.latents_std, dtype=latent.dtype, device=latent.device).view(shape)
        return latent * std + mean
    shift = getattr(cfg, "shift_factor", None) or 0.0
    return latent / cfg.scaling_factor + shift


def _check_same_shape(latent: torch.Tensor, ax) -> None:
    """Every rank must pass the same latent shape; a mismatch would otherwise desynchronise the halo exchange."""
    # on the latent's device: NCCL takes no host tensors, not even a row count
    mine = torch.tensor(list(latent.shape) + [0] * (5 - latent.dim()) + [latent.dim()], dtype=torch.int64,
                        device=latent.device)
    every = all_gather_uneven(mine.unsqueeze(0), dim=0, ax=ax, sizes=[1] * ax.size)
    if not bool((every == mine).all()):
        shapes = [tuple(int(v) for v in row[: int(row[-1])]) for row in every]
        raise ConfigError(f"patch decode needs the same full latent on every rank, got shapes {shapes}")


def patch_decode(vae, latent: torch.Tensor, ax, block_size: Optional[int] = None, *,
                 unscale: bool = False, gather: bool = True, timeout_s: Optional[float] = 120.0):
    """Decode `latent` with its rows split over the ranks of `ax`; every rank passes the same full latent.

    - `vae`: a diffusers `AutoencoderKL` or `AutoencoderTiny` (latent (B, C, H, W)) or
      `AutoencoderKLWan` (latent (B, C, T, H, W)); it is left exactly as it was
      (modules are swapped back, tiling switched back on if it was on).
    - `ax`: the AxisGroup to split over (e.g. `world_axis(ctx)` or `ctx.sp`).
    - `block_size`: compute every conv in chunks of at most this many output rows
      per rank (same result, lower peak memory).
    - `unscale`: by default the latent is what `vae.decode` takes (the caller has
      already applied `z / scaling_factor + shift_factor`, or for Wan `z * std + mean`,
      as diffusers pipelines do); with `unscale=True` this function applies it from
      `vae.config`.
    - `gather`: True returns the full decoded tensor on every rank; "first" on axis rank 0
      only (None elsewhere: the other ranks never hold the whole image); False returns
      this rank's rows of it and their offset: `(rows, first_row)`.

    Raises ConfigError, before any communication, when the latent has fewer rows
    than the ranks need (the message names the largest usable degree).
    """
    if latent.dim() not in (4, 5):
        raise ConfigError(f"latent must be (B, C, H, W) or (B, C, T, H, W), got shape {tuple(latent.shape)}")
    plan = build_plan(vae, ax, block_size=block_size, timeout_s=timeout_s)
    height = latent.shape[-2]
    sizes = split_sizes(height, ax.size)
    if min(sizes) < plan.min_rows:
        raise ConfigError(
            f"a latent {height} rows tall cannot be split over {ax.size} ranks: every rank needs at least "
            f"{plan.min_rows} latent row(s); use at most {max_patch_degree(height, plan.min_rows)} ranks "
            f"for this latent, or decode it serially")
    if unscale:
        latent = _unscale(vae, latent)
    # The decode runs in the VAE's own dtype, as ComfyUI's VAE.decode casts its samples to vae_dtype (a bf16 VAE
    # on GPUs): a float32 latent into bf16 convolutions would fail.
    weight = next(vae.parameters(), None)
    if weight is not None and weight.dtype != latent.dtype:
        latent = latent.to(weight.dtype)
    if ax.size == 1:
        with torch.no_grad():
            out = vae.decode(latent).sample
        return out if gather else (out, 0)
    _check_same_shape(latent, ax)
    start = sum(sizes[: ax.rank])
    local = latent.narrow(-2, start, sizes[ax.rank]).contiguous()
    with torch.no_grad(), swapped(vae, plan):
        out = vae.decode(local).sample
    return gather_rows(out, ax, gather)

