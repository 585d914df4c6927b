"""The public entry point: make a diffusers transformer run across the world."""
from __future__ import annotations

import torch

from .models import plan_for
from .plan import apply_plan, remove_plan


def parallelize(transformer: torch.nn.Module, ctx) -> torch.nn.Module:
    """Apply the family plan for ctx.config to `transformer` in place and return it.

    Afterwards, calling the transformer on every rank with the *full* inputs
    returns the *full* output on every rank. At world size 1 the model is
    returned untouched (no wrapper, no overhead).
    """
    if ctx.config.world_size == 1:
        return transformer
    unsupported = [n for n in ("pp", "tp") if getattr(ctx.config, f"{n}_degree") > 1]
    if unsupported:
        raise NotImplementedError(f"parallelize() does not implement {unsupported} yet; "
                                  f"use dp/cfg/ulysses/ring degrees")
    return apply_plan(transformer, plan_for(transformer), ctx)


def unparallelize(transformer: torch.nn.Module) -> torch.nn.Module:
    """Undo `parallelize` (restores the serial forward)."""
    return remove_plan(transformer)
