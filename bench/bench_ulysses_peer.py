"""Ulysses side by side with diffusers' own context parallelism, on Flux-like models, and where the time goes.

Why this script: "Ulysses at least as fast as diffusers' own" is a claim about a peer implementation that
lives in the same venv, so it is measured here, in one world, interleaved, rather than quoted. Each side runs
its own class of the same dimensions - 8 heads x 64 head dim, 4 double-stream + 4 single-stream blocks, 1024
image tokens from a 64x64 latent packed 2x2, 64 text tokens, no guidance embedding - with the tiny
checkpoints' seeded values (doctor/tiny_weights.py: nothing at zero), built identically on every rank; forward
only, fp32, one thread per rank (see _worlds.py: on CPU the question is 2 workers x 1 thread vs 1 worker x 1
thread). The peer: diffusers' FluxTransformer2DModel with its
`enable_parallelism(ContextParallelConfig(ulysses_degree=2))` (its `_cp_plan` splits image *and* text tokens).
Ours: ComfyUI's own Flux class (what the workers run), called as the workers call it, with Ulysses 2 and Ring 2
(`parallelize(model, ctx)`: image and text tokens split too). Interleaved per repeat: each side's serial forward
(rank 0, rank 1 idles), diffusers Ulysses 2, ours Ulysses 2 and Ring 2. Every parallel output is compared with
its own side's serial one (max relative error, and how many outputs were wrong: above 1e-3 - diffusers'
functional collectives on gloo have returned garbage now and then in these runs).

Where the time goes: one extra forward per method under torch.profiler (rank 0) counts `aten::cat` calls,
sums the wall time spent inside the collectives (gloo all-to-all / all-gather / send-recv and the functional
collectives' wait) and the self time of the matmuls and of the attention kernel (profiled times run a little
above the plain ones).

    python bench/bench_ulysses_peer.py [--quick]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
from collections import Counter
import sys
import time

import torch

from _worlds import DistPool, bench_device, context_for, flux, sync, write_results

HEADS, HEAD_DIM, DOUBLE, SINGLE = 8, 64, 4, 4
AXES = (16, 24, 24)  # rope axes (sum: HEAD_DIM)
LATENT = 32          # packed 2x2 latent side: 32 x 32 = 1024 image tokens
TEXT, TEXT_DIM, POOLED = 64, 64, 32
OURS = {"ours Ulysses 2": dict(ulysses_degree=2), "ours Ring 2": dict(ring_degree=2)}
DIFFUSERS = "diffusers Ulysses 2"
SERIAL = {"diffusers": "diffusers serial", "comfy": "ComfyUI serial"}  # each side's own reference
WRONG = 1e-3  # a relative error above this is a wrong output, not rounding
_cache: dict = {}


def build(side):
    """The Flux-like model of one side ("diffusers": the peer's class, "comfy": ComfyUI's), identical on every rank
    (the same seeded values)."""
    if side == "comfy":
        return flux(HEADS, HEAD_DIM, DOUBLE, SINGLE, AXES, in_channels=16, context=TEXT_DIM, pooled=POOLED
                    ).to(bench_device())
    from diffusers import FluxTransformer2DModel
    from comfyui_hybrid_parallel.doctor.tiny_weights import _random_state_dict

    model = FluxTransformer2DModel(patch_size=1, in_channels=64, num_layers=DOUBLE, num_single_layers=SINGLE,
                                   attention_head_dim=HEAD_DIM, num_attention_heads=HEADS,
                                   joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED,
                                   guidance_embeds=False, axes_dims_rope=AXES)
    model.load_state_dict(_random_state_dict(model, 0, torch.float32))
    return model.eval().to(bench_device())


def inputs(side):
    """The same latent, text and pooled values for both sides, each in its own layout (diffusers: the latent
    packed 2x2 into tokens with their position ids; ComfyUI: the latent itself, packed inside the model)."""
    g = torch.Generator().manual_seed(1)
    dev = bench_device()
    x = torch.randn(1, 16, 2 * LATENT, 2 * LATENT, generator=g)
    context, pooled = torch.randn(1, TEXT, TEXT_DIM, generator=g), torch.randn(1, POOLED, generator=g)
    t = torch.full((1,), 0.5)
    if side == "comfy":
        return {k: v.to(dev) for k, v in dict(x=x, timestep=t, context=context, y=pooled).items()}
    packed = x.reshape(1, 16, LATENT, 2, LATENT, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, LATENT * LATENT, 64)
    ys, xs = torch.meshgrid(torch.arange(LATENT), torch.arange(LATENT), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(ys), ys, xs], dim=-1).reshape(-1, 3).float()
    return {k: v.to(dev) for k, v in dict(hidden_states=packed, encoder_hidden_states=context,
                                          pooled_projections=pooled, timestep=t, img_ids=img_ids,
                                          txt_ids=torch.zeros(TEXT, 3)).items()}


def _model(key):
    """One model per use: "comfy" serves ComfyUI's serial and ours (hooks come and go), "diffusers" the peer's
    serial, "diffusers cp" keeps diffusers' context-parallel hooks for good (they cannot be removed)."""
    if key not in _cache:
        _cache[key] = build("comfy" if key == "comfy" else "diffusers")
        if key == "diffusers cp":
            _enable_diffusers_cp(_cache[key])
    return _cache[key]


def _enable_diffusers_cp(model):
    """diffusers' own Ulysses 2. Its mesh set-up picks the device as `rank % torch.accelerator.device_count()`,
    which divides by zero on a CPU-only machine: there, for this call only, one "accelerator" is reported so
    the device resolves to cpu:0 (the mesh itself is built on the gloo world as usual)."""
    from unittest import mock

    from diffusers import ContextParallelConfig

    cfg = ContextParallelConfig(ulysses_degree=2)
    if torch.accelerator.device_count() > 0:
        model.enable_parallelism(config=cfg)
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        model.enable_parallelism(config=cfg)


def _forward(model, kw):
    """One forward: ComfyUI's class as the workers call it (x, timestep by position), diffusers' by its keywords."""
    with torch.no_grad():
        if "x" in kw:
            import tiny_models as tm
            return tm.call(model, kw)
        return model(**kw, return_dict=False)[0]


def _timed(model, kw, n):
    dev = bench_device()
    times, out = [], None
    for _ in range(n):
        sync(dev)
        t = time.perf_counter()
        out = _forward(model, kw)
        sync(dev)
        times.append(time.perf_counter() - t)
    return times, out


def _rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


COLLECTIVE_KEYS = ("all_to_all", "alltoall", "all_gather", "allgather", "wait_tensor", "send", "recv",
                   "broadcast", "all_reduce", "allreduce", "bench::collective")
_WRAPPED = ("all_to_all_single", "all_gather", "batch_isend_irecv", "all_reduce", "broadcast")


class _TimedWork:
    """A collective's work handle whose wait() shows up in the profile (c10d's own op returns before it)."""

    def __init__(self, work):
        self._work = work

    def wait(self, *args, **kwargs):
        with torch.profiler.record_function("bench::collective wait"):
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def _collectives_visible():
    """Wrap torch.distributed's eager collectives (ours) so their blocking part - the call, or the handle's
    wait() when async - is a profiler event; diffusers' functional collectives record their wait already."""
    import torch.distributed as dist

    def wrap(fn):
        def call(*args, **kwargs):
            with torch.profiler.record_function("bench::collective"):
                out = fn(*args, **kwargs)
            if isinstance(out, list):
                return [_TimedWork(w) for w in out]
            return _TimedWork(out) if out is not None else None
        return call
    saved = {n: getattr(dist, n) for n in _WRAPPED}
    try:
        for n, fn in saved.items():
            setattr(dist, n, wrap(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


def _profile(model, kw):
    """(aten::cat calls, ms inside collectives, ms in matmuls, ms in the attention kernel) of one forward,
    rank 0. The matmul time shows the cost of ours replicating the text stream on every rank. Collectives are timed on the forward's own
    thread only (gloo's worker threads record the transfer itself, which may overlap compute), as the union
    of their events so nested records (c10d op -> functional wrapper) are not summed twice: for ours the
    blocking all-to-all calls, for diffusers its functional collectives plus their waits."""
    from torch.profiler import ProfilerActivity, profile
    with _collectives_visible(), profile(activities=[ProfilerActivity.CPU]) as prof:
        _forward(model, kw)
    events = prof.events()
    cats = sum(1 for e in events if e.name == "aten::cat")
    main = Counter(e.thread for e in events if e.name.startswith("aten::")).most_common(1)[0][0]
    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.thread == main and any(k in e.name.lower() for k in COLLECTIVE_KEYS)
                   and not e.name.startswith("aten::"))
    total, last_end = 0.0, -1.0
    for s, e in spans:  # union of intervals: nested or overlapping events count once
        if e <= last_end:
            continue
        total += e - max(s, last_end)
        last_end = e
    def self_ms(*names):
        return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in names) / 1e3
    return cats, total / 1e3, self_ms("aten::addmm", "aten::mm", "aten::bmm"), \
        self_ms("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math")


def serial_body(side, n):
    """Rank 0 runs its side's serial model `n` times (rank 1 idles); returns (times, output) on rank 0."""
    torch.set_num_threads(1)
    if torch.distributed.get_rank() != 0:
        return None
    return _timed(_model(side), inputs(side), n)


def diffusers_body(n, profile=False):
    torch.set_num_threads(1)
    model, kw = _model("diffusers cp"), inputs("diffusers")
    if profile:
        return _profile(model, kw)
    return _timed(model, kw, n)


def ours_body(method, n, profile=False):
    from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, unparallelize

    torch.set_num_threads(1)
    ctx = context_for(ParallelConfig(**OURS[method]))
    model, kw = _model("comfy"), inputs("comfy")
    parallelize(model, ctx)
    try:
        return _profile(model, kw) if profile else _timed(model, kw, n)
    finally:
        unparallelize(model)


def run(quick: bool):
    reps, n = (2, 1) if quick else (5, 2)
    methods = [SERIAL["diffusers"], DIFFUSERS, SERIAL["comfy"]] + list(OURS)
    side = {m: "diffusers" if m in (SERIAL["diffusers"], DIFFUSERS) else "comfy" for m in methods}
    times = {m: [] for m in methods}
    errs = {m: [] for m in methods}  # one per rank and repeat: the last forward's output, vs its side's serial
    pool = DistPool(2)
    try:
        def once(m, k, profile=False):
            if m in SERIAL.values():
                return pool.run(serial_body, side[m], k, timeout=600)
            if m == DIFFUSERS:
                return pool.run(diffusers_body, k, profile, timeout=600)
            return pool.run(ours_body, m, k, profile, timeout=600)

        for m in methods:  # warm-up: builds, groups, meshes, kernels
            once(m, 1)
        ref = {s: once(SERIAL[s], 1)[0][1] for s in SERIAL}
        for _ in range(reps):
            for m in methods:
                res = once(m, n)
                per_rank = [r for r in res if r is not None]
                times[m].extend(max(r[0][i] for r in per_rank) for i in range(n))
                errs[m] += [_rel_err(r[1], ref[side[m]]) for r in per_rank]
        prof = {m: tuple(map(min, zip(*(once(m, 1, True)[0] for _ in range(2)))))
                for m in methods if m not in SERIAL.values()}
    finally:
        pool.close()
    d_min, d_med = min(times[DIFFUSERS]), statistics.median(times[DIFFUSERS])
    rows = []
    for m in methods:
        t = times[m]
        rows.append(dict(method=m, min_ms=1e3 * min(t), median_ms=1e3 * statistics.median(t), forwards=len(t),
                         vs_diffusers_min=min(t) / d_min, vs_diffusers_median=statistics.median(t) / d_med,
                         max_rel_err=max(errs[m]), checked=len(errs[m]),
                         wrong=sum(e > WRONG for e in errs[m]), **dict(zip(("cat_calls", "collective_ms", "matmul_ms", "attention_ms"),
                                                          prof.get(m, (None,) * 4)))))
        print(f"{m}: min {1e3 * min(t):.0f} ms, median {1e3 * statistics.median(t):.0f} ms, "
              f"rel err {max(errs[m]):.1e} ({sum(e > WRONG for e in errs[m])} of {len(errs[m])} outputs wrong)",
              flush=True)
    return rows


def markdown(rows):
    md = ["| method | min ms | median ms | vs diffusers (min / median) | max rel err vs its serial (outputs wrong) | "
          "torch.cat per forward | ms in collectives | ms in matmuls | ms in attention kernel |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cats = "–" if r["cat_calls"] is None else str(r["cat_calls"])
        coll, mm, att = ("–" if r[k] is None else f"{r[k]:.0f}" for k in ("collective_ms", "matmul_ms", "attention_ms"))
        md.append(f"| {r['method']} | {r['min_ms']:.0f} | {r['median_ms']:.0f} | {r['vs_diffusers_min']:.3f}× / "
                  f"{r['vs_diffusers_median']:.3f}× | {r['max_rel_err']:.1e} ({r['wrong']} of {r['checked']} wrong) | {cats} | {coll} | {mm} | {att} |")
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats of 1 forward instead of 5 of 2")
    a = ap.parse_args(argv)
    rows = run(a.quick)
    write_results("ulysses_peer_quick" if a.quick else "ulysses_peer", rows, markdown(rows),
                  {"model": f"diffusers' FluxTransformer2DModel (the peer) and ComfyUI's Flux (ours), seeded values "
                            f"(doctor/tiny_weights.py), {HEADS} heads x {HEAD_DIM}, {DOUBLE} double + {SINGLE} single blocks, "
                            f"{LATENT * LATENT} image + {TEXT} text tokens, fp32, forward only",
                   "setup": "2-rank world, 1 thread per rank, interleaved serials / diffusers / ours per repeat; "
                            "each output checked against its own side's serial"})


if __name__ == "__main__":
    sys.exit(main())
