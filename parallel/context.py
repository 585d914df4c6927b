"""Per-process parallel state, created once after `init_process_group`.

There is no module-level registry of groups (xDiT's `_RUNTIME` singleton is the
counter-example): everything a parallel layer needs - its rank and group along
each axis, the device, the comm counters - hangs off one `ParallelContext` that
is passed explicitly. Two contexts can coexist in one process (tests do that).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from .comm import CommStats
from .config import ParallelConfig
from .mesh import AXES, rank_coords, rank_groups

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class AxisGroup:
    """This rank's view of one axis: its position, the peers, the process group.

    `group` is None when the axis has size 1 (no communication needed) or the
    world is a single process without torch.distributed.
    """

    name: str
    rank: int
    size: int
    ranks: list
    group: Optional[object]
    stats: CommStats = field(repr=False)

    # group_order[i]: the process-group rank of axis rank i. torch numbers a group's members by
    # ascending global rank, but an axis may list them in another order (the batch axis is
    # cfg-major); positional collectives use this to put pieces in axis order. Fixed per axis,
    # so computed once rather than in every all-to-all of every attention layer.
    group_order: list = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ascending = sorted(self.ranks)
        self.group_order = [ascending.index(r) for r in self.ranks]

    def global_rank(self, axis_rank: int) -> int:
        return self.ranks[axis_rank % self.size]

    @property
    def next_rank(self) -> int:
        return self.global_rank(self.rank + 1)

    @property
    def prev_rank(self) -> int:
        return self.global_rank(self.rank - 1)


class ParallelContext:
    """Config + process groups + comm counters for one process of the world."""

    def __init__(self, config: ParallelConfig, device: Optional[torch.device] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        self.config = config
        self.timeout_s = timeout_s
        self.stats = CommStats()
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size = 0, 1
        if self.world_size != config.world_size:
            raise ValueError(
                f"the world has {self.world_size} processes but the config ({config.describe()}) needs "
                f"{config.world_size}; start the world with the config's world_size")
        self.device = device or torch.device("cpu")
        self.attention_backend = "auto"  # see parallel/attention.py; a pool may force one
        self.speeds = None  # every world rank's relative speed (set_speeds), where ranks differ
        self.coords = rank_coords(config, self.rank)
        self._own_groups = []
        self.axes = self._build_axes()

    def _build_axes(self) -> dict:
        timeout = datetime.timedelta(seconds=self.timeout_s)
        axes = {}
        for name, groups in rank_groups(self.config).items():
            mine = next(g for g in groups if self.rank in g)
            pg = None
            if len(mine) > 1:
                # new_group is collective over the whole world: every rank creates every group, in order.
                for g in groups:
                    handle = dist.new_group(g, timeout=timeout)
                    self._own_groups.append(handle)
                    if g is mine:
                        pg = handle
            axes[name] = AxisGroup(name, mine.index(self.rank), len(mine), list(mine), pg, self.stats)
        return axes

    def with_config(self, config: ParallelConfig) -> "ParallelContext":
        """A context for another config of the same mesh, sharing these groups (no collective)."""
        if config.mesh_key() != self.config.mesh_key():
            raise ValueError(f"mesh changed ({self.config.describe()} -> {config.describe()}): build a new context")
        other = object.__new__(ParallelContext)
        other.__dict__.update(self.__dict__)
        other.config = config
        other._own_groups = []  # the groups stay owned by self
        return other

    # ---- ranks of different speeds (a 4090 beside a 3090) ----
    BALANCE_MIN = 1.15  # speeds closer than this split evenly (a probe's noise must not move the split)

    def set_speeds(self, speeds) -> None:
        """Every world rank's relative speed (a probe's throughput, or HP_BALANCE's list); the sequence and Ulysses'
        heads are then shared out in proportion, so the slowest rank does not set the pace. None: even split."""
        if speeds is not None:
            speeds = [float(v) for v in speeds]
            if len(speeds) != self.world_size or min(speeds) <= 0:
                raise ValueError(f"speeds must be {self.world_size} positive numbers (one per rank), got {speeds}")
        self.speeds = speeds

    def _weights(self, ranks) -> Optional[list]:
        if not self.speeds or len(ranks) < 2:
            return None
        mine = [self.speeds[r] for r in ranks]
        return mine if max(mine) / min(mine) >= self.BALANCE_MIN else None

    @property
    def sp_weights(self) -> Optional[list]:
        """Relative speeds of the sp ranks in sp order (ring-major, ulysses inside), or None for an even split -
        also under tensor parallel, whose ranks of one sp shard would each have a speed of their own."""
        sp = self.sp
        if sp.size < 2 or not self.speeds:
            return None
        return self._weights(sp.ranks) if self.tp.size == 1 else None

    @property
    def head_weights(self) -> Optional[list]:
        """Relative speeds of the Ulysses ranks for their share of the heads (attention costs heads x the whole
        sequence there). Only without ring: ring ranks exchange K/V blocks head for head with their peers of the
        other Ulysses groups, which must hold the same heads."""
        if self.ring.size > 1 or self.tp.size > 1:
            return None
        return self._weights(self.ulysses.ranks)

    def axis(self, name: str) -> AxisGroup:
        return self.axes[name]

    # Shorthands for the axes every layer asks about.
    @property
    def sp(self) -> AxisGroup:
        return self.axes["sp"]

    @property
    def ulysses(self) -> AxisGroup:
        return self.axes["ulysses"]

    @property
    def ring(self) -> AxisGroup:
        return self.axes["ring"]

    @property
    def pp(self) -> AxisGroup:
        return self.axes["pp"]

    @property
    def cfg(self) -> AxisGroup:
        return self.axes["cfg"]

    @property
    def dp(self) -> AxisGroup:
        return self.axes["dp"]

    @property
    def tp(self) -> AxisGroup:
        return self.axes["tp"]

    def destroy(self) -> None:
        """Free the subgroups (the world group belongs to whoever initialised it)."""
        for g in self._own_groups:
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: BLE001 - best effort during teardown
                pass
        self._own_groups = []

    def __repr__(self) -> str:
        coords = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"ParallelContext(rank={self.rank}/{self.world_size}, {coords}, device={self.device})"


def world_axis(ctx) -> AxisGroup:
    """An AxisGroup over every rank of the context's world.

    The VAE decode runs after sampling, when the sp/cfg/dp split of the
    denoiser no longer matters: the pool decodes on all ranks at once. The
    mesh axes each cover only part of the world unless the config has a single
    non-trivial axis, so this builds the whole-world view on the default group
    (no new_group, no collective) and shares the context's comm counters.
    """
    n = ctx.world_size
    group = dist.group.WORLD if n > 1 else None
    return AxisGroup("world", ctx.rank, n, list(range(n)), group, ctx.stats)
