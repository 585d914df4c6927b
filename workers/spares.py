"""Spare worker interpreters: Python processes that have imported torch before any world needs them.

Why: a worker's start is mostly `import torch` (~1.7 s of CPU here, more with CUDA libraries), and the first
prompt after ComfyUI starts pays it on every rank - on a small machine while ComfyUI itself loads the checkpoint on
the same cores. ComfyUI's own start-up takes seconds longer than that import, so interpreters started when the pack
loads are ready by the first prompt; a world then takes them instead of spawning (launch.World._spawn). They are
the driver's own children (subprocess, never fork or multiprocessing spawn): the process tree, the parent watch and
the reaping stay as for any worker. A spare learns its role on stdin: one JSON line {argv, env}, then the auth key
line as every worker; stdin closed without a line (the driver stopped or died) makes it exit. Spares are used once;
a world torn down later spawns its successors normally.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading


class Spares:
    """Up to `n` spare interpreters, started in the background; `take()` hands one over (or None)."""

    def __init__(self, cwd: str):
        self.cwd = cwd  # a private directory: `-c` puts the cwd first on sys.path (ComfyUI's cwd holds modules)
        self._procs: list = []
        self._lock = threading.Lock()
        self._closed = False

    def fill(self, n: int) -> None:
        """Start interpreters until `n` are alive (non-blocking: each imports torch on its own)."""
        from .bootstrap import BOOTSTRAP, PACKAGE, pack_root
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None]
            while not self._closed and len(self._procs) < n:
                cmd = [sys.executable, "-c", BOOTSTRAP, str(pack_root()), f"{PACKAGE}.workers.worker_main", "--spare"]
                self._procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, close_fds=True, cwd=self.cwd))

    def take(self):
        """A live spare's Popen, no longer owned here, or None."""
        with self._lock:
            while self._procs:
                p = self._procs.pop(0)
                if p.poll() is None:
                    return p
        return None

    def count(self) -> int:
        with self._lock:
            return sum(p.poll() is None for p in self._procs)

    def close(self) -> None:
        """Let every unused spare exit (stdin closed), killing any that does not within a second."""
        with self._lock:
            self._closed = True
            procs, self._procs = self._procs, []
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def hand_over(proc, argv: list, env: dict, authkey: bytes) -> None:
    """Give a spare its worker role: the argv worker_main parses and the environment to add, then the key."""
    proc.stdin.write(json.dumps({"argv": [str(a) for a in argv], "env": {k: str(v) for k, v in env.items()}})
                     .encode() + b"\n")
    proc.stdin.write(authkey.hex().encode() + b"\n")
    proc.stdin.close()


def spare_main() -> int:
    """The spare's side: import what every worker imports, then wait for a role (worker_main.main) or EOF."""
    import torch  # noqa: F401  (the slow part, done before anyone waits)
    import torch.distributed  # noqa: F401
    preload()
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    role = json.loads(line)
    os.environ.update(role.get("env") or {})
    from .worker_main import main
    return main(role["argv"])


# What a worker imports once ComfyUI builds a model, that touches no device and needs no role: torch's compiler
# front end (ComfyUI's ops pull it in; with sympy ~1.7 s of CPU per rank on this 2-core VM, most of a small model's
# first load on a new world). ComfyUI itself waits for the role: comfy.model_management picks and queries a CUDA
# device when imported, before the rank has set its own.
PRELOAD = ("torch._dynamo",)


def preload() -> None:
    """Import PRELOAD while the spare waits for a role (a module that fails here is imported, or fails, later)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a head start only
            pass


def default_count() -> int:
    """How many spares the pack keeps ready in a ComfyUI server: HP_SPARE_WORKERS, else one per visible GPU (at
    most 8), else 2 on a CPU-only machine (the common ulysses/cfg 2); 0 disables them."""
    value = os.environ.get("HP_SPARE_WORKERS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"HP_SPARE_WORKERS must be an integer >= 0, got {value!r}") from None
    try:
        import torch
        if torch.cuda.is_available():
            return min(8, torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch / a broken CUDA: the CPU default
        pass
    return min(2, os.cpu_count() or 1)
