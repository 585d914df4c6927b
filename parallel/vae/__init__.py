"""Patch-parallel VAE decode (rows split over ranks, exact versus serial) of ComfyUI's own VAE modules - what Patch
VAE Decode runs: `native` (the plan and the decode) and the declarations in `comfy_vaes`, on the building blocks of
`patch_ops`. (The diffusers-class decode of the library API is retired: docs/development.md.)
"""
from ..context import world_axis
from .patch_ops import HaloExchange, PatchConv, PatchGroupNorm, exchange_halo

__all__ = ["HaloExchange", "PatchConv", "PatchGroupNorm", "exchange_halo", "world_axis"]
