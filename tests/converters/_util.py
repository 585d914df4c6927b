"""Helpers shared by the ComfyUI -> diffusers converters (pure torch + diffusers)."""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

# Prefixes a ComfyUI *full* checkpoint puts in front of each component; a file from
# models/diffusion_models or models/vae has none.
COMPONENT_PREFIXES = ("model.diffusion_model.", "first_stage_model.", "vae.")


class CheckpointError(ValueError):
    """A state dict that cannot be converted; the message says what is wrong and what to pass instead."""


def strip_prefix(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop a ComfyUI component prefix when every key carries it (a plain component file is returned as is)."""
    for p in COMPONENT_PREFIXES:
        if sd and all(k.startswith(p) for k in sd):
            return {k[len(p):]: v for k, v in sd.items()}
    return dict(sd)


def count_blocks(sd: Mapping[str, torch.Tensor], prefix: str) -> int:
    """Number of consecutive indexed blocks `prefix{i}.` present (0 when none)."""
    n = 0
    while any(k.startswith(f"{prefix}{n}.") for k in sd):
        n += 1
    return n


def need(sd: Mapping[str, torch.Tensor], key: str, family: str) -> torch.Tensor:
    if key not in sd:
        raise CheckpointError(f"{family} checkpoint is missing '{key}': this does not look like a "
                              f"complete ComfyUI {family} state dict (keys without prefix expected)")
    return sd[key]


def check_consumed(leftover: Mapping[str, torch.Tensor], family: str, ignorable: tuple[str, ...] = ()) -> None:
    """Refuse to drop weights silently: a key nobody mapped means a variant we do not support."""
    rest = sorted(k for k in leftover if not any(k.startswith(p) for p in ignorable))
    if rest:
        shown = ", ".join(rest[:8]) + (" ..." if len(rest) > 8 else "")
        raise CheckpointError(f"{family} checkpoint has {len(rest)} weights the converter does not know "
                              f"({shown}); this variant of {family} is not supported")


def pad_to_patch(x: torch.Tensor, patch: tuple[int, ...]) -> torch.Tensor:
    """Pad the trailing dims up to multiples of `patch` circularly, exactly as ComfyUI's
    comfy.ldm.common_dit.pad_to_patch_size does (zero padding would change the border pixels)."""
    pad: tuple[int, ...] = ()
    for i, p in enumerate(patch):
        size = x.shape[x.ndim - len(patch) + i]
        pad = (0, (p - size % p) % p) + pad
    if not any(pad):
        return x
    return F.pad(x, pad, mode="circular")


def as_batch_timestep(t, batch: int, device, dtype=torch.float32) -> torch.Tensor:
    """ComfyUI passes one timestep per batch row; accept a scalar too. Kept in float32 even for
    half-precision latents: bf16 would round 730 to 728 before the sinusoidal embedding."""
    t = torch.as_tensor(t, device=device, dtype=dtype)
    if t.ndim == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"timestep must be a scalar or have shape ({batch},), got {tuple(t.shape)}")
    return t


def is_square(n: int) -> bool:
    r = math.isqrt(n)
    return r * r == n
