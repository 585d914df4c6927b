"""Step caching across ranks (ComfyUI's EasyCache rule in the workers' loop): speedup and error vs no cache.

ComfyUI's own MMDiT (SD3 family, 8 joint blocks, hidden 512, fp32) on the worker pool, 20 euler steps, CFG 4,
one 48 x 48 latent (576 tokens at patch 2). For each parallel config - loop mode ulysses 2, cfg 2, and PipeFusion
pp2 with 2 patches (warmup 2: its stale patch steps use one cache per patch) - the whole loop runs in the workers
without the cache and with EasyCache thresholds 0.2 (its default) / 0.5 / 1.0 (start 15 %, end 95 %), side by
side in one process. Reported: steps skipped (PipeFusion: patch steps, in steps' worth), wall time per run and
speedup vs the same config without the cache, and the relative latent error vs the uncached run of that config.
The model has random weights (issue: a trained demo model), so the error says how far the skipped steps move the
latent here, not how an image looks.
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

CONFIGS = [("loop ulysses 2", {"ulysses_degree": 2, }), ("loop cfg 2", {"cfg_degree": 2}),
           ("PipeFusion pp2 x 2 patches, warmup 2", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2})]
THRESHOLDS = (0.0, 0.2, 0.5, 1.0)


def _sigmas_window(sigmas, start_percent=0.15, end_percent=0.95):
    """ComfyUI's percent_to_sigma for a flow model with shift 3 (SD3's): the sigma at that fraction of the
    schedule's timesteps; the EasyCache node's default window."""
    def percent_to_sigma(p):
        t = 1.0 - p
        return 3.0 * t / (1 + (3.0 - 1) * t)
    return percent_to_sigma(start_percent), percent_to_sigma(end_percent)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.doctor.tiny_checkpoints import TINY_CONTEXT_DIM, TINY_POOLED_DIM
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool

    steps = 10 if args.quick else 20
    size = 32 if args.quick else 48
    repeats = 1
    tmp = Path(tempfile.mkdtemp(prefix="hp-bench-stepcache-"))
    path = tmp / "sd3_8blocks.safetensors"
    tiny.write_sd3(path, depth=8, pos_embed_max_size=64, seed=5)
    base = comfy.sd.load_diffusion_model(str(path)).model
    dm = base.diffusion_model
    g = torch.Generator().manual_seed(0)
    cond = {"context": torch.randn(2, 77, TINY_CONTEXT_DIM, generator=g), "y": torch.randn(2, TINY_POOLED_DIM, generator=g)}
    noise = torch.randn(1, 16, size, size, generator=g)
    # SD3's shifted flow schedule (ComfyUI's "simple" scheduler on shift 3)
    t = torch.linspace(1.0, 0.0, steps + 1)
    sigmas = 3.0 * t / (1 + 2.0 * t)
    start_sigma, end_sigma = _sigmas_window(sigmas)
    rows = []
    pool = WorkerPool(device="cpu", max_models=2)
    try:
        for name, degrees in CONFIGS:
            config = ParallelConfig(**degrees)
            key = "bench-stepcache"
            pool.ensure_model(config, key, "sd3", native=native_spec(base),
                              state_dict=lambda: {k: v.detach() for k, v in dm.state_dict().items()})
            base_values = {"key": key, "structure": {"transformer_options": {}}, "sampler": "euler",
                           "cfg_scale": 4.0, "convention": {"kind": "flow", "timestep_scale": 1000.0}}
            tensors = {**cond, "noise": noise, "sigmas": sigmas}
            ref, ref_s = None, None
            for threshold in THRESHOLDS:
                values = dict(base_values)
                if threshold:
                    values["step_cache"] = {"threshold": threshold, "start_sigma": start_sigma, "end_sigma": end_sigma,
                                            "subsample": 8, "channels": 16, "first": 0, "chunks": 2}
                times, out, report = [], None, {}
                for _ in range(repeats + 1):  # the first run warms up (and checks)
                    t0 = time.perf_counter()
                    res = pool.submit(config, "loop", values, dict(tensors))
                    times.append(time.perf_counter() - t0)
                    out = res.tensors["out"]
                    report = next((v["step_cache"] for v in res.per_rank if v.get("step_cache")), {})
                s = statistics.median(times[1:])
                if ref is None:
                    ref, ref_s = out, s
                err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                skipped = report.get("skipped", 0) / max(1, report.get("patches", 1))
                rows.append({"config": name, "threshold": threshold, "steps": steps,
                             "skipped_steps": round(skipped, 2), "s_per_run": s, "speedup": ref_s / s,
                             "rel_err_vs_uncached": err})
                print(f"{name:40s} threshold {threshold:.2f}: skipped {skipped:5.2f}/{steps}  {s:6.2f} s  "
                      f"{ref_s / s:4.2f}x  rel {err:.2e}", flush=True)
    finally:
        pool.close()
    header = ("| config | EasyCache threshold | steps skipped (of {}) | s / run (median) | speedup | rel. error vs "
              "uncached |\n|---|---|---|---|---|---|".format(steps))
    lines = [f"| {r['config']} | {r['threshold'] or 'off'} | {r['skipped_steps']} | {r['s_per_run']:.2f} | "
             f"{r['speedup']:.2f}× | {r['rel_err_vs_uncached']:.1e} |" for r in rows]
    setup = (f"SD3-family MMDiT 8 blocks x 512 (random weights), fp32, latent {size}x{size}, {steps} euler steps, "
             f"CFG 4, 2 CPU workers (gloo)")
    write_results("stepcache" + ("_quick" if args.quick else ""), rows,
                  f"{setup}\n\n{header}\n" + "\n".join(lines), extra={"setup": setup})


if __name__ == "__main__":
    main()
