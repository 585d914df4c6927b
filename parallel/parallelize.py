"""The engine's entry point: make ComfyUI's diffusion model run across the world."""
from __future__ import annotations

import torch

from .distrifusion import apply_distrifusion
from .models import plan_for
from .plan import apply_plan, remove_plan
from .tp import apply_tp, check_tp


def parallelize(transformer: torch.nn.Module, ctx, attention_kernel=None, plan=None) -> torch.nn.Module:
    """Apply the family plan for ctx.config to `transformer` in place and return it.

    `attention_kernel`: ComfyUI's attention function for Ulysses' local attention (see `apply_plan`).

    Afterwards, calling the transformer on every rank with the *full* inputs
    returns the *full* output on every rank. At world size 1 the model is
    returned untouched (no wrapper, no overhead).
    """
    if ctx.config.world_size == 1:
        return transformer
    if ctx.config.pp_degree > 1:
        # PipeFusion drives the model itself, inside its loop (pipefusion.run_pipefusion_loop installs
        # and removes its stage hooks per run); there is no per-forward plan to apply here.
        return transformer
    plan = plan or plan_for(transformer)
    if plan.model_class == "*":  # no family adapter: the batch split alone (the driver refused the rest first)
        if not ctx.config.batch_only:
            raise ValueError(f"{type(transformer).__name__} has no family adapter: only cfg_degree and dp_degree "
                             f"can split its work (got {ctx.config.describe()})")
        return apply_plan(transformer, plan, ctx)
    if ctx.config.method == "distrifusion":  # stale-patch attention instead of USP; run state: distrifusion_state()
        return apply_distrifusion(transformer, ctx, plan)
    if ctx.config.tp_degree > 1:
        check_tp(transformer, plan, ctx.config.tp_degree)  # refuse before anything is sharded
    apply_plan(transformer, plan, ctx, kernel=attention_kernel)
    if ctx.config.tp_degree > 1:
        apply_tp(transformer, plan, ctx.tp)
    return transformer


def unparallelize(transformer: torch.nn.Module) -> torch.nn.Module:
    """Undo the hooks of `parallelize` (restores the serial forward). Tensor-parallel
    sharding replaced the weights and is not undone: rebuild the model instead."""
    return remove_plan(transformer)
