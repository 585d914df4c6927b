"""Patch VAE Decode on ComfyUI's own VAE modules: one mechanism, each VAE class declares what its decoder holds.

Why: the workers decode with the VAE ComfyUI loaded - its class, its ops, its decode loop (a video VAE's temporal
chunks and caches) - so every VAE whose decoder was read gets the split, with no converter to write and no second
implementation to keep equal to ComfyUI's. What differs from a serial decode is only inside the ops that mix rows:

- a convolution taller than one row (Conv2d / Conv3d and ComfyUI's subclasses, the causal Conv3d with its frame
  cache included) computes its rows from halo rows of the neighbouring ranks (patch_ops.PatchConv);
- a GroupNorm takes the statistics of all ranks' rows (patch_ops.PatchGroupNorm);
- an attention block over one frame's pixels gathers every rank's keys and values (its queries stay local), by
  wrapping the block's `optimized_attention(q, k, v)` - ComfyUI's KL and Wan blocks both call it;
- everything else in the decode path is row-local: declared per VAE class after reading its forward
  (comfy_vaes.py), or refused with the module's path, so an unread module never splits silently.

The stand-ins are installed on the module *instances* (their `forward`, or the attention function attribute) for
the duration of one decode and removed after it: ComfyUI's own code still sees its classes (its decoders test
`isinstance(layer, CausalConv3d)` to feed the frame cache), and the model decodes serially again afterwards.
This module never imports ComfyUI: classes are matched by their qualified names.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..comm import all_gather_uneven, all_reduce, gather_to_first, split_sizes
from ..config import ConfigError
from .patch_ops import PaddedConv, PatchConv, PatchGroupNorm, PrepaddedConv

# torch modules that act on each pixel (or are plain containers): row-local whatever the VAE. Exactly these classes:
# a subclass (ComfyUI's TAESD Decoder is an nn.Sequential subclass, Flux.2's TAE decoder overrides its forward) runs
# code nobody read until its VAE's entry declares it
_TORCH_ROW_LOCAL = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.SiLU, nn.ReLU, nn.GELU, nn.Mish, nn.Tanh,
                    nn.Dropout, nn.Identity, nn.LeakyReLU)


def _torch_row_local(m: nn.Module) -> bool:
    """A plain torch container / per-pixel activation, or a Linear (torch's or ComfyUI's ops: over a row's last
    dimension; the one in a decoder, ResnetBlock's temb_proj, only ever sees the timestep embedding)."""
    return type(m) in _TORCH_ROW_LOCAL or (isinstance(m, nn.Linear) and (type(m) is nn.Linear
                                                                          or type(m).__module__ == "comfy.ops"))


@dataclass(frozen=True)
class ComfyVae:
    """What one family of ComfyUI VAE classes runs when it decodes (see comfy_vaes.py for the entries)."""

    title: str
    classes: tuple                   # first_stage_model classes ("module.QualName") this entry covers
    parts: tuple                     # its attributes that `decode` runs, walked in order
    row_local: tuple = ()            # module classes read and found row-local apart from their children
    attention: tuple = ()            # blocks whose `optimized_attention(q, k, v)` attends over one frame's rows
    convs: tuple = ()                # conv subclasses whose forward PatchConv reproduces (Wan's causal conv)
    padded: tuple = ()               # modules that F.pad their input (`padding`, `padding_mode`) then run `.conv`
    prepadded: tuple = ()            # modules whose callers pad their input (replicate), then run `.conv`
    dims: int = 4                    # latent (B, C, H, W) or (B, C, T, H, W)
    decoder: str = ""                # its `decoder` attribute's class, where one model class hosts several
    check: Optional[Callable] = None  # model -> [problems] beyond the module walk (a variant the entry excludes)
    byte_chunked: tuple = ()         # modules whose `run_up(..., max_chunk_size)` chunks frames by its band's bytes
    metadata: Optional[Callable] = None  # model -> the `metadata` comfy.sd.VAE needs to build it again (its config)


def qualname(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass
class NativePlan:
    """The stand-ins of one decode: (module, attribute, replacement) and the latent rows each rank must hold."""

    installs: list = field(default_factory=list)
    min_rows: int = 1

    def add(self, module: nn.Module, attr: str, value, halo: int = 0) -> None:
        self.installs.append((module, attr, value))
        self.min_rows = max(self.min_rows, halo)


def _upsample_problem(m: nn.Upsample) -> Optional[str]:
    sf = m.scale_factor if isinstance(m.scale_factor, tuple) else (m.scale_factor,)
    if m.size is not None or m.mode not in ("nearest", "nearest-exact") or any(float(f) != int(f) for f in sf):
        return (f"only nearest upsampling by integer factors keeps rows local (mode={m.mode!r}, "
                f"scale_factor={m.scale_factor}, size={m.size})")
    return None


def _gather_kv(attention, ax):
    """`optimized_attention(q, k, v)` with every rank's keys and values (rows: dim -2 of (B, C, H, W)).

    ComfyUI's VAE attention functions take (B, C, H, W) q/k/v as one head over the flattened pixels and return q's
    shape, but its split (CPU) and xformers fallbacks size their output like k; with more keys than queries the
    attention is computed here in that same layout with torch's scaled_dot_product_attention."""
    def gathered(q, k, v, *args, **kwargs):
        k = all_gather_uneven(k.contiguous(), dim=-2, ax=ax)
        v = all_gather_uneven(v.contiguous(), dim=-2, ax=ax)
        b, c = q.shape[:2]
        q_, k_, v_ = (t.reshape(b, 1, c, -1).transpose(2, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_)
        return out.transpose(2, 3).reshape(q.shape)
    gathered.__wrapped__ = attention
    return gathered


class _AgreedChunks:
    """A `max_chunk_size` every rank's ComfyUI reads as the serial decode's: LTX's Decoder.run_up cuts each level's
    output into `(total_bytes + max_chunk_size - 1) // max_chunk_size` frame chunks, and a band's bytes are its share
    of the whole, so each rank alone would cut fewer chunks than VAE Decode does - and differently from the other
    ranks, whose convolutions then exchange rows with a different call. Here that expression's `total_bytes` is
    summed over the ranks (one tiny all-reduce, at the point every rank reaches together) before it is divided: every
    rank cuts the serial decode's chunks. Any other arithmetic on it fails loudly (a changed formula is not guessed)."""

    def __init__(self, budget: int, ax, device):
        self.budget, self.ax, self.device = int(budget), ax, device

    def __radd__(self, local_bytes):
        return _PendingChunks(self, int(local_bytes), self.budget)


class _PendingChunks:
    def __init__(self, agreed: _AgreedChunks, local_bytes: int, offset: int):
        self.agreed, self.local_bytes, self.offset = agreed, local_bytes, offset

    def __sub__(self, n):
        return _PendingChunks(self.agreed, self.local_bytes, self.offset - int(n))

    def __floordiv__(self, other):
        if other is not self.agreed:
            return NotImplemented
        total = all_reduce(torch.tensor([self.local_bytes], dtype=torch.int64, device=self.agreed.device),
                           self.agreed.ax)
        return (int(total.item()) + self.offset) // self.agreed.budget


def _agreed_run_up(run_up, ax):
    """`run_up(idx, sample_ref, ..., max_chunk_size)` with the frame chunks of the serial decode on every rank."""
    def agreed(*args, **kwargs):
        args = list(args)
        budget = kwargs["max_chunk_size"] if "max_chunk_size" in kwargs else args[-1]
        if not isinstance(budget, _AgreedChunks):
            budget = _AgreedChunks(budget, ax, args[1][0].device if len(args) > 1 else kwargs["sample_ref"][0].device)
        if "max_chunk_size" in kwargs:
            kwargs["max_chunk_size"] = budget
        else:
            args[-1] = budget
        return run_up(*args, **kwargs)
    agreed.__wrapped__ = run_up
    return agreed


def _plain_child_conv(m: nn.Module, path: str, name: str) -> nn.Module:
    """The `.conv` a padding wrapper (VideoConv3d, NoPadConv3d) runs, refused unless a plain convolution."""
    conv = getattr(m, "conv", None)
    if not (type(conv) in (nn.Conv2d, nn.Conv3d) or type(conv).__module__ == "comfy.ops"):
        raise ConfigError(f"{path}: {name} runs {qualname(conv)}, not a plain convolution")
    return conv


def _walk(m: nn.Module, path: str, vae: ComfyVae, ax, plan: NativePlan, block_size, timeout_s) -> None:
    name = qualname(m)
    if isinstance(m, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        raise ConfigError(f"{path}: a transposed convolution ({name}) is not split by rows by Patch VAE Decode")
    if isinstance(m, (nn.Conv2d, nn.Conv3d)):
        if not (type(m) in (nn.Conv2d, nn.Conv3d) or type(m).__module__ == "comfy.ops" or name in vae.convs):
            # a subclass whose forward does more than convolve (pads, caches frames) would lose that in the stand-in
            raise ConfigError(f"{path}: convolution class {name} was not read for a row split; decode this VAE with "
                              f"VAE Decode")
        conv = PatchConv(m, ax, block_size=block_size, timeout_s=timeout_s, name=path)
        if conv.halo or block_size:
            plan.add(m, "forward", conv.forward, conv.halo)
        return
    if isinstance(m, nn.GroupNorm):
        plan.add(m, "forward", PatchGroupNorm(m, ax).forward)
        return
    if name in vae.padded and getattr(m, "padding", 0) != 0:  # pads itself, then convolves with no padding
        conv = _plain_child_conv(m, path, name)
        stand_in = PaddedConv(m, ax, m.padding, getattr(m, "padding_mode", "constant"), block_size=block_size,
                              timeout_s=timeout_s, name=path)
        plan.add(m, "forward", stand_in.forward, stand_in.halo)
        return
    if name in vae.prepadded:
        conv = _plain_child_conv(m, path, name)
        if conv.dilation[-2] * (conv.kernel_size[-2] - 1):  # a 1x1 conv needs no rows from anyone
            stand_in = PrepaddedConv(m, ax, timeout_s=timeout_s, name=path)
            plan.add(m, "forward", stand_in.forward, stand_in.halo)
        return
    if name in vae.byte_chunked and callable(getattr(m, "run_up", None)):  # (earlier ComfyUIs: no run_up, no chunks)
        plan.add(m, "run_up", _agreed_run_up(m.run_up, ax))
    if name in vae.attention:
        fn = getattr(m, "optimized_attention", None)
        if fn is None:
            raise ConfigError(f"{path}: {name} has no optimized_attention to gather keys and values through")
        plan.add(m, "optimized_attention", _gather_kv(fn, ax))
    elif isinstance(m, nn.Upsample):
        problem = _upsample_problem(m)
        if problem:
            raise ConfigError(f"{path}: {problem}")
    elif not (type(m) is nn.Module or _torch_row_local(m) or name in vae.row_local or name in vae.padded):
        raise ConfigError(f"{path}: module type {name} was not read for a row split (it might mix rows across "
                          f"patches); decode this VAE with VAE Decode")
    for child_name, child in m.named_children():
        _walk(child, f"{path}.{child_name}", vae, ax, plan, block_size, timeout_s)


def plan_native(model: nn.Module, vae: ComfyVae, ax, block_size=None, timeout_s=None) -> NativePlan:
    """The stand-ins for `model` (a ComfyUI first_stage_model) under the declaration `vae`; ConfigError for a
    module nobody read, a variant the declaration excludes or a bad block_size - before any communication."""
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ConfigError(f"block_size must be a positive integer number of rows or None, got {block_size!r}")
    problems = vae.check(model) if vae.check is not None else []
    if problems:
        raise ConfigError(f"{vae.title} ({qualname(model)}): {'; '.join(problems)}")
    plan = NativePlan()
    for part in vae.parts:
        m = getattr(model, part, None)
        if m is not None:
            _walk(m, part, vae, ax, plan, block_size, timeout_s)
    return plan


@contextlib.contextmanager
def installed(plan: NativePlan):
    """The plan's stand-ins on their module instances for the block; the instances exactly as before after it."""
    saved = []
    try:
        for module, attr, value in plan.installs:
            saved.append((module, attr, attr in module.__dict__, module.__dict__.get(attr)))
            object.__setattr__(module, attr, value)
        yield
    finally:
        for module, attr, had, old in reversed(saved):
            if had:
                object.__setattr__(module, attr, old)
            else:
                object.__delattr__(module, attr)


def native_patch_decode(model: nn.Module, vae: ComfyVae, latent: torch.Tensor, ax, block_size: Optional[int] = None,
                        *, gather="first", timeout_s: Optional[float] = 120.0):
    """`model.decode(latent)` (ComfyUI's first_stage_model) with the latent's rows split over the ranks of `ax`;
    every rank passes the same full latent, in the dtype ComfyUI's VAE.decode gives it (the VAE's). gather: "first"
    returns the decoded tensor on axis rank 0 (None elsewhere), True on every rank, False this rank's rows and
    their offset."""
    if latent.dim() != vae.dims:
        kind = "(B, C, H, W)" if vae.dims == 4 else "(B, C, T, H, W)"
        raise ConfigError(f"{vae.title} decodes {kind} latents, got shape {tuple(latent.shape)}")
    plan = plan_native(model, vae, ax, block_size=block_size, timeout_s=timeout_s)
    height = latent.shape[-2]
    sizes = split_sizes(height, ax.size)
    if min(sizes) < plan.min_rows:
        raise ConfigError(f"a latent {height} rows tall cannot be split over {ax.size} ranks: every rank needs at "
                          f"least {plan.min_rows} latent row(s); use at most {max(1, height // plan.min_rows)} ranks")
    if ax.size == 1:
        with torch.no_grad():
            out = model.decode(latent)
        return out if gather else (out, 0)
    start = sum(sizes[: ax.rank])
    local = latent.narrow(-2, start, sizes[ax.rank]).contiguous()
    with torch.no_grad(), installed(plan):
        out = model.decode(local)
    # later ComfyUIs' TAEHV returns its frames on ComfyUI's intermediate device (the CPU unless --gpu-only): the rows
    # are gathered where the latent is, the device the axis' collectives run on
    return gather_rows(out.to(latent.device), ax, gather)


def gather_rows(out: torch.Tensor, ax, gather):
    """This rank's decoded rows `out` assembled as `gather` asks (see patch_decode): True on every rank, "first" on
    axis rank 0 only (None elsewhere), False as (rows, first row). Output rows per rank are exchanged rather than
    assumed (a tiny collective): the last rank's patch differs from the others when a conv is not height-preserving."""
    mine = torch.tensor([[out.shape[-2]]], dtype=torch.int64, device=out.device)
    out_sizes = [int(v) for v in all_gather_uneven(mine, dim=0, ax=ax, sizes=[1] * ax.size).flatten()]
    if not gather:
        return out, sum(out_sizes[: ax.rank])
    if gather == "first":
        return gather_to_first(out, dim=out.dim() - 2, ax=ax, sizes=out_sizes)
    return all_gather_uneven(out, dim=out.dim() - 2, ax=ax, sizes=out_sizes)
