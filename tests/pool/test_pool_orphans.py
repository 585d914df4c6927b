"""A SIGKILLed driver leaves no worker behind (workers watch their control connection and parent pid)."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from comfyui_hybrid_parallel.workers.transport import list_prefix
from test_pool_fake import _alive

DRIVER = textwrap.dedent("""
    import json, sys, torch
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers import WorkerPool
    fake = sys.argv[1] if sys.argv[1] != "real" else None
    pool = WorkerPool(fake=fake, device="cpu")
    cfg = ParallelConfig(ulysses_degree=2)
    pool.submit(cfg, "steps", {"n": 1})
    print(json.dumps([[h["pid"] for h in pool.health()], pool.tmpdir, pool.shm_prefix]), flush=True)
    # in flight when the driver is killed, with an input tensor in shared memory
    pool.submit(cfg, "steps", {"n": 100000, "sleep_s": 0.05}, {"x": torch.ones(1000)})
""")


@pytest.mark.parametrize("kind", ["serve", "real"])
def test_sigkill_driver_leaves_no_workers(kind):
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, kind], stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        line = driver.stdout.readline()
        pids, tmpdir, prefix = json.loads(line)
        assert len(pids) == 2 and all(_alive(p) for p in pids) and os.path.isdir(tmpdir)
        deadline = time.monotonic() + 10.0
        while not list_prefix(prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list_prefix(prefix), "the in-flight job's input should be in shared memory"
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    survivors = _survivors(pids)
    assert survivors == [], f"workers {survivors} outlived their SIGKILLed driver by 10 s"
    # the orphans cleaned up what the driver could not
    assert list_prefix(prefix) == [] and not os.path.exists(tmpdir)


def test_normal_driver_exit_stops_workers_and_cleans_up():
    code = DRIVER.replace('pool.submit(cfg, "steps", {"n": 100000', 'pool.submit(cfg, "steps", {"n": 1')
    out = subprocess.run([sys.executable, "-c", code, "serve"], capture_output=True, text=True, cwd="/tmp",
                         timeout=60)
    assert out.returncode == 0, out.stderr
    pids, tmpdir, prefix = json.loads(out.stdout.splitlines()[0])
    assert not any(_alive(p) for p in pids)  # stopped by the pool's finalizer at interpreter exit
    assert list_prefix(prefix) == [] and not os.path.exists(tmpdir)


FORKS_DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers import WorkerPool
    pool = WorkerPool(device="cpu")
    worlds = []
    for cfg in (ParallelConfig(ulysses_degree=2), ParallelConfig(cfg_degree=2, ulysses_degree=2)):
        r = pool.submit(cfg, "steps", {"n": 2})
        worlds.append([[h["pid"] for h in pool.health()], [v["value"] for v in r.per_rank]])
    print(json.dumps([os.getpid(), worlds]), flush=True)
    time.sleep(600)
""")


def _parent(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def test_workers_fork_from_one_server_that_dies_with_the_driver():
    """Every world's workers are forks of one fork server (workers/forkserver.py), the driver's child: a second world
    forks too, its ranks compute; the server and the workers exit when the driver is SIGKILLed (the server watches
    the driver, the workers their parent)."""
    driver = subprocess.Popen([sys.executable, "-c", FORKS_DRIVER], stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        driver_pid, worlds = json.loads(driver.stdout.readline())
        (first, values2), (second, values4) = worlds
        assert values2 == [6.0] * 2 and values4 == [20.0] * 4, worlds  # step 2 * (1 + ... + n), all-reduced
        servers = {_parent(p) for p in second}
        assert len(servers) == 1 and _parent(next(iter(servers))) == driver_pid, servers
        assert not any(_alive(p) for p in first)  # the first world was stopped for the second
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    survivors = _survivors([*second, *servers])
    assert survivors == [], f"{survivors} outlived their SIGKILLed driver by 10 s"


def _survivors(pids, wait_s: float = 10.0) -> list:
    """The pids still alive after `wait_s`; killed, so that a failing test leaves nothing behind."""
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [p for p in pids if _alive(p)]
    for p in survivors:
        os.kill(p, signal.SIGKILL)
    return survivors
