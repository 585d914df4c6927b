"""PipeFusion: bytes sent per diffusion step versus the analytic volume.

Per asynchronous step every stage boundary carries the activations of all p
image tokens once (the patches add up to the image): p·hs elements, xDiT's
O(p·hs) per boundary, so (S-1)·p·hs for S stages. On top of that, our
accounting has: the text stream of joint attention (SD3, Flux), T·hs per
patch and boundary, because text tokens are recomputed with every patch; one
control element per message; and the sampled latent rows that the last stage
returns to stage 0 (p·C·unit² elements per step). Measured from the pp_* byte
counters of every rank between consecutive steps (callback), on gloo/CPU with
tiny seeded models of ComfyUI's own classes, fp32.

    python bench/bench_pipefusion.py [--quick]

Writes bench/results/pipefusion.{json,md}.
"""
from __future__ import annotations

import argparse

from _worlds import DistPool, context_for, write_results


def _body(family, pp, patches, h, w, text, steps):
    import time

    import torch
    import tiny_models as tm
    from comm_volume import hidden_width
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.pipefusion import flow, eps, run_pipefusion_loop

    ctx = context_for(ParallelConfig(pp_degree=pp, num_pipeline_patch=patches, warmup_steps=1))
    model = tm.build(family, heads=4, blocks=4)  # ComfyUI's class (tests/tiny_models.py), 4 blocks: one a stage at pp4
    kw = tm.inputs(family, 0, h=h, w=w, text=text)
    noise = kw.pop("x")
    kw.pop("timestep")
    conv = eps(lambda s: s * 60) if family == "pixart" else flow(1000.0 if family == "sd3" else 1.0)
    sigmas = torch.linspace(1.0, 0.0, steps + 1) * (10 if family == "pixart" else 1)
    sigmas[-1] = 0
    marks = []
    t0 = time.perf_counter()
    run_pipefusion_loop(model, ctx, kw, sigmas, noise, convention=conv, native_call=tm.call,
                        timestep_dtype=torch.float32, callback=lambda i, n: marks.append(dict(ctx.stats.bytes)))
    wall = time.perf_counter() - t0
    hs = hidden_width(family, model)
    return marks, wall, hs, tuple(noise.shape)


def run(cases, steps):
    from comm_volume import pipefusion_row

    rows, pools = [], {}
    try:
        for family, pp, patches, h, w, text in cases:
            pool = pools.setdefault(pp, DistPool(pp))
            res = pool.run(_body, family, pp, patches, h, w, text, steps, timeout=600)
            row = pipefusion_row(family, pp, patches, h, w, text, res)
            row["warmup_step_activation_bytes"] = sum(r[0][0].get("pp_activations", 0) for r in res)
            rows.append(row)
    finally:
        for pool in pools.values():
            pool.close()
    md = ["| family | pp·patches | p (tokens) | hs | bytes/step measured (all ranks) | analytic: (S-1)·(p·hs + P·T·hs + P)·4 "
          "+ latent back | exact | warmup step act. bytes | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['family']} | {r['degrees']} | {r['p']} | {r['hs']} | {r['measured_bytes']} | "
                  f"{r['analytic_bytes']} | {r['per_op_exact']} | {r['warmup_step_activation_bytes']} | "
                  f"{r['wall_s']:.2f} |")
    return rows, "\n".join(md)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    cases = [("sd3", 2, 2, 16, 12, 7), ("pixart", 2, 4, 48, 32, 7)]
    if not a.quick:
        cases += [("flux", 2, 3, 8, 6, 7), ("sd3", 4, 4, 16, 12, 7), ("pixart", 4, 8, 48, 32, 7)]
    rows, md = run(cases, steps=4)
    write_results("pipefusion_quick" if a.quick else "pipefusion", rows, md)


if __name__ == "__main__":
    main()
