"""What the worker pool can run on this operating system, decided once from facts, before any process starts.

Why a module of its own: the pool is built on Linux facilities - NCCL between GPUs, a unix-socket control
channel whose file descriptors the worker dups and peeks at (serve.ParentWatch), tensors through files in the
RAM-backed /dev/shm - and ComfyUI also runs on Windows and macOS, where the pack must load without breaking
ComfyUI and say, before a worker is spawned, what it cannot do and what to do instead. One decision (`decide`)
from injectable facts (`Facts`, read by small functions tests monkeypatch) serves the pool (`check_pool`, called
by WorkerPool.ensure_world before a world starts), the node layer (`check_platform`, for Parallel Config) and the
doctor (`describe_platform`).

What each system gets, and how far it is tested:
- Linux: everything the pack does - NCCL between GPUs, gloo between CPU ranks (and between ranks sharing GPUs),
  tensors through /dev/shm, or through the temp dir (disk-backed, slower) where /dev/shm is missing or read-only.
  This is where the whole test suite runs.
- macOS: CPU worker ranks over gloo only. The unix socket exists there; /dev/shm does not, so tensors go through
  the temp dir (transport.shm_dir's fallback, whose path - temp-dir transport, unix socket, gloo on CPU - the
  tests run on Linux). There is no CUDA, and Apple's GPU (MPS) is never used by the workers: with device
  "auto" the ranks run on the CPU. Not tested on macOS itself, which the description says.
- Windows: no worker pool at all. Windows torch has no NCCL, Python there has no unix sockets, and the
  worker's channel code relies on POSIX descriptors (os.dup of a socket, MSG_DONTWAIT, parent pid): the nodes
  load, and using them fails with the fix (WSL2 or Linux) before anything starts.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

WINDOWS_FIX = ("multi-GPU needs Linux with NCCL; on Windows run ComfyUI inside WSL2 (Ubuntu with NVIDIA's WSL "
               "driver: torch there sees the GPUs with CUDA and NCCL) or on a Linux machine")


@dataclass(frozen=True)
class Facts:
    """What the decision depends on; `read_facts()` fills it from this process, tests build their own."""

    system: str              # sys.platform: "linux", "darwin", "win32", "cygwin", ...
    distributed: bool        # torch.distributed is built in
    gloo: bool
    nccl: bool
    cuda: bool               # torch sees a CUDA device
    unix_socket: bool        # socket.AF_UNIX exists
    dev_shm: bool            # /dev/shm exists and is writable (else tensors go through the temp dir)
    mps: bool = False        # Apple's GPU, which the workers never use


@dataclass(frozen=True)
class Support:
    """The decision: which device kinds a world may use here, and why not where it may not."""

    system: str              # "Linux", "macOS", "Windows" or the raw sys.platform
    cpu: bool                # CPU worker ranks over gloo
    cuda: bool               # GPU worker ranks over NCCL (one rank per GPU)
    shared_gpus: bool        # ranks sharing GPUs over gloo (parallel/staged.py)
    transport: str           # where tensors travel between processes
    tested: bool             # this system runs the test suite (Linux)
    why_not_cpu: str = ""    # the reason and fix, where `cpu` is False
    why_not_cuda: str = ""   # the same for `cuda`


# ---- facts (each read by a small function, so tests can monkeypatch one) ----
def _system() -> str:
    return sys.platform


def _unix_socket() -> bool:
    return hasattr(socket, "AF_UNIX")


def _dev_shm() -> bool:
    return os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)


def _torch_facts() -> dict:
    """torch.distributed's backends and the devices torch sees (torch imported here, not at module level)."""
    import torch
    dist = getattr(torch, "distributed", None)
    distributed = bool(dist is not None and dist.is_available())
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    return {"distributed": distributed,
            "gloo": distributed and bool(dist.is_gloo_available()),
            "nccl": distributed and bool(dist.is_nccl_available()),
            "cuda": bool(torch.cuda.is_available()),
            "mps": bool(mps is not None and mps.is_available())}


def read_facts() -> Facts:
    """This process's facts."""
    return Facts(system=_system(), unix_socket=_unix_socket(), dev_shm=_dev_shm(), **_torch_facts())


# ---- the decision ----
def _name(system: str) -> str:
    if system.startswith("linux"):
        return "Linux"
    if system == "darwin":
        return "macOS"
    if system in ("win32", "cygwin", "msys"):
        return "Windows"
    return system


def decide(facts: Facts) -> Support:
    """What the pool can run with these facts (see the module doc for the reasons)."""
    name = _name(facts.system)
    if name == "Windows":
        why = f"this is Windows: {WINDOWS_FIX}; the nodes load, but the worker pool cannot start here"
        return Support(name, cpu=False, cuda=False, shared_gpus=False, transport="none", tested=False,
                       why_not_cpu=why, why_not_cuda=why)
    transport = ("shared memory (/dev/shm)" if facts.dev_shm else
                 "files in the temp dir (no writable /dev/shm: disk-backed, slower)")
    why_cpu = why_cuda = ""
    if not facts.distributed:
        why_cpu = why_cuda = (f"this torch ({name}) is built without torch.distributed; install a torch build "
                              f"with distributed support (the official Linux wheels have it)")
    if not why_cpu and not facts.gloo:
        why_cpu = f"this torch ({name}) has no gloo backend, which CPU worker ranks use"
    if not why_cuda:
        if name == "macOS":
            why_cuda = ("macOS has no CUDA and the workers do not use Apple's GPU (MPS): use device 'cpu' or "
                        "'auto' (CPU worker ranks), or a Linux machine with NVIDIA GPUs for multi-GPU")
        elif not facts.nccl:
            why_cuda = (f"this torch ({name}) has no NCCL, which GPU worker ranks use: multi-GPU needs a CUDA "
                        f"build of torch with NCCL on Linux (the official Linux CUDA wheels have it)")
        elif not facts.cuda:
            why_cuda = "torch sees no CUDA device here; use device 'cpu' or 'auto'"
    return Support(name, cpu=not why_cpu, cuda=not why_cuda,
                   shared_gpus=not why_cpu and facts.cuda and name != "macOS",
                   transport=transport, tested=name == "Linux",
                   why_not_cpu=why_cpu, why_not_cuda=why_cuda)


def _resolve(kind: str, facts: Facts) -> str:
    if kind not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {kind!r}")
    return ("cuda" if facts.cuda else "cpu") if kind == "auto" else kind


def check_os(facts: Facts | None = None) -> Support:
    """Raise ValueError with the fix where no world of any kind can start (Windows); else the decision."""
    support = decide(read_facts() if facts is None else facts)
    if support.system == "Windows":
        raise ValueError(f"Hybrid Parallel: {support.why_not_cpu}")
    return support


def check_pool(device_kind: str, *, world_size: int = 2, share_devices: bool = False,
               facts: Facts | None = None) -> None:
    """Raise ValueError with the reason and the fix if a world of `world_size` ranks of `device_kind` ("auto",
    "cpu" or "cuda") cannot run here. The pool calls it before it spawns anything. A one-rank world joins no
    process group, so it needs neither gloo nor NCCL - only the pool's channel and transport (check_os)."""
    facts = read_facts() if facts is None else facts
    support = check_os(facts)
    kind = _resolve(device_kind, facts)
    if int(world_size) <= 1:
        return
    if kind == "cpu" and not support.cpu:
        raise ValueError(f"Hybrid Parallel: CPU worker ranks cannot run here: {support.why_not_cpu}")
    if kind == "cuda":
        if share_devices:  # ranks sharing GPUs talk gloo (parallel/staged.py)
            if not support.shared_gpus:
                raise ValueError(f"Hybrid Parallel: ranks sharing GPUs cannot run here: "
                                 f"{support.why_not_cpu or support.why_not_cuda}")
        elif not support.cuda:
            raise ValueError(f"Hybrid Parallel: GPU worker ranks cannot run here: {support.why_not_cuda}")


def check_platform(device_kind: str = "auto", facts: Facts | None = None) -> None:
    """For the node layer (Parallel Config), before it builds a config or starts workers: raise ValueError with the
    reason and the fix if this system cannot run a multi-rank world of `device_kind` ("auto", "cpu" or "cuda")."""
    check_pool(device_kind, world_size=2, facts=facts)


def describe_platform(facts: Facts | None = None) -> str:
    """One line for the doctor and the logs: the system, what the pool runs on it, and how tensors travel."""
    facts = read_facts() if facts is None else facts
    s = decide(facts)
    if s.system == "Windows":
        return f"worker pool on Windows: none ({WINDOWS_FIX})"
    runs = []
    if s.cuda:
        runs.append("GPU ranks over NCCL")
    if s.cpu:
        runs.append("CPU ranks over gloo")
    if s.shared_gpus:
        runs.append("ranks sharing GPUs over gloo")
    what = ", ".join(runs) if runs else f"no worker ranks ({s.why_not_cpu or s.why_not_cuda})"
    notes = [] if s.tested else [f"not tested on {s.system}"]
    if s.system == "macOS":
        notes.insert(0, "Apple's GPU (MPS) is not used")
    elif s.cpu and not s.cuda and facts.cuda and s.why_not_cuda:
        notes.append(f"no GPU ranks: {s.why_not_cuda}")
    control = "unix socket" if facts.unix_socket else "loopback TCP"
    tail = f"; {'; '.join(notes)}" if notes else ""
    return f"worker pool on {s.system}: {what}; control channel {control}; tensors through {s.transport}{tail}"


__all__ = ["Facts", "Support", "WINDOWS_FIX", "check_os", "check_platform", "check_pool", "decide", "describe_platform",
           "read_facts"]
