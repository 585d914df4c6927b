"""torch.compile on the pool, side by side with ComfyUI compiling in-process (what TorchCompileModel + KSampler runs).

Why: TorchCompileModel is a common ComfyUI speed-up, and with the pool the diffusion model runs in the workers, so
they compile their own parallelized model (parallel/engine.py Resident.callable_for). This measures, in one run on
one machine, the time per model call (median after warm-up) and the first call (which pays the compile) of:
ComfyUI's forward eager and compiled in this process, and the pool at ulysses 2 eager and compiled; the compiled
outputs' relative error against their eager twins. ComfyUI's pytorch attention (as on GPUs: its CPU default,
sub-quadratic attention, reads the free memory at every call, which dynamo guards on - a recompile per call).
Model: ComfyUI's MMDiT (SD3), depth 8 (hidden 512), on a 64 x 64 latent (1024 image tokens), fp32, batch 2.

    python bench/bench_compile.py [--calls N] [--backend inductor]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
sys.path.insert(0, HERE)


def _time_calls(call, n: int) -> tuple:
    """(first call's seconds, median of the next n calls' seconds, last output)."""
    t = time.perf_counter()
    out = call()
    first = time.perf_counter() - t
    times = []
    for _ in range(n):
        t = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t)
    return first, statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args()

    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.cli_args
    comfy.cli_args.args.use_pytorch_cross_attention = True  # before ComfyUI picks its kernel
    import torch
    from comfy.sd import load_diffusion_model

    from _worlds import write_results
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from dataclasses import replace

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.pool import WorkerPool

    tmp = tempfile.mkdtemp(prefix="hp_bench_compile_")
    path = os.path.join(tmp, "sd3.safetensors")
    tiny.write_sd3(path, depth=8, pos_embed_max_size=64, seed=5)
    base = load_diffusion_model(path).model
    dm = base.diffusion_model
    g = torch.Generator().manual_seed(6)
    inp = {"x": torch.randn(2, 16, 64, 64, generator=g), "timestep": torch.rand(2, generator=g),
           "context": torch.randn(2, 77, 32, generator=g), "y": torch.randn(2, 24, generator=g)}
    spec = {"backend": args.backend, "options": None, "mode": None, "fullgraph": False, "dynamic": False}

    def local(model):
        with torch.no_grad():
            return model(inp["x"], inp["timestep"], context=inp["context"], y=inp["y"], transformer_options={})

    rows = []
    first, med, eager_out = _time_calls(lambda: local(dm), args.calls)
    rows.append({"run": "ComfyUI in-process, eager", "first_s": first, "median_s": med, "rel_err": 0.0})
    compiled = torch.compile(dm, backend=args.backend)
    first, med, out = _time_calls(lambda: local(compiled), args.calls)
    rows.append({"run": f"ComfyUI in-process, compiled ({args.backend})", "first_s": first, "median_s": med,
                 "rel_err": float((out - eager_out).norm() / eager_out.norm())})

    pool = WorkerPool(device="cpu")
    try:
        config = ParallelConfig(ulysses_degree=2)
        native = native_spec(base)  # the workers: ComfyUI's pytorch attention too, whatever this process picked
        runtime = native.runtime
        native = replace(native, runtime=replace(runtime, attention="pytorch",
                                                 comfy_args={**runtime.comfy_args,
                                                             "use_pytorch_cross_attention": True}))
        pool.ensure_model(config, "bench", family_adapter(dm).family, native=native,
                          state_dict=lambda: dict(dm.state_dict()))

        def on_pool(compile_spec):
            values = {"key": "bench", "structure": {"transformer_options": {}}}
            if compile_spec:
                values["compile"] = compile_spec
            return pool.submit(config, "forward", values, dict(inp)).tensors["out"]
        first, med, pool_eager = _time_calls(lambda: on_pool(None), args.calls)
        rows.append({"run": "pool ulysses 2, eager", "first_s": first, "median_s": med,
                     "rel_err": float((pool_eager - eager_out).norm() / eager_out.norm())})
        first, med, out = _time_calls(lambda: on_pool(spec), args.calls)
        rows.append({"run": f"pool ulysses 2, compiled ({args.backend})", "first_s": first, "median_s": med,
                     "rel_err": float((out - pool_eager).norm() / pool_eager.norm())})
    finally:
        pool.close()

    base_s = rows[0]["median_s"]
    lines = ["| run | first call (s) | median call (s) | vs in-process eager | rel. error vs its eager twin |",
             "|---|---|---|---|---|"]
    for r in rows:
        r["speedup"] = base_s / r["median_s"]
        lines.append(f"| {r['run']} | {r['first_s']:.2f} | {r['median_s']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['rel_err']:.1e} |")
    write_results("compile", rows, "\n".join(lines), extra={"calls": args.calls, "backend": args.backend,
                                                             "model": "ComfyUI MMDiT depth 8, 64x64 latent, batch 2"})


if __name__ == "__main__":
    main()
