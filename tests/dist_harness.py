"""Run a test body on N gloo processes on CPU, and never hang.

A `DistPool` spawns N processes once (importing torch costs seconds on this
machine) and keeps them, with their gloo world, across tests. `run(fn, ...)`
calls `fn` on every rank and returns the per-rank results. If any rank raises,
the test fails with that rank's traceback; ranks still blocked in a collective
are given a short grace period and then the world is torn down and respawned
for the next test, so one failure never hangs or poisons the rest. A per-call
timeout turns a hang into a failure the same way.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import time
import traceback

GRACE_S = 5.0


class DistFailure(AssertionError):
    """One or more ranks failed, hung or died; the message carries their tracebacks."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(backend: str, world: int) -> str:
    """"auto": NCCL with one GPU per rank when there are enough GPUs (the benchmarks), else gloo."""
    if backend != "auto":
        return backend
    import torch
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"


def _worker_main(rank: int, world: int, port: int, conn, collective_timeout_s: float, backend: str = "gloo") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["HP_TEST_RANK"] = str(rank)  # comfy_env.setup_comfy configures ComfyUI here as a worker's
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = _backend(backend, world)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=collective_timeout_s))
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, the driver decides
            conn.send(("err", traceback.format_exc()))
    dist.destroy_process_group()


# What every rank imports before its first body: loaded once by multiprocessing's fork server, then forked into each
# rank of each world. A fresh interpreter per rank paid these imports 2, 4 or 8 times per world on 2 cores (heavy
# imports took 25 s per rank of an 8-rank world). Names importable from site-packages only: Python 3.11's fork
# server preloads before it receives the tests' sys.path (ComfyUI is not there), and skips a name it cannot import.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "safetensors.torch", "comfyui_hybrid_parallel.parallel"]


def _context():
    """multiprocessing's fork server where the platform has one (the ranks are fresh forks of one interpreter that
    holds no thread and no gloo state), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class DistPool:
    def __init__(self, world_size: int, collective_timeout_s: float = 60.0, backend: str = "gloo"):
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self.backend = backend
        self.procs, self.conns = [], []
        self.spawns = 0

    def _start(self) -> None:
        ctx = _context()
        port = _free_port()
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, args=(r, self.world_size, port, child, self.collective_timeout_s,
                                                          self.backend),
                            daemon=True, name=f"dist-test-rank{r}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self.spawns += 1
        deadline = time.monotonic() + 120
        for r, c in enumerate(self.conns):
            if not c.poll(max(0.0, deadline - time.monotonic())):
                self.close()
                raise DistFailure(f"rank {r} of a {self.world_size}-process gloo world did not start in 120 s")
            c.recv()

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def run(self, fn, *args, timeout: float = 120.0, **kwargs) -> list:
        """Call fn(*args, **kwargs) on every rank; return the results in rank order."""
        if not self.procs:
            self._start()
        for c in self.conns:
            c.send((fn, args, kwargs))
        results, errors = [None] * self.world_size, {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout
        while pending:
            now = time.monotonic()
            if now > deadline:
                break
            for r in sorted(pending):
                c = self.conns[r]
                try:
                    if not c.poll(0.01):
                        continue
                    status, payload = c.recv()
                except (EOFError, OSError):
                    status, payload = "err", f"rank {r} died (exit code {self.procs[r].exitcode})"
                pending.discard(r)
                if status == "ok":
                    results[r] = payload
                else:
                    errors[r] = payload
                    deadline = min(deadline, time.monotonic() + GRACE_S)
        if not errors and not pending:
            return results
        name = getattr(fn, "__name__", repr(fn))
        parts = [f"--- rank {r} raised ---\n{tb}" for r, tb in sorted(errors.items())]
        if pending:
            parts.append(f"--- ranks {sorted(pending)} did not finish "
                         f"({'after another rank failed' if errors else f'within {timeout:.0f} s: hang?'}) ---")
        if pending:  # ranks stuck in a collective: this world is unusable, respawn on next use
            self.close()
        raise DistFailure(f"{name} failed on a {self.world_size}-rank world:\n" + "\n".join(parts))


# ---- helpers for test bodies (run inside the workers) ----
_contexts: dict = {}


def context_for(config, device=None):
    """The ParallelContext for `config` in this worker, created once (new_group is collective)."""
    from comfyui_hybrid_parallel.parallel import ParallelContext

    key = config.mesh_key()
    if key not in _contexts:
        _contexts[key] = ParallelContext(config) if device is None else ParallelContext(config, device=device)
    ctx = _contexts[key].with_config(config)
    ctx.stats.reset()
    return ctx
