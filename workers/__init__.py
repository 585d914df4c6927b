"""The persistent pool of torch.distributed workers (driver side and worker loop).

Import from here on the driver: nothing in this package imports torch at module
level except jobs.py (worker side), so importing the pool is cheap.
"""
from .launch import PoolError, StartupError
from .platform_support import check_platform, describe_platform
from .pool import (JobCancelled, JobResult, JobTimeout, WorkerDied, WorkerError, WorkerOOM, WorkerPool,
                   WorkerStalled)
from .protocol import PROTOCOL_VERSION, ProtocolError, model_families

__all__ = ["JobCancelled", "JobResult", "JobTimeout", "model_families", "PROTOCOL_VERSION", "PoolError",
           "ProtocolError", "StartupError", "WorkerDied", "WorkerError", "WorkerOOM", "WorkerPool", "WorkerStalled",
           "check_platform", "describe_platform"]
