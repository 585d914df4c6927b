"""The pool's lifecycle, transport and fault handling on fake workers (no torch.distributed; fast)."""
import glob
import os
import socket
import threading
import time

import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import (JobCancelled, JobTimeout, WorkerDied, WorkerError, WorkerPool)
from comfyui_hybrid_parallel.workers.transport import list_prefix

SP2 = ParallelConfig(ulysses_degree=2)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    p = WorkerPool(fake="serve", job_timeout_s=30)
    yield p
    p.close()


def _pids(pool):
    return [h["pid"] for h in pool.health()]


def test_start_reuse_resize_stop(pool):
    pool.submit(SP2, "steps", {"n": 1})
    gen, pids = pool.generation, _pids(pool)
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    # another config with the same mesh reuses the world
    pool.submit(ParallelConfig(ulysses_degree=2, warmup_steps=3), "steps", {"n": 1})
    assert pool.generation == gen and _pids(pool) == pids
    # a different mesh restarts it, with the new world size
    r = pool.submit(ParallelConfig(ulysses_degree=2, cfg_degree=2), "steps", {"n": 2})
    assert pool.generation == gen + 1 and len(r.per_rank) == 4
    assert r.values["value"] == 2 * 4 * 5 // 2
    new_pids = _pids(pool)
    assert not set(new_pids) & set(pids)
    time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    pool.stop()
    assert not pool.running
    time.sleep(0.2)
    assert not any(_alive(p) for p in new_pids)
    assert pool.health() == []
    assert pool.submit(SP2, "steps", {"n": 1}).values["steps"] == 1  # usable after stop


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


def _sample(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype == torch.int64:
        return torch.randint(-2**40, 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


def test_tensors_round_trip_exactly(pool):
    tensors = {f"t{i}_{j}": _sample(d, s, i * 10 + j) for i, d in enumerate(DTYPES) for j, s in enumerate(SHAPES)}
    tensors["noncontig"] = torch.arange(24.).view(4, 6).t()
    out = pool.submit(SP2, "echo", {}, tensors).tensors
    assert set(out) == set(tensors)
    for k, t in tensors.items():
        assert out[k].dtype == t.dtype and out[k].shape == t.shape, k
        assert torch.equal(out[k], t), k
    assert set(list_prefix(pool.shm_prefix)) <= pool.arena_files()


def test_no_shm_leak_after_100_jobs(pool):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    x = torch.randn(4, 64, 64)
    for i in range(100):
        out = pool.submit(SP2, "forward", {}, {"x": x + i}).tensors["out"]
        assert torch.equal(out, x + i)
    assert set(list_prefix(pool.shm_prefix)) <= pool.arena_files()
    if before:
        leaked = {os.path.join("/dev/shm", n) for n in set(os.listdir("/dev/shm")) - before if n.startswith("chp-")}
        assert leaked <= pool.arena_files() and len(leaked) <= 1  # the driver's reused input arena only


def test_progress_events(pool):
    seen = []
    pool.submit(SP2, "steps", {"n": 5}, progress=lambda s, n: seen.append((s, n)))
    assert seen == [(s, 5) for s in range(1, 6)]


def test_cancel_within_one_step(pool):
    seen = []

    def progress(step, total):
        seen.append(step)
        if step == 2:
            pool.cancel()
    with pytest.raises(JobCancelled):
        pool.submit(SP2, "steps", {"n": 50, "sleep_s": 0.05}, progress=progress)
    assert seen[:2] == [1, 2] and len(seen) <= 3
    gen = pool.generation
    assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
    assert pool.generation == gen  # cancel keeps the world


def test_cancel_token_and_callback_exception(pool):
    token = threading.Event()
    threading.Timer(0.3, token.set).start()
    t0 = time.monotonic()
    with pytest.raises(JobCancelled):
        pool.submit(SP2, "steps", {"n": 100, "sleep_s": 0.05}, cancel=token)
    assert time.monotonic() - t0 < 2.0

    class Interrupted(Exception):
        pass

    def progress(step, total):
        raise Interrupted("user pressed cancel")
    with pytest.raises(Interrupted):
        pool.submit(SP2, "steps", {"n": 100, "sleep_s": 0.05}, progress=progress)
    assert pool.submit(SP2, "steps", {"n": 1}).values["steps"] == 1


def test_bad_input_refused_before_work(pool):
    pool.submit(SP2, "steps", {"n": 1})
    gen = pool.generation
    with pytest.raises(ValueError, match="unknown job kind"):
        pool.submit(SP2, "nope")
    with pytest.raises(ValueError, match="JSON"):
        pool.submit(SP2, "steps", {"n": object()})
    with pytest.raises(TypeError, match="torch.Tensor"):
        pool.submit(SP2, "echo", {}, {"x": [1, 2]})
    with pytest.raises(ValueError, match="unknown model family"):
        pool.ensure_model(SP2, "k", "sdxl", state_dict={})
    with pytest.raises(ValueError, match="fake behaviour"):
        WorkerPool(fake="explode")
    assert pool.generation == gen and pool.submit(SP2, "steps", {"n": 1}).values["steps"] == 1


def test_residency_counter(pool):
    sd = {"w": torch.ones(3)}
    first = pool.ensure_model(SP2, "m1", "flux", state_dict=sd)
    again = pool.ensure_model(SP2, "m1", "flux", state_dict=sd)
    assert first["loaded"] and not again["loaded"] and again["loads"] == first["loads"]


@pytest.mark.parametrize("behaviour, exc, match", [
    ("raise:1", WorkerError, "fake worker rank 1 raised"),
    ("die:1", WorkerDied, "rank 1"),
    ("hang:1", JobTimeout, "did not finish"),
])
def test_fault_then_success(behaviour, exc, match):
    with WorkerPool(fake=behaviour, job_timeout_s=30) as pool:
        pool.ensure_world(SP2)
        t0 = time.monotonic()
        timeout = 2.0 if behaviour.startswith("hang") else None
        with pytest.raises(exc, match=match) as info:
            pool.submit(SP2, "steps", {"n": 3}, timeout_s=timeout)
        assert time.monotonic() - t0 < 10.0
        if exc is WorkerError:
            assert info.value.rank == 1 and "Traceback" in info.value.remote_traceback
        r = pool.submit(SP2, "steps", {"n": 3})
        assert r.values["steps"] == 3
        assert set(list_prefix(pool.shm_prefix)) <= pool.arena_files()


def test_slow_worker_reports_progress():
    with WorkerPool(fake="slow") as pool:
        seen = []
        t0 = time.monotonic()
        pool.submit(SP2, "steps", {"n": 3}, progress=lambda s, n: seen.append(s))
        assert seen == [1, 2, 3] and time.monotonic() - t0 >= 0.6


def _attack(path_glob, stop):
    """Connect to the control socket and send garbage / silence until told to stop."""
    while not stop.is_set():
        for path in glob.glob(path_glob):
            for payload in (b"\x00garbage\xff" * 10, b"", b"\x80\x04\x95" + os.urandom(64)):
                try:
                    s = socket.socket(socket.AF_UNIX)
                    s.settimeout(0.5)
                    s.connect(path)
                    s.sendall(payload)
                    s.close()
                except OSError:
                    pass
        time.sleep(0.01)


def test_unauthenticated_peers_refused_during_startup():
    with WorkerPool(fake="serve", env={"CHP_FAKE_CONNECT_DELAY_S": "0.5"}) as pool:
        stop = threading.Event()
        t = threading.Thread(target=_attack, args=(os.path.join(pool.tmpdir, "ctl-*.sock"), stop), daemon=True)
        t.start()
        try:
            r = pool.submit(SP2, "steps", {"n": 2})
        finally:
            stop.set()
            t.join(5)
        assert r.values["steps"] == 2 and pool.generation == 1
        assert pool.submit(SP2, "echo", {}, {"x": torch.ones(2)}).tensors["x"].sum() == 2


def test_health_while_busy(pool):
    pool.submit(SP2, "steps", {"n": 1})
    idle = pool.health()
    t = threading.Thread(target=pool.submit, args=(SP2, "steps", {"n": 6, "sleep_s": 0.05}))
    t.start()
    time.sleep(0.1)
    busy = pool.health()
    t.join(10)
    assert [h["state"] for h in busy] == ["busy", "busy"]
    assert [h["pid"] for h in busy] == [h["pid"] for h in idle]
    assert all(h["resident"] == idle[0]["resident"] for h in busy)


def test_release_waits_for_a_health_query_holding_the_pool(pool):
    """ComfyUI's /free arriving while the panel's health query holds the pool still releases the models (it was
    lost when the unload gave up on a held lock at once: the CI's /free test, polled every 0.2 s, met it)."""
    pool.release_models()  # the module's pool: what earlier tests left resident
    pool.ensure_model(SP2, "held", "flux", state_dict={"w": torch.zeros(3)})
    assert all("held" in h["resident"] for h in pool.health())
    holding = threading.Event()

    def health_like():
        with pool._lock:  # what health() / any short job does
            holding.set()
            time.sleep(0.5)

    t = threading.Thread(target=health_like)
    t.start()
    holding.wait(5)
    assert pool.release_models() == 1
    t.join(5)
    assert all(h["resident"] == [] for h in pool.health())
    assert pool.release_models() == 0  # nothing left to release
    pool.submit(SP2, "steps", {"n": 1})  # the world stays usable


def test_cuda_requested_without_cuda_is_refused_before_starting():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")  # not counted: the CPU run below is the check
    from comfyui_hybrid_parallel.workers import PoolError
    with WorkerPool(device="cuda") as p:
        with pytest.raises(PoolError, match="device='cpu'"):
            p.submit(SP2, "steps", {"n": 1})
        assert p.generation == 0 and p.world is None


def test_worker_killed_while_idle_restarts_transparently(pool):
    import signal
    pool.submit(SP2, "steps", {"n": 1})
    gen, pids = pool.generation, _pids(pool)
    os.kill(pids[1], signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pool.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
    assert pool.generation == gen + 1 and not set(_pids(pool)) & set(pids)


def test_a_worker_that_dies_while_idle_is_reaped_at_once():
    """No zombie until the next job: the world collects an exited worker within a second or so."""
    import signal
    p = WorkerPool(fake="serve", job_timeout_s=30)
    try:
        p.submit(SP2, "steps", {"n": 1})
        pid = _pids(p)[1]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), "the killed worker is still a zombie"
        p.submit(SP2, "steps", {"n": 1})  # and the next job restarts the world
    finally:
        p.close()


def test_leftovers_of_dead_pools_are_swept_when_a_pool_starts(tmp_path):
    """A ComfyUI killed together with its workers leaves its pool folder, its fork server's folder and shared-memory
    files; the next pool removes those of dead processes, and never a live pool's."""
    import subprocess
    import tempfile

    from comfyui_hybrid_parallel.workers.transport import shm_dir
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead_shm = os.path.join(shm_dir(), f"chp-{gone.pid}-deadbeef-0123")
    live_shm = os.path.join(shm_dir(), f"chp-{os.getpid()}-cafebabe-0123")
    dead_dir = os.path.join(tempfile.gettempdir(), f"chp-pool-{gone.pid}-x1")
    dead_forks = os.path.join(tempfile.gettempdir(), f"chp-forks-{gone.pid}-x1")  # a killed server's fork server cwd
    os.makedirs(dead_forks)
    for path in (dead_shm, live_shm):
        with open(path, "wb") as f:
            f.write(b"\0" * 4096)
    os.makedirs(dead_dir)
    open(os.path.join(dead_dir, "ctl-1.sock"), "w").close()
    try:
        p = WorkerPool(fake="serve")
        p.close()
        assert not os.path.exists(dead_shm) and not os.path.exists(dead_dir) and not os.path.exists(dead_forks)
        assert os.path.exists(live_shm)
    finally:
        for path in (dead_shm, live_shm):
            if os.path.exists(path):
                os.unlink(path)


def _stop_rank_when(pool, rank, seen, step):
    """SIGSTOP `rank` once rank 0 has reported `step` (in a thread: the job is running)."""
    import signal

    def run():
        while len(seen) < step:
            time.sleep(0.02)
        os.kill(pool.world.procs[rank].pid, signal.SIGSTOP)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _resume_all(pids):
    import signal
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_hung_rank_is_named_within_the_stall_timeout_and_the_next_job_works():
    """SIGSTOP one rank mid-run (the probe: ~120 s until gloo's timeout, then a plain error): its heartbeat
    stops and the job fails naming it after stall_timeout_s; the world restarts for the next job."""
    from comfyui_hybrid_parallel.workers import WorkerStalled
    with WorkerPool(fake="serve", job_timeout_s=120, stall_timeout_s=2.0) as pool:
        pool.submit(SP2, "steps", {"n": 1})
        pids = _pids(pool)
        seen = []
        _stop_rank_when(pool, 1, seen, 2)
        t0 = time.monotonic()
        try:
            with pytest.raises(WorkerStalled, match=r"worker rank 1 .* sent nothing for \d+ s"):
                pool.submit(SP2, "steps", {"n": 400, "sleep_s": 0.05}, progress=lambda s, n: seen.append(s))
            took = time.monotonic() - t0
        finally:
            _resume_all(pids)
        assert took < 10, took
        assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
        assert _pids(pool) != pids


def test_interrupt_wins_even_when_a_rank_hangs_and_the_next_job_works():
    """Cancel while a rank is stopped: the caller gets its answer within ~2 s (not after gloo's 120 s); the next
    job first collects the cancelled one, finds the stuck rank, and runs on a fresh world."""
    with WorkerPool(fake="serve", job_timeout_s=120, stall_timeout_s=2.0) as pool:
        pool.submit(SP2, "steps", {"n": 1})
        pids = _pids(pool)
        seen, cancel = [], threading.Event()
        stopper = _stop_rank_when(pool, 1, seen, 2)

        def interrupt():
            stopper.join()
            time.sleep(0.2)
            interrupt.at = time.monotonic()
            cancel.set()
        threading.Thread(target=interrupt, daemon=True).start()
        try:
            with pytest.raises(JobCancelled):
                pool.submit(SP2, "steps", {"n": 400, "sleep_s": 0.05}, progress=lambda s, n: seen.append(s),
                            cancel=cancel)
            answered = time.monotonic()
            assert answered - interrupt.at < 2.0, answered - interrupt.at  # the probe: 118-123 s
            # rank 1 stays stopped: the next job must find it, stop that world and run on a fresh one
            assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
            print(f"next job after the stuck rank: {time.monotonic() - answered:.1f} s")
            assert _pids(pool) != pids
        finally:
            _resume_all(pids)


def test_interrupt_answers_at_once_and_healthy_ranks_keep_the_world():
    """A cancel that arrives during a long step: the answer comes within CANCEL_WAIT_S (the step finishes in the
    background), and the next job reuses the same workers."""
    from comfyui_hybrid_parallel.workers.collect import CANCEL_WAIT_S
    with WorkerPool(fake="serve", job_timeout_s=120) as pool:
        pool.submit(SP2, "steps", {"n": 1})
        pids = _pids(pool)
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        t0 = time.monotonic()
        with pytest.raises(JobCancelled):
            pool.submit(SP2, "steps", {"n": 2, "sleep_s": 4.0}, cancel=cancel)
        assert time.monotonic() - t0 < 0.5 + CANCEL_WAIT_S + 1.0
        assert pool.submit(SP2, "steps", {"n": 2}).values["steps"] == 2
        assert _pids(pool) == pids


def test_a_long_run_with_progress_outlives_the_job_timeout():
    """The job deadline moves with progress (the probe: a loop-mode run killed at job_timeout_s mid-run); a job
    that makes no progress for job_timeout_s still times out."""
    with WorkerPool(fake="serve", job_timeout_s=1.0) as pool:
        t0 = time.monotonic()
        assert pool.submit(SP2, "steps", {"n": 30, "sleep_s": 0.1}).values["steps"] == 30
        assert time.monotonic() - t0 > 2.5  # three times the timeout
        with pytest.raises(JobTimeout):
            pool.submit(SP2, "steps", {"n": 1, "sleep_s": 3.0})


_SMALL_SHM_CHILD = r"""
import logging, os, subprocess, sys, torch
logging.basicConfig(level=logging.WARNING)
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool
from comfyui_hybrid_parallel.workers.transport import SharedMemoryFull
root = sys.argv[1]
for name, size in (("shm", "2m"), ("disk", "64m"), ("tiny", "1m")):
    os.makedirs(f"{root}/{name}", exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", f"{root}/{name}"], check=True)
os.environ["HP_SHM_DIR"], os.environ["HP_SHM_FALLBACK_DIR"] = f"{root}/shm", f"{root}/disk"
SP2 = ParallelConfig(ulysses_degree=2)
big = torch.randn(1 << 20)  # 4 MiB: more than the whole 2 MiB /dev/shm
with WorkerPool(fake="serve") as pool:
    out = pool.submit(SP2, "echo", {}, {"a": big}).tensors["a"]
    print("FALLBACK_OK", torch.equal(out, big), flush=True)
os.environ["HP_SHM_FALLBACK_DIR"] = f"{root}/tiny"
with WorkerPool(fake="serve") as pool:
    try:
        pool.submit(SP2, "echo", {}, {"a": big})
        print("NO_ERROR", flush=True)
    except SharedMemoryFull as e:
        print("FULL_ERROR", e, flush=True)
    small = torch.randn(256)
    print("STILL_USABLE", torch.equal(pool.submit(SP2, "echo", {}, {"a": small}).tensors["a"], small), flush=True)
"""


def test_a_full_dev_shm_falls_back_or_fails_clearly_never_a_signal(tmp_path):
    """A 2 MiB tmpfs as /dev/shm (Docker's default is 64 MiB; the probe's writer died of SIGBUS): a 4 MiB tensor
    goes to the fallback directory with a warning naming --shm-size; with no room anywhere the error says so,
    and the pool keeps working for what fits. A mount namespace of its own (unshare) holds the tiny tmpfs."""
    import shutil
    import subprocess
    import sys
    assert shutil.which("unshare"), "this test needs util-linux's unshare"
    res = subprocess.run(["unshare", "-rm", sys.executable, "-c", _SMALL_SHM_CHILD, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    out, err = res.stdout, res.stderr
    assert res.returncode == 0, (res.returncode, out, err[-3000:])  # -7 would be SIGBUS
    assert "FALLBACK_OK True" in out, (out, err[-3000:])
    assert "--shm-size" in err and "disk-backed" in err, err[-3000:]
    assert "FULL_ERROR" in out and "no fallback has room" in out and "--shm-size" in out, out
    assert "STILL_USABLE True" in out, out


def test_a_job_cancelled_before_it_starts_is_not_sent(pool):
    """ComfyUI's interrupt seen between two steps: the next step's job is refused here instead of being sent
    together with its cancel (a race each rank could lose, running whole steps after the interrupt)."""
    pool.submit(SP2, "steps", {"n": 1})
    jobs_before = pool._next_job
    cancel = threading.Event()
    cancel.set()
    t0 = time.monotonic()
    with pytest.raises(JobCancelled, match="before it started"):
        pool.submit(SP2, "steps", {"n": 50, "sleep_s": 0.1}, cancel=cancel)
    assert time.monotonic() - t0 < 0.5 and pool._next_job == jobs_before
    assert pool.submit(SP2, "steps", {"n": 1}).values["steps"] == 1


def test_weights_written_ahead_survive_a_world_restart(pool, monkeypatch):
    """ensure_model writes the weights before it takes the pool (overlapping Parallel Config's prestart); a world
    torn down meanwhile (another world size) must keep those files for the job that carries them, and nothing is
    left behind once it ran."""
    from comfyui_hybrid_parallel.workers.launch import World
    from comfyui_hybrid_parallel.workers.transport import shm_dir
    pool.submit(SP2, "steps", {"n": 1})
    kept = []
    teardown = World.teardown

    def checked(self, graceful=True):
        names = set(pool._written)
        teardown(self, graceful)
        kept.append((len(names), all(os.path.exists(os.path.join(shm_dir(), n)) for n in names)))
    monkeypatch.setattr(World, "teardown", checked)
    sd = {f"w{i}": torch.full((1000,), float(i)) for i in range(20)}
    res = pool.ensure_model(ParallelConfig(ulysses_degree=2, cfg_degree=2), "ahead", "sd3", state_dict=sd)
    assert res["loaded"] and kept and kept[0] == (20, True), kept
    assert not pool._written and set(list_prefix(pool.shm_prefix)) <= pool.arena_files()
