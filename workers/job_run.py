"""What a running job sees of its rank's loop (workers/worker_main.serve): the cancel flag and progress reporting,
and the exception a cancelled job ends with.

Kept apart from the loop so the jobs (workers/jobs.py) reach them without importing the rank's entry module, which
imports the jobs (no import circle); no torch here.
"""
from __future__ import annotations


class Cancelled(Exception):
    """The driver cancelled the job; all ranks stop at the same step."""


class JobRun:
    """What a handler sees of its job: progress reporting and the cancel flag."""

    def __init__(self, channel, job_id: int, rank: int, inbox):  # inbox: worker_main.Inbox
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
