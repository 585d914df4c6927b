"""DistriFusion: bytes per step vs the analytic K/V volume, and whether the async all-gather overlapped.

For each configuration a short sampler-like loop runs on a gloo world (same
harness as the tests). Per step it records what this rank *sent*
(ctx.stats) and, from the model's DistriFusion history, the forward time, the
time spent blocked on the previous step's gather handles (stale steps) and
the time of the blocking gathers (sync steps). Analytic DistriFusion volume:
2·p·hs·L elements per step (K and V of all p image tokens, hidden size hs,
L self-attention layers) is what each rank *receives*; what it sends is its
own padded patch to n-1 peers: 2·ceil(p/n)·hs·L·(n-1). USP's bytes for one
forward of the same model are listed for comparison.

Models: ComfyUI's own classes with seeded weights (bench/_worlds.py), hs = 128 each - its SD3 MMDiT
(OpenAISignatureMMDITWrapper, SD3-medium style: 2 heads x 64, 4 joint blocks) and its Flux (4 heads x 32, 2 double +
2 single blocks) - called as the workers call them; their latent is ComfyUI's (Flux: h x w is its token grid, the
latent being twice as tall and wide).

Run: python bench/bench_distrifusion.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from _worlds import DistPool, context_for, flux, mmdit, write_results


def _build(family):
    if family == "sd3":  # hs = 2 heads x 64 = 128 (ComfyUI's MMDiT: 64 per head), 4 joint blocks
        return mmdit(2, blocks=4, in_channels=4, context=32, pooled=16, pos_embed_max_size=24)
    # flux: hs = 4 x 32 = 128, 2 double + 2 single blocks
    return flux(4, 32, 2, 2, axes_dim=(8, 12, 12), in_channels=4, context=32, pooled=16)


def _inputs(family, h, w, text=16):
    """ComfyUI's inputs (x, timestep, context, y); h, w: SD3's latent, Flux's token grid (latent 2h x 2w)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, *((h, w) if family == "sd3" else (2 * h, 2 * w)), generator=g)
    return dict(x=x, timestep=torch.tensor([500.0 if family == "sd3" else 0.5]),
                context=torch.randn(1, text, 32, generator=g), y=torch.randn(1, 16, generator=g))


def _body(family, n, h, w, steps, warmup, layers_per_comm):
    import tiny_models as tm
    from comfyui_hybrid_parallel.parallel import ParallelConfig, unparallelize
    from comfyui_hybrid_parallel.parallel.distrifusion import apply_distrifusion, distrifusion_state

    torch.set_num_threads(1)
    model = _build(family)
    kw = _inputs(family, h, w)
    usp_ctx = context_for(ParallelConfig(ulysses_degree=n))
    from comfyui_hybrid_parallel.parallel import parallelize
    parallelize(model, usp_ctx)
    tm.forward(model, kw)
    unparallelize(model)
    usp_bytes = usp_ctx.stats.total_bytes()

    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=warmup))
    apply_distrifusion(model, ctx, layers_per_comm=layers_per_comm)
    st = distrifusion_state(model)
    per_step = []
    x = kw["x"].clone()
    try:
        for i in range(steps):
            ctx.stats.reset()
            st.set_step(i, total_steps=steps)
            out = tm.forward(model, {**kw, "x": x})
            x = x - out / steps
            per_step.append(ctx.stats.snapshot())
        hist = [dict(r) for r in st.history]
    finally:
        unparallelize(model)
    return dict(per_step=per_step, history=hist, usp_bytes=usp_bytes, hs=model.hidden_size)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one small configuration")
    args = ap.parse_args(argv)
    configs = [("sd3", 2, 32, 32, 6, 1, 1), ("flux", 2, 16, 16, 6, 1, 2)]
    if not args.quick:
        configs += [("sd3", 4, 30, 34, 6, 1, None), ("flux", 2, 17, 15, 6, 1, None)]
    pools, rows = {}, []
    try:
        for family, n, h, w, steps, warmup, lpc in configs:
            pool = pools.setdefault(n, DistPool(n))
            res = pool.run(_body, family, n, h, w, steps, warmup, lpc, timeout=600)
            tokens = h * w if family == "flux" else (h // 2) * (w // 2)
            hs, layers = res[0]["hs"], res[0]["history"][0]["layers"]
            analytic = 2 * tokens * hs * layers * 4                     # fp32 bytes received per rank per step
            sent_patch = 2 * -(-tokens // n) * hs * layers * 4 * (n - 1)
            for r, out in enumerate(res[:1]):                         # rank 0 is representative (all equal)
                for s, (snap, hist) in enumerate(zip(out["per_step"], out["history"])):
                    kv = sum(v["bytes"] for k, v in snap.items() if k.startswith("distrifusion"))
                    rows.append(dict(family=family, n=n, tokens=tokens, layers=layers, step=s, mode=hist["mode"],
                                     kv_bytes_sent=kv, total_bytes_sent=sum(v["bytes"] for v in snap.values()),
                                     analytic_2phsL=analytic, expected_sent=sent_patch,
                                     forward_ms=1e3 * hist["forward_s"], wait_ms=1e3 * hist["wait_s"],
                                     sync_comm_ms=1e3 * hist["sync_comm_s"], usp_bytes=out["usp_bytes"],
                                     layers_per_comm=lpc))
    finally:
        for p in pools.values():
            p.close()
    md = ["| family | n | tokens | L | step | mode | K/V bytes sent | expected 2·⌈p/n⌉·hs·L·(n-1)·4 | "
          "2·p·hs·L·4 | USP bytes/fwd | forward ms | blocked-on-handles ms | blocking-gather ms |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['family']} | {r['n']} | {r['tokens']} | {r['layers']} | {r['step']} | {r['mode']} | "
                  f"{r['kv_bytes_sent']} | {r['expected_sent']} | {r['analytic_2phsL']} | {r['usp_bytes']} | "
                  f"{r['forward_ms']:.1f} | {r['wait_ms']:.2f} | {r['sync_comm_ms']:.2f} |")
    # stale steps whose buffers came from the previous stale step's asynchronous gather
    stale = [r for p, r in zip(rows, rows[1:]) if r["mode"] == p["mode"] == "stale" and r["family"] == p["family"]]
    if stale:
        frac = statistics.median(r["wait_ms"] / r["forward_ms"] for r in stale)
        sync = [r for r in rows if r["mode"] == "sync"]
        md.append(f"\nMedian share of a stale forward spent blocked on the previous step's gather handles: "
                  f"{100 * frac:.2f} % (sync steps spend a median {statistics.median(r['sync_comm_ms'] for r in sync):.2f}"
                  f" ms in blocking gathers).")
    write_results("distrifusion_quick" if args.quick else "distrifusion", rows, "\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
