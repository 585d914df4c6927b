"""Ranks of different speeds: an even sequence split against one in proportion to the probed speeds (HP_BALANCE).

Why: a 4090 beside a 3090 (or a busy CPU core) makes an even split wait for the slow rank at every collective. Here
one of two CPU ranks is made deliberately slower: the ranks are pinned to one core each (HP_WORKER_CPUS) and a
busy loop shares rank 1's core, so rank 1 runs at about half speed. The same Ulysses 2 / Ring 2 forward of
ComfyUI's own SD3 (MMDiT, hidden 384, 6 blocks, 64x64 latent = 1024 image tokens) runs through the pool with
balance "off" (even split) and "probe" (each rank's matmul throughput measured at world start, the sequence - and
Ulysses' heads - split accordingly); both are timed alternately in one run, and both checked against ComfyUI's
forward in this process. Degree 1 on the unloaded core is the reference.

    python bench/bench_uneven.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from _worlds import write_results

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _busy(core: int) -> subprocess.Popen:
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def _model(tmp: Path):
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp / "sd3_medium.safetensors"
    tc.write_sd3(path, depth=6, pos_embed_max_size=64, seed=5)
    return comfy.sd.load_diffusion_model(str(path)).model


def _inputs(base, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(1, 16, 64, 64, generator=g), "context": torch.randn(1, 77, 32, generator=g),
            "y": torch.randn(1, 24, generator=g), "timestep": torch.full((1,), 500.0)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 timed rounds instead of 7")
    args = ap.parse_args(argv)
    if (os.cpu_count() or 1) < 2 or not hasattr(os, "sched_setaffinity"):
        raise SystemExit("needs 2 cores and sched_setaffinity (Linux)")
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    rounds = 3 if args.quick else 7
    tmp = Path(tempfile.mkdtemp(prefix="hp-uneven-"))
    torch.set_num_threads(1)
    base = _model(tmp)
    dm = base.diffusion_model
    inp = _inputs(base, 3)
    with torch.no_grad():
        ref = dm(inp["x"], inp["timestep"], transformer_options={}, **{k: inp[k] for k in ("context", "y")})
    busy = _busy(1)
    pools = {b: WorkerPool(device="cpu", balance=b, env={"HP_WORKER_CPUS": "0;1", "HP_STRICT_COMM": "0"})
             for b in ("off", "probe")}
    rows = []
    try:
        for name, degrees in (("Ulysses 2", dict(ulysses_degree=2)), ("Ring 2", dict(ring_degree=2))):
            config = ParallelConfig(**degrees)
            times, errs, speeds = {b: [] for b in pools}, {}, {}
            for b, pool in pools.items():
                pool.ensure_model(config, "sd3", family_adapter(dm).family, native=native_spec(base),
                                  state_dict=lambda: dict(dm.state_dict()))
                out = pool.submit(config, "forward", {"key": "sd3", "structure": {"transformer_options": {}}},
                                  dict(inp)).tensors["out"]
                errs[b] = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                speeds[b] = pool.health()[0]["speeds"]
            for _ in range(rounds):  # alternate, so the machine's other load hits both alike
                for b, pool in pools.items():
                    t = time.perf_counter()
                    pool.submit(config, "forward", {"key": "sd3", "structure": {"transformer_options": {}}}, dict(inp))
                    times[b].append(time.perf_counter() - t)
            even, balanced = statistics.median(times["off"]), statistics.median(times["probe"])
            rel = [round(s / max(speeds["probe"]), 2) for s in speeds["probe"]] if speeds["probe"] else None
            rows.append({"method": name, "even_s": round(even, 4), "balanced_s": round(balanced, 4),
                         "speedup": round(even / balanced, 3), "probed_relative_speeds": rel,
                         "rel_err_even": errs["off"], "rel_err_balanced": errs["probe"]})
            print(rows[-1], flush=True)
    finally:
        busy.kill()
        for p in pools.values():
            p.close()
    lines = ["# Ranks of different speeds: even split vs split by probed speed", "",
             "Two CPU ranks pinned to one core each, a busy loop sharing rank 1's core (rank 1 at about half speed). "
             "ComfyUI's SD3 (hidden 384, 6 blocks), 1024 image + 77 text tokens, one forward; medians of "
             f"{rounds} alternating rounds.", "",
             "| method | even split s | split by speed s | speedup | probed speeds (relative) | rel err even | rel err balanced |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['even_s']} | {r['balanced_s']} | {r['speedup']}x | "
                     f"{r['probed_relative_speeds']} | {r['rel_err_even']:.1e} | {r['rel_err_balanced']:.1e} |")
    write_results("uneven" + ("_quick" if args.quick else ""), rows, "\n".join(lines))


if __name__ == "__main__":
    main()
