"""Comm helpers on real gloo worlds of 2 and 4 processes, including uneven sizes, and the harness itself."""
import pytest
import torch
import torch.distributed as dist

from comfyui_hybrid_parallel.parallel import ParallelConfig, all_gather_uneven, all_reduce, all_to_all, broadcast, split_sizes
from comfyui_hybrid_parallel.parallel.comm import RingExchange, irecv, isend
from dist_harness import DistFailure, context_for

pytestmark = pytest.mark.dist


def _full(seed, shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _all_to_all_body(n, seq, heads, seed):
    """(B, S/n, H, D) sequence shards -> (B, S, H/n, D) head shards and back, uneven on both sides."""
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = ctx.ulysses
    full = _full(seed, (2, seq, heads, 3))
    seq_sizes, head_sizes = split_sizes(seq, n), split_sizes(heads, n)
    mine = full.split(seq_sizes, dim=1)[ax.rank]
    heads_shard = all_to_all(mine, scatter_dim=2, gather_dim=1, ax=ax, gather_sizes=seq_sizes)
    torch.testing.assert_close(heads_shard, full.split(head_sizes, dim=2)[ax.rank], rtol=0, atol=0)
    back = all_to_all(heads_shard, scatter_dim=1, gather_dim=2, ax=ax, gather_sizes=head_sizes)
    torch.testing.assert_close(back, mine, rtol=0, atol=0)
    return ctx.stats.snapshot()["all_to_all"]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("seq, heads", [(8, 4), (7, 4), (13, 6), (5, 5)])
def test_all_to_all(dist_pools, n, seq, heads):
    res = dist_pools(n).run(_all_to_all_body, n, seq, heads, seed=seq * 31 + heads)
    assert all(r["calls"] == 2 for r in res)
    # every element except the ones that stay home is sent exactly once per direction
    total = sum(r["bytes"] for r in res)
    seq_sizes, head_sizes = split_sizes(seq, n), split_sizes(heads, n)
    home = sum(seq_sizes[r] * head_sizes[r] for r in range(n)) * 2 * 3 * 4
    assert total == 2 * (2 * seq * heads * 3 * 4 - home)


def _gather_body(n, sizes, dim, pass_sizes):
    ctx = context_for(ParallelConfig(ring_degree=n))
    ax = ctx.ring
    parts = [_full(100 + r, (3, s, 2) if dim == 1 else (s, 3)) for r, s in enumerate(sizes)]
    out = all_gather_uneven(parts[ax.rank], dim=dim, ax=ax, sizes=sizes if pass_sizes else None)
    torch.testing.assert_close(out, torch.cat(parts, dim=dim), rtol=0, atol=0)
    return ctx.stats.snapshot()


@pytest.mark.parametrize("n, sizes", [(2, [3, 3]), (2, [4, 1]), (4, [2, 0, 5, 1]), (4, [1, 1, 1, 1])])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("pass_sizes", [True, False])
def test_all_gather_uneven(dist_pools, n, sizes, dim, pass_sizes):
    res = dist_pools(n).run(_gather_body, n, sizes, dim, pass_sizes)
    per_row = 3 * 2 if dim == 1 else 3
    assert res[0]["all_gather"]["bytes"] >= max(sizes) * per_row * 4 * (n - 1)


def _ring_body(n):
    ctx = context_for(ParallelConfig(ring_degree=n))
    ax = ctx.ring
    k, v = _full(ax.rank, (2, 5)), _full(50 + ax.rank, (3,))
    seen = [ax.rank]
    for step in range(n - 1):  # a full rotation visits every rank's block once
        k, v = RingExchange([k, v], ax).wait()
        src = (ax.rank - step - 1) % n
        torch.testing.assert_close(k, _full(src, (2, 5)), rtol=0, atol=0)
        torch.testing.assert_close(v, _full(50 + src, (3,)), rtol=0, atol=0)
        seen.append(src)
    assert sorted(seen) == list(range(n))
    return ctx.stats.snapshot()["ring_p2p"]


@pytest.mark.parametrize("n", [2, 4])
def test_ring_exchange(dist_pools, n):
    res = dist_pools(n).run(_ring_body, n)
    assert all(r == {"calls": n - 1, "bytes": (n - 1) * (10 + 3) * 4} for r in res)


def _pipeline_body(n):
    """Stage i sends a patch to stage i+1, non-blocking, with the matching shape known to the receiver."""
    ctx = context_for(ParallelConfig(pp_degree=n, num_pipeline_patch=n))
    ax = ctx.pp
    x = torch.full((2, 3), float(ax.rank)) if ax.rank == 0 else None
    if ax.rank > 0:
        buf = torch.empty(2, 3)
        irecv(buf, ax.rank - 1, ax).wait()
        x = buf + 1
    if ax.rank < n - 1:
        isend(x, ax.rank + 1, ax).wait()
    torch.testing.assert_close(x, torch.full((2, 3), float(ax.rank)))
    return ctx.stats.snapshot().get("pp_send", {"bytes": 0})["bytes"]


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_send_recv(dist_pools, n):
    res = dist_pools(n).run(_pipeline_body, n)
    assert res == [24] * (n - 1) + [0]


def _reduce_broadcast_body(n):
    ctx = context_for(ParallelConfig(dp_degree=2, ulysses_degree=n // 2))
    dp = ctx.dp
    x = torch.full((4,), float(ctx.rank))
    all_reduce(x, dp)
    expect = sum(r for r in dp.ranks)
    torch.testing.assert_close(x, torch.full((4,), float(expect)))
    y = torch.full((3,), float(ctx.rank))
    broadcast(y, ctx.ulysses, src_axis_rank=ctx.ulysses.size - 1)
    torch.testing.assert_close(y, torch.full((3,), float(ctx.ulysses.ranks[-1])))
    return dp.ranks


@pytest.mark.parametrize("n", [2, 4])
def test_all_reduce_broadcast_on_subgroups(dist_pools, n):
    res = dist_pools(n).run(_reduce_broadcast_body, n)
    if n == 4:
        assert res == [[0, 2], [1, 3], [0, 2], [1, 3]]


def _size_one_axes_body():
    """At degree 1 along an axis every helper is a no-op and sends nothing."""
    ctx = context_for(ParallelConfig(dp_degree=2))
    x = torch.randn(3, 4)
    assert all_to_all(x, 0, 1, ctx.ulysses) is x
    assert all_gather_uneven(x, 0, ctx.ring) is x
    assert RingExchange([x], ctx.ring).wait()[0] is x
    return ctx.stats.total_bytes()


def test_size_one_axes_send_nothing(dist_pools):
    assert dist_pools(2).run(_size_one_axes_body) == [0, 0]


# ---- the harness: a failure or a hang on one rank fails the test everywhere, and the pool recovers ----
def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the harness
    return "unreachable"


def _hang_on_rank_0():
    import time
    if dist.get_rank() == 0:
        time.sleep(60)
    return dist.get_rank()


def _ranks():
    return dist.get_rank()


def test_harness_reports_failing_rank_and_recovers(dist_pools):
    pool = dist_pools(2)
    with pytest.raises(DistFailure) as e:
        pool.run(_raise_on_rank_1)
    msg = str(e.value)
    assert "rank 1 raised" in msg and "boom on rank 1" in msg and "RuntimeError" in msg
    assert pool.run(_ranks) == [0, 1]  # respawned world is usable


def test_harness_timeout_turns_hang_into_failure(dist_pools):
    pool = dist_pools(2)
    with pytest.raises(DistFailure, match=r"ranks \[0\] did not finish \(within 3 s: hang"):
        pool.run(_hang_on_rank_0, timeout=3)
    assert pool.run(_ranks) == [0, 1]


def _non_ascending_axis_body():
    """The batch axis lists its ranks cfg-major ([0, 2, 1, 3] for dp2·cfg2), not in global order."""
    ctx = context_for(ParallelConfig(dp_degree=2, cfg_degree=2))
    ax = ctx.axis("batch")
    mine = torch.full((ax.rank + 1, 2), float(ax.rank))
    gathered = all_gather_uneven(mine, 0, ax)
    expect = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(ax.size)])
    torch.testing.assert_close(gathered, expect, rtol=0, atol=0)
    # row j of every rank's tensor is addressed to axis rank j; axis rank j receives them in axis order
    x = torch.tensor([[10.0 * ax.rank + j] * 3 for j in range(ax.size)])
    got = all_to_all(x, scatter_dim=0, gather_dim=0, ax=ax, gather_sizes=[1] * ax.size)
    torch.testing.assert_close(got, torch.tensor([[10.0 * i + ax.rank] * 3 for i in range(ax.size)]), rtol=0, atol=0)
    return ax.ranks


def test_collectives_follow_axis_order_not_global_order(dist_pools):
    res = dist_pools(4).run(_non_ascending_axis_body)
    assert res[0] == [0, 2, 1, 3]
