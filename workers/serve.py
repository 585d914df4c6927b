"""The worker's message loop, shared by the real worker and the fake one (no torch here).

One thread receives: the main thread, which runs one job at a time, reads the
control channel itself - blocking while idle, and taking in whatever arrived at
each cancel check while a job runs (Inbox). Two helper threads never read: the
heartbeat says the rank is alive while it computes, and the parent watch exits
the process as soon as the driver is gone (parent pid changed, or EOF on the
channel seen by peeking), so no worker outlives a SIGKILLed driver even while
it is stuck in a job.
"""
from __future__ import annotations

import os
import socket
import shutil
import signal
import threading
import time
import traceback

from collections import deque

from .protocol import ProtocolError
from .transport import cleanup_prefix

PARENT_POLL_S = 1.0
EXIT_DRIVER_GONE = 3


class Cancelled(Exception):
    """The driver cancelled the job; all ranks stop at the same step."""


class JobRun:
    """What a handler sees of its job: progress reporting and the cancel flag."""

    def __init__(self, channel, job_id: int, rank: int, inbox: "Inbox"):
        self.channel, self.job_id, self.rank = channel, job_id, rank
        self._inbox = inbox

    @property
    def cancel_requested(self) -> bool:
        """Takes in what the driver sent meanwhile (the main thread is the only reader), then answers."""
        self._inbox.take_arrived()
        return self.job_id in self._inbox.cancelled

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
        self.channel = None  # set by the Inbox: its EOF, seen by peeking, also means the driver is gone
        self._peek_sock: socket.socket | None = None
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            if self.driver_gone() or self.channel_closed():
                self.exit()
            time.sleep(PARENT_POLL_S)

    def channel_closed(self) -> bool:
        """EOF on the control channel, seen without taking anything off it (MSG_PEEK on a dup of its socket): the
        main thread reads only between jobs and at cancel checks, so a driver that dies while a rank waits in
        a collective would otherwise go unnoticed where the parent pid cannot tell (torchrun-started ranks). An
        unread message hides the EOF behind it until the main thread takes it (its next cancel check; a rank stuck
        in a collective meanwhile ends at the collective's timeout)."""
        if self.channel is None:
            return False
        try:
            if self._peek_sock is None:
                self._peek_sock = socket.socket(fileno=os.dup(self.channel.fileno()))
            return self._peek_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, nothing pending
        except (ConnectionError, ValueError):
            return True  # reset by the peer, or the channel was closed here
        except OSError:
            return False  # not a socket, or cannot peek: the parent pid and the main thread's reads still tell

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


class Inbox:
    """Every receive of the worker, on its main thread: no hand-off between threads on the hot path.

    Why on the main thread: step mode sends one job per model call, and a
    reader thread that queued each job for the main thread cost a thread wake-up
    and a GIL switch per call (~50-70 us of a ~1.5 ms tiny step here). While idle,
    the main thread waits on the socket itself; while a job runs, whatever has
    arrived is taken at each cancel check (`JobRun.cancel_requested`, the stop
    points every job already polls), never waiting: a cancel is marked, a job or
    `stop` that came early is kept for later. EOF or a broken channel exits the
    process as before (ParentWatch.exit), and the parent-watch thread sees EOF
    while a job runs without taking anything off the channel (`channel_closed`).
    """

    def __init__(self, channel, watch: "ParentWatch"):
        self.channel, self.watch = channel, watch
        self.cancelled: set = set()
        self.waiting: deque = deque()  # jobs (and None for `stop`) read while a job ran
        watch.channel = channel

    def _read(self, timeout: float | None) -> None:
        try:
            msg = self.channel.recv(expect={"job", "cancel", "stop"}, timeout=timeout)
        except TimeoutError:
            if self.watch.driver_gone():
                self.watch.exit()
            return
        except (EOFError, OSError, ProtocolError):
            # The driver died or is not ours any more: nobody will collect our results.
            self.watch.exit()
        if msg["t"] == "cancel":
            self.cancelled.add(int(msg["job"]))
        else:
            self.waiting.append(None if msg["t"] == "stop" else msg)

    def next_job(self):
        """The next job message, or None for `stop`; blocks (checking on the driver every PARENT_POLL_S)."""
        while not self.waiting:
            self._read(PARENT_POLL_S)
        return self.waiting.popleft()

    def take_arrived(self) -> None:
        """Read every message already here, without waiting (called from the main thread only)."""
        while self.channel.conn.poll(0):
            self._read(None)


def serve(channel, rank: int, execute, watch: ParentWatch) -> None:
    """Run jobs until `stop`; `execute(msg, run) -> result fields` (it reports its own errors)."""
    inbox = Inbox(channel, watch)
    running: dict = {"job": None}
    threading.Thread(target=_heartbeat, args=(channel, rank, running), name="heartbeat", daemon=True).start()
    while True:
        msg = inbox.next_job()
        if msg is None:
            return
        job_id = int(msg["job"])
        run = JobRun(channel, job_id, rank, inbox)
        running["job"] = job_id
        try:
            fields = execute(msg, run)
        except BaseException as e:  # noqa: BLE001 - the driver decides what a failure means
            fields = error_fields(e, rank)
        running["job"] = None
        inbox.cancelled.discard(job_id)
        try:
            channel.send("result", job=job_id, rank=rank, **fields)
        except (OSError, ValueError):
            watch.exit()  # the driver hung up: nobody will read this result
