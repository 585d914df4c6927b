"""Parameter memory per rank under tensor parallel vs degree 1 (Flux, SD3, PixArt; medium-sized configs).

The models are ComfyUI's own classes (Flux, the SD3 MMDiT OpenAISignatureMMDITWrapper, PixArtMS) built with
seeded weights (bench/_worlds.py), each 8 heads x 64 (hidden 512): Flux 2 double + 4 single blocks, SD3 6 joint
blocks, PixArt 6 blocks.

    python bench/bench_tp_memory.py [--quick]      (quick: tp 2 only)
"""
import argparse

from _worlds import DistPool, bench_device, comfy_model, context_for, flux, mmdit, write_results

# medium: enough layers/width that the sharded Linears dominate, as in real checkpoints
CONFIGS = {
    "flux": dict(heads=8, head_dim=64, double=2, single=4, axes_dim=(16, 24, 24), in_channels=16, context=256,
                 pooled=64),
    "sd3": dict(depth=8, blocks=6, in_channels=16, context=256, pooled=64, pos_embed_max_size=64),
    "pixart": dict(hidden_size=512, num_heads=8, depth=6, in_channels=4, caption_channels=256),
}


def build(family, seed=0):
    """The family's medium model (ComfyUI's class, seeded weights) on bench_device()."""
    if family == "flux":
        model = flux(**CONFIGS["flux"], seed=seed)
    elif family == "sd3":
        model = mmdit(**CONFIGS["sd3"], seed=seed)
    else:
        def make(ops):
            from comfy.ldm.pixart.pixartms import PixArtMS
            return PixArtMS(input_size=None, patch_size=2, model_max_length=120, pe_interpolation=None,
                            micro_condition=False, operations=ops, device="meta", **CONFIGS["pixart"])
        model = comfy_model(make, seed)
    return model.to(bench_device())


def _body(family, tp):
    from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize
    from comfyui_hybrid_parallel.parallel.tp import local_param_bytes

    model = build(family)
    full = local_param_bytes(model)
    parallelize(model, context_for(ParallelConfig(tp_degree=tp)))
    return full, local_param_bytes(model)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tp 2 only")
    a = ap.parse_args(argv)
    rows = []
    for tp in ((2,) if a.quick else (2, 4)):
        pool = DistPool(tp)
        try:
            for family in CONFIGS:
                res = pool.run(_body, family, tp, timeout=600)
                full, local = res[0]
                rows.append(dict(family=family, tp=tp, full_mb=full / 2**20, per_rank_mb=max(r[1] for r in res) / 2**20))
        finally:
            pool.close()
    md = ["| family | tp | params, degree 1 (MiB) | params per rank (MiB) | fraction |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['family']} | {r['tp']} | {r['full_mb']:.1f} | {r['per_rank_mb']:.1f} | "
                  f"{r['per_rank_mb'] / r['full_mb']:.2f} |")
    write_results("tp_memory_quick" if a.quick else "tp_memory", rows, "\n".join(md),
                  {"models": "ComfyUI's Flux / MMDiT / PixArtMS, seeded weights, 8 heads x 64: "
                             + "; ".join(f"{k} {v}" for k, v in CONFIGS.items())})


if __name__ == "__main__":
    main()
