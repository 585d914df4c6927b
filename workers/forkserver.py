"""The fork server: one interpreter that has imported torch forks every worker of the worlds on this machine.

Why: a world start was mostly imports, paid by every rank of every world - `import torch` (0.7-1.7 s of CPU here,
more with CUDA libraries) and torch's compiler front end that ComfyUI's comfy.model_management pulls in (0.6-1.7 s),
several seconds of CPU per rank, 10 s of wall time for a 4-rank world on a 2-core machine (the libraries only
ComfyUI's VAE and text-encoder code imports - transformers, torchvision - are left to the ranks that build a VAE:
see PRELOAD). A fork of an interpreter that already holds them costs milliseconds, so a config
change (a new world) costs the driver ~1 s instead, and the imported pages are shared copy-on-write between the
ranks. Same idea as multiprocessing's forkserver, without its re-import of ComfyUI's main.py in every child.

What stays as before: a worker is `worker_main.main` with the same argv, environment (the launcher's, in full), key
(handed over the fork server's stdin, never on a command line) and working folder. The server is the driver's child
and the workers are the server's, so a worker's parent watch watches the server, and the server watches the driver:
a driver that dies takes the server and then its workers; a closed server forks no more and exits when its last
worker has. Nothing received is unpickled: requests are JSON lines from the driver on a pipe only it holds.

What a fork cannot carry: CUDA initialised before the fork (the server never touches a device: ComfyUI, which picks a
device when imported, loads after the fork), threads (the server has none of its own), and environment variables
that libraries read when imported - those of `IMPORT_TIME_ENV`; a world whose environment differs there from the
server's starts its ranks as fresh interpreters (launch.World._spawn), as does every world off Linux (fork after
importing torch is not safe on macOS) or with HP_FORK_SERVER=0.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading

from .bootstrap import BOOTSTRAP, PACKAGE, imports_without_gc, pack_root

# Imported by the server before it says ready: torch, its distributed package and the compiler front end that
# ComfyUI's own comfy.model_management pulls in (through comfy_kitchen), with the small libraries every diffusion
# model imports. ComfyUI itself waits for the rank: comfy.model_management picks a device when imported, and the
# spec configures its flags first.
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "einops", "safetensors.torch")
# Not imported here: transformers, torchvision, torchaudio (~0.5 s). No diffusion model module of ComfyUI imports
# them (its VAE / text-encoder code does: comfy.sd, which a Parallel VAE Decode rank imports itself), and before
# ready they sat on the first world's critical path (a headless first prompt, issue 69); imported later here, on
# a CPU machine, they took a core from the ranks' first steps.
# Environment read when those libraries load (their value is the server's in every fork; PYTORCH_CUDA_ALLOC_CONF's
# backend, for one, is read by a static initialiser of torch's CUDA library): a world asking for other values gets
# fresh interpreters. OMP_NUM_THREADS is not among them: each rank sets its threads (torch.set_num_threads).
IMPORT_TIME_ENV = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "TORCH_", "PYTORCH_", "LD_", "PYTHON")
IMPORT_TIME_EXEMPT = ("OMP_NUM_THREADS",)
POLL_S = 0.05


class ForkServerError(RuntimeError):
    """The fork server could not fork a worker (it exited, or never became ready)."""


def enabled() -> bool:
    """Fork workers here: Linux only, unless HP_FORK_SERVER=0."""
    return sys.platform.startswith("linux") and os.environ.get("HP_FORK_SERVER", "1").strip() != "0"


def default_count() -> int:
    """Whether the pack starts its fork server ahead of a prompt (a workflow opened, a headless prompt queued,
    HP_PRESTART): HP_SPARE_WORKERS (its name from when the head start was N spare interpreters), 0 = nothing before
    a prompt; by default on (1 per visible GPU, at most 8, else 2 on a CPU-only machine: the ranks a head start
    expects). The first world starts the fork server itself either way."""
    value = os.environ.get("HP_SPARE_WORKERS", "").strip()
    if value:
        try:
            return max(0, int(value))
        except ValueError:
            raise ValueError(f"HP_SPARE_WORKERS must be an integer >= 0, got {value!r}") from None
    try:
        import torch  # optional here: a broken CUDA install must not stop the head start's decision
        if torch.cuda.is_available():
            return min(8, torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch / a broken CUDA: the CPU default
        pass
    return min(2, os.cpu_count() or 1)


def import_time_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k not in IMPORT_TIME_EXEMPT}


class ForkedProcess:
    """A worker forked by the server, with the part of subprocess.Popen's interface the launcher uses. Its exit
    status comes from the server (its parent), which reaps it at once."""

    def __init__(self, server: "ForkServer", pid: int, args):
        self.server, self.pid, self.args = server, pid, args
        self.returncode = None
        self._exited = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self):
        if self.returncode is None and self.server.gone():
            # the server is gone, so no exit status will come: this process is reparented and its parent watch
            # ends it within a second; until then it is alive
            try:
                os.kill(self.pid, 0)
            except (ProcessLookupError, PermissionError):  # gone, or its pid went to someone else's process
                self._set_exit(-signal.SIGKILL)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        left = timeout  # seconds still to wait (None: until it exits); checked in short steps for a gone server
        while self.poll() is None:
            step = 0.2 if left is None else min(0.2, left)
            if self._exited.wait(step):
                break
            if left is not None:
                left -= step
                if left <= 0 and self.poll() is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a reaped pid (it may be another process's by now)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The driver's side: starts the server (in the background: it imports while ComfyUI loads) and forks workers.

    One per driver process that starts worlds: the runtime's, shared by the pools it makes, or a pool's own."""

    def __init__(self, cwd: str):
        self.cwd = cwd  # a private folder: `-c` puts the cwd first on sys.path (ComfyUI's cwd holds modules)
        self.proc = None
        self.env: dict = {}  # the server's import-time environment (IMPORT_TIME_ENV)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._closed = False  # close() was called: this object forks no more (a later head start makes a new one)
        self._next = 0
        self._pending: dict = {}   # request id -> [event, pid or error]
        self._children: dict = {}  # pid -> ForkedProcess
        self._early_exits: dict = {}  # pid -> code, for an exit read before its fork's reply was handled

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self, env: dict | None = None) -> None:
        """Start the server if it is not running (non-blocking: it imports PRELOAD on its own), with the environment
        its workers will have (`env`, else this process's): what torch reads when imported - the CUDA allocator's
        backend in PYTORCH_CUDA_ALLOC_CONF, which launch.worker_env changes from ComfyUI's - is fixed here."""
        with self._lock:
            if self._closed or (self.proc is not None and not self._gone.is_set()):
                return
            read_fd, write_fd = os.pipe()
            self._ready.clear()
            self._gone.clear()
            env = dict(os.environ if env is None else env)
            self.env = import_time_env(env)
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", BOOTSTRAP, str(pack_root()), f"{PACKAGE}.workers.forkserver_main",
                     "--driver-pid", str(os.getpid()), "--reply-fd", str(write_fd)],
                    stdin=subprocess.PIPE, pass_fds=(write_fd,), close_fds=True, cwd=self.cwd, env=env)
            finally:
                os.close(write_fd)
            threading.Thread(target=self._read, args=(os.fdopen(read_fd, "r"),), name="hybrid-parallel-forks",
                             daemon=True).start()

    def gone(self) -> bool:
        return self._gone.is_set()

    def ready(self) -> bool:
        return self._ready.is_set() and not self._gone.is_set()

    def serves(self, env: dict) -> bool:
        """Whether a worker with environment `env` can be forked here (its import-time variables are the server's)."""
        return (self.proc is not None and not self._closed and not self._gone.is_set()
                and import_time_env(env) == self.env)

    def spawn(self, argv: list, env: dict, authkey: bytes, cwd: str, timeout_s: float) -> ForkedProcess:
        """Fork one worker: worker_main.main(argv) with exactly `env` and `cwd`, its key handed over on the pipe.
        Waits for the server's imports if they are still running (they started earlier than a fresh interpreter
        would); raises ForkServerError if the server cannot fork (the launcher then starts a fresh interpreter)."""
        with self._lock:
            if self.proc is None or self._closed or self._gone.is_set():
                raise ForkServerError("the fork server is not running")
            self._next += 1
            rid = self._next
            slot = self._pending[rid] = [threading.Event(), None]
            line = json.dumps({"id": rid, "argv": [str(a) for a in argv], "env": {k: str(v) for k, v in env.items()},
                               "cwd": cwd, "key": authkey.hex()})
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (OSError, ValueError) as e:
                self._pending.pop(rid, None)
                raise ForkServerError(f"the fork server does not take requests: {e}") from None
        if not slot[0].wait(timeout_s):
            raise ForkServerError(f"the fork server did not fork a worker within {timeout_s:.0f} s")
        with self._lock:
            self._pending.pop(rid, None)
            if not isinstance(slot[1], int):
                raise ForkServerError(f"the fork server could not fork a worker: {slot[1]}")
            child = self._children[slot[1]] = ForkedProcess(self, slot[1], argv)
            if slot[1] in self._early_exits:
                child._set_exit(self._early_exits.pop(slot[1]))
            return child

    def _read(self, replies) -> None:
        """The server's replies: ready, forked <id> <pid>, failed <id> <why>, exit <pid> <code>."""
        try:
            for line in replies:
                word, _, rest = line.strip().partition(" ")
                if word == "ready":
                    self._ready.set()
                elif word in ("forked", "failed"):
                    rid, _, value = rest.partition(" ")
                    with self._lock:
                        slot = self._pending.get(int(rid))
                        if slot is not None:
                            slot[1] = int(value) if word == "forked" else value
                            slot[0].set()
                elif word == "exit":
                    pid, code = (int(v) for v in rest.split())
                    with self._lock:
                        child = self._children.pop(pid, None)
                        if child is None:
                            self._early_exits[pid] = code
                    if child is not None:
                        child._set_exit(code)
        except (OSError, ValueError):
            pass
        finally:
            self._gone.set()
            with self._lock:
                for slot in self._pending.values():
                    slot[1] = slot[1] or "the fork server exited"
                    slot[0].set()
                proc = self.proc
            replies.close()
            try:
                proc.wait(timeout=5.0)  # its reply pipe closes as it exits: collect it (no zombie)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Fork no more; the server exits once the workers it forked have (a running world is not disturbed)."""
        with self._lock:
            proc, self._closed = self.proc, True
        if proc is not None and proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass


# ---- the server's side ----
def _preload() -> None:
    with imports_without_gc(freeze=True):
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a head start only: a module failing here is imported (or fails) later
                pass


def serve(driver_pid: int, reply_fd: int) -> int:
    """Import PRELOAD, say ready, then fork a worker per request line on stdin until stdin closes and the last
    worker has exited, or the driver is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; closing stdin stops us
    _preload()

    def reply(text: str) -> None:
        os.write(reply_fd, (text + "\n").encode())

    reply("ready")
    children: set = set()
    buf, open_ = b"", True
    while open_ or children:
        while children:  # reap at once: no zombie, and the driver learns each exit status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            children.discard(pid)
            reply(f"exit {pid} {os.waitstatus_to_exitcode(status)}")
        if os.getppid() != driver_pid:
            return 0  # the driver is gone: the workers' parent watches see this process go and clean up
        if not open_:
            select.select([], [], [], POLL_S)
            continue
        if not select.select([0], [], [], POLL_S)[0]:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            open_ = False
            continue
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            try:
                request = json.loads(line)
                rid = int(request["id"])
            except (ValueError, KeyError, TypeError):
                continue
            try:
                pid = os.fork()
            except OSError as e:
                reply(f"failed {rid} {e}")
                continue
            if pid == 0:
                from .worker_main import run_forked  # lazy: the worker's side, in the child only
                run_forked(request, reply_fd)
            children.add(pid)
            reply(f"forked {rid} {pid}")
    return 0


def main(argv=None) -> int:
    """`workers.forkserver_main --driver-pid P --reply-fd F`: the server's entry module runs this (it is its own
    module so that runpy runs a module nothing imports; its forks run worker_main.main)."""
    p = argparse.ArgumentParser(description="the pack's fork server (started by the driver)")
    p.add_argument("--driver-pid", type=int, required=True)
    p.add_argument("--reply-fd", type=int, required=True)
    args = p.parse_args(argv)
    return serve(args.driver_pid, args.reply_fd)
