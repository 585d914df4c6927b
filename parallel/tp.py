"""Tensor parallel: Megatron-style column/row sharding of Linear layers, on plain local tensors.

A family declares a layout (module-name pattern -> style): Q/K/V and MLP-up projections are column
sharded (each rank computes its heads / hidden slice, no communication), the attention output and
MLP-down projections are row sharded (one all-reduce per sub-block: seed 003's placement).

Why plain local tensors and not DTensor: ComfyUI's ops (manual cast, fp8 `weight_dtype`, scaled fp8)
cast the weight a module holds at every call. A plain shard of that weight runs through exactly the
same code and stays in its storage dtype (fp8 Flux over 2 GPUs holds half its fp8 bytes per GPU),
where DTensor would need every cast in ComfyUI's ops to understand sharding. The mechanism:

* `Colwise`: a rank keeps its slice of the output features (and of the bias). A packed layer (fused
  qkv, Flux's qkv+MLP `linear1`) has its blocks split separately, so every rank holds the same heads
  of q, k and v and its slice of the MLP.
* `Rowwise`: a rank keeps its slice of the input features (blocks split separately when the input
  concatenates column-sharded pieces, e.g. [attention, MLP]); its forward sums the local products
  with one all-reduce, in fp32 (a half-precision product is taken with its fp32 accumulator, `_Fp32Partials`);
  the bias stays on tp rank 0 only, so it is added once.
* `ShardedNorm`: an RMSNorm over column-sharded features (Wan normalises q and k over all heads
  together): its weight is sharded like the features and its mean of squares is summed over the tp
  group (one small all-reduce of (B, L, 1)) - Megatron's treatment of a norm across a sharded width.
* `Divide`: attributes that size a per-rank view (ComfyUI's `num_heads`, Flux's `hidden_size` used to
  split `linear1`'s output) are divided by the degree. A module that reads the width from its input instead
  (ComfyUI's PixArt attention: `B, N, C = x.shape`) is shown its input with the local width (`input_width`: an
  alias whose `shape` reports C / n; its ops return plain tensors).

Quantized weights (ComfyUI's mixed-precision ops: a comfy-kitchen QuantizedTensor per weight) are split where the
layout is tensorwise - one stored value per weight in the weight's own shape and a single scale (fp8 e4m3 / e5m2,
int8 tensorwise, every old scaled-fp8 checkpoint): the stored values are sliced like a plain weight and the scale is
kept on every rank, so a shard is the same layout of the same bytes, computed by the same ops. A block-scaled or
packed layout (nvfp4, mxfp8: scales per block, padded and swizzled) is refused with its name before any weight is
touched; ulysses/ring/cfg/dp degrees and shard_weights run it with whole weights.

Composes with USP: attention sees this rank's heads only, and Ulysses splits those further - rank
order puts tp innermost, so its all-reduces stay on the closest devices. Layouts are validated in
full before any weight is touched (`tp_problems`), which is also how the nodes refuse a degree
before any worker starts.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .plan import path_matches
from .shard import as_parameter, is_wrapper, layout_name, slice_wrapper, tensorwise_problem, wrapper_parts

Blocks = Union[None, int, tuple, Callable]  # one block; k equal blocks; sizes; f(linear, parent) -> sizes


@dataclass(frozen=True)
class Colwise:
    blocks: Blocks = None


@dataclass(frozen=True)
class Rowwise:
    blocks: Blocks = None


@dataclass(frozen=True)
class ShardedNorm:
    pass


@dataclass(frozen=True)
class Divide:
    attrs: tuple
    input_width: bool = False  # the module reads the model width from its input (B, N, C = x.shape): show it C / n


class _LocalWidth(torch.Tensor):
    """The input of a module that takes the model width from `x.shape` (ComfyUI's PixArt attention), as that module
    must see it under tensor parallel: the same tensor (an alias, no copy) whose `shape` reports this rank's share
    of the last dimension. Every op on it runs on the plain tensor and returns a plain tensor, so the local width
    goes no further than the module's own shape arithmetic."""

    @property
    def shape(self):
        with torch._C.DisableTorchFunctionSubclass():
            size = torch.Tensor.size(self)
        return torch.Size((*size[:-1], size[-1] // self._hp_tp))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _local_width(forward, n: int):
    @functools.wraps(forward)
    def wrapped(x, *args, **kwargs):
        view = x.as_subclass(_LocalWidth)
        view._hp_tp = n
        return forward(view, *args, **kwargs)
    return wrapped


def _style(value):
    """A plan's declared style, checked (a family module's typo fails here, naming it)."""
    if isinstance(value, (Colwise, Rowwise, Divide, ShardedNorm)):
        return value
    raise ValueError(f"unsupported tensor-parallel style {value!r}")


def _block_sizes(style, linear, parent, width: int) -> list:
    b = style.blocks
    if callable(b):
        b = b(linear, parent)
    if b is None:
        return [width]
    if isinstance(b, int):
        if width % b:
            raise ValueError(f"{width} features do not pack into {b} equal blocks")
        return [width // b] * b
    return [int(s) for s in b]


def _linear(mod) -> bool:
    """torch's Linear, or a layer computing as one with its own class: ComfyUI's mixed-precision ops' Linear (a
    Module holding in_features, out_features and an (out, in) weight - quantized or plain)."""
    if isinstance(mod, torch.nn.Linear):
        return True
    w = getattr(mod, "weight", None)
    i, o = getattr(mod, "in_features", None), getattr(mod, "out_features", None)
    return (isinstance(w, torch.Tensor) and isinstance(i, int) and isinstance(o, int)
            and tuple(w.shape) == (o, i))


def _heads(model, attr: str) -> Optional[int]:
    return int(getattr(model, attr, 0) or 0) or None


@dataclass
class _Shard:
    path: str
    module: torch.nn.Module
    style: object
    sizes: list  # block sizes along the sharded dimension (out features: Colwise, in features: Rowwise)


def _resolve(model: torch.nn.Module, plan, n: int) -> tuple:
    """([_Shard], [(module, attr)], problems): what the layout shards, and why it cannot (empty if it can)."""
    layout = plan.tp
    if layout is None:
        return [], [], [f"tensor parallel is not supported for {plan.model_class}: {plan.tp_refusal}"]
    problems, shards, divides = [], [], []
    heads = _heads(model, plan.heads_attr)
    if heads and heads % n:
        ok = [d for d in range(1, heads + 1) if heads % d == 0]
        problems.append(f"tp_degree={n} does not divide the model's {heads} attention heads; "
                        f"use a tp_degree in {ok}")
    modules = dict(model.named_modules())
    refused_layouts = set()
    for pattern, value in layout.items():
        style = _style(value)
        for path, mod in modules.items():
            if not path_matches(path, pattern):
                continue
            if isinstance(style, Divide):
                for a in style.attrs:
                    v = getattr(mod, a, None)
                    if isinstance(v, int):
                        if v % n:
                            problems.append(f"{path}.{a} = {v} is not divisible by tp_degree={n}")
                        divides.append((mod, a))
                if style.input_width:
                    norms = [f"{path}.{k}" for k, c in mod.named_children()
                             if isinstance(c, (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.GroupNorm))]
                    if norms:  # a norm over the full width inside (PixArt's qk_norm): not sharded here
                        problems.append(f"{norms[0]} normalises the full width of a sharded attention; tensor "
                                        f"parallel does not run it")
                    divides.append((mod, _LocalWidth))
                continue
            if isinstance(style, ShardedNorm):
                w = getattr(mod, "weight", None)
                width = w.shape[-1] if w is not None else None
                if not hasattr(mod, "eps") or (w is not None and w.ndim != 1):
                    problems.append(f"tp plan entry {pattern!r} matched {path!r}, a {type(mod).__name__} (not an "
                                    f"RMSNorm with a 1-D weight)")
                elif width is not None and width % n:
                    problems.append(f"{path} normalises {width} features, not divisible by tp_degree={n}")
                else:
                    shards.append(_Shard(path, mod, style, [width] if width else []))
                continue
            if not _linear(mod):
                problems.append(f"tp plan entry {pattern!r} matched {path!r}, a {type(mod).__name__}")
                continue
            if is_wrapper(mod.weight):  # a quantized weight: split only where a slice of its bytes is a slice of it
                why = tensorwise_problem(mod.weight)
                if why:
                    layout = layout_name(mod.weight)
                    if layout not in refused_layouts:  # once per layout: the first layer says what it stores
                        refused_layouts.add(layout)
                        problems.append(f"tensor parallel does not split {layout} weights ({path}: {why}), a shard "
                                        f"would have to be re-quantized; use ulysses/ring/cfg/dp degrees or "
                                        f"shard_weights, which compute with whole weights")
                    continue
            parent = modules[path.rpartition(".")[0]]
            width = mod.out_features if isinstance(style, Colwise) else mod.in_features
            try:
                sizes = _block_sizes(style, mod, parent, width)
            except (AttributeError, ValueError) as e:
                problems.append(f"{path}: {e}")
                continue
            if sum(sizes) != width or any(s % n for s in sizes):
                what = "outputs" if isinstance(style, Colwise) else "inputs"
                problems.append(f"{path} has {width} {what} in blocks {sizes}, not divisible by tp_degree={n}")
            extra = [k for k, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False))
                     if k not in ("weight", "bias") and t is not None and t.numel() > 1]
            if extra:
                problems.append(f"{path} carries per-channel tensors {extra} (a quantised format) that tensor "
                                f"parallel does not shard; load the model with weight_dtype 'default' or fp8")
            shards.append(_Shard(path, mod, style, sizes))
    if not shards and not problems:
        problems.append(f"the {plan.family} tp plan matched no Linear module of {type(model).__name__}")
    return shards, divides, problems


def tp_problems(model: torch.nn.Module, plan, n: int) -> list:
    """Why `model` cannot be sharded `n` ways (empty if it can). Reads only: safe on the driver's model."""
    return _resolve(model, plan, n)[2]


def check_tp(model: torch.nn.Module, plan, tp_size: int) -> None:
    """Refuse, before sharding anything, a degree the model cannot be split by."""
    problems = tp_problems(model, plan, tp_size)
    if problems:
        raise ValueError("; ".join(problems[:3]))


def _pieces(t: torch.Tensor, dim: int, sizes: list, n: int, r: int) -> torch.Tensor:
    """This rank's slice of every block of `t` along `dim`: one copy for several blocks; for one block a view of
    host memory (CPU ranks map one shared copy of the weights, so a view costs nothing) but a copy on a device,
    where a view would keep the whole weight alive on the GPU (a cluster rank receives its weights there)."""
    parts = [blk.narrow(dim, r * (s // n), s // n) for blk, s in zip(t.split(sizes, dim=dim), sizes)]
    if len(parts) > 1:
        return torch.cat(parts, dim=dim)
    return parts[0] if t.device.type == "cpu" else parts[0].clone()


def apply_tp(model: torch.nn.Module, plan, ax) -> torch.nn.Module:
    """Shard `model` in place over the ranks of axis `ax` (the tp axis)."""
    n, r = ax.size, ax.rank
    shards, divides, problems = _resolve(model, plan, n)
    if problems:
        raise ValueError("; ".join(problems[:3]))
    for s in shards:
        if isinstance(s.style, ShardedNorm):
            _shard_norm(s.module, ax)
            continue
        m, colwise = s.module, isinstance(s.style, Colwise)
        dim = 0 if colwise else 1
        if is_wrapper(m.weight):  # tensorwise quantized (checked): its stored values sliced, its scale kept
            w = slice_wrapper(m.weight, dim, lambda v: _pieces(v, dim, s.sizes, n, r))
            m.weight = as_parameter(w)
            if hasattr(m, "_orig_shape"):  # (ComfyUI's mixed-precision Linear: the shape it loads a weight as)
                m._orig_shape = tuple(w.shape)
        else:
            w = _pieces(m.weight.data, dim, s.sizes, n, r)
            m.weight = torch.nn.Parameter(w, requires_grad=False)
        if colwise:
            m.out_features = w.shape[0]
            if m.bias is not None:
                m.bias = torch.nn.Parameter(_pieces(m.bias.data, 0, s.sizes, n, r), requires_grad=False)
        else:
            m.in_features = w.shape[1]
            if m.bias is not None and r != 0:
                m.bias = None  # added once, by tp rank 0, before the sum
            m.forward = _row_reduced(m.forward, ax)
    for mod, a in divides:
        if a is _LocalWidth:
            mod.forward = _local_width(mod.forward, n)
        else:
            setattr(mod, a, getattr(mod, a) // n)
    model._hp_tp_size = n
    return model


def _shard_norm(mod, ax) -> None:
    """RMS over the full width from this rank's slice: x * rsqrt(sum_tp(x^2) / width + eps) * w."""
    n, r = ax.size, ax.rank
    if mod.weight is not None:
        mod.weight = torch.nn.Parameter(_pieces(mod.weight.data, 0, [mod.weight.shape[0]], n, r), requires_grad=False)
    eps = mod.eps if mod.eps is not None else torch.finfo(torch.float32).eps

    def forward(x):
        xf = x.float()
        ss = xf.pow(2).sum(-1, keepdim=True)
        dist.all_reduce(ss, group=ax.group)
        ax.stats.record("tp_all_reduce", ss.numel() * ss.element_size() * 2 * (n - 1) // n)
        y = xf * torch.rsqrt(ss / (x.shape[-1] * n) + eps)
        if mod.weight is None:
            return y.to(x.dtype)
        w = mod.weight.to(device=x.device, dtype=x.dtype)
        if x.dtype in _HALF and _rms_norm_weights_before_rounding(x.device.type, x.dtype):
            return (y * w.float()).to(x.dtype)
        return y.to(x.dtype) * w
    mod.forward = forward


@functools.cache
def _rms_norm_weights_before_rounding(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's F.rms_norm (what ComfyUI's RMSNorm calls) multiplies a half-precision input by the weight
    in fp32 and rounds once (torch 2.13 on CPU), rather than rounding the normalised input first; asked once per
    device type and dtype, so that a sharded norm rounds as one device's norm does (the other way put TP on ComfyUI's
    Wan in bf16 5e-3 from one device)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g).to(device_type, dtype)
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(device_type, dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.equal(F.rms_norm(x, (64,), weight=w, eps=1e-6), (y * w.float()).to(dtype))


_HALF = (torch.float16, torch.bfloat16)


@functools.cache
def _mm_out_dtype_works(device_type: str) -> bool:
    """Whether this torch has a half-precision GEMM with an fp32 result on `device_type` (`mm(out_dtype=)`, CUDA
    builds of torch >= 2.8); asked once per device type."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def _linear_fp32(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ w.T (+ b) in fp16/bf16 with the fp32 accumulator kept (not rounded to x's dtype)."""
    if _mm_out_dtype_works(x.device.type):
        y = torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32).view(*x.shape[:-1], w.shape[0])
        return y if b is None else y.add_(b)
    return F.linear(x.float(), w.float(), None if b is None else b.float())


class _Fp32Partials(TorchFunctionMode):
    """Inside a row-sharded Linear: a half-precision product comes out in fp32. The rank's partial sum stays
    unrounded until the all-reduce has added every rank's, and the total is rounded once - as one device's GEMM
    rounds its fp32 accumulator once. Rounding each partial and summing in bf16 (what NCCL does with bf16
    tensors) put TP ~1e-3 away from one device's output. `dtype` records the dtype the output would have had.
    ComfyUI's cast ops run unchanged around it (they end in F.linear); fp8's scaled matmul is left alone, and so is a
    product of quantized tensors (ComfyUI's mixed-precision ops: the layout's own kernel)."""

    def __init__(self):
        super().__init__()
        self.dtype = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            if x.dtype in _HALF and w.dtype == x.dtype and not is_wrapper(x) and not is_wrapper(w):
                self.dtype = x.dtype
                return _linear_fp32(x, w, b)
        return func(*args, **kwargs)


def _row_reduced(forward, ax):
    """A row-sharded Linear's forward: the local product (fp32 for half-precision compute), summed over the tp
    ranks in fp32 (never in bf16 / fp16), returned in the dtype the module would have returned."""
    n = ax.size

    @functools.wraps(forward)
    def reduced(*args, **kwargs):
        mode = _Fp32Partials()
        with mode:
            out = forward(*args, **kwargs)
        dtype = mode.dtype or out.dtype
        total = out if out.dtype == torch.float32 else out.float()
        dist.all_reduce(total, group=ax.group)
        ax.stats.record("tp_all_reduce", total.numel() * total.element_size() * 2 * (n - 1) // n)
        return total if total.dtype == dtype else total.to(dtype)
    return reduced


def local_param_bytes(model: torch.nn.Module) -> int:
    """Bytes of parameters this rank actually holds (its shards; freed meta weights of other PipeFusion
    stages do not count)."""

    def held(p):  # a quantized weight holds its inner tensors' bytes, not its logical shape in its logical dtype
        return sum(held(x) for x in wrapper_parts(p)[0].values()) if is_wrapper(p) else p.numel() * p.element_size()
    return sum(held(p) for p in model.parameters() if not p.is_meta)
