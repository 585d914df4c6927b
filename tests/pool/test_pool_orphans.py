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


SPARES_DRIVER = textwrap.dedent("""
    import json, sys, tempfile, time
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers import WorkerPool
    from comfyui_hybrid_parallel.workers.spares import Spares
    spares = Spares(tempfile.mkdtemp())
    spares.fill(3)
    unused = [p.pid for p in spares._procs]
    pool = WorkerPool(device="cpu")
    pool.spares = spares
    r = pool.submit(ParallelConfig(ulysses_degree=2), "steps", {"n": 2})
    used = [h["pid"] for h in pool.health()]
    print(json.dumps([unused, used, [v["value"] for v in r.per_rank], spares.count()]), flush=True)
    time.sleep(600)
""")


def test_spare_interpreters_become_workers_and_die_with_the_driver():
    """Interpreters started ahead (torch imported) are taken by the next world instead of new processes: the
    workers' pids are the spares' and the job is computed by them; the unused spare and the workers exit when
    the driver is SIGKILLed (stdin EOF / the parent watch)."""
    driver = subprocess.Popen([sys.executable, "-c", SPARES_DRIVER], stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        unused, used, values, left = json.loads(driver.stdout.readline())
        assert sorted(used) == sorted(unused[:2]) and left == 1, (unused, used, left)
        assert values == [6.0, 6.0]  # step 2 * (1 + 2), all-reduced over the two former spares
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(10)
    survivors = _survivors(unused)
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
