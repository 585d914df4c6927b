"""Patch-parallel VAE decode (rows split over ranks, exact versus serial).

ComfyUI's own VAE modules (what Patch VAE Decode runs): `native` and the declarations in `comfy_vaes`. The diffusers
KL, Wan and tiny (TAESD) VAEs (library API, `patch_decode`) need diffusers, an optional dependency: their names are
imported on first use.
"""
from importlib import import_module

from ..context import world_axis
from .patch_ops import GatherTokens, HaloExchange, PatchConv, PatchGroupNorm, exchange_halo

_DIFFUSERS_API = {"max_patch_degree": ".decode", "patch_decode": ".decode", "Plan": ".plan", "build_plan": ".plan",
                  "swapped": ".plan", "PatchWanAttention": ".wan"}


def __getattr__(name):
    if name in _DIFFUSERS_API:
        return getattr(import_module(_DIFFUSERS_API[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GatherTokens", "HaloExchange", "PatchConv", "PatchGroupNorm", "PatchWanAttention", "Plan", "build_plan",
    "exchange_halo", "max_patch_degree", "patch_decode", "swapped", "world_axis",
]
