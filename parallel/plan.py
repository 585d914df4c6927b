"""One mechanism that applies a family's parallel plan to ComfyUI's diffusion model.

A family adapter (parallel/models/<family>.py) only *declares* what is split:
which forward inputs carry the batch, where the image token sequence is split
(a module's input or output, or a method's input), where it is gathered again, and which modules
contain the self-attention that must become USP attention. This module does
the *how*, with forward hooks and one attention swap with two entry points (parallel/attention_seam.py):
ComfyUI's `optimized_attention_override` seam, which the root wrapper sets in `transformer_options`
for the call, and a TorchFunctionMode swapping `F.scaled_dot_product_attention` for ComfyUI code that calls
torch's kernel directly (PixArt). Either way, inside a declared
attention module the attention is USP; anywhere else the model's own kernel runs unchanged.

The model's own code stays untouched either way: projections, norms and RoPE are its own.
Parallel code never imports ComfyUI: the plan names modules and arguments only.

After `parallelize(model, ctx)`, every rank calls the model with the *full*
inputs and gets the *full* output; splitting and gathering happen inside.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Union

import torch

from .attention_seam import attention_wrapper, comfy_attention_override
from .comm import all_gather_uneven, split_sizes
from .plan_inputs import (_INPUT_ACTIONS, PrefixLength, SequenceIndex, SequenceRanges, SequenceRows,  # noqa: F401
                          SequenceSegments, SplitGrid, SplitInput, _RunState, _shard,
                          _split_input_hook)


@dataclass(frozen=True)
class SplitOutput:
    """Shard a module's output (or each element of a tuple output) along the image sequence."""
    dim: int


@dataclass(frozen=True)
class GatherOutput:
    """Gather a module's sequence-sharded output back to the full sequence. `after_prefix`: the output is
    [replicated prefix, local shard] (a single-stream model's final layer over [caption, image]): the prefix
    is kept once in front of the gathered image sequence."""
    dim: int
    after_prefix: bool = False
    grid: bool = False  # gather a SplitGrid's rows (dim = the grid's row dim) instead of a flat sequence


@dataclass(frozen=True)
class Attention:
    """Inside matching modules attention is self-attention over the sharded sequence.

    The text length of a joint (MMDiT) attention is what q holds beyond the local image shard (0 for image-only
    self-attention): ComfyUI's joint blocks concatenate the text (whole, or this rank's shard where the plan splits
    it) with the local image tokens.

    `text_first`: the text precedes the image in q/k/v. It may be a function of the model instance instead, where
    the order differs between versions of the model's code (ComfyUI's HunyuanVideo): `resolve_plan` decides it
    from the model - by what its classes hold, never by a version number - before anything reads it.
    """
    text_first: Union[bool, Callable] = True
    seam: str = "sdpa"  # "sdpa": F.scaled_dot_product_attention inside the module; "comfy": ComfyUI's override
    # comfy seam only: the module's attention has its queries from a stream the plan leaves whole on every rank and
    # its keys / values from this rank's shard of the split sequence (LTX-2's video-to-audio attention: audio queries,
    # video keys): k and v are gathered along the sequence, then the model's own kernel runs on the whole keys
    gather_kv: bool = False
    # comfy seam only: the attention call may hold queries for only the last rows of its keys - the rows before them
    # being replicated prefix (text) whose queries the model computes apart (HiDream-O1's two-pass attention: the
    # causal AR prefix's own pass, then the generated tokens' queries over [AR prefix, generated] keys). The missing
    # query rows are filled with zeros for the joint attention and their output rows dropped: rows are independent
    query_tail: bool = False
    # how many self-attention calls one matching module makes in a forward (default one): what DistriFusion keeps
    # K/V buffers for, counted by the memory plan before any work (SD3.5's blocks add an image-only attn2)
    calls: Optional[Callable] = None


@dataclass(frozen=True)
class BlockList:
    """PipeFusion: a ModuleList of transformer blocks that the stages split. `streams`: the forward arguments
    that flow from block to block, the image stream first - each a name, or (name, position) for a block
    whose forward takes *args (ComfyUI's JointBlock); `returns`: the names of the returned tensors, in order."""
    path: str
    streams: tuple = ("hidden_states",)
    returns: tuple = ("hidden_states",)


@dataclass(frozen=True)
class PipelinePlan:
    """PipeFusion: the block lists in execution order, and the latent layout the model takes: "image" =
    (B, C, H, W) patchified by the model (its `patch_size` attribute), "video" = (B, C, T, H, W) patchified
    (1, ph, pw) into (frame, row, col)-ordered tokens (`patch_size` attribute)."""
    blocks: tuple
    latent: str


# ComfyUI arguments no sequence split has to know: the call's options, the pooled vector (one row per sample), and
# the ControlNet's own text (ComfyUI hands it to every model call; only the ControlNet on the driver reads it)
_PER_SAMPLE_INPUTS = ("transformer_options", "y", "crossattn_controlnet")


@dataclass(frozen=True)
class FamilyPlan:
    family: str
    model_class: str
    batch_inputs: tuple
    sequence: dict            # module path ("" = the model itself) -> list of SplitInput/SplitOutput/GatherOutput
    attention: dict           # module path pattern ('*' = one path segment) -> Attention
    tp: Optional[dict] = None  # module path pattern -> parallel/tp.py's style (Colwise, Rowwise, ShardedNorm, Divide)
    tp_refusal: str = ""       # why tensor parallel is refused when `tp` is None
    heads_attr: str = "num_attention_heads"
    comfy: bool = False        # a ComfyUI module: forward(x, timestep, context, ..., transformer_options)
    pipeline: Optional[PipelinePlan] = None  # PipeFusion's stages (None: refused with pipeline_refusal)
    pipeline_refusal: str = ""
    # why DistriFusion (stale K/V) is refused for the family, before any worker starts; "" = it runs
    distrifusion_refusal: str = ""
    # ComfyUI inputs (beyond batch_inputs and sequence_refusals) the sequence-parallel plan was checked with; any
    # other tensor input under ulysses/ring is refused at the call (`checked_inputs`)
    other_inputs: tuple = ()
    # forward inputs the sequence split cannot carry (name -> why, and what to do instead): a call that passes
    # one (not None) under ulysses/ring is refused with that text rather than computed wrong; the reason may be a
    # function of the input's value returning the text, or None where the split carries that value
    sequence_refusals: dict = field(default_factory=dict)
    # likewise for PipeFusion's patches (checked by the nodes on the conditioning they capture, before the loop)
    pipeline_refusals: dict = field(default_factory=dict)

    def checked_inputs(self) -> set:
        """The forward inputs a sequence-parallel run of this plan accepts: the batch inputs, the ones it splits
        along the sequence, the ones it refuses with a reason, and `other_inputs`."""
        split = {a.name for actions in self.sequence.values() for a in actions if getattr(a, "name", None)}
        return {*_PER_SAMPLE_INPUTS, *self.batch_inputs, *self.other_inputs, *self.sequence_refusals, *split}

    @property
    def splits_text(self) -> bool:
        """The plan splits the joint text stream over the sequence ranks (a SplitInput with text=True)."""
        return any(getattr(a, "text", False) for actions in self.sequence.values() for a in actions)


def resolve_plan(plan: FamilyPlan, model: torch.nn.Module) -> FamilyPlan:
    """`plan` as it applies to `model`: every declaration given as a function of the model (an Attention's
    `text_first`) decided for this instance; the plan itself where it has none. `plan_for` and `apply_plan` call it,
    so whoever reads a plan for a model reads booleans."""
    if not any(callable(a.text_first) for a in plan.attention.values()):
        return plan
    return replace(plan, attention={p: replace(a, text_first=bool(a.text_first(model))) if callable(a.text_first)
                                    else a for p, a in plan.attention.items()})


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
    override: Optional[object] = None              # ComfyUI's optimized_attention_override for this plan
    # ComfyUI's kernel the driver runs (sage, flash, sub-quad...), for the Ulysses ranks' local attention through
    # ComfyUI's seam; None: the kernel the seam hands over (attention_seam.comfy_attention_override)
    kernel: Optional[object] = None

    @property
    def split_text(self) -> bool:
        """USP splits a declared text stream; another attention method (DistriFusion's stale K/V) reads the
        text whole, as its buffers are laid out."""
        return self.attention_fn is None


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
        dim = spec.dim % output.ndim
        if spec.grid:
            return all_gather_uneven(output.contiguous(), dim, applied.ctx.sp, sizes=applied.state.grid[3])
        if spec.after_prefix:
            prefix = output.shape[dim] - sizes[applied.ctx.sp.rank]
            applied.state.prefix_len = prefix
            return torch.cat([output.narrow(dim, 0, prefix), all_gather_uneven(
                output.narrow(dim, prefix, output.shape[dim] - prefix).contiguous(), dim, applied.ctx.sp,
                sizes=sizes)], dim=dim)
        return all_gather_uneven(output.contiguous(), dim, applied.ctx.sp, sizes=sizes)
    return hook


def path_matches(path: str, pattern: str) -> bool:
    """fnmatch per dotted segment: '*' stands for exactly one segment (a block index), never for several."""
    p, q = path.split("."), pattern.split(".")
    return len(p) == len(q) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(p, q))


def last_index(pattern: str, modules: dict) -> str:
    """A plan path with a "-1" segment (the last block of a ModuleList: Kandinsky 5 gathers its tokens there,
    before the model reshapes them to the patch grid for its output layer) as the path of that block."""
    parts = pattern.split(".")
    for i, seg in enumerate(parts):
        if seg == "-1":
            blocks = modules.get(".".join(parts[:i]))
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks):
                parts[i] = str(len(blocks) - 1)
    return ".".join(parts)


def wrap_forward(module, forwards: list, make_wrapper, name: str = "forward") -> None:
    """Replace module.<name> (its forward by default) by make_wrapper(old); record how to undo it."""
    had = name in module.__dict__
    old = getattr(module, name)
    setattr(module, name, make_wrapper(old))
    forwards.append((module, had, old, name))


def restore_forwards(forwards: list) -> None:
    """Undo `wrap_forward`s, newest first."""
    for entry in reversed(forwards):
        mod, had, old = entry[:3]
        name = entry[3] if len(entry) > 3 else "forward"
        if had:
            setattr(mod, name, old)
        else:
            delattr(mod, name)
    forwards.clear()


def _method_split_wrapper(applied, path, specs):
    """A method (not a module) whose inputs are split: wrap it and apply the input hook to its call."""
    hook = _split_input_hook(applied, path, specs)

    def make(old):
        @functools.wraps(old)
        def method(*args, **kwargs):
            args, kwargs = hook(None, args, kwargs)
            return old(*args, **kwargs)
        return method
    return make


def _gather_batch(out, ax, sizes):
    if isinstance(out, list):  # a multi-stream model's output, one tensor per stream (LTX-2: video, audio)
        return [all_gather_uneven(o.contiguous(), 0, ax, sizes=sizes) for o in out]
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
            batched = plan.batch_inputs
            if batched == ("*",):  # a model no adapter names (parallel/models/any_model.py): every tensor argument
                batched = tuple(k for k in kwargs if k != "transformer_options")
            first = kwargs[batched[0]]  # a multi-stream model's latent is a list (MiniMax H3: video, audio)
            B = (first[0] if isinstance(first, (list, tuple)) else first).shape[0]
            if plan.comfy:
                # ComfyUI batches every conditioning along dim 0 (comfy/conds.py: CONDRegular / CONDList concat), so
                # an argument a newer ComfyUI added (Wan's context_latents, Lumina's siglip_feats...) is split with
                # the batch like the declared ones - never handed whole to a rank holding part of the batch
                batched = batched + tuple(k for k in kwargs if k not in batched and k != "transformer_options")
            if plan.comfy and ctx.sp.size > 1:  # ComfyUI's attention seam, for this call only
                options = dict(kwargs.get("transformer_options") or {})
                options["optimized_attention_override"] = applied.override
                kwargs["transformer_options"] = options
            sizes = None
            # Fewer samples than batch ranks: every batch rank computes the whole batch (correct, redundant).
            if batch_ax.size > 1 and B >= batch_ax.size:
                sizes = split_sizes(B, batch_ax.size)
                start, n = sum(sizes[: batch_ax.rank]), sizes[batch_ax.rank]
                kwargs = {k: _slice_batch(v, B, start, n) if k in batched else v
                          for k, v in kwargs.items()}
            if ctx.sp.size > 1:  # (an empty list is no input: ComfyUI's default for list arguments)
                reasons = [_refusal(plan.sequence_refusals[n], kwargs[n]) for n in sorted(plan.sequence_refusals)
                           if _given(kwargs.get(n))]
                if any(reasons):
                    raise ValueError(f"{plan.model_class} under ulysses/ring: " + "; ".join(r for r in reasons if r))
                unchecked = sorted(k for k, v in kwargs.items() if plan.comfy and k not in plan.checked_inputs()
                                   and isinstance(v, (torch.Tensor, list, tuple, dict)) and _given(v))
                if unchecked:  # a new input may add tokens or index the whole sequence: never split it blindly
                    raise ValueError(f"{plan.model_class} under ulysses/ring was given {', '.join(unchecked)}, "
                                     f"an input its sequence-parallel plan was not checked with (a newer ComfyUI's "
                                     f"conditioning); use cfg/dp degrees (ulysses/ring degree 1) for it")
                args_, kwargs = _split_input_hook(applied, "", plan.sequence.get("", []))(None, (), kwargs)
                if plan.comfy and isinstance(kwargs.get("control"), dict):  # ControlNet residuals: per rank
                    kwargs["control"] = {k: _ShardedResiduals(v, applied) if isinstance(v, (list, tuple)) else v
                                         for k, v in kwargs["control"].items()}
            out = old(**kwargs)
            if sizes is not None:
                out = _gather_batch(out, batch_ax, sizes)
            return out
        return forward
    return make


class _ShardedResiduals(list):
    """ControlNet residuals ComfyUI computed for the full image sequence, handed out per rank: entry i, read
    when the model adds it to its tokens (after the split), is this rank's part of it. Models add a residual
    to the *first* tokens of the image stream (`img[:, :len(add)] += add`, `x += add`), which on a rank are
    the ones from its shard's start: so the part is add[start : min(end, len(add))]."""

    def __init__(self, items, applied):
        super().__init__(items)
        self._applied = applied

    def __getitem__(self, i):
        add = super().__getitem__(i)
        state = self._applied.state
        if not isinstance(add, torch.Tensor) or state.seq_sizes is None:
            return add
        rank = self._applied.ctx.sp.rank
        start = sum(state.seq_sizes[:rank])
        end = min(start + state.seq_sizes[rank], add.shape[1])
        return add.narrow(1, min(start, add.shape[1]), max(0, end - start))


def _refusal(reason, value) -> Optional[str]:
    """A sequence_refusals entry for a given input: its text, or - where it is a function of the value (an input the
    split carries in some forms only: LTXV's guide entries that build no attention mask) - what it returns."""
    return reason(value) if callable(reason) else reason


def _given(value) -> bool:
    """Whether a model argument carries something: not None, not an empty list / dict (ComfyUI's defaults)."""
    return value is not None and not (isinstance(value, (list, tuple, dict)) and len(value) == 0)


def _slice_batch(value, B, start, n):
    if isinstance(value, torch.Tensor):
        return value.narrow(0, start, n) if value.ndim > 0 and value.shape[0] == B else value
    if isinstance(value, dict):
        return {k: _slice_batch(v, B, start, n) for k, v in value.items()}
    if isinstance(value, (list, tuple)):  # e.g. reference latents: one batched tensor per reference
        return type(value)(_slice_batch(v, B, start, n) for v in value)
    return value


def apply_plan(model: torch.nn.Module, plan: FamilyPlan, ctx, attention_fn=None, kernel=None) -> torch.nn.Module:
    """Install the plan's hooks on `model` (in place). Undo with `remove_plan`.

    `attention_fn` replaces USP attention in the plan's attention modules (same signature as `usp_attention`).
    `kernel`: ComfyUI's attention function (unwrapped, ComfyUI's signature) that Ulysses' local attention calls
    through ComfyUI's seam, so the ranks run the kernel the user picked in ComfyUI; None: the one the seam hands over.
    """
    if getattr(model, "_hp_applied", None) is not None:
        raise RuntimeError("model is already parallelized; call remove_plan(model) first")
    plan = resolve_plan(plan, model)
    applied = _Applied(plan, ctx, attention_fn=attention_fn, kernel=kernel)
    applied.override = comfy_attention_override(applied)
    modules = dict(model.named_modules())
    if ctx.sp.size > 1:
        for key, actions in plan.sequence.items():
            if key == "":
                continue  # applied by the root wrapper, after the batch split
            path, _, method = key.partition(":")
            if method:  # "path:method": a method whose inputs are split (ComfyUI's forward_orig)
                if path not in modules or not callable(getattr(modules[path], method, None)):
                    raise KeyError(f"{plan.family} plan names method {key!r}, which {type(model).__name__} lacks")
                inputs = [a for a in actions if isinstance(a, _INPUT_ACTIONS)]
                wrap_forward(modules[path], applied.forwards, _method_split_wrapper(applied, key, inputs), name=method)
                continue
            path = last_index(path, modules)
            targets = [(p, m) for p, m in modules.items() if p and path_matches(p, path)]
            if not targets:
                raise KeyError(f"{plan.family} plan names module {path!r}, which {type(model).__name__} lacks")
            for p, mod in targets:
                inputs = [a for a in actions if isinstance(a, _INPUT_ACTIONS)]
                if inputs:
                    applied.handles.append(mod.register_forward_pre_hook(
                        _split_input_hook(applied, p, inputs), with_kwargs=True))
                for a in actions:
                    if isinstance(a, SplitOutput):
                        applied.handles.append(mod.register_forward_hook(_split_output_hook(applied, p, a)))
                    elif isinstance(a, GatherOutput):
                        applied.handles.append(mod.register_forward_hook(_gather_output_hook(applied, p, a)))
        matched = 0
        for path, mod in modules.items():
            for pattern, spec in plan.attention.items():
                if path_matches(path, pattern):
                    wrap_forward(mod, applied.forwards, attention_wrapper(applied, spec))
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


Sequence = Union[SplitInput, SplitOutput, GatherOutput, PrefixLength, SequenceIndex, SequenceSegments, SequenceRows,
                 SplitGrid, SequenceRanges]
