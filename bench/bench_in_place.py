"""What the in-place check (workers/bridge/inplace.py) costs per prompt, at real sizes: Flux.1 12B (19 double + 38
single blocks) and Wan 2.1 14B (40 layers), built on the meta device with ComfyUI's own classes (no weights, no
memory) as ComfyUI's loader builds them, beside the tiny SD3 the tests use.

The check walks every module of the BaseModel (instance callables, torch hooks), the classes and model-code modules
it runs (cached per code file), and compares the submodules with ComfyUI's class built from the config (cached per
class and config: the first prompt pays the meta build, the next ones a dictionary walk). Printed: the first call
and the median of the next ones, per model, with the module count.

    python bench/bench_in_place.py [--repeat 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))


def _meta_base_model(model_config_cls, unet_config: dict):
    """ComfyUI's BaseModel of `model_config_cls` built on the meta device, as its loader builds it."""
    import torch
    cfg = model_config_cls(unet_config)
    cfg.set_inference_dtype(torch.bfloat16, None)
    return cfg.get_model({}, "", device=torch.device("meta"))


def models() -> dict:
    import comfy.ldm.flux.model as flux
    import comfy.supported_models as sm

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    fluxcfg = {"image_model": "flux", "in_channels": 16, "patch_size": 2, "out_channels": 16, "vec_in_dim": 768,
               "context_in_dim": 4096, "hidden_size": 3072, "mlp_ratio": 4.0, "num_heads": 24, "depth": 19,
               "depth_single_blocks": 38, "axes_dim": [16, 56, 56], "theta": 10000, "qkv_bias": True,
               "guidance_embed": True}
    fluxcfg = {**fluxcfg, **tc.detected(flux.FluxParams, txt_ids_dims=[], vec_in_dim=768)}
    wancfg = {"image_model": "wan2.1", "model_type": "t2v", "patch_size": (1, 2, 2), "text_len": 512, "in_dim": 16,
              "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "text_dim": 4096, "out_dim": 16, "num_heads": 40,
              "num_layers": 40, "window_size": (-1, -1), "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6}
    return {"Flux.1 12B": _meta_base_model(sm.Flux, fluxcfg), "Wan 2.1 14B": _meta_base_model(sm.WAN21_T2V, wancfg)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="(run_all's flag) the same run: it takes seconds")
    args = ap.parse_args()
    from comfy_env import setup_comfy
    setup_comfy()
    import tempfile

    import comfy.sd

    from _worlds import write_results
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.workers.bridge.inplace import build_key, in_place_findings
    path = Path(tempfile.mkdtemp(prefix="hp-bench-inplace-")) / "tiny_sd3.safetensors"
    tc.write_sd3(path)
    world = {"tiny SD3 (the tests')": comfy.sd.load_diffusion_model(str(path)).model, **models()}
    rows = []
    for name, base in world.items():
        t = time.perf_counter()
        found = in_place_findings(base, build_key(base))
        first = time.perf_counter() - t
        times = []
        for _ in range(args.repeat):
            t = time.perf_counter()
            in_place_findings(base, build_key(base))
            times.append(time.perf_counter() - t)
        rows.append({"model": name, "modules": sum(1 for _ in base.modules()), "findings": len(found),
                     "first_ms": round(first * 1e3, 2), "next_ms": round(statistics.median(times) * 1e3, 2),
                     "spread_ms": round((max(times) - min(times)) * 1e3, 2)})
    md = ["| model | modules | findings | first prompt (ms) | next prompts, median (ms) | spread (ms) |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['model']} | {r['modules']} | {r['findings']} | {r['first_ms']} | {r['next_ms']} | {r['spread_ms']} |"
           for r in rows]
    write_results("in_place", rows, "\n".join(md), {"repeat": args.repeat})


if __name__ == "__main__":
    main()
