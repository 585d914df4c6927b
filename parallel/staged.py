"""Staged communication: CUDA ranks that talk through gloo, every collective's tensors copied through host memory.

Why: NCCL runs one rank per GPU and refuses two ranks on one device, so a machine with a single GPU could never run
the CUDA code of a multi-rank method (Ulysses' all-to-alls on device buffers, ring's LSE kernels, DistriFusion's
asynchronous K/V, PipeFusion's stage sends, the VAE halo) - exactly the code no CPU test sees. With staging, N ranks
share one GPU: they compute there as they would on N GPUs and exchange host copies over gloo. It is slow (two
copies per collective, host-side gloo) and exists for the GPU suite (bench/gpu_suite.py) and tests - a pool
opts in with WorkerPool(share_devices=True) or HP_SHARE_DEVICES=1, never by default.

How: `StagedComm.install()` wraps torch.distributed's collectives and point-to-point calls in the worker process.
A call's tensors on the device (all of them with `stage_all`, which CPU tests use so that a copy-back that is
missing shows as a wrong result) are copied to fresh host tensors, the real gloo call runs on those, and the
tensors the call writes (its first argument: the output, or the tensor reduced / broadcast / received in place)
are copied back - at once for a synchronous call, at `wait()` for an asynchronous one (the returned work is
wrapped). Installed before strict mode (parallel/strict.py), which then checks the device tensors callers pass.
"""
from __future__ import annotations

import inspect
import os

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

ENV = "HP_SHARE_DEVICES"
_OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
        "all_to_all_single", "all_to_all", "broadcast", "reduce", "gather", "scatter", "isend", "irecv", "send", "recv")
_WRITES_NOTHING = ("isend", "send")
_WRITES = {"gather": "gather_list"}  # the argument a call writes, where it is not the first


class _StagedWork:
    """An asynchronous call's work: its results reach the device tensors when it is waited on."""

    def __init__(self, work, back):
        self._work, self._back = work, back

    def wait(self, *args, **kwargs):
        ok = self._work.wait(*args, **kwargs)
        self._back()
        self._back = _nothing
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def __getattr__(self, name):
        return getattr(self._work, name)


def _nothing() -> None:
    return None


class StagedComm:
    """Wraps torch.distributed in this process so a world of device tensors runs over a host (gloo) backend."""

    def __init__(self, stage_all: bool = False):
        self.stage_all = stage_all
        self.real = {}
        self.copies = 0  # tensors staged so far (tests read it: the path really ran)

    @staticmethod
    def installed() -> bool:
        fn = dist.all_reduce
        while fn is not None:  # strict mode wraps on top of it
            if getattr(fn, "staged", False):
                return True
            fn = getattr(fn, "__wrapped__", None)
        return False

    def install(self) -> "StagedComm":
        for name in _OPS:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            self.real[name] = fn
            wrapped = self._wrap(name, fn)
            for mod in (dist, c10d):
                if hasattr(mod, name):
                    setattr(mod, name, wrapped)
        return self

    def _staged(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.stage_all

    def _to_host(self, value, pairs: list):
        if isinstance(value, torch.Tensor) and self._staged(value):
            host = torch.empty(value.shape, dtype=value.dtype, device="cpu")
            host.copy_(value)
            pairs.append((value, host))
            self.copies += 1
            return host
        if isinstance(value, list):
            return [self._to_host(v, pairs) for v in value]
        if isinstance(value, tuple):
            return tuple(self._to_host(v, pairs) for v in value)
        return value

    def _wrap(self, name: str, real):
        sig = inspect.signature(real)
        first = next(iter(sig.parameters))
        written = None if name in _WRITES_NOTHING else _WRITES.get(name, first)

        def call(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            back: list = []
            for arg, value in list(bound.arguments.items()):
                pairs = back if arg == written else []
                bound.arguments[arg] = self._to_host(value, pairs)

            def copy_back() -> None:
                for dev, host in back:
                    dev.copy_(host)
            with torch._C.DisableTorchFunction():  # the host copies go straight to gloo (past strict mode's checks)
                out = real(*bound.args, **bound.kwargs)
            if out is not None and hasattr(out, "wait"):
                return _StagedWork(out, copy_back)
            copy_back()
            return out
        call.__name__ = name
        call.__wrapped__ = real
        call.staged = True
        return call


def enabled() -> bool:
    return os.environ.get(ENV, "").strip() not in ("", "0")
