"""CFG and data parallelism around PipeFusion: the batch is split *outside* the pipeline.

Every (cfg, dp) coordinate of the mesh owns one pipeline (its pp group) and
runs the whole loop on its share of the batch:

* dp: the latent batch is split into near-equal slices (`split_sizes`); the
  final latents are all-gathered along dp. A batch smaller than dp is
  computed whole by every replica (correct, redundant), as in plan.py.
* cfg (degree 2, needs cfg_scale): cfg rank 0 runs the conditional half,
  rank 1 the unconditional one; their last stages swap each patch's model
  output (one all-gather of the patch over the cfg axis, patches arrive in the
  same order on both) and apply the same CFG mix and sampler step, so both
  replicas hold the same latent and their stage 0s get identical rows back.
Without cfg_degree, a cfg_scale run carries [cond, uncond] through one pipeline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..comm import all_gather_uneven, split_sizes
from ..config import ConfigError


@dataclass(frozen=True)
class BatchShare:
    start: int
    count: int
    sizes: Optional[list]   # dp slice sizes, None when every replica runs the whole batch
    cfg_split: bool         # the CFG halves live on the two cfg ranks


def _take(v, B, start, n, halves):
    """Slice one input: `halves` = which CFG halves (0 cond, 1 uncond) of a [cond, uncond] batch to keep."""
    if isinstance(v, dict):
        return {k: _take(x, B, start, n, halves) for k, x in v.items()}
    if not isinstance(v, torch.Tensor) or v.ndim == 0:
        return v
    if halves is None:
        return v.narrow(0, start, n) if v.shape[0] == B else v
    if v.shape[0] != 2 * B:
        return v
    return torch.cat([v.narrow(0, h * B + start, n) for h in halves])


def share_batch(ctx, batch_inputs, inputs: dict, noise: torch.Tensor, cfg_scale):
    """This replica's (share, inputs, noise)."""
    B = noise.shape[0]
    if ctx is None:
        return BatchShare(0, B, None, False), inputs, noise
    c = ctx.config
    cfg_split = c.cfg_degree > 1
    if cfg_split and cfg_scale is None:
        raise ConfigError("cfg_degree=2 splits the conditional and unconditional halves of classifier-free "
                          "guidance over two pipelines: pass cfg_scale, or set cfg_degree=1")
    dp = ctx.dp
    sizes = split_sizes(B, dp.size) if dp.size > 1 and B >= dp.size else None
    start, n = (sum(sizes[:dp.rank]), sizes[dp.rank]) if sizes else (0, B)
    halves = None if cfg_scale is None else ((ctx.cfg.rank,) if cfg_split else (0, 1))
    local = {k: _take(v, B, start, n, halves) if k in batch_inputs else v for k, v in inputs.items()}
    return BatchShare(start, n, sizes, cfg_split), local, noise.narrow(0, start, n)


def gather_cfg(out: torch.Tensor, ctx, share: BatchShare) -> torch.Tensor:
    """[cond, uncond] model output of this patch from the two cfg replicas (last stages only)."""
    if not share.cfg_split:
        return out
    return all_gather_uneven(out.contiguous(), 0, ctx.cfg, sizes=[out.shape[0]] * ctx.cfg.size)


def gather_dp(x: torch.Tensor, ctx, share: BatchShare) -> torch.Tensor:
    if ctx is None or share.sizes is None:
        return x
    return all_gather_uneven(x.contiguous(), 0, ctx.dp, sizes=share.sizes)
