"""One mechanism that applies a family's parallel plan to a diffusers transformer.

A family adapter (parallel/models/<family>.py) only *declares* what is split:
which forward inputs carry the batch, where the image token sequence is split
(a module's input or output), where it is gathered again, and which modules
contain the self-attention that must become USP attention. This module does
the *how*, with forward hooks and a TorchFunctionMode that swaps the
`F.scaled_dot_product_attention` call inside those attention modules for
`usp_attention` - the diffusers processors themselves are untouched, so their
projections, norms and RoPE stay diffusers' own code.

After `parallelize(model, ctx)`, every rank calls the model with the *full*
inputs and gets the *full* output; splitting and gathering happen inside.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .comm import all_gather_uneven, split_sizes
from .usp import usp_attention


@dataclass(frozen=True)
class SplitInput:
    """Shard a forward argument along the image sequence (`dim`); `only_ndim` limits it to that rank."""
    name: str
    dim: int
    position: Optional[int] = None
    only_ndim: Optional[int] = None


@dataclass(frozen=True)
class SplitOutput:
    """Shard a module's output (or each element of a tuple output) along the image sequence."""
    dim: int


@dataclass(frozen=True)
class GatherOutput:
    """Gather a module's sequence-sharded output back to the full sequence."""
    dim: int


@dataclass(frozen=True)
class Attention:
    """Inside matching modules F.scaled_dot_product_attention is self-attention over the sharded sequence.

    `text_arg`: the module argument holding the replicated text stream of a
    joint (MMDiT) attention, whose length tells where text sits in q/k/v.
    """
    text_arg: Optional[str] = None
    text_first: bool = True


@dataclass(frozen=True)
class FamilyPlan:
    family: str
    model_class: str
    batch_inputs: tuple
    sequence: dict            # module path ("" = the model itself) -> list of SplitInput/SplitOutput/GatherOutput
    attention: dict           # module path pattern ('*' = one path segment) -> Attention
    tp: Optional[dict] = None  # diffusers `_tp_plan` format: pattern -> "colwise" | "rowwise" | packed
    tp_refusal: str = ""       # why tensor parallel is refused when `tp` is None
    heads_attr: str = "num_attention_heads"


@dataclass
class _RunState:
    """Per-forward facts shared by the hooks: the image sequence split of this call."""
    seq_len: Optional[int] = None
    seq_sizes: Optional[list] = None

    def sizes_for(self, n: int, sp_size: int, where: str) -> list:
        if self.seq_len is None:
            self.seq_len, self.seq_sizes = n, split_sizes(n, sp_size)
        elif n != self.seq_len:
            raise RuntimeError(f"sequence split at {where!r} sees {n} tokens but an earlier split saw "
                               f"{self.seq_len}: the family plan is inconsistent")
        return self.seq_sizes


@dataclass
class _Applied:
    plan: FamilyPlan
    ctx: object
    state: _RunState = field(default_factory=_RunState)
    handles: list = field(default_factory=list)
    forwards: list = field(default_factory=list)   # (module, had_instance_forward, old)
    # What replaces self-attention (usp_attention's signature); another method (DistriFusion) passes its own.
    attention_fn: Optional[object] = None
    cleanups: list = field(default_factory=list)   # called by remove_plan (e.g. drain in-flight comm)


def _arg(args, kwargs, name, position):
    if name in kwargs:
        return kwargs[name], ("kw", name)
    if position is not None and len(args) > position:
        return args[position], ("pos", position)
    return None, None


def _set_arg(args, kwargs, where, value):
    kind, key = where
    if kind == "kw":
        kwargs[key] = value
    else:
        args = list(args)
        args[key] = value
    return tuple(args), kwargs


def _shard(x: torch.Tensor, dim: int, applied: _Applied, where: str) -> torch.Tensor:
    sp = applied.ctx.sp
    dim = dim % x.ndim
    sizes = applied.state.sizes_for(x.shape[dim], sp.size, where)
    start = sum(sizes[: sp.rank])
    return x.narrow(dim, start, sizes[sp.rank])


def _split_input_hook(applied, path, specs):
    def hook(module, args, kwargs):
        for s in specs:
            value, where = _arg(args, kwargs, s.name, s.position)
            if not isinstance(value, torch.Tensor) or (s.only_ndim is not None and value.ndim != s.only_ndim):
                continue
            args, kwargs = _set_arg(args, kwargs, where, _shard(value, s.dim, applied, f"{path}:{s.name}"))
        return args, kwargs
    return hook


def _split_output_hook(applied, path, spec):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return tuple(_shard(o, spec.dim, applied, path) if isinstance(o, torch.Tensor) else o for o in output)
        return _shard(output, spec.dim, applied, path)
    return hook


def _gather_output_hook(applied, path, spec):
    def hook(module, args, output):
        sizes = applied.state.seq_sizes
        if sizes is None:
            raise RuntimeError(f"{path!r} gathers a sequence that was never split: the family plan is inconsistent")
        return all_gather_uneven(output.contiguous(), spec.dim % output.ndim, applied.ctx.sp, sizes=sizes)
    return hook


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _USPInterceptor(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to USP attention; everything else runs unchanged."""

    def __init__(self, applied: _Applied, text_len: int, text_first: bool):
        super().__init__()
        self.applied, self.text_len, self.text_first = applied, text_len, text_first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        rest = dict(zip(_SDPA_ARGS, args))
        rest.update(kwargs)
        q, k, v = rest.pop("query"), rest.pop("key"), rest.pop("value")
        if rest.get("attn_mask") is not None or rest.get("is_causal") or rest.get("dropout_p", 0.0) or \
                rest.get("enable_gqa"):
            raise NotImplementedError("sequence-parallel attention supports unmasked, non-causal self-attention "
                                      "without dropout/GQA; this model's self-attention uses one of those")
        state = self.applied.state
        if state.seq_sizes is None:
            raise RuntimeError("self-attention ran on a sequence that was never split: plan inconsistent")
        attend = self.applied.attention_fn or usp_attention
        return attend(q, k, v, ctx=self.applied.ctx, seq_sizes=state.seq_sizes, text_len=self.text_len,
                      text_first=self.text_first, scale=rest.get("scale"),
                      backend=getattr(self.applied.ctx, "attention_backend", "auto"))


def path_matches(path: str, pattern: str) -> bool:
    """fnmatch per dotted segment: '*' stands for exactly one segment (a block index), never for several."""
    p, q = path.split("."), pattern.split(".")
    return len(p) == len(q) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p, q))


def wrap_forward(module, forwards: list, make_wrapper) -> None:
    """Replace module.forward by make_wrapper(old forward); record how to undo it in `forwards`."""
    had = "forward" in module.__dict__
    old = module.forward
    module.forward = make_wrapper(old)
    forwards.append((module, had, old))


def restore_forwards(forwards: list) -> None:
    """Undo `wrap_forward`s, newest first."""
    for mod, had, old in reversed(forwards):
        if had:
            mod.forward = old
        else:
            del mod.forward
    forwards.clear()


def _attention_wrapper(applied, spec):
    def make(old):
        sig = inspect.signature(old)

        @functools.wraps(old)
        def forward(*args, **kwargs):
            text_len = 0
            if spec.text_arg is not None:
                bound = sig.bind_partial(*args, **kwargs).arguments
                text = bound.get(spec.text_arg)
                text_len = 0 if text is None else text.shape[1]
            with _USPInterceptor(applied, text_len, spec.text_first):
                return old(*args, **kwargs)
        return forward
    return make


def _gather_batch(out, ax, sizes):
    if isinstance(out, tuple):
        return (all_gather_uneven(out[0].contiguous(), 0, ax, sizes=sizes),) + tuple(out[1:])
    if hasattr(out, "sample"):
        out.sample = all_gather_uneven(out.sample.contiguous(), 0, ax, sizes=sizes)
        return out
    return all_gather_uneven(out.contiguous(), 0, ax, sizes=sizes)


def _root_wrapper(applied):
    plan, ctx = applied.plan, applied.ctx
    batch_ax = ctx.axis("batch")

    def make(old):
        sig = inspect.signature(old)

        @functools.wraps(old)
        def forward(*args, **kwargs):
            kwargs = dict(sig.bind(*args, **kwargs).arguments)
            kwargs.update(kwargs.pop("kwargs", {}) or {})
            applied.state = _RunState()
            hs = kwargs["hidden_states"]
            B = hs.shape[0]
            sizes = None
            # Fewer samples than batch ranks: every batch rank computes the whole batch (correct, redundant).
            if batch_ax.size > 1 and B >= batch_ax.size:
                sizes = split_sizes(B, batch_ax.size)
                start, n = sum(sizes[: batch_ax.rank]), sizes[batch_ax.rank]
                kwargs = {k: _slice_batch(v, B, start, n) if k in plan.batch_inputs else v
                          for k, v in kwargs.items()}
            if ctx.sp.size > 1:
                args_, kwargs = _split_input_hook(applied, "", plan.sequence.get("", []))(None, (), kwargs)
            out = old(**kwargs)
            if sizes is not None:
                out = _gather_batch(out, batch_ax, sizes)
            return out
        return forward
    return make


def _slice_batch(value, B, start, n):
    if isinstance(value, torch.Tensor):
        return value.narrow(0, start, n) if value.ndim > 0 and value.shape[0] == B else value
    if isinstance(value, dict):
        return {k: _slice_batch(v, B, start, n) for k, v in value.items()}
    return value


def apply_plan(model: torch.nn.Module, plan: FamilyPlan, ctx, attention_fn=None) -> torch.nn.Module:
    """Install the plan's hooks on `model` (in place). Undo with `remove_plan`.

    `attention_fn` replaces USP attention in the plan's attention modules (same signature as `usp_attention`).
    """
    if getattr(model, "_hp_applied", None) is not None:
        raise RuntimeError("model is already parallelized; call remove_plan(model) first")
    applied = _Applied(plan, ctx, attention_fn=attention_fn)
    modules = dict(model.named_modules())
    if ctx.sp.size > 1:
        for path, actions in plan.sequence.items():
            if path == "":
                continue  # applied by the root wrapper, after the batch split
            if path not in modules:
                raise KeyError(f"{plan.family} plan names module {path!r}, which {type(model).__name__} lacks")
            mod = modules[path]
            inputs = [a for a in actions if isinstance(a, SplitInput)]
            if inputs:
                applied.handles.append(mod.register_forward_pre_hook(
                    _split_input_hook(applied, path, inputs), with_kwargs=True))
            for a in actions:
                if isinstance(a, SplitOutput):
                    applied.handles.append(mod.register_forward_hook(_split_output_hook(applied, path, a)))
                elif isinstance(a, GatherOutput):
                    applied.handles.append(mod.register_forward_hook(_gather_output_hook(applied, path, a)))
        matched = 0
        for path, mod in modules.items():
            for pattern, spec in plan.attention.items():
                if path_matches(path, pattern):
                    wrap_forward(mod, applied.forwards, _attention_wrapper(applied, spec))
                    matched += 1
                    break
        if matched == 0:
            raise KeyError(f"{plan.family} plan's attention patterns {list(plan.attention)} match no module")
    wrap_forward(model, applied.forwards, _root_wrapper(applied))
    model._hp_applied = applied
    return model


def remove_plan(model: torch.nn.Module) -> torch.nn.Module:
    applied = getattr(model, "_hp_applied", None)
    if applied is None:
        return model
    for fn in applied.cleanups:
        fn()
    for h in applied.handles:
        h.remove()
    restore_forwards(applied.forwards)
    model._hp_applied = None
    return model


Sequence = Union[SplitInput, SplitOutput, GatherOutput]
