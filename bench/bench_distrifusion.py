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

Run: /work/venv/bin/python bench/bench_distrifusion.py [--quick]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from _worlds import DistPool, context_for, write_results


def _build(family):
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    if family == "sd3":  # hs = 4 heads x 32 = 128, 4 joint layers
        m = SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=4, attention_head_dim=32,
                                  num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=128,
                                  pooled_projection_dim=16, out_channels=4, pos_embed_max_size=48)
    else:  # flux: hs = 4 x 32 = 128, 2 double + 2 single blocks
        m = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=2, num_single_layers=2,
                                   attention_head_dim=32, num_attention_heads=4, joint_attention_dim=32,
                                   pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(8, 12, 12))
    return m.eval()


def _inputs(family, h, w, text=16):
    g = torch.Generator().manual_seed(1)
    if family == "sd3":
        return dict(hidden_states=torch.randn(1, 4, h, w, generator=g),
                    encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                    pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([500.0]))
    ids = torch.zeros(h, w, 3)
    ids[..., 1], ids[..., 2] = torch.arange(h)[:, None], torch.arange(w)[None, :]
    return dict(hidden_states=torch.randn(1, h * w, 8, generator=g),
                encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                pooled_projections=torch.randn(1, 16, generator=g), timestep=torch.tensor([0.5]),
                img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3))


def _body(family, n, h, w, steps, warmup, layers_per_comm):
    from comfyui_hybrid_parallel.parallel import ParallelConfig, unparallelize
    from comfyui_hybrid_parallel.parallel.distrifusion import apply_distrifusion, distrifusion_state

    torch.set_num_threads(1)
    model = _build(family)
    kw = _inputs(family, h, w)
    usp_ctx = context_for(ParallelConfig(ulysses_degree=n))
    from comfyui_hybrid_parallel.parallel import parallelize
    parallelize(model, usp_ctx)
    with torch.no_grad():
        model(**kw, return_dict=False)
    unparallelize(model)
    usp_bytes = usp_ctx.stats.total_bytes()

    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=warmup))
    apply_distrifusion(model, ctx, layers_per_comm=layers_per_comm)
    st = distrifusion_state(model)
    per_step = []
    x = kw["hidden_states"].clone()
    try:
        for i in range(steps):
            ctx.stats.reset()
            st.set_step(i, total_steps=steps)
            with torch.no_grad():
                out = model(**{**kw, "hidden_states": x}, return_dict=False)[0]
            x = x - out[:, : x.shape[1]] / steps
            per_step.append(ctx.stats.snapshot())
        hist = [dict(r) for r in st.history]
    finally:
        unparallelize(model)
    return dict(per_step=per_step, history=hist, usp_bytes=usp_bytes)


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
            hs, layers = 128, res[0]["history"][0]["layers"]
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
