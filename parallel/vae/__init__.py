"""Patch-parallel VAE decode (rows split over ranks, exact versus serial): diffusers KL, Wan and tiny (TAESD) VAEs."""
from .decode import max_patch_degree, patch_decode, world_axis
from .patch_ops import GatherTokens, HaloExchange, PatchConv, PatchGroupNorm, exchange_halo
from .plan import Plan, build_plan, swapped
from .wan import PatchWanAttention

__all__ = [
    "GatherTokens", "HaloExchange", "PatchConv", "PatchGroupNorm", "PatchWanAttention", "Plan", "build_plan",
    "exchange_halo", "max_patch_degree", "patch_decode", "swapped", "world_axis",
]
