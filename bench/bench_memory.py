"""Per-rank parameter memory and peak activation memory versus degree 1, for TP and PipeFusion.

Why measured per rank: these methods are chosen to fit a model or an image
that does not fit one device, so the number that matters is the largest rank's
share. Parameters: bytes a rank holds (their local shards under TP). Peak
activations: bytes of tensor storages allocated during the forward (TP) or the
whole sampling loop (PipeFusion: its per-stage K/V buffers included) and alive
at once, counted by live_bytes.LiveBytes (weights and inputs excluded; on CUDA
this equals what torch.cuda.max_memory_allocated adds). PipeFusion today keeps
the whole model on every stage; the "own blocks" column is what a stage would
hold if the other stages' blocks were dropped. Patch VAE decode is bench_vae_native.py.
Model: the medium SD3 of bench_tp_memory - ComfyUI's MMDiT (OpenAISignatureMMDITWrapper) with seeded weights,
hidden 512, 8 heads, 6 joint blocks - on a 48x48 latent (576 tokens), called as the workers call it; PipeFusion
runs the workers' native call with fp32 timesteps.

    python bench/bench_memory.py [--quick]
"""
from __future__ import annotations

import argparse
import sys

import torch

from _worlds import DistPool, bench_device, context_for, write_results
from bench_tp_memory import CONFIGS, build
from live_bytes import LiveBytes


def _model():
    return build("sd3")


def _inputs(h, w, text=77):
    """ComfyUI's MMDiT's inputs (x, timestep, context, y) on bench_device()."""
    g = torch.Generator().manual_seed(3)
    dev = bench_device()
    c = CONFIGS["sd3"]
    return dict(x=torch.randn(1, c["in_channels"], h, w, generator=g).to(dev),
                timestep=torch.tensor([500.0]).to(dev),
                context=torch.randn(1, text, c["context"], generator=g).to(dev),
                y=torch.randn(1, c["pooled"], generator=g).to(dev))


def _param_bytes(params) -> int:
    from comfyui_hybrid_parallel.parallel.tp import local_param_bytes
    return local_param_bytes(torch.nn.ParameterList(list(params)))


def _peak(fn) -> int:
    mode = LiveBytes()
    with torch.no_grad(), mode:
        fn()
    return mode.peak


def body(method, degree, h, w, steps):
    """(serial params, serial peak) on rank 0 and this rank's (params held, params of own blocks, peak)."""
    import tiny_models as tm
    from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize
    from comfyui_hybrid_parallel.parallel.pipefusion import flow, run_pipefusion_loop
    from comfyui_hybrid_parallel.parallel.models import plan_for
    from comfyui_hybrid_parallel.parallel.pipefusion.plans import (flat_blocks, keep_stage_blocks, pipeline_plan_for,
                                                                   stage_ranges)

    torch.set_num_threads(1)
    model, kw = _model(), _inputs(h, w)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)

    def loop(ctx):
        k = dict(kw)
        noise = k.pop("x")
        k.pop("timestep")
        return run_pipefusion_loop(model, ctx, k, sigmas, noise, convention=flow(1000.0), native_call=tm.call,
                                   timestep_dtype=torch.float32)

    out = {"serial_params": _param_bytes(model.parameters())}
    if torch.distributed.get_rank() == 0:
        serial = (lambda: loop(None)) if method == "PipeFusion" else (lambda: tm.call(model, kw))
        out["serial_peak"] = _peak(serial)
    if method == "TP":
        ctx = context_for(ParallelConfig(tp_degree=degree))
        parallelize(model, ctx)
        out["params"] = out["own_params"] = _param_bytes(model.parameters())
        out["peak"] = _peak(lambda: tm.call(model, kw))
    else:
        ctx = context_for(ParallelConfig(pp_degree=degree, num_pipeline_patch=degree, warmup_steps=1))
        blocks = flat_blocks(model, pipeline_plan_for(plan_for(model)))
        s0, s1 = stage_ranges(len(blocks), degree)[ctx.pp.rank]
        others = {id(p) for i, (_, b, _) in enumerate(blocks) if not s0 <= i < s1 for p in b.parameters()}
        out["own_params"] = _param_bytes(p for p in model.parameters() if id(p) not in others)
        keep_stage_blocks(model, ctx)  # as the workers do when they load a model for pp > 1
        out["params"] = _param_bytes(model.parameters())
        out["peak"] = _peak(lambda: loop(ctx))
    return out


def run(quick: bool = False):
    h = w = 32 if quick else 48
    rows = []
    for degree in ((2,) if quick else (2, 4)):
        pool = DistPool(degree)
        try:
            for method in ("TP", "PipeFusion"):
                res = pool.run(body, method, degree, h, w, 3, timeout=600)
                r0 = res[0]
                big = max(res, key=lambda r: r["peak"])
                rows.append(dict(method=method, degree=degree, latent=[h, w],
                                 params_deg1_MiB=r0["serial_params"] / 2**20,
                                 params_per_rank_MiB=max(r["params"] for r in res) / 2**20,
                                 own_block_params_MiB=max(r["own_params"] for r in res) / 2**20,
                                 peak_act_deg1_MiB=r0["serial_peak"] / 2**20,
                                 peak_act_per_rank_MiB=[r["peak"] / 2**20 for r in res],
                                 peak_ratio=big["peak"] / r0["serial_peak"]))
        finally:
            pool.close()
    return rows


def markdown(rows):
    md = ["| method | degree | latent | params deg. 1 MiB | params per rank MiB | own blocks only MiB | "
          "peak act. deg. 1 MiB | peak act. per rank MiB (max) | ratio |", "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['method']} | {r['degree']} | {r['latent'][0]}×{r['latent'][1]} | {r['params_deg1_MiB']:.1f} | "
                  f"{r['params_per_rank_MiB']:.1f} | {r['own_block_params_MiB']:.1f} | {r['peak_act_deg1_MiB']:.1f} | "
                  f"{max(r['peak_act_per_rank_MiB']):.1f} | {r['peak_ratio']:.2f} |")
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.quick)
    write_results("memory_quick" if a.quick else "memory", rows, markdown(rows))


if __name__ == "__main__":
    sys.exit(main())
