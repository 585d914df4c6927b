"""Weight sharding (the FSDP idea on the pack's own comm layer): every rank of an axis holds 1/N of the weights.

Why: with sequence parallelism every rank holds the whole model, so a Wan 2.2 14B or Qwen-Image 20B in
bf16 does not fit four 24 GB GPUs. Sharded, a rank keeps 1/N of every weight at rest; a block's full
weights exist only while it runs, gathered one block ahead (an asynchronous all-gather that overlaps the
previous block's compute) and freed right after.

Why not torch's `fully_shard`: it turns parameters into DTensors and owns the hooks; ComfyUI's ops read
`self.weight` and cast it on every call (fp8 weight dtypes, scaled fp8, manual cast), and the attention
seam changes what the blocks compute. Plain tensors swapped in and out around each block compose with all
of that; the shards are raw bytes, so fp8 travels as it is stored (gloo has no fp8 type).

Units: each child of the model's top-level block lists (`nn.ModuleList`s: SD3's joint_blocks, Flux's
double/single blocks, Wan's blocks, ...) is one unit; everything else (embedders, final layer, the
modulation outside blocks) is the root unit, gathered for the whole forward. Needs every rank of the axis
to run the same blocks in the same order, which USP, CFG and data parallel do; tensor parallel and
PipeFusion split the weights themselves and are refused in the config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

ALIGN = 64  # byte offset of every tensor in a unit's flat buffer: any dtype view is aligned
SHARD_BUFFER = "_hp_weight_shard"


@dataclass
class _Entry:
    owner: torch.nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype
    shape: tuple
    offset: int
    nbytes: int


@dataclass
class _Unit:
    name: str
    module: torch.nn.Module
    entries: list
    size: int                             # padded bytes of the full flat buffer (a multiple of the axis size)
    full: Optional[torch.Tensor] = None   # the gathered buffer while the unit is in use
    pending: Optional[object] = None      # the asynchronous all-gather in flight (prefetch), until waited
    hooks: list = field(default_factory=list)

    @property
    def shard(self) -> torch.Tensor:
        return self.module._buffers[SHARD_BUFFER]


def _all_gather(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
    return gather(out, shard, group=group, async_op=async_op)


def _block_units(model: torch.nn.Module) -> list:
    """(name, module) of every child of the model's top-level ModuleLists, in registration order (the order a
    DiT runs them)."""
    out = []
    for list_name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            out += [(f"{list_name}.{i}", block) for i, block in enumerate(child)]
    return out


def _entries(module: torch.nn.Module, skip: set, world: int) -> tuple:
    """The tensors a unit owns (parameters and persistent buffers not in `skip`), laid out in one flat buffer."""
    entries, offset, seen = [], 0, set()
    for owner in module.modules():
        if id(owner) in skip:
            continue
        tensors = [(n, p, True) for n, p in owner._parameters.items() if p is not None]
        tensors += [(n, b, False) for n, b in owner._buffers.items()
                    if b is not None and n not in owner._non_persistent_buffers_set and n != SHARD_BUFFER]
        for name, t, is_param in tensors:
            if id(t) in seen or t.is_meta:
                continue
            seen.add(id(t))
            nbytes = t.numel() * t.element_size()
            # size(), not shape: a loader's tensor subclass (GGUF) reports its logical shape, while its bytes are
            # rows of quantized blocks - the shard holds and gathers those bytes, the tensor object stays its own
            entries.append(_Entry(owner, name, is_param, t.dtype, tuple(t.size()), offset, nbytes))
            offset += math.ceil(nbytes / ALIGN) * ALIGN
    size = math.ceil(max(offset, 1) / (world * ALIGN)) * world * ALIGN
    return entries, size


class WeightSharding:
    """The shards of one model on one rank, and the hooks that gather and free them around each unit."""

    def __init__(self, model: torch.nn.Module, ax):
        self.model, self.ax = model, ax
        self.world, self.rank, self.group = ax.size, ax.rank, ax.group
        self.gathered_bytes = 0       # bytes of full units held right now
        self.peak_gathered_bytes = 0  # the most ever held at once (the bench and tests read it)
        blocks = _block_units(model)
        block_ids = {id(m) for _, b in blocks for m in b.modules()}
        self.units = [self._make_unit("root", model, block_ids)]
        self.units += [self._make_unit(name, b, set()) for name, b in blocks]
        self._index = {id(u.module): i for i, u in enumerate(self.units)}
        self._install()

    # ---- sharding (once, on the host) ----
    def _make_unit(self, name: str, module: torch.nn.Module, skip: set) -> _Unit:
        entries, size = _entries(module, skip, self.world)
        per = size // self.world
        lo, hi = self.rank * per, (self.rank + 1) * per
        shard = torch.zeros(per, dtype=torch.uint8)
        for e in entries:  # copy only the bytes of this rank's slice; the full flat buffer is never built
            t = self._tensor(e)
            a, b = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if a < b:
                raw = torch.Tensor.as_subclass(t, torch.Tensor).detach().contiguous().reshape(-1).view(torch.uint8)
                shard[a - lo:b - lo] = raw[a - e.offset:b - e.offset]
            self._set(e, torch.empty(0, dtype=e.dtype, device=t.device))  # the full tensor is dropped here
        module.register_buffer(SHARD_BUFFER, shard, persistent=False)
        return _Unit(name, module, entries, size)

    @staticmethod
    def _tensor(e: _Entry) -> torch.Tensor:
        return e.owner._parameters[e.name] if e.is_param else e.owner._buffers[e.name]

    @staticmethod
    def _set(e: _Entry, t: torch.Tensor) -> None:
        if e.is_param:
            e.owner._parameters[e.name].data = t
        else:
            e.owner._buffers[e.name] = t

    # ---- gather / free ----
    def _start(self, unit: _Unit, async_op: bool) -> None:
        shard = unit.shard
        unit.full = torch.empty(unit.size, dtype=torch.uint8, device=shard.device)
        unit.pending = _all_gather(unit.full, shard, self.group, async_op)
        self.gathered_bytes += unit.size
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)

    @staticmethod
    def _wait(unit: _Unit) -> None:
        if unit.pending is not None:  # an asynchronous gather in flight (a synchronous one returned None)
            unit.pending.wait()
            unit.pending = None

    def _materialize(self, unit: _Unit) -> None:
        """Wait for the unit's gather and point its tensors at views of the full buffer."""
        if unit.full is None:
            self._start(unit, async_op=False)
        self._wait(unit)
        for e in unit.entries:
            view = unit.full[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            self._set(e, view)

    def _release(self, unit: _Unit) -> None:
        if unit.full is None:
            return
        self._wait(unit)  # never free a buffer a collective still writes
        for e in unit.entries:
            self._set(e, torch.empty(0, dtype=e.dtype, device=unit.full.device))
        self.gathered_bytes -= unit.size
        unit.full, unit.pending = None, None

    # ---- hooks ----
    def _install(self) -> None:
        root = self.units[0]
        root.hooks.append(self.model.register_forward_pre_hook(self._root_pre, prepend=True))
        root.hooks.append(self.model.register_forward_hook(self._root_post))
        for unit in self.units[1:]:
            unit.hooks.append(unit.module.register_forward_pre_hook(self._block_pre))
            unit.hooks.append(unit.module.register_forward_hook(self._block_post))

    def _root_pre(self, module, args):
        for unit in self.units:  # a forward that failed half-way left units gathered: start clean
            self._release(unit)
        self._materialize(self.units[0])
        if len(self.units) > 1:
            self._start(self.units[1], async_op=True)  # the first block's weights arrive during the embedders

    def _root_post(self, module, args, output):
        for unit in self.units:
            self._release(unit)

    def _block_pre(self, module, args):
        i = self._index[id(module)]
        self._materialize(self.units[i])
        if i + 1 < len(self.units) and self.units[i + 1].full is None:
            self._start(self.units[i + 1], async_op=True)  # one block ahead

    def _block_post(self, module, args, output):
        self._release(self.units[self._index[id(module)]])

    def remove(self) -> None:
        for unit in self.units:
            for h in unit.hooks:
                h.remove()
            unit.hooks = []

    def stats(self) -> dict:
        return {"shard_bytes": sum(u.size // self.world for u in self.units),
                "full_bytes": sum(u.size for u in self.units),
                "largest_block_bytes": max((u.size for u in self.units[1:]), default=0),
                "root_bytes": self.units[0].size, "units": len(self.units),
                "peak_gathered_bytes": self.peak_gathered_bytes}


def apply_weight_sharding(model: torch.nn.Module, ctx) -> Optional[WeightSharding]:
    """Shard `model`'s weights over the axis `ctx.config.shard_weights` names ("sequence": the Ulysses x Ring
    ranks; "all": the whole world); returns the sharding (kept on the model as `_hp_sharding`), or None."""
    choice = getattr(ctx.config, "shard_weights", "none")
    if choice == "none":
        return None
    from .context import world_axis
    ax = ctx.sp if choice == "sequence" else world_axis(ctx)
    if ax.size <= 1:
        return None
    sharding = WeightSharding(model, ax)
    model._hp_sharding = sharding
    return sharding
