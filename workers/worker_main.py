"""One real worker, a rank, from its start to its exit: `python -m comfyui_hybrid_parallel.workers.worker_main`,
or forked by the driver's fork server (workers/forkserver.py -> `run_forked`), or started by the driver with
subprocess (never multiprocessing spawn, whose children re-run ComfyUI's main.py).

Start: the auth key arrives on a pipe (stdin, or the fork server's), never on the command line where `ps` would show
it. Connect and authenticate, say hello, receive the world description, join the torch.distributed world (with a
timeout), build the ParallelContext once, report ready, then serve jobs.

The job loop (`serve`, shared with the fake worker; no torch at this module's top): one thread receives - the main
thread, which runs one job at a time, reads the control channel itself, blocking while idle and taking in whatever
arrived at each cancel check while a job runs (Inbox). Two helper threads never read: the heartbeat says the rank is
alive while it computes, and the parent watch exits the process as soon as the driver is gone (parent pid changed,
or EOF on the channel seen by peeking), so no worker outlives a SIGKILLed driver even while it is stuck in a job.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque

from .bootstrap import imports_without_gc
from .cluster import read_authkey_file
from .job_run import Cancelled, JobRun
from .protocol import ProtocolError, connect
from .transport import cleanup_prefix

PARENT_POLL_S = 1.0
EXIT_DRIVER_GONE = 3



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--torchrun", action="store_true", help="started by torchrun (cluster.py): rank and world "
                   "size from its environment, the key from --authkey-file, the driver watched by its channel")
    p.add_argument("--rank", type=int)
    p.add_argument("--world-size", type=int)
    p.add_argument("--address", "--driver", dest="address", required=True,
                   help="driver's unix socket path or host:port")
    p.add_argument("--driver-pid", type=int, default=0)
    p.add_argument("--authkey-file")
    args = p.parse_args(argv)
    if args.torchrun:
        if not args.authkey_file:
            p.error("--torchrun needs --authkey-file")
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.driver_pid = 0
    elif args.rank is None or args.world_size is None or not args.driver_pid:
        p.error("--rank, --world-size and --driver-pid are required unless --torchrun")
    return args


def read_authkey() -> bytes:
    line = sys.stdin.readline().strip()
    sys.stdin.close()
    if len(line) != 64:
        raise SystemExit("worker: expected a 32-byte hex auth key on stdin")
    return bytes.fromhex(line)


def _join_world(args, init: dict):
    """init_process_group + ParallelContext; returns (ctx, device)."""
    threads = int(init.get("threads") or 1)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    with imports_without_gc():  # torch (a fresh interpreter's) and the engine; not the join's wait below
        import torch
        import torch.distributed as dist

        from comfyui_hybrid_parallel.parallel import ParallelConfig, ParallelContext

    torch.set_num_threads(threads)
    config = ParallelConfig.from_dict(init["config"])
    device = torch.device(init["device"] if init["device"] != "local" else
                          f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if init["backend"] == "nccl" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=float(init["timeout_s"]))
    if args.world_size > 1:
        dist.init_process_group(init["backend"], init_method=init["init_method"], rank=args.rank,
                                world_size=args.world_size, timeout=timeout)
    from comfyui_hybrid_parallel.parallel import staged, strict
    if init.get("staged") and args.world_size > 1:  # ranks sharing GPUs talk gloo through host copies
        staged.StagedComm(stage_all=init["staged"] == "all").install()
    if strict.enabled() and init["backend"] == "gloo":  # tests: fail where NCCL would (parallel/strict.py)
        device = strict.compute_device(device)
        strict.StrictComm().install()
    ctx = ParallelContext(config, device=device, timeout_s=float(init["timeout_s"]))
    ctx.set_speeds(_speeds(init, ctx, device, threads))
    return ctx, device


def _speeds(init: dict, ctx, device, threads: int):
    """Every rank's relative speed, or None for an even split (launch.py `balance`): given by the driver
    (HP_BALANCE's list), or probed here and shared - on GPU worlds by default (a 4090 beside a 3090), on CPU worlds
    only when asked (CPU ranks share cores, so a probe there measures the neighbours too)."""
    given = init.get("speeds")
    if given:
        return [float(v) for v in given]
    balance = init.get("balance", "auto")
    if ctx.world_size == 1 or balance == "off" or (balance == "auto" and device.type != "cuda"):
        return None
    import torch
    import torch.distributed as dist

    from comfyui_hybrid_parallel.parallel.costmodel import probe_speed
    mine = torch.tensor([probe_speed(device, threads)], dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(ctx.world_size)]
    dist.all_gather(every, mine)
    return [float(t.item()) for t in every]


def _pin_cpus(rank: int) -> None:
    """HP_WORKER_CPUS="0;1,2;..." (one ;-separated entry per rank): this rank's cores, set before torch starts its
    threads. For NUMA layouts and for benches that make one CPU rank deliberately slower (bench_uneven.py)."""
    spec = os.environ.get("HP_WORKER_CPUS", "").strip()
    if not spec or not hasattr(os, "sched_setaffinity"):
        return
    entries = spec.split(";")
    if rank < len(entries) and entries[rank].strip():
        os.sched_setaffinity(0, {int(c) for c in entries[rank].split(",")})


def main(argv=None, authkey: bytes | None = None) -> int:
    """`authkey`: given by the fork server (workers/forkserver.py), which read it from the driver's pipe."""
    args = parse_args(argv)
    _pin_cpus(args.rank)
    watch = ParentWatch(args.driver_pid, args.rank)
    if args.torchrun:
        key = read_authkey_file(args.authkey_file)
    else:
        key = authkey if authkey is not None else read_authkey()
    channel = connect(args.address, key)
    channel.send("hello", rank=args.rank, pid=os.getpid(), host=socket.gethostname())
    init = channel.recv(expect={"init"}, timeout=60.0)
    if not args.torchrun:  # a cluster worker owns no files of the driver's machine
        watch.prefix, watch.tmpdir = init["shm_prefix"], os.path.dirname(args.address)
    try:
        ctx, device = _join_world(args, init)
    except BaseException as e:  # noqa: BLE001 - tell the driver why, then exit
        channel.send("ready", rank=args.rank, ok=False,
                     error=f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        return 2
    channel.send("ready", rank=args.rank, ok=True, device=str(device))

    with imports_without_gc():
        from .jobs import WorkerState, make_executor  # lazy: torch and the engine, once _join_world set the rank up

    state = WorkerState(args.rank, device, init["shm_prefix"], init.get("max_models", 2),
                        broadcast_tensors=bool(init.get("broadcast_tensors")))
    contexts = {ctx.config.mesh_key(): ctx}  # one per mesh this world runs (a config change keeps the workers)
    serve(channel, args.rank, make_executor(state, ctx, contexts), watch)
    release(state, contexts, channel)
    return 0


def release(state, contexts: dict, channel) -> None:
    """What a clean stop releases before the process ends: the resident models (their shared-memory
    mappings), the process groups, the control channel."""
    state.engine.models.clear()
    for ctx in contexts.values():
        ctx.destroy()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    channel.close()


# ---- the job loop (the fake worker's too) ----
def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


def error_fields(exc: BaseException, rank: int) -> dict:
    kind = "cancelled" if isinstance(exc, Cancelled) else "oom" if is_oom(exc) else "error"
    return {"ok": False, "error": {"kind": kind, "type": type(exc).__name__, "message": str(exc)[:2000],
                                   "traceback": traceback.format_exc()[-20000:], "rank": rank}}


class ParentWatch:
    """Exit as soon as the driver is gone, even while still importing torch or joining the world.

    A SIGKILLed driver cannot clean up, so the orphan does: it removes the
    pool's shared-memory files (`prefix`, known once the world is described)
    and rank 0 removes the pool's private temp dir (`tmpdir`).
    """

    def __init__(self, driver_pid: int, rank: int):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's business; it stops us
        self.driver_pid, self.rank = driver_pid, rank
        self.prefix: str | None = None
        self.tmpdir: str | None = None
        self.channel = None  # set by the Inbox: its EOF, seen by peeking, also means the driver is gone
        self._peek_sock: socket.socket | None = None
        threading.Thread(target=self._watch, name="parent-watch", daemon=True).start()

    def _watch(self) -> None:
        while True:
            if self.driver_gone() or self.channel_closed():
                self.exit()
            time.sleep(PARENT_POLL_S)

    def channel_closed(self) -> bool:
        """EOF on the control channel, seen without taking anything off it (MSG_PEEK on a dup of its socket): the
        main thread reads only between jobs and at cancel checks, so a driver that dies while a rank waits in
        a collective would otherwise go unnoticed where the parent pid cannot tell (torchrun-started ranks). An
        unread message hides the EOF behind it until the main thread takes it (its next cancel check; a rank stuck
        in a collective meanwhile ends at the collective's timeout)."""
        if self.channel is None:
            return False
        try:
            if self._peek_sock is None:
                self._peek_sock = socket.socket(fileno=os.dup(self.channel.fileno()))
            return self._peek_sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, nothing pending
        except (ConnectionError, ValueError):
            return True  # reset by the peer, or the channel was closed here
        except OSError:
            return False  # not a socket, or cannot peek: the parent pid and the main thread's reads still tell

    def driver_gone(self) -> bool:
        # driver_pid 0: started by torchrun, maybe on another machine; the control channel's EOF tells
        return self.driver_pid != 0 and os.getppid() != self.driver_pid

    def exit(self) -> None:
        """Exit; clean up only if the driver is really gone (EOF may come a moment before reparenting).

        A live driver that hung up on us (e.g. while killing the world) still owns
        its files and temp dir, which a world started next may already use.
        """
        deadline = time.monotonic() + 2.0
        while not self.driver_gone() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            if not self.driver_gone():
                return
            if self.prefix:
                cleanup_prefix(self.prefix)
            if self.rank == 0 and self.tmpdir and os.path.basename(self.tmpdir).startswith("chp-pool-"):
                shutil.rmtree(self.tmpdir, ignore_errors=True)
        finally:
            os._exit(EXIT_DRIVER_GONE)


HEARTBEAT_S = 1.0  # while a job runs, each rank says it is alive this often (the driver detects stalls by it)


def _heartbeat(channel, rank: int, running: dict) -> None:
    """A thread of its own, so a rank computing or waiting in a collective (both release the GIL) still
    beats; a stopped, frozen or deadlocked process does not - which is exactly what the driver looks for."""
    while True:
        time.sleep(HEARTBEAT_S)
        job = running.get("job")
        if job is not None:
            try:
                channel.send("heartbeat", job=job, rank=rank)
            except (OSError, ValueError):
                return


class Inbox:
    """Every receive of the worker, on its main thread: no hand-off between threads on the hot path.

    Why on the main thread: step mode sends one job per model call, and a
    reader thread that queued each job for the main thread cost a thread wake-up
    and a GIL switch per call (~50-70 us of a ~1.5 ms tiny step here). While idle,
    the main thread waits on the socket itself; while a job runs, whatever has
    arrived is taken at each cancel check (`JobRun.cancel_requested`, the stop
    points every job already polls), never waiting: a cancel is marked, a job or
    `stop` that came early is kept for later. EOF or a broken channel exits the
    process as before (ParentWatch.exit), and the parent-watch thread sees EOF
    while a job runs without taking anything off the channel (`channel_closed`).
    """

    def __init__(self, channel, watch: "ParentWatch"):
        self.channel, self.watch = channel, watch
        self.cancelled: set = set()
        self.waiting: deque = deque()  # jobs (and None for `stop`) read while a job ran
        watch.channel = channel

    def _read(self, timeout: float | None) -> None:
        try:
            msg = self.channel.recv(expect={"job", "cancel", "stop"}, timeout=timeout)
        except TimeoutError:
            if self.watch.driver_gone():
                self.watch.exit()
            return
        except (EOFError, OSError, ProtocolError):
            # The driver died or is not ours any more: nobody will collect our results.
            self.watch.exit()
        if msg["t"] == "cancel":
            self.cancelled.add(int(msg["job"]))
        else:
            self.waiting.append(None if msg["t"] == "stop" else msg)

    def next_job(self):
        """The next job message, or None for `stop`; blocks (checking on the driver every PARENT_POLL_S)."""
        while not self.waiting:
            self._read(PARENT_POLL_S)
        return self.waiting.popleft()

    def take_arrived(self) -> None:
        """Read every message already here, without waiting (called from the main thread only)."""
        while self.channel.conn.poll(0):
            self._read(None)


def serve(channel, rank: int, execute, watch: ParentWatch) -> None:
    """Run jobs until `stop`; `execute(msg, run) -> result fields` (it reports its own errors)."""
    inbox = Inbox(channel, watch)
    running: dict = {"job": None}
    threading.Thread(target=_heartbeat, args=(channel, rank, running), name="heartbeat", daemon=True).start()
    while True:
        msg = inbox.next_job()
        if msg is None:
            return
        job_id = int(msg["job"])
        run = JobRun(channel, job_id, rank, inbox)
        running["job"] = job_id
        try:
            fields = execute(msg, run)
        except BaseException as e:  # noqa: BLE001 - the driver decides what a failure means
            fields = error_fields(e, rank)
        running["job"] = None
        inbox.cancelled.discard(job_id)
        try:
            channel.send("result", job=job_id, rank=rank, **fields)
        except (OSError, ValueError):
            watch.exit()  # the driver hung up: nobody will read this result


# ---- a fork of the fork server ----
def run_forked(request: dict, reply_fd: int) -> None:
    """A worker forked by the fork server (workers/forkserver.serve), in the child: the request's folder,
    environment and stdin, then `main`; never returns."""
    code = 1
    try:
        os.close(reply_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        sys.stdin = open(0, closefd=False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = main(request["argv"], authkey=bytes.fromhex(request["key"]))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the driver's stderr, as a fresh worker's would
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    code = main()
    # Everything this worker owns is released; skip the interpreter's finalisation (torch and ComfyUI
    # modules tearing down, OpenMP pools joining), which took seconds and ended in the pool's SIGKILL.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
