"""What a pool job ends with: its result, or the PoolError subclass that says which rank failed and how.

Kept apart from pool.py so callers that only catch or inspect (nodes/, tests) need not read the pool's machinery.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .launch import PoolError, StartupError


class WorkerError(PoolError):
    """A rank raised; `rank` and `remote_traceback` say where and why."""

    def __init__(self, message: str, rank: int = -1, remote_traceback: str = ""):
        super().__init__(message)
        self.rank, self.remote_traceback = rank, remote_traceback


class WorkerOOM(WorkerError):
    """A rank ran out of memory; the message names the parallel config to change."""


class WorkerDied(PoolError):
    """A worker process exited during a job."""


class JobTimeout(PoolError):
    """The job did not finish within its timeout (a hang); the world was torn down."""


class JobCancelled(PoolError):
    """The job was cancelled; all ranks stopped (or finish their step in the background) and the world is up."""


class WorkerStalled(PoolError):
    """A rank stopped sending heartbeats during a job (stopped, frozen or deadlocked); the world was torn down."""


@dataclass
class JobResult:
    values: dict                      # rank 0's JSON values
    tensors: dict                     # rank 0's tensors (owned by the caller; nothing left in shared memory)
    per_rank: list = field(default_factory=list)  # every rank's JSON values
    job_id: int = 0
    elapsed_s: float = 0.0


__all__ = ["JobCancelled", "JobResult", "JobTimeout", "PoolError", "StartupError", "WorkerDied", "WorkerError",
           "WorkerOOM", "WorkerStalled"]
