"""Strict mode (parallel/strict.py): a gloo CPU world that fails where NCCL on GPUs would.

Each guard is shown both ways on a real 2-process gloo world: the NCCL-illegal pattern fails with a message that
names the fix, and the legal pattern beside it passes (so the guard is not simply refusing everything).
The ranks get their own pool (the guard patches torch.distributed for the life of the process).
"""
import pytest
import torch
import torch.distributed as dist

from comfyui_hybrid_parallel.parallel import strict
from dist_harness import DistFailure, DistPool

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def strict_pool():
    pool = DistPool(2, collective_timeout_s=8.0)
    yield pool
    pool.close()


def _ensure():
    """Install the guard once per process (the harness respawns its ranks after a failing test)."""
    if not strict.StrictComm.installed():
        strict.StrictComm().install()


# ---- device discipline (one process) ----

def test_a_host_tensor_meeting_compute_tensors_fails_and_a_moved_one_passes():
    w = torch.randn(4, 3)  # made before the mode: as a weight on the device
    with strict.DeviceDiscipline():
        x = torch.randn(2, 3, device=strict.COMPUTE)
        assert x.device == strict.COMPUTE and w.device == strict.COMPUTE
        host = torch.arange(3, dtype=torch.float32)  # no device: the host, as beside CUDA
        assert strict.is_host(host) and host.device == torch.device("cpu")
        with pytest.raises(strict.StrictDeviceError, match="Expected all tensors to be on the same device"):
            torch.nn.functional.linear(host.unsqueeze(0), w)
        with pytest.raises(strict.StrictDeviceError, match="same device"):
            x + host
        moved = host.to(x.device)
        assert not strict.is_host(moved) and strict.is_host(host)  # the original stays on the host
        torch.testing.assert_close(x + moved, x + torch.arange(3, dtype=torch.float32, device=x.device))
        assert not strict.is_host(x * torch.tensor(2.0))  # a 0-dim host scalar mixes on CUDA too
        assert strict.is_host(x.cpu()) and strict.is_host(x.float().cpu().unsqueeze(0))
        assert not strict.is_host(torch.zeros(2, device=x.device))
        assert not strict.is_host(host.new_zeros(2).to(w))  # .to(tensor) takes that tensor's device
        with pytest.raises(strict.StrictDeviceError, match="numpy"):
            x.numpy()
        x.cpu().numpy()


def test_the_mode_changes_no_value():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(5, 7, generator=g), torch.randn(7, 2, generator=g)
    plain = torch.softmax(a @ b, dim=0)
    with strict.DeviceDiscipline():
        guarded = torch.softmax(a.to(strict.COMPUTE) @ b, dim=0)
    assert torch.equal(plain, guarded)


# ---- collectives (2 gloo ranks) ----

def _host_collective():
    _ensure()
    with strict.DeviceDiscipline():
        rows = torch.tensor([[3]], dtype=torch.int64)  # decode.py's row count before its fix
        got = [torch.empty_like(rows) for _ in range(2)]
        dist.all_gather(got, rows)


def _device_collective():
    _ensure()
    with strict.DeviceDiscipline():
        rows = torch.tensor([[3 + dist.get_rank()]], dtype=torch.int64, device=strict.COMPUTE)
        got = [torch.empty_like(rows) for _ in range(2)]
        dist.all_gather(got, rows)
    return [int(g) for g in got]


def test_a_collective_of_host_tensors_fails_on_every_rank_and_one_on_the_device_passes(strict_pool):
    with pytest.raises(DistFailure, match="Tensors must be CUDA"):
        strict_pool.run(_host_collective)
    assert strict_pool.run(_device_collective) == [[3, 4], [3, 4]]


def _mismatched_order():
    _ensure()
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)


def _mismatched_size():
    _ensure()
    dist.all_reduce(torch.ones(4 + dist.get_rank()))


def _same_order():
    _ensure()
    t = torch.full((4,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    dist.broadcast(t, src=1)
    return t.tolist()


def test_ranks_issuing_different_collectives_fail_with_both_named(strict_pool):
    with pytest.raises(DistFailure, match=r"rank 0: all_reduce #\d+ of 4 elements; rank 1: broadcast"):
        strict_pool.run(_mismatched_order)
    with pytest.raises(DistFailure, match="same sizes"):
        strict_pool.run(_mismatched_size)
    assert strict_pool.run(_same_order) == [[3.0] * 4, [3.0] * 4]


def _fp8_reduction():
    _ensure()
    dist.all_reduce(torch.zeros(4, dtype=torch.float8_e4m3fn))


def test_fp8_is_no_reduction_type(strict_pool):
    with pytest.raises(DistFailure, match="not an NCCL reduction type"):
        strict_pool.run(_fp8_reduction)


# ---- point to point ----

def _send_first_then_receive():
    """Both ranks wait on their send before posting their receive: NCCL hangs, and so does gloo."""
    _ensure()
    peer = 1 - dist.get_rank()
    dist.isend(torch.ones(3), peer).wait()
    buf = torch.empty(3)
    dist.irecv(buf, peer).wait()


def _ring_batch():
    """RingExchange's pattern: sends and receives posted together, then waited: legal on NCCL."""
    _ensure()
    peer = 1 - dist.get_rank()
    out = torch.full((3,), float(dist.get_rank()))
    buf = torch.empty(3)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, buf, peer)])
    for w in works:
        w.wait()
    return buf.tolist()


def _tags_are_ignored():
    """Two messages sent with tags 1, 2 and received by tag 2, 1: gloo matches by tag, NCCL in order."""
    _ensure()
    if dist.get_rank() == 0:
        a, b = dist.isend(torch.tensor([1.0]), 1, tag=1), dist.isend(torch.tensor([2.0]), 1, tag=2)
        b.wait()
        a.wait()
        return None
    x, y = torch.empty(1), torch.empty(1)
    wy, wx = dist.irecv(y, 0, tag=2), dist.irecv(x, 0, tag=1)
    wy.wait()
    wx.wait()
    return [float(y), float(x)]


def test_p2p_matches_in_order_not_by_tag(strict_pool):
    assert strict_pool.run(_tags_are_ignored)[1] == [1.0, 2.0]  # gloo alone gives [2.0, 1.0]


def test_a_send_waited_before_its_receive_is_posted_hangs_as_on_nccl(strict_pool):
    """NCCL does not buffer sends; neither does gloo's tcp transport (nothing to emulate: this keeps it so)."""
    assert strict_pool.run(_ring_batch) == [[1.0] * 3, [0.0] * 3]
    with pytest.raises(DistFailure, match="(?i)timed out"):
        strict_pool.run(_send_first_then_receive, timeout=30)
    strict_pool.close()  # a gloo timeout closes the world's pairs: the next use starts a fresh one


# ---- staged communication (parallel/staged.py): device tensors over gloo through host copies ----

@pytest.fixture(scope="module")
def staged_pool():
    pool = DistPool(2, collective_timeout_s=20.0)
    yield pool
    pool.close()


def _staged_collectives():
    """Every call shape the methods use, with every tensor staged (stage_all: CPU stands in for the device, so a
    result that is not copied back shows as a wrong value)."""
    from comfyui_hybrid_parallel.parallel import staged
    if not staged.StagedComm.installed():
        staged.StagedComm(stage_all=True).install()
    r = dist.get_rank()
    out = {}
    t = torch.full((3,), float(r + 1))
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    b = torch.full((2,), float(r + 5))
    dist.broadcast(b, src=1)
    out["broadcast"] = b.tolist()
    got = [torch.empty(2) for _ in range(2)]
    dist.all_gather(got, torch.full((2,), float(r)))
    out["all_gather"] = [g.tolist() for g in got]
    flat = torch.empty(4)
    dist.all_gather_into_tensor(flat, torch.full((2,), float(10 + r)))
    out["all_gather_into_tensor"] = flat.tolist()
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(4, dtype=torch.float32) * (r + 1))
    out["reduce_scatter_tensor"] = rs.tolist()
    recv = torch.empty(3)
    send = torch.tensor([r * 10.0, r * 10.0 + 1, r * 10.0 + 2])
    work = dist.all_to_all_single(recv, send, output_split_sizes=[1, 2] if r == 0 else [2, 1],
                                  input_split_sizes=[1, 2] if r == 0 else [2, 1], async_op=True)
    work.wait()
    out["all_to_all_single_async"] = recv.tolist()
    peer = 1 - r
    buf = torch.empty(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), float(r + 7)), peer),
                                    dist.P2POp(dist.irecv, buf, peer)])
    for w in works:
        w.wait()
    out["batch_p2p"] = buf.tolist()
    return out


def test_staged_collectives_write_their_results_back_to_the_device_tensors(staged_pool):
    res = staged_pool.run(_staged_collectives)
    for r, got in enumerate(res):
        assert got["all_reduce"] == [3.0] * 3
        assert got["broadcast"] == [6.0, 6.0]
        assert got["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert got["all_gather_into_tensor"] == [10.0, 10.0, 11.0, 11.0]
        assert got["reduce_scatter_tensor"] == ([0.0, 3.0] if r == 0 else [6.0, 9.0])
        assert got["all_to_all_single_async"] == ([0.0, 10.0, 11.0] if r == 0 else [1.0, 2.0, 12.0])
        assert got["batch_p2p"] == [float(1 - r + 7)] * 2
