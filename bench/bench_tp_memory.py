"""Parameter memory per rank under tensor parallel vs degree 1 (Flux, SD3, PixArt; medium-sized configs)."""
import torch

from _worlds import DistPool, context_for, write_results

CONFIGS = {  # medium: enough layers/width that the sharded Linears dominate, as in real checkpoints
    "flux": dict(patch_size=1, in_channels=64, num_layers=2, num_single_layers=4, attention_head_dim=64,
                 num_attention_heads=8, joint_attention_dim=256, pooled_projection_dim=64, axes_dims_rope=(16, 24, 24)),
    "sd3": dict(sample_size=32, patch_size=2, in_channels=16, num_layers=6, attention_head_dim=64,
                num_attention_heads=8, joint_attention_dim=256, caption_projection_dim=512, pooled_projection_dim=64,
                out_channels=16, pos_embed_max_size=64),
    "pixart": dict(sample_size=32, patch_size=2, in_channels=4, out_channels=8, num_layers=6, num_attention_heads=8,
                   attention_head_dim=64, cross_attention_dim=512, caption_channels=256,
                   use_additional_conditions=False),
}


def _body(family, tp):
    import diffusers
    from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize
    from comfyui_hybrid_parallel.parallel.tp import local_param_bytes

    cls = {"flux": diffusers.FluxTransformer2DModel, "sd3": diffusers.SD3Transformer2DModel,
           "pixart": diffusers.PixArtTransformer2DModel}[family]
    torch.manual_seed(0)
    model = cls(**CONFIGS[family]).eval()
    full = local_param_bytes(model)
    parallelize(model, context_for(ParallelConfig(tp_degree=tp)))
    return full, local_param_bytes(model)


def main():
    rows = []
    for tp in (2, 4):
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
    write_results("tp_memory", rows, "\n".join(md))


if __name__ == "__main__":
    main()
