"""Which decoder modules a patch decode wraps, which it runs as they are, and which it refuses.

A plan is built by walking the decoder's module tree once. Each module type is
in exactly one of three sets:

- wrapped: ops that mix rows get a patch-aware stand-in from patch_ops.py/wan.py
  (convs with a kernel taller than 1, GroupNorm, attention K/V);
- row-local: containers and per-row ops whose diffusers forward was read and
  found not to mix rows beyond their children (checked field by field where a
  flag could change that, e.g. an Upsample2D with a transposed conv);
- anything else: refused with a ConfigError naming the module path, so a new
  diffusers block never silently gives a wrong image.

`swapped(plan)` puts the stand-ins into the module tree and always puts the
originals back, so the caller's VAE decodes serially afterwards as before.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch.nn as nn
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from diffusers.models.autoencoders.vae import Decoder, DecoderTiny
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_blocks import AutoencoderTinyBlock, UNetMidBlock2D, UpDecoderBlock2D
from diffusers.models.upsampling import Upsample2D

from ..config import ConfigError
from .patch_ops import GatherTokens, PatchConv, PatchGroupNorm
from .wan import PatchWanAttention

_PER_ROW = (nn.SiLU, nn.Mish, nn.GELU, nn.ReLU, nn.Dropout, nn.Identity, nn.Linear,
            nn.ModuleList, nn.Sequential, wan.WanRMS_norm, wan.DupUp3D)
# DecoderTiny (AutoencoderTiny, TAESD): its forward adds tanh(x/3)*3 before and *2-1 after its layers, both per
# element; AutoencoderTinyBlock adds its conv stack to its (1x1 or identity) skip and applies a ReLU: per row.
_CONTAINERS = (Decoder, UNetMidBlock2D, UpDecoderBlock2D, DecoderTiny, AutoencoderTinyBlock, wan.WanDecoder3d,
               wan.WanMidBlock, wan.WanResidualBlock, wan.WanUpBlock, wan.WanResidualUpBlock)


@dataclass
class Plan:
    """The stand-ins of one decode: (parent, child name, wrapper) and the rows each rank must hold."""

    swaps: list = field(default_factory=list)
    min_rows: int = 1

    def add(self, parent: nn.Module, name: str, wrapper: nn.Module) -> None:
        self.swaps.append((parent, name, wrapper))
        if isinstance(wrapper, PatchConv):
            self.min_rows = max(self.min_rows, wrapper.halo)


def _check_row_local(mod: nn.Module, path: str) -> None:
    if isinstance(mod, ResnetBlock2D):
        if mod.up or mod.down or mod.time_emb_proj is not None:
            raise ConfigError(f"{path}: a ResnetBlock2D with up/down sampling or a time embedding is not "
                              f"supported by patch decode")
    elif isinstance(mod, Upsample2D):
        if mod.use_conv_transpose or not mod.interpolate:
            raise ConfigError(f"{path}: Upsample2D with a transposed conv or without interpolation is not "
                              f"supported by patch decode")
    elif isinstance(mod, nn.Upsample):  # WanUpsample, DecoderTiny's x2 (each rank's rows double, in order)
        sf = mod.scale_factor if isinstance(mod.scale_factor, tuple) else (mod.scale_factor,) * 2
        if mod.size is not None or mod.mode not in ("nearest", "nearest-exact") or float(sf[0]) != int(sf[0]):
            raise ConfigError(f"{path}: only nearest upsampling by an integer factor keeps rows local "
                              f"(got mode={mod.mode!r}, scale_factor={mod.scale_factor}, size={mod.size})")
    elif isinstance(mod, wan.WanResample):
        if mod.mode not in ("upsample2d", "upsample3d", "none"):
            raise ConfigError(f"{path}: WanResample mode {mod.mode!r} is not supported by patch decode")
    elif not isinstance(mod, _PER_ROW + _CONTAINERS):
        raise ConfigError(
            f"{path}: module type {type(mod).__name__} has not been checked for patch-parallel VAE decode "
            f"(it might mix rows across patches); decode this VAE serially")


def _plan_attention(attn: Attention, path: str, ax, plan: Plan) -> None:
    if getattr(attn, "fused_projections", False) or not hasattr(attn, "to_k"):
        raise ConfigError(f"{path}: fused QKV projections are not supported by patch decode; "
                          f"call vae.unfuse_qkv_projections() first")
    if type(attn.processor) not in (AttnProcessor, AttnProcessor2_0):
        raise ConfigError(f"{path}: attention processor {type(attn.processor).__name__} is not supported by "
                          f"patch decode; call vae.set_default_attn_processor() first")
    if attn.spatial_norm is not None or attn.norm_cross:
        raise ConfigError(f"{path}: attention with spatial or cross norm is not supported by patch decode")
    for name, child in attn.named_children():
        sub = f"{path}.{name}"
        if name in ("to_k", "to_v"):
            plan.add(attn, name, GatherTokens(child, ax, dim=1))
        elif isinstance(child, nn.GroupNorm):
            plan.add(attn, name, PatchGroupNorm(child, ax))
        else:
            _walk(child, sub, ax, plan, None, None)


def _walk(mod: nn.Module, path: str, ax, plan: Plan, block_size, timeout_s, parent=None, name=None) -> None:
    if isinstance(mod, (nn.Conv2d, nn.Conv3d)):
        conv = PatchConv(mod, ax, block_size=block_size, timeout_s=timeout_s, name=path)
        if conv.halo or block_size:
            plan.add(parent, name, conv)
        return
    if isinstance(mod, nn.GroupNorm):
        plan.add(parent, name, PatchGroupNorm(mod, ax))
        return
    if isinstance(mod, wan.WanAttentionBlock):
        plan.add(parent, name, PatchWanAttention(mod, ax))
        return
    if isinstance(mod, Attention):
        _plan_attention(mod, path, ax, plan)
        return
    _check_row_local(mod, path)
    for child_name, child in mod.named_children():
        _walk(child, f"{path}.{child_name}", ax, plan, block_size, timeout_s, mod, child_name)


def build_plan(vae: nn.Module, ax, block_size=None, timeout_s=None) -> Plan:
    """Walk the parts of `vae` that `vae.decode` runs; refuse VAE classes that were not checked."""
    from diffusers import AutoencoderKL, AutoencoderKLWan, AutoencoderTiny

    if not isinstance(vae, (AutoencoderKL, AutoencoderKLWan, AutoencoderTiny)):
        raise ConfigError(f"patch decode supports diffusers AutoencoderKL, AutoencoderKLWan and AutoencoderTiny, got "
                          f"{type(vae).__name__}; decode it serially")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ConfigError(f"block_size must be a positive integer number of rows or None, got {block_size!r}")
    plan = Plan()
    for name in ("post_quant_conv", "decoder"):
        mod = getattr(vae, name, None)
        if mod is not None:
            _walk(mod, name, ax, plan, block_size, timeout_s, vae, name)
    return plan


@contextlib.contextmanager
def swapped(vae: nn.Module, plan: Plan):
    """Install the plan's stand-ins (and switch tiling off) for the duration of the block, then restore."""
    originals = []
    tiling = getattr(vae, "use_tiling", None)
    try:
        for parent, name, wrapper in plan.swaps:
            originals.append((parent, name, getattr(parent, name)))
            setattr(parent, name, wrapper)
        if tiling:
            vae.use_tiling = False
        yield vae
    finally:
        for parent, name, original in reversed(originals):
            setattr(parent, name, original)
        if tiling is not None:
            vae.use_tiling = tiling
