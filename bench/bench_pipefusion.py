"""PipeFusion: bytes sent per diffusion step versus the analytic volume.

Per asynchronous step every stage boundary carries the activations of all p
image tokens once (the patches add up to the image): p·hs elements, xDiT's
O(p·hs) per boundary, so (S-1)·p·hs for S stages. On top of that, our
accounting has: the text stream of joint attention (SD3, Flux), T·hs per
patch and boundary, because text tokens are recomputed with every patch; one
control element per message; and the sampled latent rows that the last stage
returns to stage 0 (p·C·unit² elements per step). Measured from the pp_* byte
counters of every rank between consecutive steps (callback), on gloo/CPU with
tiny random models, fp32.

    python bench/bench_pipefusion.py [--quick]

Writes bench/results/pipefusion.{json,md}.
"""
from __future__ import annotations

import argparse

from _worlds import DistPool, context_for, write_results


def _build(family, layers):
    import torch
    from diffusers import FluxTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel

    torch.manual_seed(0)
    if family == "pixart":
        return PixArtTransformer2DModel(sample_size=32, patch_size=2, in_channels=4, out_channels=8,
                                        num_layers=layers, num_attention_heads=4, attention_head_dim=16,
                                        cross_attention_dim=64, caption_channels=24,
                                        use_additional_conditions=False).eval()
    if family == "sd3":
        return SD3Transformer2DModel(sample_size=32, patch_size=2, in_channels=4, num_layers=layers,
                                     attention_head_dim=16, num_attention_heads=4, joint_attention_dim=24,
                                     caption_projection_dim=64, pooled_projection_dim=12, out_channels=4,
                                     pos_embed_max_size=48).eval()
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=layers // 2,
                                  num_single_layers=layers - layers // 2, attention_head_dim=16,
                                  num_attention_heads=4, joint_attention_dim=24, pooled_projection_dim=12,
                                  guidance_embeds=True, axes_dims_rope=(4, 6, 6)).eval()


def _body(family, pp, patches, h, w, text, steps):
    import time

    import torch
    import tiny_models as tm
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.pipefusion import flow, eps, run_pipefusion_loop

    ctx = context_for(ParallelConfig(pp_degree=pp, num_pipeline_patch=patches, warmup_steps=1))
    model = _build(family, 4)
    kw = tm.inputs(family, 0, h=h, w=w, text=text)
    noise = kw.pop("hidden_states")
    kw.pop("timestep")
    conv = eps(lambda s: s * 60) if family == "pixart" else flow(1000.0 if family == "sd3" else 1.0)
    sigmas = torch.linspace(1.0, 0.0, steps + 1) * (10 if family == "pixart" else 1)
    sigmas[-1] = 0
    marks = []
    t0 = time.perf_counter()
    run_pipefusion_loop(model, ctx, kw, sigmas, noise, convention=conv,
                        callback=lambda i, n: marks.append(dict(ctx.stats.bytes)))
    wall = time.perf_counter() - t0
    hs = model.config.num_attention_heads * model.config.attention_head_dim
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
    cases = [("sd3", 2, 2, 16, 12, 7), ("pixart", 2, 4, 16, 12, 7)]
    if not a.quick:
        cases += [("flux", 2, 3, 8, 6, 7), ("sd3", 4, 4, 16, 12, 7), ("pixart", 4, 8, 16, 12, 7)]
    rows, md = run(cases, steps=4)
    write_results("pipefusion_quick" if a.quick else "pipefusion", rows, md)


if __name__ == "__main__":
    main()
