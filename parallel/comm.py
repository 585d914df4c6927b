"""Collectives every parallel method uses, each counting the bytes it sends.

The helpers take an `AxisGroup` (see context.py) so that callers say *which
axis* they talk along, never raw ranks. Byte counts are what this rank sends
to *other* ranks (its own chunk of an all-to-all stays home and is not
counted); benchmarks compare them with the analytic volumes of each method.
Every helper short-circuits at axis size 1, so serial runs pay nothing.
gloo refuses all_gather with uneven sizes, so `all_gather_uneven` pads.
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist


class CommStats:
    """Calls and bytes sent per operation name, for benchmarks and tests."""

    def __init__(self) -> None:
        self.calls = defaultdict(int)
        self.bytes = defaultdict(int)

    def record(self, op: str, nbytes: int) -> None:
        if torch.compiler.is_compiling():  # a compiled model: a counter in its graph would be guarded, and every
            return                          # new value would recompile it (compiled calls are not counted)
        self.calls[op] += 1
        self.bytes[op] += int(nbytes)

    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    def snapshot(self) -> dict:
        return {op: {"calls": self.calls[op], "bytes": self.bytes[op]} for op in sorted(self.calls)}

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def split_sizes(n: int, parts: int) -> list:
    """Sizes of `parts` near-equal chunks of `n`, larger ones first (the layout every shard uses)."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def weighted_sizes(n: int, weights: Optional[Sequence[float]], parts: Optional[int] = None) -> list:
    """`n` split in proportion to `weights` (the ranks' relative speeds): largest remainders get the leftover
    units, and every part keeps at least 1 where n allows (taken from the largest). Without weights:
    `split_sizes(n, parts)`. Why: on devices of different speeds an even split lets the slowest set the pace."""
    if not weights:
        return split_sizes(n, parts)
    k, total = len(weights), float(sum(weights))
    if n < k or total <= 0 or min(weights) <= 0:
        return split_sizes(n, k)
    raw = [n * w / total for w in weights]
    sizes = [int(r) for r in raw]
    for i in sorted(range(k), key=lambda i: (sizes[i] - raw[i], i))[: n - sum(sizes)]:
        sizes[i] += 1
    for i in range(k):
        if sizes[i] == 0:
            sizes[i] = 1
            sizes[max(range(k), key=lambda j: sizes[j])] -= 1
    return sizes


def all_to_all_buffers(send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                       recv_counts: Sequence[int], ax, counted: Optional[dict] = None, async_op: bool = False):
    """One all-to-all between flat, contiguous buffers whose chunks are in *axis* order.

    Chunk j of `send` (send_counts[j] elements) goes to axis rank j; chunk j of `recv` (recv_counts[j])
    arrives from axis rank j, written in place - so a caller that lays `recv` out as (a slice of) the tensor
    it wants next, and fills `send` with one strided copy per piece, pays no cat on either side.
    `counted` (op name -> elements per destination) says under which counter names the bytes this rank sends
    to the others are recorded (default: all of them as "all_to_all"); a rank's own chunk is never counted.
    `async_op`: return a function that completes the exchange (call it before reading `recv` or reusing
    `send`), so the caller can compute meanwhile; otherwise complete it here and return None.
    """
    send_counts, recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
    for op, counts in (counted or {"all_to_all": send_counts}).items():
        ax.stats.record(op, send.element_size() * sum(c for j, c in enumerate(counts) if j != ax.rank))
    order = ax.group_order
    if order == sorted(order):
        work = dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_counts,
                                      group=ax.group, async_op=async_op)
        return work.wait if async_op else None
    # torch lays chunks out in process-group rank order: reorder both sides around the call (synchronously)
    by_group = sorted(range(ax.size), key=lambda j: order[j])
    sends, recvs = send.split(send_counts), recv.split(recv_counts)
    tmp = torch.empty_like(recv)
    dist.all_to_all_single(tmp, torch.cat([sends[j] for j in by_group]),
                           output_split_sizes=[recv_counts[j] for j in by_group],
                           input_split_sizes=[send_counts[j] for j in by_group], group=ax.group)
    for j, piece in zip(by_group, tmp.split([recv_counts[j] for j in by_group])):
        recvs[j].copy_(piece)
    return (lambda: None) if async_op else None


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int, ax,
               gather_sizes: Optional[Sequence[int]] = None,
               scatter_sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Scatter `x` along `scatter_dim` to the ranks of `ax`, gather their pieces along `gather_dim`.

    The general sequence<->heads exchange (USP attention uses the cat-free `all_to_all_buffers` directly).
    Chunks along `scatter_dim` follow `scatter_sizes` (default `split_sizes`), so uneven splits work.
    `gather_sizes[j]` is rank j's size of `gather_dim`; by default every rank is assumed to hold as many as
    this one.
    """
    if ax.size == 1:
        return x
    if scatter_sizes is None:
        scatter_sizes = split_sizes(x.shape[scatter_dim], ax.size)
    scatter_sizes = list(scatter_sizes)
    if gather_sizes is None:
        gather_sizes = [x.shape[gather_dim]] * ax.size
    inputs = torch.split(x, scatter_sizes, dim=scatter_dim)
    send_counts = [c.numel() for c in inputs]
    send = torch.empty(sum(send_counts), dtype=x.dtype, device=x.device)
    for piece, slot in zip(inputs, send.split(send_counts)):
        slot.view(piece.shape).copy_(piece)
    out_shapes = []
    for j in range(ax.size):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[ax.rank]
        shape[gather_dim] = gather_sizes[j]
        out_shapes.append(shape)
    recv_counts = [int(torch.Size(s).numel()) for s in out_shapes]
    recv = torch.empty(sum(recv_counts), dtype=x.dtype, device=x.device)
    all_to_all_buffers(send, recv, send_counts, recv_counts, ax)
    return torch.cat([p.view(s) for p, s in zip(recv.split(recv_counts), out_shapes)], dim=gather_dim)


def _padded(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`x` zero-padded along `dim` to `size`, contiguous (gloo's and NCCL's gathers need equal shapes)."""
    if size != x.shape[dim]:
        pad_shape = list(x.shape)
        pad_shape[dim] = size - x.shape[dim]
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    return x.contiguous()


def all_gather_uneven(x: torch.Tensor, dim: int, ax, sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`; ranks may hold different sizes there.

    Pass `sizes` when every rank knows them (saves one small collective);
    otherwise they are exchanged first. Shards are padded to the largest size
    because gloo's all_gather needs equal shapes.
    """
    if ax.size == 1:
        return x
    if sizes is None:
        mine = torch.tensor([x.shape[dim]], dtype=torch.int64, device=x.device)
        got = [torch.empty_like(mine) for _ in range(ax.size)]
        dist.all_gather(got, mine, group=ax.group)
        sizes = [int(got[g].item()) for g in ax.group_order]
    if sizes[ax.rank] != x.shape[dim]:
        raise ValueError(f"sizes[{ax.rank}]={sizes[ax.rank]} but this rank holds {x.shape[dim]} along dim {dim}")
    x = _padded(x, dim, max(sizes))
    got = [torch.empty_like(x) for _ in range(ax.size)]
    dist.all_gather(got, x, group=ax.group)
    ax.stats.record("all_gather", _nbytes(x) * (ax.size - 1))
    got = [got[g] for g in ax.group_order]  # group-rank order -> axis order
    return torch.cat([g.narrow(dim, 0, s) for g, s in zip(got, sizes)], dim=dim)


def gather_to_first(x: torch.Tensor, dim: int, ax, sizes: Sequence[int]) -> Optional[torch.Tensor]:
    """Concatenate every rank's `x` along `dim` on axis rank 0 only (None elsewhere): a result one rank returns
    (the decoded image) need not be assembled on every rank. Shards are padded to the largest, as for all_gather."""
    if ax.size == 1:
        return x
    x = _padded(x, dim, max(sizes))
    first = ax.global_rank(0)
    got = [torch.empty_like(x) for _ in range(ax.size)] if ax.rank == 0 else None
    dist.gather(x, gather_list=got, dst=first, group=ax.group)
    ax.stats.record("gather", 0 if ax.rank == 0 else _nbytes(x))
    if ax.rank != 0:
        return None
    got = [got[g] for g in ax.group_order]
    return torch.cat([g.narrow(dim, 0, s) for g, s in zip(got, sizes)], dim=dim)


def all_reduce(x: torch.Tensor, ax, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce; counts the 2(n-1)/n volume of a ring all-reduce."""
    if ax.size == 1:
        return x
    dist.all_reduce(x, op=op, group=ax.group)
    ax.stats.record("all_reduce", _nbytes(x) * 2 * (ax.size - 1) // ax.size)
    return x


def any_rank(flag: bool, axes, device) -> bool:
    """True when `flag` is set on any rank of `axes` (a decision every rank must share: cancel, skip a step):
    one 1-element MAX all-reduce per axis with more than one rank."""
    axes = [ax for ax in axes if ax.size > 1]
    if not axes:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    for ax in axes:
        t = all_reduce(t, ax, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


def broadcast(x: torch.Tensor, ax, src_axis_rank: int = 0) -> torch.Tensor:
    """In-place broadcast from the axis rank `src_axis_rank`."""
    if ax.size == 1:
        return x
    dist.broadcast(x, src=ax.global_rank(src_axis_rank), group=ax.group)
    if ax.rank == src_axis_rank:
        ax.stats.record("broadcast", _nbytes(x) * (ax.size - 1))
    return x


class RingExchange:
    """One rotation of a ring: send tensors to the next rank, receive the previous rank's.

    Issued at construction, completed by `wait()`, so the caller can compute
    on the current block while the next one is in flight (Ring attention).
    """

    def __init__(self, tensors: Sequence[torch.Tensor], ax):
        self._reqs = []
        if ax.size == 1:
            self.received = list(tensors)
            return
        tensors = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = []
        for t, r in zip(tensors, self.received):
            ops.append(dist.P2POp(dist.isend, t, ax.next_rank, group=ax.group))
            ops.append(dist.P2POp(dist.irecv, r, ax.prev_rank, group=ax.group))
        self._reqs = dist.batch_isend_irecv(ops)
        ax.stats.record("ring_p2p", sum(_nbytes(t) for t in tensors))

    def wait(self) -> list:
        for r in self._reqs:
            r.wait()
        self._reqs = []
        return self.received


def complete(work, device: torch.device, timeout_s: Optional[float] = None):
    """Complete an asynchronous collective or p2p `work` whose tensors are on `device`.

    On CUDA (NCCL), `wait()` only orders the compute stream after the communication and returns at once, so
    the host keeps queueing kernels; `wait(timeout)` would instead block the host until the transfer is done at
    every layer (torch waits on the host whenever a timeout is given), which defeats the overlap DistriFusion,
    PipeFusion and the VAE halo exchange are built on. A hang there is still bounded: by the process group's
    timeout (NCCL's watchdog) and by the pool's stall detection. On the host (gloo) the wait blocks anyway,
    so it is bounded by `timeout_s` to say which transfer never came."""
    if device.type == "cuda" or timeout_s is None:
        return work.wait()
    return work.wait(timeout=datetime.timedelta(seconds=timeout_s))


def isend(t: torch.Tensor, dst_axis_rank: int, ax, op: str = "pp_send"):
    """Non-blocking send to an axis rank (pipeline stages); returns the work handle."""
    work = dist.isend(t.contiguous(), ax.global_rank(dst_axis_rank), group=ax.group)
    ax.stats.record(op, _nbytes(t))
    return work


def irecv(buf: torch.Tensor, src_axis_rank: int, ax):
    """Non-blocking receive into `buf` from an axis rank; returns the work handle."""
    return dist.irecv(buf, ax.global_rank(src_axis_rank), group=ax.group)
