"""CPU scaling: 2 ranks x 1 thread against 1 rank x 1 thread, per parallel method, on a compute-bound model.

Why this shape: on CPU the honest question is whether a second worker with its
own core beats one worker on one core (more threads in one process would be a
different baseline). Both sides run in the same 2-process world, one thread
each: the serial baseline runs on rank 0 while rank 1 idles, then the parallel
run uses both; serial and parallel alternate (S, P, S, P...) so that other load
on a shared machine hits both alike. The model is ComfyUI's own SD3 MMDiT
(OpenAISignatureMMDITWrapper, SD3-medium style) with seeded weights (bench/_worlds.py): hidden 256, 4 heads,
4 joint blocks, 64x64 latent = 1024 image tokens, 77 text tokens, called as the workers call it (PipeFusion with
their native call), whose step takes well over 100 ms on one thread. CFG and DP split a batch of 2
(the serial baseline computes both samples); the sequence methods, TP and
DistriFusion split one sample; DistriFusion times its stale steps; PipeFusion
times a whole loop (1 synchronous warm-up step + stale steps, 2 patches) against
the serial loop. Targets (issue 10): CFG/DP >= 1.85x, USP >= 1.6x.
On CUDA the same script runs one GPU per rank with NCCL (see _worlds.py).

    python bench/bench_scaling.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from _worlds import DistPool, bench_device, context_for, mmdit, sync, write_results

METHODS = {  # name: (config kwargs, batch)
    "CFG": (dict(cfg_degree=2), 2),
    "DP": (dict(dp_degree=2), 2),
    "Ulysses": (dict(ulysses_degree=2), 1),
    "Ring": (dict(ring_degree=2), 1),
    "TP": (dict(tp_degree=2), 1),
    "DistriFusion": (dict(ulysses_degree=2, method="distrifusion", warmup_steps=1), 1),
    "PipeFusion": (dict(pp_degree=2, num_pipeline_patch=2, warmup_steps=1), 1),
}
H = W = 64
TEXT = 77
_cache: dict = {}


def build():
    """ComfyUI's MMDiT depth 4 (hidden 256 = 4 heads x 64, 4 joint blocks), text width 64, pooled 32."""
    return mmdit(4, in_channels=16, context=64, pooled=32, pos_embed_max_size=H // 2).to(bench_device())


def _inputs(batch):
    g = torch.Generator().manual_seed(batch)
    dev = bench_device()
    return dict(x=torch.randn(batch, 16, H, W, generator=g).to(dev),
                timestep=torch.full((batch,), 500.0).to(dev),
                context=torch.randn(batch, TEXT, 64, generator=g).to(dev),
                y=torch.randn(batch, 32, generator=g).to(dev))


def _forward(model, kw):
    """One forward as the workers call ComfyUI's model (tests/tiny_models.call)."""
    import tiny_models as tm
    return tm.call(model, kw)


def _model():
    if "m" not in _cache:
        _cache["m"] = build()
    return _cache["m"]


def _timed(fn):
    dev = bench_device()
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return time.perf_counter() - t, out


def _sigmas(n):
    s = torch.linspace(1.0, 0.0, n + 1)
    return s


def _pipefusion_step_s(model, ctx, kw, forwards):
    """Seconds per step of a PipeFusion loop of `forwards` steps (ctx None: the one-process schedule)."""
    import tiny_models as tm
    from comfyui_hybrid_parallel.parallel.pipefusion import flow, run_pipefusion_loop
    kw = dict(kw)
    noise = kw.pop("x")
    kw.pop("timestep")
    t, _ = _timed(lambda: run_pipefusion_loop(model, ctx, kw, _sigmas(forwards), noise, convention=flow(1000.0),
                                              native_call=tm.call, timestep_dtype=torch.float32))
    return t / forwards


def serial_body(method, forwards):
    """Rank 0: the work of `forwards` steps on one rank; the other rank idles. Seconds per step."""
    if torch.distributed.get_rank() != 0:
        return None
    torch.set_num_threads(1)
    cfg, batch = METHODS[method]
    model, kw = _model(), _inputs(batch)
    with torch.no_grad():
        if method == "PipeFusion":
            return _pipefusion_step_s(model, None, kw, forwards)
        times = [_timed(lambda: _forward(model, kw))[0] for _ in range(forwards)]
    return statistics.median(times)


def parallel_body(method, forwards):
    """Every rank: `forwards` parallel steps; seconds per step (DistriFusion: its stale steps)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, unparallelize

    torch.set_num_threads(1)
    cfg, batch = METHODS[method]
    ctx = context_for(ParallelConfig(**cfg))
    model = build() if method == "TP" else _model()  # TP shards the weights for good: a fresh copy
    kw = _inputs(batch)
    with torch.no_grad():
        if method == "PipeFusion":
            return _pipefusion_step_s(model, ctx, kw, forwards)
        parallelize(model, ctx)
        try:
            if method == "DistriFusion":
                from comfyui_hybrid_parallel.parallel.distrifusion import distrifusion_state
                st = distrifusion_state(model)
                times = []
                for i in range(forwards + 1):  # step 0 is the synchronous warm-up
                    st.set_step(i)
                    t, _ = _timed(lambda: _forward(model, kw))
                    times.append(t)
                times = times[1:]
            else:
                times = [_timed(lambda: _forward(model, kw))[0] for _ in range(forwards)]
        finally:
            if method != "TP":
                unparallelize(model)
    return statistics.median(times)


def run(quick: bool = False):
    forwards, reps = (1, 1) if quick else (3, 3)
    rows = []
    pool = DistPool(2)
    try:
        pool.run(serial_body, "Ulysses", 1, timeout=600)  # build the model, warm up
        for method in METHODS:
            pf = max(forwards, 3) if method == "PipeFusion" else forwards  # PipeFusion: warm-up + stale steps
            pool.run(parallel_body, method, 1, timeout=600)               # warm-up (groups, buffers, kernels)
            ser, par = [], []
            for _ in range(reps):
                ser.append(pool.run(serial_body, method, pf, timeout=600)[0])
                par.append(max(pool.run(parallel_body, method, pf, timeout=600)))
            s_med, p_med = statistics.median(ser), statistics.median(par)
            rows.append(dict(method=method, config=METHODS[method][0], batch=METHODS[method][1],
                             serial_ms=1e3 * s_med, parallel_ms=1e3 * p_med, speedup=s_med / p_med,
                             speedup_min=min(ser) / min(par), efficiency=s_med / p_med / 2, reps=reps,
                             steps_per_rep=pf))
            print(f"{method}: serial {1e3 * s_med:.0f} ms, parallel {1e3 * p_med:.0f} ms, "
                  f"speedup {s_med / p_med:.2f}", flush=True)
    finally:
        pool.close()
    return rows


TARGETS = {"CFG": 1.85, "DP": 1.85, "Ulysses": 1.6, "Ring": 1.6}


def markdown(rows):
    md = ["| method | batch | 1 rank × 1 thread ms/step | 2 ranks × 1 thread ms/step | speedup (median) | "
          "speedup (min) | efficiency | target |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        t = TARGETS.get(r["method"])
        md.append(f"| {r['method']} | {r['batch']} | {r['serial_ms']:.0f} | {r['parallel_ms']:.0f} | "
                  f"{r['speedup']:.2f}× | {r['speedup_min']:.2f}× | {100 * r['efficiency']:.0f} % | "
                  f"{f'≥ {t}×' if t else '–'} |")
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.quick)
    write_results("scaling_quick" if a.quick else "scaling", rows, markdown(rows),
                  {"model": "ComfyUI's SD3 MMDiT (OpenAISignatureMMDITWrapper), seeded weights, hidden 256, 4 heads, "
                           "4 joint blocks, 64x64 latent, 77 text tokens"})


if __name__ == "__main__":
    sys.exit(main())
