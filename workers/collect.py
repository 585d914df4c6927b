"""How one job's replies come back from the ranks: the driver's side of a job after it was sent.

Why its own module: the pool (workers/pool.py) owns the world's lifecycle and sends jobs; this is the part that waits
for them - every rank's result, progress and heartbeat, a cancel that must win within CANCEL_WAIT_S, a rank that
died, stalled or raised (that rank's traceback fails the job for all), a cancelled job's late results collected before
the next one, and rank 0's reply read back (tensors, values, the ranks' residency report). WorkerPool inherits it.
"""
from __future__ import annotations

import logging
import time
from multiprocessing.connection import wait as wait_conns

from . import residency
from .errors import (JobCancelled, JobResult, JobTimeout, PoolError, WorkerDied, WorkerError, WorkerOOM,
                     WorkerStalled)
from .launch import World
from .protocol import ProtocolError
from .transport import read_tensor, unlink

FAULT_GRACE_S = 2.0   # after one rank failed, the others get this long to report theirs
DRAIN_STALL_S = 3.0   # silence that marks a rank stuck while the next job collects a cancelled one
CANCEL_WAIT_S = 1.5   # a cancelled job gets this long to stop before the caller gets its answer anyway
POLL_S = 0.05
DEATH_CHECK_S = 0.5


class JobCollection:
    """The collection half of WorkerPool (it provides _cancel, _teardown, shm_prefix, _arena_maps and
    stall_timeout_s)."""

    def _collect(self, world: World, job_id: int, config, timeout_s: float, progress, cancel,
                 preview=None) -> JobResult:
        start = time.monotonic()
        deadline = start + timeout_s  # moved on by every progress step: a long run is not a hang
        results: dict = {}
        failed_at = None
        callback_exc = None
        cancel_at = None
        last_death_check = start
        seen = world.seen = {r: start for r in range(world.world_size)}  # last message per rank (kept for _drain)
        conns = {ch.conn: r for r, ch in enumerate(world.channels)}
        while len(results) < world.world_size:
            now = time.monotonic()
            if cancel_at is None and (self._cancel.is_set() or callback_exc is not None
                                      or (cancel is not None and cancel.is_set())):
                cancel_at = now
                try:
                    world.broadcast("cancel", job=job_id)
                except (OSError, ValueError):
                    pass  # a dead worker: the death check below reports it
            if now > deadline or (failed_at is not None and now > failed_at + FAULT_GRACE_S):
                break
            if cancel_at is not None and now > cancel_at + CANCEL_WAIT_S:
                # Interrupt wins: answer now. The ranks finish (or abandon) the step in the background; the
                # next job first collects them (_drain), and a rank that never answers is found stuck there.
                world.pending, world.state = job_id, "cancelling"
                if callback_exc is not None:
                    raise callback_exc
                raise JobCancelled(f"job {job_id} was cancelled (its ranks stop in the background)")
            if now - last_death_check > DEATH_CHECK_S:
                last_death_check = now
                self._check_deaths(world, job_id, results)
                self._check_stalls(world, job_id, results, seen, now)
            waiting = [c for c, r in conns.items() if r not in results]
            for conn in wait_conns(waiting, timeout=POLL_S):
                rank = conns[conn]
                try:
                    msg = world.channels[rank].recv(expect={"progress", "result", "heartbeat"})
                except (EOFError, OSError):
                    self._died(world, rank, job_id)
                except ProtocolError as e:
                    self._teardown(graceful=False)
                    raise PoolError(f"rank {rank} sent a bad message: {e}") from None
                seen[rank] = time.monotonic()
                if msg["t"] == "heartbeat":
                    continue
                if msg["t"] == "progress":
                    if int(msg["job"]) == job_id:
                        deadline = max(deadline, seen[rank] + timeout_s)
                    if callback_exc is None and int(msg["job"]) == job_id:
                        try:
                            if preview is not None and msg.get("preview"):
                                preview(int(msg["step"]), int(msg["total"]),
                                        read_tensor(msg["preview"], self.shm_prefix, maps=self._arena_maps))
                            if progress is not None:
                                progress(int(msg["step"]), int(msg["total"]))
                        except BaseException as e:  # noqa: BLE001 - cancel the job, re-raise after the drain
                            callback_exc = e
                    continue
                if int(msg["job"]) != job_id:
                    continue  # a late answer to an older job
                results[rank] = msg
                err = msg.get("error") or {}
                if not msg.get("ok") and err.get("kind") != "cancelled" and failed_at is None:
                    failed_at = time.monotonic()
        return self._finish(world, job_id, config, results, callback_exc, timeout_s, start)

    def _check_stalls(self, world: World, job_id: int, results: dict, seen: dict, now: float) -> None:
        """A rank whose heartbeat stopped (SIGSTOP, a frozen machine, a deadlock that holds the GIL) fails the
        job within stall_timeout_s, named - instead of everyone waiting for the collective timeout."""
        for rank in range(world.world_size):
            if rank not in results and now - seen[rank] > self.stall_timeout_s:
                self._teardown(graceful=False)
                raise WorkerStalled(f"worker rank {rank} (of {world.config.describe()}, pid "
                                    f"{world.procs[rank].pid}) sent nothing for {now - seen[rank]:.0f} s during job "
                                    f"{job_id} (stopped, frozen or deadlocked); the world was stopped and restarts "
                                    f"on the next job")

    def _drain(self, world: World) -> bool:
        """Collect the results of a job that was answered as cancelled before its ranks stopped. True: the world
        is idle again; False: a rank died or stalled, and the world was torn down (the caller starts another)."""
        job_id = world.pending
        seen = dict(world.seen)  # silence counts from the rank's last message in the cancelled job
        # A healthy rank beats every second even mid-step; after a cancel, a few seconds of silence is a stuck
        # rank, and the next prompt should not wait the full stall timeout to find out.
        drain_stall = min(self.stall_timeout_s, DRAIN_STALL_S)
        done: set = set()
        conns = {ch.conn: r for r, ch in enumerate(world.channels)}
        try:
            while len(done) < world.world_size:
                now = time.monotonic()
                for rank, p in enumerate(world.procs):
                    if rank not in done and (p.poll() is not None or now - seen[rank] > drain_stall):
                        raise WorkerStalled(f"rank {rank} did not finish cancelled job {job_id}")
                for conn in wait_conns([c for c, r in conns.items() if r not in done], timeout=POLL_S):
                    rank = conns[conn]
                    msg = world.channels[rank].recv(expect={"progress", "result", "heartbeat"})
                    seen[rank] = time.monotonic()
                    if msg["t"] == "result" and int(msg["job"]) == job_id:
                        done.add(rank)
                        for d in (msg.get("tensors") or {}).values():
                            unlink(d, self.shm_prefix)
        except (PoolError, EOFError, OSError, ProtocolError) as e:
            logging.getLogger(__name__).info("hybrid parallel: restarting the workers: %s", e)
            self._teardown(graceful=False)
            return False
        world.pending, world.state = None, "idle"
        return True

    def _check_deaths(self, world: World, job_id: int, results: dict) -> None:
        for rank, p in enumerate(world.procs):
            if p.poll() is not None and rank not in results:
                self._died(world, rank, job_id)

    def _died(self, world: World, rank: int, job_id: int) -> None:
        code = world.procs[rank].poll()
        if code is None:
            try:
                code = world.procs[rank].wait(timeout=1.0)
            except Exception:  # noqa: BLE001 - still alive but hung up: treat as dead
                code = "unknown"
        self._teardown(graceful=False)
        raise WorkerDied(f"worker rank {rank} (of {world.config.describe()}) died during job {job_id} "
                         f"(exit code {code}); the world was stopped and restarts on the next job")

    def _finish(self, world, job_id, config, results, callback_exc, timeout_s, start) -> JobResult:
        missing = sorted(set(range(world.world_size)) - set(results))
        errors = {r: m["error"] for r, m in sorted(results.items()) if not m.get("ok")}
        real = {r: e for r, e in errors.items() if e.get("kind") != "cancelled"}
        if missing or real:
            for m in results.values():  # rank 0's tensors of a failed job
                for d in (m.get("tensors") or {}).values():
                    unlink(d, self.shm_prefix)
            if missing:
                self._teardown(graceful=False)
        if real:
            rank, err = next(iter(real.items()))
            where = f"rank {rank} of {world.config.describe()} ({world.devices[rank]})"
            tail = (f"\nranks {missing} did not finish (stuck in a collective); the world was stopped "
                    f"and restarts on the next job" if missing else "")
            if err.get("kind") == "oom":
                raise WorkerOOM(f"out of memory on {where}: {err['message']}\nlower the resolution or batch, or "
                                f"spread the work over more devices (more ulysses/ring/pp degree){tail}",
                                rank, err.get("traceback", ""))
            raise WorkerError(f"job {job_id} failed on {where}: {err['type']}: {err['message']}{tail}\n"
                              f"--- remote traceback (rank {rank}) ---\n{err.get('traceback', '')}",
                              rank, err.get("traceback", ""))
        if missing:
            if callback_exc is not None:
                raise callback_exc
            raise JobTimeout(f"job {job_id} did not finish within {timeout_s:.0f} s on ranks {missing} of "
                             f"{world.config.describe()} (hang?); the world was stopped and restarts on the next job")
        if callback_exc is not None:
            raise callback_exc
        if errors:
            raise JobCancelled(f"job {job_id} was cancelled")
        descs = results[0].get("tensors") or {}
        tensors = {k: read_tensor(d, self.shm_prefix, unlink=True, maps=self._arena_maps) for k, d in descs.items()}
        values = results[0].get("values") or {}
        per_rank = [results[r].get("values") or {} for r in sorted(results)]
        reports = [residency.report(v) for v in per_rank]
        if all(r is not None for r in reports):
            world.reports = reports
            world.slots = list(reports[0].slots)
            if any(r.need is not None for r in reports):  # a rank found no room: all of them answered "short"
                values["short"] = True
        return JobResult(values=values, tensors=tensors, per_rank=per_rank, job_id=job_id,
                         elapsed_s=time.monotonic() - start)
