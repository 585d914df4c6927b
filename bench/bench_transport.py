"""Per-step round trip through the worker pool versus a plain in-process copy.

What the pool adds to every step in step mode: the driver writes the latent to
shared memory, sends one JSON job message, the worker maps the latent, rank 0
writes its result to shared memory and answers, the driver maps the result.
Measured with the diagnostic "echo" job on one real worker (degree 1), so the
model's compute is excluded; the "control only" row is a job without tensors.

    python bench/bench_transport.py [--reps 50]

Prints a Markdown table and writes bench/results/transport.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool

CASES = [
    ("control only (no tensor)", None, None),
    ("SD 512² latent 4x64x64 fp32", (1, 4, 64, 64), torch.float32),
    ("1 MB latent 1x4x256x256 fp32 (SD 2048²)", (1, 4, 256, 256), torch.float32),
    ("Flux 1024² latent 16x128x128 fp32", (1, 16, 128, 128), torch.float32),
    ("Wan 480p 81f latent 16x21x60x104 bf16", (1, 16, 21, 60, 104), torch.bfloat16),
]


def _time(fn, reps: int) -> list:
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _stats(ms: list) -> dict:
    ms = sorted(ms)
    return {"median_ms": statistics.median(ms), "p90_ms": ms[int(0.9 * (len(ms) - 1))], "min_ms": ms[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    cfg = ParallelConfig()
    rows = []
    with WorkerPool(device="cpu") as pool:
        t = time.perf_counter()
        pool.ensure_world(cfg)
        start_s = time.perf_counter() - t
        for name, shape, dtype in CASES:
            if shape is None:
                pool_ms = _time(lambda: pool.submit(cfg, "steps", {"n": 0}), args.reps)
                copy_ms, nbytes = None, 0
            else:
                x = torch.randn(shape).to(dtype)
                nbytes = x.numel() * x.element_size()

                def round_trip():
                    out = pool.submit(cfg, "echo", {}, {"x": x}).tensors["x"]
                    assert out.shape == x.shape
                pool_ms = _time(round_trip, args.reps)
                copy_ms = _time(lambda: x.clone(), args.reps)
            rows.append({"case": name, "bytes": nbytes, "pool": _stats(pool_ms),
                         "in_process_copy": _stats(copy_ms) if copy_ms else None})
    print(f"World start (1 CPU worker, gloo): {start_s:.2f} s\n")
    print("min is the better estimate on a shared machine (others' load only ever adds time)\n")
    print("| case | size | pool round trip min / median | in-process copy min / median | overhead (min) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        copy, pool_s = r["in_process_copy"], r["pool"]
        cm = f"{copy['min_ms']:.3f} / {copy['median_ms']:.3f} ms" if copy else "-"
        over = f"{pool_s['min_ms'] - copy['min_ms']:.2f} ms" if copy else "-"
        print(f"| {r['case']} | {r['bytes'] / 2**20:.2f} MiB | {pool_s['min_ms']:.2f} / {pool_s['median_ms']:.2f} ms "
              f"| {cm} | {over} |")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    out = os.path.join(os.path.dirname(__file__), "results", "transport.json")
    with open(out, "w") as f:
        json.dump({"reps": args.reps, "world_start_s": start_s, "machine": platform.platform(),
                   "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows}, f, indent=2)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
