"""What each input declaration of a family plan does to a forward argument (parallel/plan.py applies them).

A family adapter declares, per module (or method) of the model, which of its arguments hold the split sequence or
something indexed by it: the tokens themselves (SplitInput, SplitGrid), a position or ranges of positions in the
sequence (SequenceIndex, SequenceRanges), a per-segment or per-token table (SequenceSegments, SequenceRows), the
length of a prefix (PrefixLength). Here each kind is turned into this rank's value, from the facts of the current
forward (`_RunState`: the sequence's length and its split over the sp ranks) - one function per kind, and
`_split_input_hook`, the forward pre-hook that applies a module's declarations in order. Kept apart from the plan's
mechanism (hooks, batch split, attention swap) because this is where new model forwards keep adding kinds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .comm import weighted_sizes


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


# the declarations that act on a module's (or method's) inputs
_INPUT_ACTIONS = (SplitInput, PrefixLength, SequenceIndex, SequenceSegments, SequenceRows, SplitGrid, SequenceRanges)


@dataclass
class _RunState:
    """Per-forward facts shared by the hooks: the image sequence split of this call, and the text's."""
    seq_len: Optional[int] = None
    seq_sizes: Optional[list] = None
    attention: Optional[object] = None  # the Attention spec while a declared module runs
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


def _shard(x: torch.Tensor, dim: int, applied, where: str) -> torch.Tensor:
    sp = applied.ctx.sp
    dim = dim % x.ndim
    sizes = applied.state.sizes_for(x.shape[dim], sp.size, where, applied.ctx.sp_weights)
    start = sum(sizes[: sp.rank])
    return x.narrow(dim, start, sizes[sp.rank])


def _shard_text(x: torch.Tensor, dim: int, applied, where: str) -> torch.Tensor:
    """This rank's shard of the text stream (or of its RoPE ids), or x whole where the text stays whole."""
    sp = applied.ctx.sp
    dim = dim % x.ndim
    sizes = applied.state.text_sizes_for(x.shape[dim], sp.size, where, applied.ctx.sp_weights)
    return x if sizes is None else x.narrow(dim, sum(sizes[: sp.rank]), sizes[sp.rank])


def _shard_after_prefix(x: torch.Tensor, dim: int, prefix: int, applied, where: str) -> torch.Tensor:
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


def _groups_of_shard(x: torch.Tensor, dim: int, applied) -> torch.Tensor:
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


def _shard_bounds(applied) -> tuple:
    """[lo, hi): this rank's tokens in the whole split sequence."""
    sizes, rank = applied.state.seq_sizes, applied.ctx.sp.rank
    lo = sum(sizes[:rank])
    return lo, lo + sizes[rank]


def _sequence_segments(value, applied, where: str) -> list:
    """SequenceSegments: a segment table over the whole sequence -> this rank's part, counted from its shard's start."""
    sizes = applied.state.seq_sizes
    if sizes is None or not value or value[-1][1] != applied.state.seq_len:
        raise RuntimeError(f"{where} is a segment table that does not cover the split sequence "
                           f"({applied.state.seq_len} tokens): the family plan is inconsistent")
    lo, hi = _shard_bounds(applied)
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
    return spec.cut(value, *_shard_bounds(applied), applied.state.seq_len)


def _sequence_ranges(value, applied, after_prefix: bool, where: str) -> list:
    """SequenceRanges: global (start, end) ranges -> this rank's, in its local stream."""
    sizes = applied.state.seq_sizes
    prefix = applied.state.split_prefix if after_prefix else 0
    if sizes is None or prefix is None:
        raise RuntimeError(f"{where} holds positions in the split sequence but no split has seen it yet: the family "
                           f"plan is inconsistent")
    lo, hi = _shard_bounds(applied)
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
