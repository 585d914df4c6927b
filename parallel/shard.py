"""Weight sharding (the FSDP idea on the pack's own comm layer): every rank of an axis holds 1/N of the weights.

Why: with sequence parallelism every rank holds the whole model, so a Wan 2.2 14B or Qwen-Image 20B in
bf16 does not fit four 24 GB GPUs. Sharded, a rank keeps 1/N of every weight at rest; a block's full
weights exist only while it runs, gathered one block ahead (an asynchronous all-gather that overlaps the
previous block's compute) and freed right after.

Why not torch's `fully_shard`: it turns parameters into DTensors and owns the hooks; ComfyUI's ops read
`self.weight` and cast it on every call (fp8 weight dtypes, scaled fp8, manual cast), and the attention
seam changes what the blocks compute. Plain tensors swapped in and out around each block compose with all
of that; the shards are raw bytes, so fp8 travels as it is stored (gloo has no fp8 type).

Quantized weights (ComfyUI's mixed-precision ops hold a comfy-kitchen `QuantizedTensor`: a wrapper tensor subclass
with no storage of its own, its quantized bytes and scales being inner tensors named by `__tensor_flatten__`): each
inner tensor is a region of the flat buffer like any weight, so a rank holds 1/N of the quantized bytes and scales
as they are stored (fp8 stays 1 byte, nvfp4 half a byte per value), never dequantized. Gathered, the wrapper is
rebuilt around views of the full buffer by its own `__tensor_unflatten__` (the layout sees its whole tensors, so any
layout whose inner tensors are plain tensors splits this way); between uses its slot holds an empty placeholder.

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

from .context import world_axis

ALIGN = 64  # byte offset of every tensor in a unit's flat buffer: any dtype view is aligned
SHARD_BUFFER = "_hp_weight_shard"


# ---- wrapper tensor subclasses (ComfyUI's quantized weights), as plain inner tensors and back ----

def is_wrapper(t) -> bool:
    """A tensor subclass that names its inner tensors (torch's `__tensor_flatten__` protocol) rather than holding
    storage of its own: comfy-kitchen's QuantizedTensor, which ComfyUI's mixed-precision ops hold for a quantized
    weight (its quantized bytes and scales)."""
    return (t is not None and type(t) not in (torch.Tensor, torch.nn.Parameter)
            and getattr(type(t), "__tensor_flatten__", None) is not None)


def wrapper_parts(t) -> tuple:
    """({inner name: tensor}, context) of a wrapper tensor: the tensors it is made of, as it holds them (no copy),
    and the context its `__tensor_unflatten__` rebuilds it from."""
    names, ctx = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}, ctx


def rebuild_wrapper(cls, parts: dict, ctx, size, stride):
    """The wrapper tensor `cls` makes of `parts` and `ctx` (its own `__tensor_unflatten__`, as torch rebuilds one)."""
    return cls.__tensor_unflatten__(dict(parts), ctx, tuple(size), tuple(stride))


def as_parameter(t: torch.Tensor) -> torch.Tensor:
    """`t` as a module parameter without a copy. torch.nn.Parameter(subclass) detaches it - for a QuantizedTensor a
    new wrapper whose scales are cloned - and flags the result `_is_param`; the flag alone is what makes a tensor
    subclass a Parameter (torch's _ParameterMeta), so a wrapper is flagged in place and keeps its inner tensors."""
    if not is_wrapper(t):
        return t if isinstance(t, torch.nn.Parameter) else torch.nn.Parameter(t, requires_grad=False)
    if t.requires_grad:
        t = t.detach()
    t._is_param = True
    return t


def layout_name(t) -> str:
    """The quantization layout a wrapper weight is stored in (comfy-kitchen: "TensorCoreFP8E4M3Layout", ...)."""
    layout = getattr(t, "_layout_cls", None)
    return layout if isinstance(layout, str) else type(layout).__name__ if layout is not None else type(t).__name__


def wrapper_problem(t) -> Optional[str]:
    """Why a wrapper tensor cannot be held as plain bytes and rebuilt around them (None if it can): an inner tensor
    that is itself a subclass, or that has no storage."""
    parts, _ = wrapper_parts(t)
    for n, p in parts.items():
        if type(p) not in (torch.Tensor, torch.nn.Parameter) or p.is_meta:
            what = "a meta tensor" if type(p) in (torch.Tensor, torch.nn.Parameter) else f"a {type(p).__name__}"
            return f"its {layout_name(t)} tensor holds {n} as {what}, not plain bytes"
    return None


_POSITIONAL = ("transposed", "convrot")  # layout flags that tie stored positions to the logical ones


def tensorwise_problem(t) -> Optional[str]:
    """Why slicing a wrapper weight's stored values along a dimension is not slicing the weight (None if it is): a
    tensorwise layout (fp8 / int8 with one scale) stores one value per weight in the weight's own shape and every
    other inner tensor is a single number, so a slice of its values with the same scale is the slice of the weight.
    Block-scaled layouts (nvfp4, mxfp8: a scale per block, padded and swizzled), packed values (two fp4 per byte),
    per-channel scales, transposed or rotated storage are not. The reason names what the weight stores."""
    parts, ctx = wrapper_parts(t)
    big = [n for n, p in parts.items() if p.numel() > 1]
    fields = ctx.get("non_tensor_fields") if isinstance(ctx, dict) else None
    if len(big) != 1 or tuple(parts[big[0]].shape) != tuple(t.shape):
        stored = ", ".join(f"{n} {tuple(p.shape)}" for n, p in parts.items())
        return (f"it stores {stored} for a {tuple(t.shape)} weight: values packed or scaled by block, not one "
                f"value per weight with a single scale")
    flags = [k for k in _POSITIONAL if isinstance(fields, dict) and fields.get(k)]
    if flags:
        return f"it stores its values {' and '.join(flags)}"
    if not isinstance(fields, dict) or "orig_shape" not in fields:
        return "its shape is not a field of its layout's parameters"
    return None


def slice_wrapper(t, dim: int, piece) -> torch.Tensor:
    """The tensorwise wrapper weight `t` (tensorwise_problem(t) is None) cut to `piece(stored values)` along `dim`:
    the stored values sliced, the single-number scales kept, the layout's shape field set to the new shape."""
    parts, ctx = wrapper_parts(t)
    big = next(n for n, p in parts.items() if p.numel() > 1)
    parts[big] = piece(parts[big])
    shape = list(t.shape)
    shape[dim] = parts[big].shape[dim]
    ctx = dict(ctx, non_tensor_fields=dict(ctx["non_tensor_fields"], orig_shape=tuple(shape)))
    stride = torch.empty(shape, device="meta").stride()
    return rebuild_wrapper(type(t), parts, ctx, shape, stride)


@dataclass
class _Part:
    name: str
    dtype: torch.dtype
    shape: tuple
    offset: int
    nbytes: int


@dataclass
class _Entry:
    owner: torch.nn.Module
    name: str
    is_param: bool
    dtype: torch.dtype
    shape: tuple
    offset: int
    nbytes: int
    parts: Optional[list] = None     # a wrapper weight (quantized): its inner tensors' regions of the flat buffer
    wrapper: Optional[tuple] = None  # (class, flatten context, size, stride): what rebuilds it around them

    def regions(self) -> list:
        """(name, dtype, shape, offset, nbytes) of the bytes this entry holds in the flat buffer."""
        if self.parts is None:
            return [(None, self.dtype, self.shape, self.offset, self.nbytes)]
        return [(p.name, p.dtype, p.shape, p.offset, p.nbytes) for p in self.parts]


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
            if is_wrapper(t):  # a quantized weight: each inner tensor (bytes, scales) is a region of its own
                problem = wrapper_problem(t)
                if problem:
                    raise ValueError(f"shard_weights cannot split {type(owner).__name__}.{name}: {problem}; run it "
                                     f"with shard_weights none (ulysses/ring/cfg/dp degrees hold the whole model)")
                parts, ctx = wrapper_parts(t)
                start, regions = offset, []
                for n, p in parts.items():
                    nbytes = p.numel() * p.element_size()
                    regions.append(_Part(n, p.dtype, tuple(p.shape), offset, nbytes))
                    offset += math.ceil(nbytes / ALIGN) * ALIGN
                entries.append(_Entry(owner, name, is_param, t.dtype, tuple(t.size()), start, offset - start,
                                      parts=regions, wrapper=(type(t), ctx, tuple(t.size()), tuple(t.stride()))))
                continue
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
        self.quantized_bytes = 0        # bytes of the quantized weights' inner tensors (bytes and scales), all ranks
        self.quantized_shard_bytes = 0  # of those, the bytes this rank's shards hold
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
            parts = wrapper_parts(t)[0] if e.parts is not None else None
            for part, _, _, offset, nbytes in e.regions():
                a, b = max(lo, offset), min(hi, offset + nbytes)
                if a < b:
                    src = parts[part] if parts is not None else torch.Tensor.as_subclass(t, torch.Tensor)
                    raw = src.detach().contiguous().reshape(-1).view(torch.uint8)
                    shard[a - lo:b - lo] = raw[a - offset:b - offset]
                    if parts is not None:
                        self.quantized_shard_bytes += b - a
                if parts is not None and part is not None:
                    self.quantized_bytes += nbytes
            self._set(e, self._placeholder(e, t.device))  # the full tensor is dropped here
        module.register_buffer(SHARD_BUFFER, shard, persistent=False)
        return _Unit(name, module, entries, size)

    @staticmethod
    def _tensor(e: _Entry) -> torch.Tensor:
        return e.owner._parameters[e.name] if e.is_param else e.owner._buffers[e.name]

    @staticmethod
    def _set(e: _Entry, t: torch.Tensor) -> None:
        if e.parts is not None:  # a wrapper weight and its placeholder are different objects: the slot changes
            if e.is_param:
                e.owner._parameters[e.name] = as_parameter(t)
            else:
                e.owner._buffers[e.name] = t
        elif e.is_param:
            e.owner._parameters[e.name].data = t
        else:
            e.owner._buffers[e.name] = t

    @staticmethod
    def _placeholder(e: _Entry, device) -> torch.Tensor:
        """What the slot holds between uses: an empty tensor (of the stored dtype, for a quantized weight)."""
        return torch.empty(0, dtype=e.parts[0].dtype if e.parts else e.dtype, device=device)

    @staticmethod
    def _view(full: torch.Tensor, dtype, shape, offset: int, nbytes: int) -> torch.Tensor:
        return full[offset:offset + nbytes].view(dtype).view(shape)

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
            if e.parts is None:
                self._set(e, self._view(unit.full, e.dtype, e.shape, e.offset, e.nbytes))
                continue
            cls, ctx, size, stride = e.wrapper  # the quantized weight, rebuilt around views of the gathered bytes
            parts = {name: self._view(unit.full, dtype, shape, offset, nbytes)
                     for name, dtype, shape, offset, nbytes in e.regions()}
            self._set(e, rebuild_wrapper(cls, parts, ctx, size, stride))

    def _release(self, unit: _Unit) -> None:
        if unit.full is None:
            return
        self._wait(unit)  # never free a buffer a collective still writes
        for e in unit.entries:
            self._set(e, self._placeholder(e, unit.full.device))
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
                "peak_gathered_bytes": self.peak_gathered_bytes, "quantized_bytes": self.quantized_bytes,
                "quantized_shard_bytes": self.quantized_shard_bytes}


def apply_weight_sharding(model: torch.nn.Module, ctx) -> Optional[WeightSharding]:
    """Shard `model`'s weights over the axis `ctx.config.shard_weights` names ("sequence": the Ulysses x Ring
    ranks; "all": the whole world); returns the sharding (kept on the model as `_hp_sharding`), or None."""
    choice = getattr(ctx.config, "shard_weights", "none")
    if choice == "none":
        return None
    ax = ctx.sp if choice == "sequence" else world_axis(ctx)
    if ax.size <= 1:
        return None
    sharding = WeightSharding(model, ax)
    model._hp_sharding = sharding
    return sharding
