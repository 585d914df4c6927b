"""Degree-1 overhead: the same model and inputs sampled in-process and through the worker pool.

Why two comparisons: the model loop isolates what the pool adds to one
forward (shared memory, job message, worker dispatch): a plain Euler loop
calling ComfyUI's SD3 diffusion model (MMDiT) in this process, against the
same loop with each forward sent to the pool, where the workers built the same
class from the same weights (pool.ensure_model with native=, as the nodes make
a model resident). The ComfyUI pair is what a user sees - KSampler against
Hybrid Sampler with a degree-1 Parallel Config, both running ComfyUI's own
sampling, so the difference also includes the input/output conversions of the
APPLY_MODEL proxy. Target: <= 1.02x.

Every side uses the same weights: a seeded SD3 checkpoint in ComfyUI's own
format (doctor/tiny_checkpoints.py) loaded with ComfyUI's loader
(comfy.sd.load_diffusion_model, fp32). "tiny" is the test model; "medium"
(hidden 256, 4 joint blocks, 64x64 latent = 1024 tokens) is chosen so that one step takes >= 100 ms on one
CPU thread. The worker of a degree-1 world gets all the machine's threads;
the in-process side is given the same number. Runs are interleaved (A, B, A,
B...) so that other load on a shared machine hits both sides alike; per-step
time = run time / steps (20 steps, as a real run: the per-run costs count as
they would); the ratio of the medians and of the minima is given, and what the
pool adds per step in microseconds - the number that carries over to another
model: the pool costs <= 2 % wherever a step takes >= 50x that.
Both comparisons are skipped, with a note, where ComfyUI is not installed.

    python bench/bench_overhead.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

from _worlds import write_results

os.environ.setdefault("TQDM_DISABLE", "1")  # ComfyUI's progress bars: noise in the log, time in the loop

MODELS = {  # name: (ComfyUI SD3 depth -> hidden 64*depth, heads depth; latent h, w; text tokens)
    "tiny": (2, 16, 16, 8),
    "medium": (4, 64, 64, 77),
}


def _checkpoint(name: str, tmp: str):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    depth, h, w, _ = MODELS[name]
    path = os.path.join(tmp, f"sd3_{name}.safetensors")
    sd = tc.write_sd3(path, depth=depth, pos_embed_max_size=max(h, w) // 2)
    return path, sd


def _interleave(fns: dict, reps: int, steps: int) -> tuple:
    """({name: [ms per step, one per rep]}, max |difference| of each warm-up result from the first one's)."""
    first = [f() for f in fns.values()]
    err = max(float((first[0] - other).abs().max()) for other in first[1:])
    out = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            f()
            out[k].append((time.perf_counter() - t) * 1000 / steps)
    return out, err


def _row(model, pair, times, a, b, note=""):
    ta, tb = times[a], times[b]
    added_us = 1e3 * (statistics.median(tb) - statistics.median(ta))
    return dict(model=model, comparison=pair, baseline=a, pool=b, baseline_ms=statistics.median(ta),
                pool_ms=statistics.median(tb), ratio_median=statistics.median(tb) / statistics.median(ta),
                ratio_min=min(tb) / min(ta), added_us_per_step=added_us,
                step_ms_for_2pct=max(0.0, added_us) / 1e3 / 0.02, reps=len(ta), note=note)


def _load(path):
    import comfy.sd
    return comfy.sd.load_diffusion_model(path, model_options={"dtype": torch.float32})


def model_pair(pool, name, path, steps, reps, threads):
    """In-process forward loop of ComfyUI's SD3 vs the same loop with each forward on the pool (step mode)."""
    import tiny_models as tm
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec

    depth, h, w, text = MODELS[name]
    base = _load(path).model
    model = base.diffusion_model
    pc, key = ParallelConfig(), f"bench-{name}"
    # the weights as Runtime.ensure_native sends them (as the layers hold them)
    pool.ensure_model(pc, key, family_adapter(model).family, native=native_spec(base),
                      state_dict=lambda: {k: raw(v) for k, v in host_tensors(model).items()})
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 16, h, w, generator=g)
    cond = dict(context=torch.randn(1, text, tc.TINY_CONTEXT_DIM, generator=g),
                y=torch.randn(1, tc.TINY_POOLED_DIM, generator=g))
    sigmas = torch.linspace(1, 0, steps + 1)

    def loop(forward):
        x = x0
        for i in range(steps):
            v = forward(dict(x=x, timestep=(sigmas[i] * 1000).reshape(1), **cond))
            x = x + (sigmas[i + 1] - sigmas[i]) * v
        return x

    def local():
        torch.set_num_threads(threads)
        return loop(lambda kw: tm.forward(model, kw))  # called as the workers call it

    def pooled():
        # as the nodes run it (Runtime.quiet_driver): this process computes its small update ops with one thread
        # while the worker has every core, or its idle thread pool spins beside the worker (3-8 % of a medium step)
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return loop(lambda kw: pool.forward(pc, key, kw, {"transformer_options": {}}))
        finally:
            torch.set_num_threads(before)  # what the next in-process run and a Runtime made later start from

    times, err = _interleave({"model in-process": local, "model via pool": pooled}, reps, steps)
    return _row(name, "model loop", times, "model in-process", "model via pool",
                f"max |diff| {err:.1e}; attention: {attention_kernel()} on both sides")


def comfy_pair(runtime, name, path, steps, reps, threads):
    """ComfyUI's KSampler vs Hybrid Sampler (degree 1), in this process, same MODEL and conditioning."""
    import comfy_env
    comfy_env.setup_comfy()
    import comfy.sd
    import nodes as comfy_nodes  # ComfyUI's top-level module (bench/ is sys.path[0], not the pack)
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.nodes import HybridSampler
    from comfyui_hybrid_parallel.workers.driver.configs import HybridParallelConfig
    from comfyui_hybrid_parallel.parallel import ParallelConfig

    import comfy.utils
    comfy.utils.PROGRESS_BAR_ENABLED = False
    depth, h, w, text = MODELS[name]
    patcher = _load(path)
    g = torch.Generator().manual_seed(0)

    def c():
        return [[torch.randn(1, text, tc.TINY_CONTEXT_DIM, generator=g),
                 {"pooled_output": torch.randn(1, tc.TINY_POOLED_DIM, generator=g)}]]
    pos, neg = c(), c()
    latent = {"samples": torch.zeros(1, 16, h, w)}
    HybridSampler.runtime = runtime
    hp = HybridParallelConfig(ParallelConfig(), device="auto")
    hp_loop = HybridParallelConfig(ParallelConfig(), device="auto", mode="loop")

    def ksampler():
        torch.set_num_threads(threads)
        return comfy_nodes.common_ksampler(patcher, 7, steps, 1.0, "euler", "simple", pos, neg, latent)[0]["samples"]

    def hybrid(config):
        return lambda: HybridSampler().sample(patcher, 7, steps, 1.0, "euler", "simple", pos, neg, latent,
                                              config)[0]["samples"]

    step, loop = "Hybrid Sampler step mode (degree 1)", "Hybrid Sampler loop mode (degree 1)"
    times, err = _interleave({"KSampler": ksampler, step: hybrid(hp), loop: hybrid(hp_loop)}, reps, steps)
    kernel = attention_kernel()
    note = f"max |diff| {err:.1e}; attention: {kernel} on both sides"
    return [_row(name, "ComfyUI, step mode", times, "KSampler", step, note),
            _row(name, "ComfyUI, loop mode", times, "KSampler", loop, note)]


def attention_kernel() -> str:
    """The attention function ComfyUI picked in this process (a degree-1 worker imports ComfyUI with the same
    flags, so it picks the same one)."""
    import comfy.ldm.modules.attention as attention
    return attention.optimized_attention.__name__


def run(quick: bool = False, pytorch_attention: bool = True):
    from comfyui_hybrid_parallel.workers import WorkerPool
    import comfy_env

    threads = os.cpu_count() or 1  # what the pool gives the one worker of a degree-1 world
    steps, reps = (2, 1) if quick else (20, 5)
    rows, notes = [], []
    if comfy_env.comfyui_dir() is None:
        notes.append("ComfyUI is not installed here: the model loop and the KSampler / Hybrid Sampler pair were "
                     "skipped")
        return rows, notes
    if pytorch_attention:  # ComfyUI's --use-pytorch-cross-attention (on --cpu it picks sub-quadratic otherwise)
        sys.path.append(str(comfy_env.comfyui_dir()))
        import comfy.cli_args
        comfy.cli_args.args.use_pytorch_cross_attention = True
    comfy_env.setup_comfy()  # before the tiny checkpoints: it builds from ComfyUI's classes
    from comfyui_hybrid_parallel.nodes import Runtime
    tmp = tempfile.mkdtemp(prefix="hp-bench-")
    paths = {name: _checkpoint(name, tmp)[0] for name in MODELS}
    with WorkerPool(device="auto") as pool:
        for name in MODELS:
            rows.append(model_pair(pool, name, paths[name], steps, reps, threads))
    runtime = Runtime()  # one pool for both models, as in one ComfyUI process
    try:
        for name in MODELS:
            rows.extend(comfy_pair(runtime, name, paths[name], steps, reps, threads))
    finally:
        runtime.stop()
    return rows, notes


def markdown(rows, notes):
    md = ["| model | comparison | in-process ms/step | via pool ms/step | ratio (median) | ratio (min) | "
          "pool adds per step (median) | ≤ 1.02× from a step of | note |",
          "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['comparison']} | {r['baseline_ms']:.1f} | {r['pool_ms']:.1f} | "
                  f"{r['ratio_median']:.3f} | {r['ratio_min']:.3f} | {r['added_us_per_step']:.0f} µs | "
                  f"{r['step_ms_for_2pct']:.0f} ms | {r['note']} |")
    return "\n".join(md + [f"\n{n}" for n in notes])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--comfy-default-attention", action="store_true",
                    help="keep ComfyUI's default kernel (sub-quadratic on --cpu) instead of its pytorch one")
    a = ap.parse_args(argv)
    rows, notes = run(a.quick, not a.comfy_default_attention)
    write_results("overhead_quick" if a.quick else "overhead", rows, markdown(rows, notes),
                  {"threads": os.cpu_count(), "models": MODELS, "notes": notes})


if __name__ == "__main__":
    sys.exit(main())
