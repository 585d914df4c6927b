"""Which ranks talk to which along every parallel axis.

Rank order, innermost first: tp -> ulysses -> ring -> pp -> cfg -> dp (xDiT's
"tp-sp-pp-cfg-dp" with Ulysses inside Ring). Innermost axes get adjacent ranks,
so the chattiest traffic (tensor parallel, Ulysses all-to-all) stays on the
closest devices (same node, NVLink) when ranks are laid out in device order.
Pure functions: no torch.distributed here, so the mesh is testable anywhere.
"""
from __future__ import annotations

import itertools

from .config import ParallelConfig

AXES = ("tp", "ulysses", "ring", "pp", "cfg", "dp")  # innermost first


def axis_sizes(config: ParallelConfig) -> dict:
    return {"tp": config.tp_degree, "ulysses": config.ulysses_degree, "ring": config.ring_degree,
            "pp": config.pp_degree, "cfg": config.cfg_degree, "dp": config.dp_degree}


def _strides(sizes: dict) -> dict:
    strides, s = {}, 1
    for ax in AXES:
        strides[ax] = s
        s *= sizes[ax]
    return strides


def rank_coords(config: ParallelConfig, rank: int) -> dict:
    """Coordinate of `rank` along every axis."""
    sizes = axis_sizes(config)
    if not 0 <= rank < config.world_size:
        raise ValueError(f"rank {rank} outside world of size {config.world_size}")
    out = {}
    for ax in AXES:
        out[ax] = rank % sizes[ax]
        rank //= sizes[ax]
    return out


def _groups_varying(config: ParallelConfig, varying: tuple) -> list:
    """Groups of ranks that differ only in the `varying` axes (ordered innermost first)."""
    sizes = axis_sizes(config)
    strides = _strides(sizes)
    fixed = [ax for ax in AXES if ax not in varying]
    groups = []
    for fixed_coords in itertools.product(*(range(sizes[ax]) for ax in reversed(fixed))):
        base = sum(c * strides[ax] for c, ax in zip(fixed_coords, reversed(fixed)))
        members = []
        # Outer varying axis changes slowest so that e.g. sp rank = ring_rank * ulysses + ulysses_rank.
        for var_coords in itertools.product(*(range(sizes[ax]) for ax in reversed(varying))):
            members.append(base + sum(c * strides[ax] for c, ax in zip(var_coords, reversed(varying))))
        groups.append(members)
    return sorted(groups)


def rank_groups(config: ParallelConfig) -> dict:
    """The ranks that communicate along each axis.

    Keys: dp, cfg, pp, sp, ring, ulysses, tp, and batch (cfg x dp: the ranks
    a batch is split over, cfg-major so that ComfyUI's [cond..., uncond...]
    batch puts the conditional half on cfg rank 0). Each value partitions
    range(world_size); a group's list is in the order of the axis' own rank.
    """
    groups = {ax: _groups_varying(config, (ax,)) for ax in AXES}
    groups["sp"] = _groups_varying(config, ("ulysses", "ring"))
    groups["batch"] = _groups_varying(config, ("dp", "cfg"))
    return {k: groups[k] for k in ("dp", "cfg", "pp", "sp", "ring", "ulysses", "tp", "batch")}
