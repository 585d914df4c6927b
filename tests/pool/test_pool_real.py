"""The pool on real torch.distributed (gloo) workers: 2 ranks, one world reused across the module - the jobs that need
no model (a model's forward, loop, residency and eviction through the pool: tests/families/test_native_pool.py and
test_native_pipefusion.py, on ComfyUI's own models)."""
import os
import time

import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import (JobCancelled, JobTimeout, WorkerDied, WorkerError, WorkerOOM,
                                             WorkerPool)
from comfyui_hybrid_parallel.workers.transport import list_prefix
from test_pool_fake import DTYPES, SHAPES, _alive, _sample

pytestmark = pytest.mark.dist

SP2 = ParallelConfig(ulysses_degree=2)


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(device="cpu", job_timeout_s=120, max_models=2)
    p.ensure_world(SP2)
    yield p
    p.close()


def test_world_and_health(pool):
    r = pool.submit(SP2, "steps", {"n": 3})
    assert [v["value"] for v in r.per_rank] == [3.0 * 3, 3.0 * 3]  # step 3 * (1 + 2), all-reduced
    h = pool.health()
    assert [x["rank"] for x in h] == [0, 1] and all(x["device"] == "cpu" and x["state"] == "idle" for x in h)
    assert all(_alive(x["pid"]) and x["rss_bytes"] > 10_000_000 for x in h)


@pytest.mark.parametrize("in_place", [False, True], ids=["copied", "changing-in-place"])
def test_tensors_round_trip_exactly(pool, in_place):
    """Every dtype and shape (empty ones too), copied by the workers or - named `changing`, as a step's latent is -
    used in place in the driver's arena."""
    tensors = {f"t{i}_{j}": _sample(d, s, 100 + i * 10 + j) for i, d in enumerate(DTYPES) for j, s in enumerate(SHAPES)}
    out = pool.submit(SP2, "echo", {"changing": list(tensors) if in_place else []}, tensors).tensors
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape and torch.equal(out[k], t), k
    assert set(list_prefix(pool.shm_prefix)) <= pool.arena_files()


def test_no_shm_leak_after_100_jobs(pool):
    before = set(os.listdir("/dev/shm"))
    x = torch.randn(16, 32, 32)
    for i in range(100):
        out = pool.submit(SP2, "echo", {}, {"x": x, "i": torch.tensor(i)}).tensors
        assert int(out["i"]) == i and torch.equal(out["x"], x)
    assert set(list_prefix(pool.shm_prefix)) <= pool.arena_files()
    new = {os.path.join("/dev/shm", n) for n in set(os.listdir("/dev/shm")) - before if n.startswith("chp-")}
    assert new <= pool.arena_files() and len(new) <= 2  # the two reused arenas, nothing per job


def test_progress_and_cancel_within_one_step(pool):
    seen = []

    def progress(step, total):
        seen.append((step, total))
        if step == 2:
            pool.cancel()
    gen = pool.generation
    with pytest.raises(JobCancelled):
        pool.submit(SP2, "steps", {"n": 40, "sleep_s": 0.05}, progress=progress)
    assert seen[:2] == [(1, 40), (2, 40)] and len(seen) <= 3
    assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2 and pool.generation == gen


def test_oom_reported_with_config(pool):
    gen = pool.generation
    with pytest.raises(WorkerOOM, match="out of memory on rank 0 of ulysses2"):
        pool.submit(SP2, "steps", {"n": 1, "alloc_bytes": 1 << 52})
    assert pool.submit(SP2, "steps", {"n": 1}).values["steps"] == 1 and pool.generation == gen


@pytest.mark.parametrize("fault, exc, match", [
    ({"raise_at": 2}, WorkerError, "injected failure at step 2 on rank 1"),
    ({"die_at": 2}, WorkerDied, "rank 1"),
    ({"hang_at": 2}, JobTimeout, "did not finish"),
])
def test_fault_then_success(pool, fault, exc, match):
    gen = pool.generation
    t0 = time.monotonic()
    with pytest.raises(exc, match=match) as info:
        pool.submit(SP2, "steps", {"n": 4, **fault}, timeout_s=4.0)
    assert time.monotonic() - t0 < 10.0
    if exc is WorkerError:
        assert info.value.rank == 1 and "injected failure" in info.value.remote_traceback
    assert not pool.running  # rank 0 was stuck in the step's all-reduce: the world was stopped
    assert pool.submit(SP2, "steps", {"n": 2}).values["value"] == 2.0 * 3
    assert pool.generation == gen + 1
