"""Weight sharding: per-rank weight bytes, peak gathered bytes and time per step, sharded vs unsharded.

ComfyUI's own MMDiT (SD3 family, 8 joint blocks, hidden 512) loaded by UNETLoader's path in fp32 and
fp8_e4m3fn, made resident on the worker pool for Ulysses 2 and CFG 2 with and without `shard_weights`;
one forward per step on a 64 x 64 latent (1024 tokens), batch 2. Every configuration runs in the same
process, one after the other; each is checked against ComfyUI's serial forward before it is timed.
"""
import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _worlds import write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

CONFIGS = [("ulysses 2", {"ulysses_degree": 2}, "sequence"), ("cfg 2", {"cfg_degree": 2}, "all")]


def _inputs(base, size, seed=0):
    from comfyui_hybrid_parallel.doctor.tiny_checkpoints import TINY_CONTEXT_DIM, TINY_POOLED_DIM
    g = torch.Generator().manual_seed(seed)
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    d = {"x": torch.randn(2, 16, size, size, generator=g), "context": torch.randn(2, 77, TINY_CONTEXT_DIM, generator=g),
         "y": torch.randn(2, TINY_POOLED_DIM, generator=g)}
    d = {k: v.to(dtype) for k, v in d.items()}
    d["timestep"] = torch.rand(2, generator=g) * 1000
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.workers.pool import WorkerPool

    repeats = 3 if args.quick else 7
    size = 32 if args.quick else 64
    tmp = Path(tempfile.mkdtemp(prefix="hp-bench-shard-"))
    path = tmp / "sd3_8blocks.safetensors"
    tiny.write_sd3(path, depth=8, pos_embed_max_size=64, seed=5)
    rows = []
    pool = WorkerPool(device="cpu", max_models=2)
    try:
        for precision, dtype in (("fp32", torch.float32), ("fp8_e4m3fn", torch.float8_e4m3fn)):
            base = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype}).model
            dm = base.diffusion_model
            inp = _inputs(base, size)
            rest = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
            with torch.no_grad():
                ref = dm(inp["x"], inp["timestep"], transformer_options={}, **rest)
            full = sum(v.numel() * v.element_size() for v in dm.state_dict().values())
            for name, degrees, axis in CONFIGS:
                for shard in ("none", axis):
                    config = ParallelConfig(**degrees, shard_weights=shard)
                    key = f"bench-shard:{precision}"
                    pool.ensure_model(config, key, "sd3", native=native_spec(base),
                                      state_dict=lambda: {k: v.detach() for k, v in dm.state_dict().items()})
                    values = {"key": key, "structure": {"transformer_options": {}}}
                    out = pool.submit(config, "forward", values, dict(inp)).tensors["out"]  # warm-up and check
                    err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                    times = []
                    for _ in range(repeats):
                        t = time.perf_counter()
                        pool.submit(config, "forward", values, dict(inp))
                        times.append((time.perf_counter() - t) * 1e3)
                    per_rank = pool.submit(config, "model_bytes", {"key": key}).per_rank
                    s = per_rank[0].get("sharding") or {}
                    rows.append({"config": name, "shard_weights": shard, "precision": precision,
                                 "weights_MiB": full / 2**20,
                                 "per_rank_MiB": max(r["bytes"] for r in per_rank) / 2**20,
                                 "peak_gathered_MiB": s.get("peak_gathered_bytes", 0) / 2**20,
                                 "ms_per_step": statistics.median(times), "ms_min": min(times), "rel_err": err,
                                 "tokens": (size // 2) ** 2})
                    print(rows[-1], flush=True)
    finally:
        pool.close()
    md = ["| config | precision | shard_weights | weights (MiB) | per rank at rest (MiB) | peak gathered (MiB) | "
          "ms / step (median) | vs unsharded | rel err vs serial |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base_row = next(b for b in rows if b["config"] == r["config"] and b["precision"] == r["precision"]
                        and b["shard_weights"] == "none")
        md.append(f"| {r['config']} | {r['precision']} | {r['shard_weights']} | {r['weights_MiB']:.1f} | "
                  f"{r['per_rank_MiB']:.1f} | {r['peak_gathered_MiB']:.1f} | {r['ms_per_step']:.1f} | "
                  f"{r['ms_per_step'] / base_row['ms_per_step']:.2f}× | {r['rel_err']:.1e} |")
    write_results("shard_quick" if args.quick else "shard", rows, "\n".join(md),
                  {"model": "ComfyUI MMDiT, 8 joint blocks, hidden 512", "latent": [size, size], "batch": 2,
                   "repeats": repeats})


if __name__ == "__main__":
    main()
