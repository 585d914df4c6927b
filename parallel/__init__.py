"""The parallel engine: pure torch on ComfyUI's model objects (never imports ComfyUI: the family plans name modules
and arguments)."""
from .comm import CommStats, all_gather_uneven, all_reduce, all_to_all, broadcast, split_sizes
from .config import ConfigError, ParallelConfig
from .context import AxisGroup, ParallelContext
from .mesh import AXES, rank_coords, rank_groups
from .parallelize import parallelize, unparallelize

__all__ = [
    "AXES", "AxisGroup", "CommStats", "ConfigError", "ParallelConfig", "ParallelContext",
    "all_gather_uneven", "all_reduce", "all_to_all", "broadcast", "parallelize", "rank_coords", "rank_groups",
    "split_sizes", "unparallelize",
]
