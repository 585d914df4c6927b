"""One mechanism that applies a family's parallel plan to a transformer (ComfyUI's own or diffusers').

A family adapter (parallel/models/<family>.py) only *declares* what is split:
which forward inputs carry the batch, where the image token sequence is split
(a module's input or output, or a method's input), where it is gathered again, and which modules
contain the self-attention that must become USP attention. This module does
the *how*, with forward hooks and one attention swap with two entry points (parallel/attention_seam.py):
ComfyUI's `optimized_attention_override` seam, which the root wrapper sets in `transformer_options`
for the call, and a TorchFunctionMode swapping `F.scaled_dot_product_attention` for diffusers
processors and ComfyUI code that calls torch's kernel directly (PixArt). Either way, inside a declared
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
from .comm import all_gather_uneven, split_sizes, weighted_sizes


@dataclass(frozen=True)
class SplitInput:
    """Shard a forward argument along the image sequence (`dim`); `only_ndim` limits it to that rank.

    `only_full`: shard only when the argument spans the whole sequence already seen (a per-token
    modulation is split, a broadcast one of length 1 is left alone).
    `prefix_from`: see the field; the split keeps that prefix whole in front of this rank's shard.
    `per_group`: with only_full, an argument with one entry per equal group of tokens (Wan 2.2's per-frame
    modulation: n entries for n frames, expanded by the model with repeat_interleave against the *full*
    sequence) becomes the per-token entries of this rank's shard - the model then sees one per local token.
    """
    name: str
    dim: int
    position: Optional[int] = None
    only_ndim: Optional[int] = None
    only_full: bool = False
    per_group: bool = False
    # the argument holds [replicated prefix, image sequence] along `dim`, the prefix as long as argument
    # `prefix_from` along its dim 1 (Qwen-Image's RoPE table over [text, image]): only the image part is split
    prefix_from: Optional[str] = None
    # the same layout, the prefix being whatever the argument holds beyond the image sequence already split
    # (Lumina 2's RoPE table over [caption, image], handed to single-stream blocks with no text argument)
    after_prefix: bool = False
    # the argument is the text stream of a joint (MMDiT) attention, `dim` its token dimension (or its RoPE ids):
    # under USP it is split over the sp ranks like the image, so each rank projects only its share of the text
    # (see `_RunState.text_sizes_for` for when it stays whole)
    text: bool = False
    # the argument is a tuple / list and the sequence is in its element `item` (ComfyUI 0.33's LTXV RoPE table,
    # `(rotation matrix, split_mode)`); the other elements pass unchanged. An argument that is no tuple / list is
    # left to the SplitInputs without `item` (one declaration each for a model code that hands a bare tensor)
    item: Optional[int] = None


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
class SplitGrid:
    """A forward argument holding the split sequence as a grid of tokens, not a flat run: ComfyUI 0.33's Cosmos
    Predict2 / Anima blocks take their tokens as (B, T, H, W, D), flattening (t h w) only around attention and
    modulating per frame (B, T, 1, 1, D). The grid is split along its rows (`dim` = H, T before it and W after it):
    this rank holds rows [h0, h1) of every frame, T * (h1 - h0) * W tokens - one run of the flattened sequence
    where T = 1, one run per frame otherwise, which attention without a mask does not mind (it is equivariant to the
    order of the tokens) as long as every per-token table is cut to the same tokens. `flat`: the argument is such a
    table, the sequence flattened (t h w) along `dim` (the RoPE rows), cut to this rank's rows of every frame. The
    first grid seen sets the split; an argument of another size is left alone. GatherOutput(grid=True) gathers."""
    name: str
    dim: int
    position: Optional[int] = None
    flat: bool = False


@dataclass(frozen=True)
class PrefixLength:
    """A forward argument holding where the image sequence starts in a [prefix, sequence] stream, as an int or one
    int per sample (a list): it is set to the length of the prefix that a GatherOutput(after_prefix=True) kept in
    front of the gathered sequence - before that gather ran it is an error. For a crop that the model computes from
    lengths some of which it saw split (ComfyUI 0.33's NextDiT: the [caption, local image] stream's length minus
    the *whole* image's length); where the model computes it right the value is unchanged."""
    name: str
    position: Optional[int] = None


@dataclass(frozen=True)
class SequenceIndex:
    """A forward argument holding a position in the split image sequence (an int over the whole sequence): set to
    where that position falls in this rank's shard, clamped to it (0 where the shard starts after it, the shard's
    length where it ends before). For a per-token rule "the tokens before the index do A, the rest B" - ComfyUI
    0.33's Qwen-Image-Edit-2511 `timestep_zero_index`: the image's tokens take the timestep's modulation, the
    reference images' tokens after them t = 0's - which each rank then applies to its own tokens exactly."""
    name: str
    position: Optional[int] = None


@dataclass(frozen=True)
class SequenceSegments:
    """A forward argument holding a table of contiguous segments over the whole split sequence - a list of
    (start, stop, rows) in order, `rows` an int or one entry per token (a tensor of stop - start) - set to this
    rank's part of it: the segments that meet its shard, clipped to it and counted from its first token, a
    per-token entry cut to the same rows. For a per-segment rule (MiniMax H3's modulation: text, audio and video
    rows of one packed stream take different timesteps' scale / shift / gate), which each rank then applies to its
    own tokens exactly."""
    name: str
    position: Optional[int] = None


@dataclass(frozen=True)
class SequenceRows:
    """A forward argument carrying per-token rows of the split sequence in a form of the model's own (ComfyUI 0.33
    LTX-2's `CompressedTimestep`: one modulation row per latent frame, expanded to the frame's tokens inside the
    block): set to `cut(value, start, stop, seq_len)` - this rank's rows [start, stop) of the whole sequence's
    seq_len, in a form the model reads the same way (or the value itself where it is not per token: one row
    broadcast to every token). The family adapter that knows the form supplies `cut`."""
    name: str
    cut: Callable
    position: Optional[int] = None


@dataclass(frozen=True)
class SequenceRanges:
    """A forward argument holding (start, end) ranges of global positions - over the split sequence, or with
    `after_prefix` over a [replicated prefix, sequence] stream whose prefix a SplitInput(after_prefix=True) cut off
    before - set to the same tokens on this rank: ranges in the prefix unchanged, the rest clipped to this rank's
    shard and counted from where the shard sits in the local stream; a range with no token here is dropped. For a
    per-token rule over index ranges (ComfyUI 0.33's NextDiT Omni `timestep_zero_index`: the real image's and
    caption's tokens take the timestep's modulation, the reference images' t = 0's)."""
    name: str
    position: Optional[int] = None
    after_prefix: bool = False


@dataclass(frozen=True)
class Attention:
    """Inside matching modules attention is self-attention over the sharded sequence.

    `text_arg`: the module argument holding the text stream of a joint (MMDiT)
    attention (whole, or this rank's shard where the plan splits it), whose length
    tells where text sits in q/k/v. Without it the text length is what q holds beyond
    the local image shard (0 for image-only self-attention), which is how ComfyUI's
    joint blocks are read: they concatenate the text with the local image tokens.

    `text_first`: the text precedes the image in q/k/v. It may be a function of the model instance instead, where
    the order differs between versions of the model's code (ComfyUI's HunyuanVideo): `resolve_plan` decides it
    from the model - by what its classes hold, never by a version number - before anything reads it.
    """
    text_arg: Optional[str] = None
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
    (B, C, H, W) patchified by the model (patch size from its config or `patch_size` attribute), "video" =
    (B, C, T, H, W) patchified (1, ph, pw) into (frame, row, col)-ordered tokens (`patch_size` attribute), "tokens"
    = (B, N, C) packed tokens with row-major `img_ids`."""
    blocks: tuple
    latent: str


# the declarations that act on a module's (or method's) inputs
_INPUT_ACTIONS = (SplitInput, PrefixLength, SequenceIndex, SequenceSegments, SequenceRows, SplitGrid, SequenceRanges)

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
    tp: Optional[object] = None  # diffusers `_tp_plan` format: pattern -> "colwise" | "rowwise" | packed
                                 # (or a function returning it: see tp_layout)
    tp_refusal: str = ""       # why tensor parallel is refused when `tp` is None
    heads_attr: str = "num_attention_heads"
    comfy: bool = False        # a ComfyUI module: forward(x, timestep, context, ..., transformer_options)
    pipeline: Optional[PipelinePlan] = None  # PipeFusion's stages (None: refused with pipeline_refusal)
    pipeline_refusal: str = ""
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

    def tp_layout(self) -> Optional[dict]:
        """The tensor-parallel layout; `tp` may be a function returning it (read lazily: Flux's comes from
        diffusers' class, whose import costs seconds at every worker start)."""
        return self.tp() if callable(self.tp) else self.tp


def resolve_plan(plan: FamilyPlan, model: torch.nn.Module) -> FamilyPlan:
    """`plan` as it applies to `model`: every declaration given as a function of the model (an Attention's
    `text_first`) decided for this instance; the plan itself where it has none. `plan_for` and `apply_plan` call it,
    so whoever reads a plan for a model reads booleans."""
    if not any(callable(a.text_first) for a in plan.attention.values()):
        return plan
    return replace(plan, attention={p: replace(a, text_first=bool(a.text_first(model))) if callable(a.text_first)
                                    else a for p, a in plan.attention.items()})


@dataclass
class _RunState:
    """Per-forward facts shared by the hooks: the image sequence split of this call, and the text's."""
    seq_len: Optional[int] = None
    seq_sizes: Optional[list] = None
    attention: Optional[tuple] = None  # (Attention spec, text_len or None) while a declared module runs
    text_len: Optional[int] = None     # the whole text's length, once a declared text split saw it
    text_sizes: Optional[list] = None  # its shards over the sp ranks; None: the text stays whole on every rank
    prefix_len: Optional[int] = None   # the prefix a GatherOutput(after_prefix=True) kept (for PrefixLength)
    split_prefix: Optional[int] = None  # the prefix an after_prefix split kept whole in front (for SequenceRanges)
    grid: Optional[tuple] = None       # (T, H, W, rows per rank) once a SplitGrid split the sequence

    def sizes_for(self, n: int, sp_size: int, where: str, weights=None) -> list:
        """The image sequence's shards over the sp ranks: near-equal, or in proportion to the ranks' speeds
        (`weights`, ParallelContext.sp_weights: devices of different speeds)."""
        if self.seq_len is None:
            self.seq_len, self.seq_sizes = n, weighted_sizes(n, weights, sp_size)
        elif n != self.seq_len:
            raise RuntimeError(f"sequence split at {where!r} sees {n} tokens but an earlier split saw "
                               f"{self.seq_len}: the family plan is inconsistent")
        return self.seq_sizes

    def text_sizes_for(self, n: int, sp_size: int, where: str, weights=None) -> Optional[list]:
        """The text's shards, or None where it stays whole: a text shorter than the degree would leave a rank
        without text, and then that rank could not tell a joint attention (its text length 0) from an
        image-only one (SD3.5's attn2) inside the same block - every rank must read each call the same way."""
        if self.text_len is None:
            self.text_len = n
            self.text_sizes = weighted_sizes(n, weights, sp_size) if n >= sp_size else None
        elif n != self.text_len:
            raise RuntimeError(f"text split at {where!r} sees {n} tokens but an earlier split saw "
                               f"{self.text_len}: the family plan is inconsistent")
        return self.text_sizes


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


def _arg(args, kwargs, name, position):
    if name in kwargs:
        return kwargs[name], ("kw", name)
    if position is not None and len(args) > position:
        return args[position], ("pos", position)
    return None, None


def _set_arg(args, kwargs, where, value):
    if where[0] == "item":  # an element of a tuple argument (SplitInput.item)
        _, outer, whole, i = where
        return _set_arg(args, kwargs, outer, type(whole)(value if j == i else v for j, v in enumerate(whole)))
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
    sizes = applied.state.sizes_for(x.shape[dim], sp.size, where, applied.ctx.sp_weights)
    start = sum(sizes[: sp.rank])
    return x.narrow(dim, start, sizes[sp.rank])


def _shard_text(x: torch.Tensor, dim: int, applied: _Applied, where: str) -> torch.Tensor:
    """This rank's shard of the text stream (or of its RoPE ids), or x whole where the text stays whole."""
    sp = applied.ctx.sp
    dim = dim % x.ndim
    sizes = applied.state.text_sizes_for(x.shape[dim], sp.size, where, applied.ctx.sp_weights)
    return x if sizes is None else x.narrow(dim, sum(sizes[: sp.rank]), sizes[sp.rank])


def _shard_after_prefix(x: torch.Tensor, dim: int, prefix: int, applied: _Applied, where: str) -> torch.Tensor:
    """[prefix, sequence] -> [prefix, this rank's shard of the sequence] (a table computed once for the whole
    sequence and handed to every block: each block call gets the full one and takes its part). A prefix that is
    the text of a split text stream is cut to this rank's text shard too."""
    dim = dim % x.ndim
    rest = x.shape[dim] - prefix
    if applied.state.seq_len is not None and rest != applied.state.seq_len:
        return x  # already local (or not this sequence): leave it
    applied.state.split_prefix = prefix
    head = x.narrow(dim, 0, prefix)
    if applied.state.text_sizes is not None and prefix == applied.state.text_len:
        head = _shard_text(head, dim, applied, where)
    return torch.cat([head, _shard(x.narrow(dim, prefix, rest), dim, applied, where)], dim=dim)


def _groups_of_shard(x: torch.Tensor, dim: int, applied: _Applied) -> torch.Tensor:
    """Per-group entries (one per equal run of tokens) -> one entry per token of this rank's shard, without
    materialising the full per-token tensor. Runs of ceil(tokens / entries), the last one short where the entries
    do not divide the tokens - as ComfyUI's Wan expands them (`repeat_e`: repeat_interleave by one more, cut to the
    sequence), e.g. per-frame timesteps over a sequence with a reference image's or extra frames' tokens."""
    sp, state = applied.ctx.sp, applied.state
    dim = dim % x.ndim
    start = sum(state.seq_sizes[: sp.rank])
    tokens = torch.arange(start, start + state.seq_sizes[sp.rank], device=x.device)
    return x.index_select(dim, tokens // -(-state.seq_len // x.shape[dim]))


def _prefix_length(value, applied, where: str):
    """PrefixLength: `value` (an int, or a list / tuple of one per sample) replaced by the gathered prefix's length."""
    n = applied.state.prefix_len
    if n is None:
        raise RuntimeError(f"{where} sets a prefix length before a GatherOutput(after_prefix=True) gathered the "
                           f"sequence: the family plan is inconsistent")
    return type(value)(n for _ in value) if isinstance(value, (list, tuple)) else n


def _sequence_index(value, applied, where: str) -> int:
    """SequenceIndex: a global position in the image sequence -> its place in this rank's shard, clamped."""
    sizes = applied.state.seq_sizes
    if sizes is None:
        raise RuntimeError(f"{where} is a position in the image sequence but no split has seen that sequence yet: "
                           f"the family plan is inconsistent")
    rank = applied.ctx.sp.rank
    return min(max(int(value) - sum(sizes[:rank]), 0), sizes[rank])


def _sequence_segments(value, applied, where: str) -> list:
    """SequenceSegments: a segment table over the whole sequence -> this rank's part, counted from its shard's start."""
    sizes = applied.state.seq_sizes
    if sizes is None or not value or value[-1][1] != applied.state.seq_len:
        raise RuntimeError(f"{where} is a segment table that does not cover the split sequence "
                           f"({applied.state.seq_len} tokens): the family plan is inconsistent")
    rank = applied.ctx.sp.rank
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    out = []
    for start, stop, rows in value:
        a, b = max(start, lo), min(stop, hi)
        if a < b:
            if isinstance(rows, torch.Tensor) and rows.ndim > 0:
                rows = rows[a - start:b - start]
            out.append((a - lo, b - lo, rows))
    return out


def _shard_grid(spec, x, applied, where: str):
    """SplitGrid: this rank's rows of every frame of a (.., T, H, W, ..) token grid, or of a flattened (t h w) table."""
    sp, state = applied.ctx.sp, applied.state
    dim = spec.dim % x.ndim
    if state.grid is None:
        if spec.flat:
            raise RuntimeError(f"{where} is a flattened table of a token grid no split has seen yet: the family "
                               f"plan is inconsistent")
        T, H, W = x.shape[dim - 1], x.shape[dim], x.shape[dim + 1]
        if H < sp.size:
            raise ValueError(f"{where}: {H} rows of patches cannot be split over {sp.size} sequence-parallel ranks; "
                             f"use a larger latent or a smaller ulysses/ring degree")
        rows = weighted_sizes(H, applied.ctx.sp_weights, sp.size)
        state.seq_len, state.seq_sizes = T * H * W, [T * r * W for r in rows]
        state.grid = (T, H, W, rows)
    T, H, W, rows = state.grid
    start, n = sum(rows[:sp.rank]), rows[sp.rank]
    if spec.flat:
        if x.shape[dim] != T * H * W:
            return x
        grid = x.reshape(x.shape[:dim] + (T, H, W) + x.shape[dim + 1:]).narrow(dim + 1, start, n)
        return grid.reshape(x.shape[:dim] + (T * n * W,) + x.shape[dim + 1:])
    if tuple(x.shape[dim - 1:dim + 2]) != (T, H, W):
        return x
    return x.narrow(dim, start, n)


def _sequence_rows(spec, value, applied, where: str):
    """SequenceRows: the model's per-token rows of the whole sequence -> this rank's, cut by the adapter's function."""
    sizes = applied.state.seq_sizes
    if sizes is None:
        raise RuntimeError(f"{where} holds rows of the split sequence but no split has seen that sequence yet: "
                           f"the family plan is inconsistent")
    lo = sum(sizes[:applied.ctx.sp.rank])
    return spec.cut(value, lo, lo + sizes[applied.ctx.sp.rank], applied.state.seq_len)


def _sequence_ranges(value, applied, after_prefix: bool, where: str) -> list:
    """SequenceRanges: global (start, end) ranges -> this rank's, in its local stream."""
    sizes = applied.state.seq_sizes
    prefix = applied.state.split_prefix if after_prefix else 0
    if sizes is None or prefix is None:
        raise RuntimeError(f"{where} holds positions in the split sequence but no split has seen it yet: the family "
                           f"plan is inconsistent")
    rank = applied.ctx.sp.rank
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    out = []
    for start, end in value:
        if start < prefix:  # the replicated prefix: the same positions on every rank
            out.append((start, min(end, prefix)))
        a, b = max(start - prefix, lo), min(end - prefix, hi)
        if a < b:
            out.append((prefix + a - lo, prefix + b - lo))
    return out


def _split_input_hook(applied, path, specs):
    def hook(module, args, kwargs):
        for s in specs:
            value, where = _arg(args, kwargs, s.name, s.position)
            if isinstance(s, SequenceRanges):
                if where is not None and isinstance(value, (list, tuple)):
                    args, kwargs = _set_arg(args, kwargs, where, _sequence_ranges(value, applied, s.after_prefix,
                                                                                  f"{path}:{s.name}"))
                continue
            if isinstance(s, SplitGrid):
                if isinstance(value, torch.Tensor):
                    args, kwargs = _set_arg(args, kwargs, where, _shard_grid(s, value, applied, f"{path}:{s.name}"))
                continue
            if isinstance(s, SequenceRows):
                if where is not None and value is not None:
                    args, kwargs = _set_arg(args, kwargs, where, _sequence_rows(s, value, applied, f"{path}:{s.name}"))
                continue
            if isinstance(s, SequenceSegments):
                if where is not None and isinstance(value, (list, tuple)):
                    args, kwargs = _set_arg(args, kwargs, where, _sequence_segments(value, applied,
                                                                                    f"{path}:{s.name}"))
                continue
            if isinstance(s, SequenceIndex):
                if where is not None and isinstance(value, int) and not isinstance(value, bool):
                    args, kwargs = _set_arg(args, kwargs, where, _sequence_index(value, applied, f"{path}:{s.name}"))
                continue
            if isinstance(s, PrefixLength):
                if where is not None:
                    args, kwargs = _set_arg(args, kwargs, where, _prefix_length(value, applied, f"{path}:{s.name}"))
                continue
            if s.item is not None:  # split the element of a tuple argument: set the tuple with the element replaced
                if not (isinstance(value, (tuple, list)) and len(value) > s.item):
                    continue
                where, value = ("item", where, value, s.item), value[s.item]
            if not isinstance(value, torch.Tensor) or (s.only_ndim is not None and value.ndim != s.only_ndim):
                continue
            if s.text:
                if applied.split_text:
                    args, kwargs = _set_arg(args, kwargs, where, _shard_text(value, s.dim, applied,
                                                                             f"{path}:{s.name}"))
                continue
            if s.prefix_from is not None:
                prefix = _arg(args, kwargs, s.prefix_from, None)[0]
                if isinstance(prefix, torch.Tensor):
                    # a split text's argument is already local here: the table's prefix is the whole text
                    n = applied.state.text_len if applied.state.text_sizes is not None else prefix.shape[1]
                    args, kwargs = _set_arg(args, kwargs, where, _shard_after_prefix(
                        value, s.dim, n, applied, f"{path}:{s.name}"))
                continue
            if s.after_prefix:
                full = applied.state.seq_len
                if full is None:
                    raise RuntimeError(f"{path}:{s.name} splits after a prefix before the image sequence was split: "
                                       f"the family plan is inconsistent")
                n = value.shape[s.dim % value.ndim]
                args, kwargs = _set_arg(args, kwargs, where, _shard_after_prefix(
                    value, s.dim, n - full, applied, f"{path}:{s.name}"))
                continue
            n, full = value.shape[s.dim % value.ndim], applied.state.seq_len
            if s.only_full and n != full:
                if s.per_group and full and 1 < n and 2 * n <= full:  # (n <= full < 2n: ComfyUI does not expand)
                    args, kwargs = _set_arg(args, kwargs, where, _groups_of_shard(value, s.dim, applied))
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
