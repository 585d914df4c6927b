"""The persistent pool of torch.distributed workers (driver side and worker loop).

Import from here on the driver: nothing in this package imports torch at module level except jobs.py (worker side),
so importing the pool is cheap. The names below are read lazily (PEP 562): a process that only needs one module of
this package - the fork server, whose start is on a headless first prompt's critical path (issue 69), a fresh
worker - does not import the driver's pool and launcher (~50 ms) to get it.
"""
import importlib

_EXPORTS = {
    "PoolError": "launch", "StartupError": "launch",
    "check_platform": "platform_support", "describe_platform": "platform_support",
    "JobCancelled": "pool", "JobResult": "pool", "JobTimeout": "pool", "WorkerDied": "pool", "WorkerError": "pool",
    "WorkerOOM": "pool", "WorkerPool": "pool", "WorkerStalled": "pool",
    "PROTOCOL_VERSION": "protocol", "ProtocolError": "protocol", "model_families": "protocol",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
