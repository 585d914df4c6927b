"""Entry point of one real worker: `python -m comfyui_hybrid_parallel.workers.worker_main`.

Forked by the driver's fork server (workers/forkserver.py), or started by the
driver with subprocess (never multiprocessing spawn, whose children re-run
ComfyUI's main.py). The auth key arrives on a pipe (stdin, or the fork server's),
never on the command line where `ps` would show it. Order: connect and authenticate, say
hello, receive the world description, join the torch.distributed world (with a
timeout), build the ParallelContext once, report ready, then serve jobs.
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
import traceback

from .cluster import read_authkey_file
from .protocol import connect
from .serve import ParentWatch, serve


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


if __name__ == "__main__":
    code = main()
    # Everything this worker owns is released; skip the interpreter's finalisation (torch and ComfyUI
    # modules tearing down, OpenMP pools joining), which took seconds and ended in the pool's SIGKILL.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
