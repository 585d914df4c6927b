"""The worker's receive side (workers/worker_main.py): one reader, the main thread, and no hand-off on the hot path.

Over a real socket pair with the pool's own message encoding: jobs arrive in
order and `stop` ends the loop; a cancel sent while a job runs is seen at the
job's next cancel check (the main thread takes in what arrived, never waiting);
a job that arrived during another one is run after it; EOF while idle exits
through the watch; the parent watch sees EOF by peeking without taking a
pending message off the channel.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from comfyui_hybrid_parallel.workers.protocol import Channel
from comfyui_hybrid_parallel.workers.job_run import Cancelled
from comfyui_hybrid_parallel.workers.worker_main import Inbox, ParentWatch, serve


class StubWatch:
    """What serve() needs of ParentWatch, without a thread that could end the test process."""

    def __init__(self):
        self.channel = None
        self.exits = 0

    def driver_gone(self) -> bool:
        return False

    def exit(self):
        self.exits += 1
        raise SystemExit("driver gone")


def _pair():
    a, b = socket.socketpair()
    return Channel(Connection(a.detach())), Channel(Connection(b.detach()))


def _results(driver: Channel, n: int, timeout: float = 10.0) -> list:
    out = []
    while len(out) < n:
        msg = driver.recv(expect={"result", "heartbeat", "progress"}, timeout=timeout)
        if msg["t"] == "result":
            out.append(msg)
    return out


def test_jobs_in_order_and_a_cancel_seen_while_the_job_runs():
    driver, worker = _pair()
    ran, started = [], threading.Event()

    def execute(msg, run):
        ran.append(int(msg["job"]))
        if msg["kind"] == "wait_for_cancel":
            started.set()
            deadline = time.monotonic() + 10
            while not run.cancel_requested:  # the only place a running job hears the driver
                assert time.monotonic() < deadline, "the cancel never reached the running job"
                time.sleep(0.001)
            raise Cancelled("cancelled")
        return {"ok": True, "values": {"kind": msg["kind"]}, "tensors": {}}

    t = threading.Thread(target=serve, args=(worker, 0, execute, StubWatch()), daemon=True)
    t.start()
    driver.send("job", job=1, kind="plain")
    driver.send("job", job=2, kind="wait_for_cancel")
    assert started.wait(10)
    driver.send("job", job=3, kind="plain")  # arrives while job 2 runs: taken in by its cancel checks, run next
    driver.send("cancel", job=2)
    r1, r2, r3 = _results(driver, 3)
    assert (r1["job"], r1["ok"]) == (1, True)
    assert (r2["job"], r2["ok"], r2["error"]["kind"]) == (2, False, "cancelled")
    assert (r3["job"], r3["ok"], r3["values"]["kind"]) == (3, True, "plain")
    driver.send("stop")
    t.join(10)
    assert not t.is_alive() and ran == [1, 2, 3]


def test_a_cancel_for_a_finished_job_does_not_touch_the_next_one():
    driver, worker = _pair()

    def execute(msg, run):
        return {"ok": True, "values": {"cancelled": run.cancel_requested}, "tensors": {}}

    t = threading.Thread(target=serve, args=(worker, 0, execute, StubWatch()), daemon=True)
    t.start()
    driver.send("job", job=1, kind="x")
    assert _results(driver, 1)[0]["values"]["cancelled"] is False
    driver.send("cancel", job=1)  # too late: job 1 is done
    driver.send("job", job=2, kind="x")
    assert _results(driver, 1)[0]["values"]["cancelled"] is False
    driver.send("stop")
    t.join(10)
    assert not t.is_alive()


def test_eof_while_idle_exits_through_the_watch():
    driver, worker = _pair()
    watch = StubWatch()
    inbox = Inbox(worker, watch)
    assert watch.channel is worker  # the parent watch peeks at this channel
    driver.close()
    with pytest.raises(SystemExit):
        inbox.next_job()
    assert watch.exits == 1


def test_take_arrived_never_waits():
    driver, worker = _pair()
    inbox = Inbox(worker, StubWatch())
    t0 = time.monotonic()
    inbox.take_arrived()
    assert time.monotonic() - t0 < 0.5 and not inbox.waiting
    driver.send("cancel", job=7)
    driver.send("job", job=8, kind="x")
    deadline = time.monotonic() + 5
    while len(inbox.waiting) < 1 and time.monotonic() < deadline:
        inbox.take_arrived()
    assert inbox.cancelled == {7} and [m["job"] for m in inbox.waiting] == [8]


def test_parent_watch_sees_eof_by_peeking_without_taking_a_message():
    driver, worker = _pair()
    watch = object.__new__(ParentWatch)  # no watch thread: its exit would end this process
    watch.channel, watch._peek_sock = None, None
    assert watch.channel_closed() is False  # no channel yet
    watch.channel = worker
    assert watch.channel_closed() is False  # open, nothing pending
    driver.send("job", job=1, kind="x")
    probe = socket.socket(fileno=os.dup(worker.fileno()))
    deadline = time.monotonic() + 5
    while not worker.conn.poll(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    pending = probe.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    assert watch.channel_closed() is False  # open, a message pending: every byte still there afterwards
    assert probe.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT) == pending
    probe.close()
    assert worker.recv(timeout=5)["job"] == 1
    driver.close()
    assert watch.channel_closed() is True
