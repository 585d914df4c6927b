"""The fork server (workers/forkserver.py) on real workers: which worlds it forks and which start fresh interpreters,
and that a closed server lets its running world finish before it exits."""
import gc
import subprocess

import pytest

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import forkserver
from comfyui_hybrid_parallel.workers.bootstrap import imports_without_gc
from comfyui_hybrid_parallel.workers.pool import WorkerPool
from test_pool_fake import _alive
from test_pool_orphans import _parent, _survivors

pytestmark = pytest.mark.skipif(not forkserver.enabled(), reason="the fork server runs on Linux only")

U2 = ParallelConfig(ulysses_degree=2)


def _steps(pool, config=U2) -> list:
    return [v["value"] for v in pool.submit(config, "steps", {"n": 2}).per_rank]


def _gc(pool) -> list:
    return [v["gc"] for v in pool.submit(U2, "health", {}).per_rank]


def test_a_world_whose_import_time_environment_differs_gets_fresh_interpreters(forks):
    """A variable torch or OpenMP reads when imported (IMPORT_TIME_ENV) cannot reach a fork of a server that imported
    them already: such a world starts fresh interpreters, one with the server's values forks; the thread count
    (OMP_NUM_THREADS, set per world and applied by each rank) does not count. A pool's own server starts in its first
    world's environment. Either way a rank's garbage collector runs (its imports only pause it); a fork does not
    walk what the server imported (frozen there: workers/bootstrap.imports_without_gc)."""
    assert forkserver.import_time_env({"OMP_NUM_THREADS": "3", "TORCH_LOGS": "+dynamo", "HOME": "/x"}) == {
        "TORCH_LOGS": "+dynamo"}
    with WorkerPool(device="cpu", forks=forks, env={"HP_WORKER_CPUS": ""}) as pool:  # not read at import: forked
        assert _steps(pool) == [6.0, 6.0]
        assert all(isinstance(p, forkserver.ForkedProcess) for p in pool.world.procs)
        assert {_parent(p.pid) for p in pool.world.procs} == {forks.pid} == {pool.fork_server_pid}
        assert all(g["enabled"] and g["frozen"] > 100_000 for g in _gc(pool))  # torch's objects, frozen
    other = {"TORCH_SHOW_CPP_STACKTRACES": "1"}
    with WorkerPool(device="cpu", forks=forks, env=other) as pool:  # the running server imported torch without it
        assert _steps(pool) == [6.0, 6.0]
        assert all(isinstance(p, subprocess.Popen) for p in pool.world.procs) and pool.fork_server_pid is None
        assert _gc(pool) == [{"enabled": True, "frozen": 0}] * 2
    with WorkerPool(device="cpu", env=other) as pool:  # its own server, started with it
        assert _steps(pool) == [6.0, 6.0]
        assert all(isinstance(p, forkserver.ForkedProcess) for p in pool.world.procs)
        assert pool.fork_server_pid not in (None, forks.pid)
        with open(f"/proc/{pool.fork_server_pid}/environ", "rb") as f:
            assert b"TORCH_SHOW_CPP_STACKTRACES=1" in f.read().split(b"\0")


def test_a_closed_server_lets_its_world_finish_then_exits(tmp_path):
    """close() stops the forking, not the workers: the running world still computes, a new world starts fresh
    interpreters, and the server exits once its last worker has."""
    server = forkserver.ForkServer(str(tmp_path))
    pool = WorkerPool(device="cpu", forks=server)
    try:
        assert _steps(pool) == [6.0, 6.0]
        forked = [p.pid for p in pool.world.procs]
        server.close()
        assert _steps(pool) == [6.0, 6.0] and [p.pid for p in pool.world.procs] == forked  # the same world
        assert _alive(server.pid)
        assert _steps(pool, ParallelConfig(cfg_degree=2, ulysses_degree=2)) == [20.0] * 4  # a new world...
        assert all(isinstance(p, subprocess.Popen) for p in pool.world.procs)  # ...of fresh interpreters
        assert _survivors(forked) == [] and _survivors([server.pid], wait_s=5.0) == []
        assert server.gone() and server.proc.returncode == 0
    finally:
        pool.close()


def test_imports_pause_the_collector_and_restore_it():
    """The pause ends with the block, an error included, and leaves a collector that was off (an outer pause) off;
    `freeze` moves what exists out of the collector's sight."""
    assert gc.isenabled()
    with pytest.raises(KeyError):
        with imports_without_gc():
            assert not gc.isenabled()
            with imports_without_gc():
                pass
            assert not gc.isenabled()  # the inner pause does not end the outer one
            raise KeyError("x")
    assert gc.isenabled()
    try:
        with imports_without_gc(freeze=True):
            kept = [[] for _ in range(10)]
        assert gc.isenabled() and gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
