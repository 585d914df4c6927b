"""The worker's message loop, shared by the real worker and the fake one (no torch here).

Two threads, because a worker busy in a job must still hear `cancel` and notice
that its driver is gone: the reader thread owns all receives (jobs go to a
queue, cancels mark the job id, EOF or a changed parent pid exits the process
at once so no worker outlives a SIGKILLed driver), and the main thread runs one
job at a time and sends its progress and result.
"""
from __future__ import annotations

import os
import queue
import shutil
import signal
import threading
import time
import traceback

from .protocol import ProtocolError

PARENT_POLL_S = 1.0
EXIT_DRIVER_GONE = 3


class Cancelled(Exception):
    """The driver cancelled the job; all ranks stop at the same step."""


class JobRun:
    """What a handler sees of its job: progress reporting and the cancel flag."""

    def __init__(self, channel, job_id: int, rank: int, cancelled: set):
        self.channel, self.job_id, self.rank = channel, job_id, rank
        self._cancelled = cancelled

    @property
    def cancel_requested(self) -> bool:
        return self.job_id in self._cancelled

    def progress(self, step: int, total: int, preview: dict | None = None) -> None:
        """Rank 0 speaks for the world, so the driver sees each step once. `preview`: the descriptor of a
        tensor rank 0 wrote to its preview arena (the driver copies it out before it answers the step)."""
        if self.rank == 0:
            extra = {"preview": preview} if preview is not None else {}
            self.channel.send("progress", job=self.job_id, step=int(step), total=int(total), **extra)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def error_fields(exc: BaseException, rank: int) -> dict:
    kind = "cancelled" if isinstance(exc, Cancelled) else "oom" if is_oom(exc) else "error"
    return {"ok": False, "error": {"kind": kind, "type": type(exc).__name__, "message": str(exc)[:2000],
                                   "traceback": traceback.format_exc()[-20000:], "rank": rank}}


class ParentWatch:
    """Exit as soon as the driver is gone, even while still importing torch or joining the world.

    A SIGKILLed driver cannot clean up, so the orphan does: it removes the
    pool's shared-memory files (`prefix`, known once the world is described)
    and rank 0 removes the pool's private temp dir (`tmpdir`).
    """

    def __init__(self, driver_pid: int, rank: int):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; it stops us
        self.driver_pid, self.rank = driver_pid, rank
        self.prefix: str | None = None
        self.tmpdir: str | None = None
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            if self.driver_gone():
                self.exit()
            time.sleep(PARENT_POLL_S)

    def driver_gone(self) -> bool:
        # driver_pid 0: started by torchrun, maybe on another machine; the control channel's EOF tells
        return self.driver_pid != 0 and os.getppid() != self.driver_pid

    def exit(self) -> None:
        """Exit; clean up only if the driver is really gone (EOF may come a moment before reparenting).

        A live driver that hung up on us (e.g. while killing the world) still owns
        its files and temp dir, which a world started next may already use.
        """
        deadline = time.monotonic() + 2.0
        while not self.driver_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            if not self.driver_gone():
                return
            if self.prefix:
                from .transport import cleanup_prefix
                cleanup_prefix(self.prefix)
            if self.rank == 0 and self.tmpdir and os.path.basename(self.tmpdir).startswith("chp-pool-"):
                shutil.rmtree(self.tmpdir, ignore_errors=True)
        finally:
            os._exit(EXIT_DRIVER_GONE)


HEARTBEAT_S = 1.0  # while a job runs, each rank says it is alive this often (the driver detects stalls by it)


def _heartbeat(channel, rank: int, running: dict) -> None:
    """A thread of its own, so a rank computing or waiting in a collective (both release the GIL) still
    beats; a stopped, frozen or deadlocked process does not - which is exactly what the driver looks for."""
    while True:
        time.sleep(HEARTBEAT_S)
        job = running.get("job")
        if job is not None:
            try:
                channel.send("heartbeat", job=job, rank=rank)
            except (OSError, ValueError):
                return


def serve(channel, rank: int, execute, watch: ParentWatch) -> None:
    """Run jobs until `stop`; `execute(msg, run) -> result fields` (it reports its own errors)."""
    jobs: queue.Queue = queue.Queue()
    cancelled: set = set()
    running: dict = {"job": None}
    threading.Thread(target=_heartbeat, args=(channel, rank, running), name="heartbeat", daemon=True).start()

    def reader() -> None:
        while True:
            try:
                msg = channel.recv(expect={"job", "cancel", "stop"}, timeout=PARENT_POLL_S)
            except TimeoutError:
                if watch.driver_gone():
                    watch.exit()
                continue
            except (EOFError, OSError, ProtocolError):
                # The driver died or is not ours any more: nobody will collect our results.
                watch.exit()
            if msg["t"] == "cancel":
                cancelled.add(int(msg["job"]))
            elif msg["t"] == "stop":
                jobs.put(None)
                return
            else:
                jobs.put(msg)

    threading.Thread(target=reader, name="driver-reader", daemon=True).start()
    while True:
        msg = jobs.get()
        if msg is None:
            return
        job_id = int(msg["job"])
        run = JobRun(channel, job_id, rank, cancelled)
        running["job"] = job_id
        try:
            fields = execute(msg, run)
        except BaseException as e:  # noqa: BLE001 - the driver decides what a failure means
            fields = error_fields(e, rank)
        running["job"] = None
        cancelled.discard(job_id)
        try:
            channel.send("result", job=job_id, rank=rank, **fields)
        except (OSError, ValueError):
            watch.exit()  # the driver hung up: nobody will read this result
