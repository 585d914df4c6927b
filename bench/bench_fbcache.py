"""First Block Cache (Comfy-WaveSpeed's rule) on the pool against the same cache on one device, side by side.

A real ComfyUI server with the tests' stand-in of Comfy-WaveSpeed's node (tests/standins/Comfy-WaveSpeed, its
contract), ComfyUI's own MMDiT (SD3 family: 8 joint blocks of width 512, fp32, random weights) on a 48 x 48 latent
(576 image tokens), 16 euler steps, cfg 4. Four graphs, each run `--runs` times interleaved (KSampler, KSampler + the
node, Parallel Model ulysses 2, Parallel Model ulysses 2 + the node), after one warm-up prompt of each: the median
seconds with the spread, the cache's speed-up on each side (no cache / cache), the pool's speed-up over one device,
and each cached latent's distance from its uncached twin (how far the skipped steps moved it - random weights, so it
says nothing of a picture) and the pool's cached latent from one device's cached one (the exactness: <= 1e-5).

    python bench/bench_fbcache.py [--runs 3] [--quick]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

THRESHOLD = 0.8  # random weights: the first block's residual changes by most of itself per step; 0.2 (a real model's setting) never hits


def _graph(tag: str, cached: bool, degrees: dict | None, steps: int, size: int, seed: int):
    from comfy_server import parallel_model, workflow
    g = workflow(None, tag, size * 8, size * 8, steps=steps)
    for k in ("7", "8", "11"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = "bench_sd3_8.safetensors"
    g["5"]["inputs"]["seed"] = seed
    model = ["1", 0]
    if cached:
        g["20"] = {"class_type": "ApplyFBCacheOnModel", "inputs": {
            "model": model, "object_to_patch": "diffusion_model", "residual_diff_threshold": THRESHOLD,
            "start": 0.0, "end": 1.0, "max_consecutive_cache_hits": -1}}
        model = ["20", 0]
    if degrees is not None:
        model = parallel_model(g, degrees, model=tuple(model))
    g["5"]["inputs"]["model"] = model
    return g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from comfy_env import setup_comfy
    comfy_dir = setup_comfy()
    from _worlds import write_results
    from comfy_server import CountingServer, latent, rel, write_checkpoints
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    steps, size = (8, 32) if args.quick else (16, 48)
    base = Path(tempfile.mkdtemp(prefix="hp-bench-fbcache-"))
    server = CountingServer(comfy_dir, base)
    shutil.copytree(HERE.parent / "tests" / "standins" / "Comfy-WaveSpeed", base / "custom_nodes" / "Comfy-WaveSpeed")
    write_checkpoints(base, ("sd3",))  # its VAE file is the graph's (not decoded)
    tc.write_sd3(base / "models" / "diffusion_models" / "bench_sd3_8.safetensors", depth=8, pos_embed_max_size=64,
                 seed=5)
    sides = {"KSampler": (False, None), "KSampler + First Block Cache": (True, None),
             "Parallel Model u2": (False, {"ulysses_degree": 2}),
             "Parallel Model u2 + First Block Cache": (True, {"ulysses_degree": 2})}
    times = {name: [] for name in sides}
    server.start()
    try:
        for run in range(args.runs + 1):  # run 0 warms each side up (loads, world start)
            for name, (cached, degrees) in sides.items():
                tag = f"{name.replace(' ', '_').replace('+', 'fb')}_{run}"
                t = time.perf_counter()
                entry = server.run(_graph(tag, cached, degrees, steps, size, seed=42))
                took = time.perf_counter() - t
                if entry["status"]["status_str"] != "success":
                    raise RuntimeError(f"{name}: {entry['status']}\n{server.tail()}")
                if run:
                    times[name].append(took)
        lat = {name: latent(server, f"{name.replace(' ', '_').replace('+', 'fb')}_{args.runs}") for name in sides}
        hits = sum(w.get("first_block_hits", 0) for w in server.get("/hybrid_parallel/pool")["workers"]
                   if w.get("rank") == 0)
    finally:
        server.stop()
    med = {n: statistics.median(t) for n, t in times.items()}
    rows = [{"side": n, "median_s": round(med[n], 3), "spread_s": round(max(t) - min(t), 3), "runs": len(t)}
            for n, t in times.items()]
    ks, ksfb = med["KSampler"], med["KSampler + First Block Cache"]
    pm, pmfb = med["Parallel Model u2"], med["Parallel Model u2 + First Block Cache"]
    extra = {"cache_speedup_one_device": round(ks / ksfb, 3), "cache_speedup_pool": round(pm / pmfb, 3),
             "pool_speedup_uncached": round(ks / pm, 3), "pool_speedup_cached": round(ksfb / pmfb, 3),
             "cached_vs_uncached_one_device": rel(lat["KSampler + First Block Cache"], lat["KSampler"]),
             "pool_cached_vs_one_device_cached": rel(lat["Parallel Model u2 + First Block Cache"],
                                                     lat["KSampler + First Block Cache"]),
             "steps": steps, "latent": [size, size], "threshold": THRESHOLD, "pool_cache_hits_last_run": hits}
    md = ["| side | median s | spread s | runs |", "|---|---|---|---|"]
    md += [f"| {r['side']} | {r['median_s']} | {r['spread_s']} | {r['runs']} |" for r in rows]
    md += ["", f"First Block Cache speed-up: one device {extra['cache_speedup_one_device']}x, the pool (u2) "
           f"{extra['cache_speedup_pool']}x; pool over one device: {extra['pool_speedup_uncached']}x uncached, "
           f"{extra['pool_speedup_cached']}x cached ({hits} of {steps} steps' calls served from the cache on the "
           f"workers). The pool's cached latent is {extra['pool_cached_vs_one_device_cached']:.1e} from one "
           f"device's cached one; caching moved one device's latent by {extra['cached_vs_uncached_one_device']:.1e} "
           f"(random weights)."]
    write_results("fbcache", rows, "\n".join(md), extra)


if __name__ == "__main__":
    main()
