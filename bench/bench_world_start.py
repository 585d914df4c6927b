"""World starts with the fork server vs fresh interpreters, side by side in one run.

Why: a world's start was mostly each rank's imports (torch, its compiler front end, the libraries ComfyUI's model code
imports); workers/forkserver.py pays them once and forks every rank. This measures, per mode, the first world (the
fork server's own start included: it also imports ahead what fresh ranks import only at their first model - the
libraries of ComfyUI's model code) and each later world switch (a new config of another size), as seconds until
every rank has imported ComfyUI as a prompt's ranks do, plus the pool's host memory while idle (PSS of the workers and the fork server: what the forks
share with it is counted once).

    python bench/bench_world_start.py [--switches 4]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from _worlds import write_results  # noqa: E402
from bench_native import _pss  # noqa: E402

from comfyui_hybrid_parallel.parallel import ParallelConfig  # noqa: E402
from comfyui_hybrid_parallel.workers.messages import ComfyRuntime  # noqa: E402
from comfyui_hybrid_parallel.workers.pool import WorkerPool  # noqa: E402

WORLDS = (ParallelConfig(ulysses_degree=2), ParallelConfig(cfg_degree=2, ulysses_degree=2))


def _ready(pool, config) -> float:
    """Seconds until every rank of `config`'s world has imported ComfyUI as a prompt's ranks do (the prestart's job)."""
    from comfy_env import comfyui_dir
    t = time.perf_counter()
    runtime = ComfyRuntime(comfy_dir=str(comfyui_dir()), comfy_args={"cpu": True})
    pool.submit(config, "prepare", {"comfy": runtime.message()}, timeout_s=300)
    return time.perf_counter() - t


def measure(forked: bool, switches: int) -> dict:
    os.environ["HP_FORK_SERVER"] = "1" if forked else "0"
    with WorkerPool(device="cpu") as pool:
        first = _ready(pool, WORLDS[0])
        times = {2: [], 4: []}
        for i in range(switches):
            config = WORLDS[(i + 1) % 2]
            times[config.world_size].append(_ready(pool, config))
        pids = [p.pid for p in pool.world.procs] + ([pool.fork_server_pid] if pool.fork_server_pid else [])
        idle, ranks = sum(_pss(p) for p in pids), pool.world.world_size
    return {"mode": "fork server" if forked else "fresh interpreters", "first_world_s": round(first, 2),
            "switch_to_2_ranks_s": round(statistics.median(times[2]), 2),
            "switch_to_4_ranks_s": round(statistics.median(times[4]), 2),
            "last_world_ranks": ranks, "idle_host_mib": round(idle / 2**20)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--switches", type=int, default=4, help="world switches after the first (odd: ends on 4 ranks)")
    args = p.parse_args()
    rows = [measure(forked, args.switches) for forked in (False, True)]
    keys = list(rows[0])
    md = ["## World start: fork server vs fresh interpreters (CPU, gloo; seconds until every rank imported ComfyUI)", "",
          "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    fresh, forked = rows
    md += ["", f"ratio (fork server / fresh): first world {forked['first_world_s'] / fresh['first_world_s']:.2f}, "
               f"switch to 2 ranks {forked['switch_to_2_ranks_s'] / fresh['switch_to_2_ranks_s']:.2f}, "
               f"switch to 4 ranks {forked['switch_to_4_ranks_s'] / fresh['switch_to_4_ranks_s']:.2f}"]
    write_results("world_start", rows, "\n".join(md))


if __name__ == "__main__":
    main()
