"""Bytes each rank sends per diffusion step, from the comm counters, against an exact analytic volume.

Why an exact formula and not only xDiT's table: the table (Ulysses (4/N)·p·hs·L,
Ring 2·p·hs·L, DistriFusion 2·p·hs·L, TP 4·p·hs·L, PipeFusion 2·p·hs) is
asymptotic; a counter that disagrees with it by a few per cent could be
a real inefficiency or just a dropped (N-1)/N. So the volume of *this*
implementation is derived term by term (per op, per rank, uneven splits,
padding included) and must equal the counters; the image-attention part of it
is then compared with the table.

Notation: B batch on the rank, p image tokens, T text tokens, H heads, D head
dim, hs = H·D, L self-attention layers, e bytes per element (4, fp32),
s = split_sizes(p, N) the shards. MMDiT text (SD3, Flux) is split over the N
sequence ranks too when T >= N (t = split_sizes(T, N)): in a joint layer a rank's
shard is then its text and image rows, s_r -> t_r + s_r and p -> T + p below.
A shorter text stays whole on every rank (replicated). Counters count what a
rank *sends* to other ranks (its own all-to-all chunk stays home). Per rank
and per forward (= one step in step mode):

* Ulysses (U ranks), per layer: all-to-all of q,k,v: 3·B·D·s_r·(H - h_r)
  and of the output back: B·h_r·D·(p - s_r), with h = split_sizes(H, U);
  even: 4·B·p·hs·(U-1)/U² = xDiT's (4/N)·p·hs · (N-1)/N. Replicated MMDiT text:
  its output is all-gathered over heads: B·h_r·T·D·(U-1) (it rides in the return
  all-to-all, so uneven head shards are not padded to max(h) as gloo's
  all_gather required; counted as "all_gather").
* Ring (R ranks), per layer: K and V blocks (padded to the largest) rotate
  R-1 times: 2·B·H·max(s)·D·(R-1); even: 2·p·hs·(N-1)/N = xDiT · (N-1)/N.
  Replicated text K/V never travel (split text travels in its blocks).
* USP (U x R): Ulysses inside each ring block (p/R tokens), then the ring
  on H/U heads: 4·B·p·hs·(U-1)/(N·U) + 2·B·p·hs·(R-1)/N per layer, even.
* DistriFusion, per step that refreshes: all-gather of the padded own K/V:
  2·B·H·max(s)·D·L·(N-1) = xDiT 2·p·hs·L · (N-1)/N; the last step of a run
  gathers nothing (nobody would read it).
* TP (row-wise layers; tp.py's counter, cross-checked here against the calls
  to torch.distributed.all_reduce on the tp group): each row-wise Linear all-reduces its output, 2(N-1)/N of
  it per rank (ring all-reduce). SD3 block: to_out, ff (p·hs each) + to_add_out,
  ff_context (T·hs) -> image part 4·p·hs·(N-1)/N = xDiT · (N-1)/N;
  Flux single blocks have one packed all-reduce of (p+T)·hs; PixArt three (attn1,
  attn2, ff) of p·hs.
* Every sequence method ends with one all-gather of the proj_out output
  (B·max(s)·C_out·(N-1)); CFG / DP gather the model output over the batch
  ranks (max batch shard · per-sample output · (n-1)).
* PipeFusion (loop mode, per asynchronous step, bench_pipefusion.py): every
  stage but the last sends the activations of all p tokens once (p·hs; xDiT's
  2·p·hs counts a stage's input and output), + T·hs text and 1 control element
  per patch, and the last stage sends the sampled latent back to stage 0.

Run: python bench/comm_volume.py [--quick]  (deterministic: counts, not times)
"""
from __future__ import annotations

import argparse
import math

import torch

from _worlds import DistPool, context_for, write_results

E = 4  # fp32


def split_sizes(n, parts):
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


# ---------------------------------------------------------------- model facts (from ComfyUI's model instance)
def hidden_width(family, model) -> int:
    """hs = H·D of a tiny ComfyUI model (tests/tiny_models.py)."""
    return model.dim if family == "wan" else model.hidden_size


def model_facts(family, model, h, w, text, frames=1):
    """p, T, H, D, attention layers [(has_text)], width of the gathered output per token, per-sample output numel.
    h, w: the latent (Flux: its token grid, as tests/tiny_models.py takes it)."""
    if family == "flux":
        H = model.num_heads
        p, layers = h * w, [True] * (len(model.double_blocks) + len(model.single_blocks))
        c_out = model.final_layer.linear.out_features
        out_ps = p * c_out
    elif family == "sd3":
        H = model.joint_blocks[0].x_block.attn.num_heads
        p = (h // 2) * (w // 2)
        dual = sum(b.x_block.x_block_self_attn for b in model.joint_blocks)  # SD3.5's image-only attn2
        layers = [True] * len(model.joint_blocks) + [False] * dual
        c_out = model.final_layer.linear.out_features
        out_ps = model.out_channels * h * w
    elif family == "pixart":
        H = model.num_heads
        p, layers = (h // 2) * (w // 2), [False] * len(model.blocks)
        c_out = model.final_layer.linear.out_features
        out_ps = model.in_channels * h * w  # its forward returns the eps half of the learned-sigma output
    elif family == "wan":
        H = model.num_heads
        p, layers = frames * (h // 2) * (w // 2), [False] * len(model.blocks)
        c_out = model.head.head.out_features
        out_ps = model.out_dim * frames * h * w
    else:
        raise ValueError(family)
    return dict(p=p, T=text, H=H, D=hidden_width(family, model) // H, layers=layers, c_out=c_out, out_ps=out_ps)


def tp_rowwise(family, model, f):
    """(tokens, out_features) of every row-wise Linear of the family's TP placement (ComfyUI's module names)."""
    p, T, hs = f["p"], f["T"], f["H"] * f["D"]
    rows = []
    if family == "sd3":  # x_block: attn.proj, (attn2.proj), mlp.fc2; context_block the same two unless pre_only
        for blk in model.joint_blocks:
            rows += [(p, hs)] * (2 + blk.x_block.x_block_self_attn)
            rows += [(T, hs)] * 2 if not blk.context_block.pre_only else []
    elif family == "flux":  # double: img/txt attn proj, img/txt mlp out; single: one packed linear2 of [txt, img]
        rows += [(p, hs), (T, hs), (p, hs), (T, hs)] * len(model.double_blocks) + [(p + T, hs)] * len(model.single_blocks)
    elif family == "pixart":  # attn.proj, cross_attn.proj, mlp.fc2
        rows += [(p, hs), (p, hs), (p, hs)] * len(model.blocks)
    return rows


# ---------------------------------------------------------------- the analytic volume
def analytic(method, deg, f, B, rank_coords, steps=None, step=None, family=None, tp_rows=None):
    """Exact bytes this rank sends in one forward, per counter name, for our implementation."""
    p, T, H, D, layers = f["p"], f["T"], f["H"], f["D"], f["layers"]
    out = {}
    if method in ("ulysses", "ring", "usp"):
        U, R = deg.get("ulysses_degree", 1), deg.get("ring_degree", 1)
        u, rho = rank_coords["ulysses"], rank_coords["ring"]
        N = U * R
        me = rho * U + u
        hu = split_sizes(H, U)
        h_loc = hu[u] if U > 1 else H
        for has_text in layers:
            split = has_text and T and T >= N  # the text's rows join the shards
            s = [a + b for a, b in zip(split_sizes(T, N), split_sizes(p, N))] if split else split_sizes(p, N)
            block = [sum(s[r * U:(r + 1) * U]) for r in range(R)]
            if U > 1:
                out["all_to_all"] = out.get("all_to_all", 0) + E * B * D * (
                    3 * s[me] * (H - hu[u]) + hu[u] * (block[rho] - s[me]))
                if has_text and T and not split:
                    out["all_gather"] = out.get("all_gather", 0) + E * B * hu[u] * T * D * (U - 1)
            if R > 1:
                out["ring_p2p"] = out.get("ring_p2p", 0) + E * 2 * B * h_loc * max(block) * D * (R - 1)
        out["all_gather"] = out.get("all_gather", 0) + E * B * max(split_sizes(p, N)) * f["c_out"] * (N - 1)
    elif method == "distrifusion":
        N = deg["ulysses_degree"]
        s = split_sizes(p, N)
        kv = E * 2 * B * H * max(s) * D * len(layers) * (N - 1)
        key = "distrifusion_sync_kv" if step < max(1, deg.get("warmup_steps", 1)) else "distrifusion_async_kv"
        if key == "distrifusion_sync_kv" or step < steps - 1:
            out[key] = kv
        out["all_gather"] = E * B * max(s) * f["c_out"] * (N - 1)
    elif method == "tp":
        N = deg["tp_degree"]
        out["tp_all_reduce"] = sum(E * B * tok * width * 2 * (N - 1) // N for tok, width in tp_rows)
    elif method in ("cfg", "dp"):
        n = deg.get("cfg_degree", 1) * deg.get("dp_degree", 1)
        out["all_gather"] = E * max(split_sizes(B, n)) * f["out_ps"] * (n - 1) if B >= n else 0
    return out


def xdit(method, deg, f, B):
    """(xDiT's table value per device, what our image-attention part per rank should be for an even split).

    The table is asymptotic and counts the split tokens: image tokens, and in a joint layer the text too when
    it is split (T >= N); for an even split our exact part is the table times (N-1)/N (a rank's own shard
    never leaves it). USP is not in the table: its Ulysses part is the Ulysses row on a ring block (p/R
    tokens, U ranks), its ring part the Ring row on hs/U.
    """
    hs, L = f["H"] * f["D"], len(f["layers"])
    N = math.prod(v for k, v in deg.items() if k.endswith("_degree"))
    # mean tokens split per layer (a layer's text joins when it is split: not under DistriFusion)
    text = f["T"] if method != "distrifusion" and f["T"] >= N else 0
    p = f["p"] + text * sum(f["layers"]) / L
    if method == "ulysses":
        table = 4 / N * p * hs * L
    elif method in ("ring", "distrifusion"):
        table = 2 * p * hs * L
    elif method == "usp":
        U, R = deg["ulysses_degree"], deg["ring_degree"]
        uly, ring = 4 / U * (p / R) * hs * L, 2 * p * (hs / U) * L
        return E * B * (uly + ring), E * B * (uly * (U - 1) / U + ring * (R - 1) / R)
    elif method == "tp":
        return E * B * 4 * p * hs * len(f["layers"]), None
    else:
        return None, None
    return E * B * table, E * B * table * (N - 1) / N


def image_part(method, measured: dict, f, deg, B) -> int:
    """The measured bytes the xDiT table describes: attention traffic of the split tokens (no replicated text,
    no gather)."""
    if method in ("ulysses", "usp", "ring"):
        return measured.get("all_to_all", 0) + measured.get("ring_p2p", 0)
    if method == "distrifusion":
        return measured.get("distrifusion_sync_kv", 0) + measured.get("distrifusion_async_kv", 0)
    return 0


# ---------------------------------------------------------------- measuring, on every rank
class CollectiveBytes:
    """Bytes a rank sends in torch.distributed's all-reduces on the tp group, seen at torch's own API (an
    independent check of tp.py's counter): a ring all-reduce sends 2(N-1)/N of the tensor."""

    def __init__(self, ax):
        self.ax, self.bytes, self.calls = ax, 0, 0

    def __enter__(self):
        import torch.distributed as dist
        self._orig = dist.all_reduce

        def counted(t, *args, group=None, **kwargs):
            if group is self.ax.group and self.ax.size > 1:
                self.calls += 1
                self.bytes += t.numel() * t.element_size() * 2 * (self.ax.size - 1) // self.ax.size
            return self._orig(t, *args, group=group, **kwargs)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._orig


def config_of(method, deg):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    if method == "distrifusion":
        return ParallelConfig(method="distrifusion", **deg)
    return ParallelConfig(**deg)


def measure_body(family, method, deg, h, w, text, batch, seed, steps=1, frames=1, heads=None):
    """Per-rank: counters of each forward, rank coordinates, the model facts and TP placement."""
    import tiny_models as tm
    from comfyui_hybrid_parallel.parallel import parallelize, unparallelize
    from comfyui_hybrid_parallel.parallel.distrifusion import distrifusion_state
    from _worlds import bench_device

    dev = bench_device()
    ctx = context_for(config_of(method, deg))
    model = tm.build(family, **({"heads": heads} if heads else {})).to(dev)
    kw = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v)
          for k, v in tm.inputs(family, seed, batch=batch, h=h, w=w, text=text, frames=frames).items()}
    facts = model_facts(family, model, h, w, text, frames)
    rows = tp_rowwise(family, model, facts) if method == "tp" else None
    parallelize(model, ctx)
    per_step = []
    try:
        for i in range(steps):
            if method == "distrifusion":
                distrifusion_state(model).set_step(i, total_steps=steps)
            ctx.stats.reset()
            counter = CollectiveBytes(ctx.tp)
            with counter:
                tm.forward(model, kw)
            snap = {k: v["bytes"] for k, v in ctx.stats.snapshot().items()}
            if method == "tp" and not counter.calls:
                raise AssertionError("tensor parallel ran without an all-reduce on the tp group")
            if counter.calls:  # tp.py's own counter, cross-checked against torch's collectives
                if snap.get("tp_all_reduce") != counter.bytes:
                    raise AssertionError(f"tp.py counted {snap.get('tp_all_reduce')} all-reduce bytes, torch's "
                                         f"collectives {counter.bytes}")
            per_step.append(snap)
    finally:
        unparallelize(model)
    return dict(per_step=per_step, coords=dict(ctx.coords), facts=facts, tp_rows=rows)


def check(family, method, deg, h, w, text, batch, results, steps=1):
    """Rows comparing every rank's counters with `analytic`, one per step: the world's totals and worst rank."""
    rows = []
    f = results[0]["facts"]
    B_rank = batch
    for step in range(steps):
        meas_tot = ana_tot = img_tot = 0
        worst = 0.0
        per_op_ok = True
        for r in results:
            m = r["per_step"][step]
            a = analytic(method, deg, f, B_rank, r["coords"], steps=steps, step=step, family=family,
                         tp_rows=r["tp_rows"])
            mt, at = sum(m.values()), sum(a.values())
            per_op_ok &= {k: v for k, v in m.items() if v} == {k: v for k, v in a.items() if v}
            worst = max(worst, abs(mt / at - 1) if at else float(mt != 0))
            meas_tot, ana_tot = meas_tot + mt, ana_tot + at
            img_tot += image_part(method, m, f, deg, B_rank)
        N = len(results)
        table, even = xdit(method, deg, f, batch)
        rows.append(dict(family=family, method=method, degrees=config_of(method, deg).describe(), N=N,
                         latent=[h, w], p=f["p"], T=text, hs=f["H"] * f["D"], L=len(f["layers"]), batch=batch,
                         step=step, measured_bytes=meas_tot, analytic_bytes=ana_tot,
                         ratio=meas_tot / ana_tot if ana_tot else None, worst_rank_dev=worst,
                         per_op_exact=per_op_ok, measured_image_attn_bytes=img_tot if even else None,
                         xdit_table_bytes_per_device=table,
                         image_vs_xdit=img_tot / (even * N) if even and img_tot else None,
                         per_rank_measured=[sum(r["per_step"][step].values()) for r in results]))
    return rows


def pipefusion_row(family, pp, patches, h, w, text, res, step=2):
    """One asynchronous PipeFusion step (bench_pipefusion._body results): counters vs the exact volume."""
    hs, shape = res[0][2], res[0][3]

    def step_bytes(key):
        return sum(r[0][step].get(key, 0) - (r[0][step - 1].get(key, 0) if step else 0) for r in res)

    p = h * w if family == "flux" else (h // 2) * (w // 2)
    act, lat = step_bytes("pp_activations"), step_bytes("pp_latent")
    img = (pp - 1) * p * hs * E
    txt = (pp - 1) * patches * text * hs * E if family != "pixart" else 0
    flags = (pp - 1) * patches * E
    latent = math.prod(shape) * E
    ana = img + txt + flags + latent
    return dict(family=family, method="pipefusion", degrees=f"pp{pp}·patches{patches}", N=pp, latent=[h, w], p=p,
                T=text, hs=hs, L=None, batch=1, step=step, measured_bytes=act + lat, analytic_bytes=ana,
                ratio=(act + lat) / ana, worst_rank_dev=None, per_op_exact=(act, lat) == (img + txt + flags, latent),
                measured_image_attn_bytes=act - txt - flags, xdit_table_bytes_per_device=2 * p * hs * E,
                image_vs_xdit=(act - txt - flags) / img, wall_s=max(r[1] for r in res),
                per_rank_measured=[sum(r[0][step].values()) - sum(r[0][step - 1].values()) for r in res])


# ---------------------------------------------------------------- the section
def cases(quick):
    """(family, method, degrees, h, w, text, batch, steps); p divides N in the first size, not in the second."""
    out = []
    sizes = {"sd3": [(16, 16), (30, 34)], "flux": [(8, 8), (9, 11)]}
    for n in ((2, 4) if quick else (2, 4, 8)):
        for fam in ("sd3", "flux"):
            for (h, w) in sizes[fam][: (1 if quick and n == 4 else 2)]:
                out.append((fam, "ulysses", dict(ulysses_degree=n), h, w, 8, 1, 1))
                out.append((fam, "ring", dict(ring_degree=n), h, w, 8, 1, 1))
                if n >= 4:
                    out.append((fam, "usp", dict(ulysses_degree=2, ring_degree=n // 2), h, w, 8, 1, 1))
                out.append((fam, "distrifusion", dict(ulysses_degree=n, warmup_steps=1), h, w, 8, 1, 3))
                if n <= 4:
                    out.append((fam, "tp", dict(tp_degree=n), h, w, 8, 1, 1))
        if n == 2:
            out.append(("pixart", "cfg", dict(cfg_degree=2), 34, 32, 8, 2, 1))  # ComfyUI's PixArt: (h + w) / 2 >= 33
            out.append(("pixart", "dp", dict(dp_degree=2), 34, 32, 8, 3, 1))
    return out


PIPEFUSION = [("sd3", 2, 2, 16, 12, 7), ("pixart", 2, 4, 48, 32, 7), ("pixart", 4, 4, 34, 32, 7),
              ("sd3", 4, 4, 32, 24, 7), ("flux", 2, 3, 8, 6, 7)]


def run(quick=False):
    pools, rows = {}, []
    try:
        for fam, method, deg, h, w, text, batch, steps in cases(quick):
            n = math.prod(v for k, v in deg.items() if k.endswith("_degree"))
            pool = pools.setdefault(n, DistPool(n))
            res = pool.run(measure_body, fam, method, deg, h, w, text, batch, seed=h * 7 + w, steps=steps,
                           timeout=300)
            rows += check(fam, method, deg, h, w, text, batch, res, steps)
        import bench_pipefusion
        for fam, pp, patches, h, w, text in PIPEFUSION[: 2 if quick else None]:
            pool = pools.setdefault(pp, DistPool(pp))
            res = pool.run(bench_pipefusion._body, fam, pp, patches, h, w, text, 4, timeout=300)
            rows.append(pipefusion_row(fam, pp, patches, h, w, text, res))
    finally:
        for p in pools.values():
            p.close()
    return rows


def markdown(rows):
    md = ["| family | method | degrees | latent | p | step | bytes/step, all ranks (measured) | analytic | "
          "measured/analytic | per op exact | image-attn part / xDiT·(N-1)/N |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ix = f"{r['image_vs_xdit']:.3f}" if r["image_vs_xdit"] is not None else "–"
        md.append(f"| {r['family']} | {r['method']} | {r['degrees']} | {r['latent'][0]}×{r['latent'][1]} | {r['p']} | "
                  f"{r['step']} | {r['measured_bytes']} | {r['analytic_bytes']} | "
                  f"{(r['ratio'] or 0):.4f} | {r['per_op_exact']} | {ix} |")
    return "\n".join(md)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    rows = run(a.quick)
    write_results("comm_volume_quick" if a.quick else "comm_volume", rows, markdown(rows))
    bad = [r for r in rows if r["ratio"] is not None and abs(r["ratio"] - 1) > 0.05]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
