"""The GPU suite's `quant` section: ComfyUI's quantized layouts on comfy-kitchen's kernels, pool vs KSampler.

Why on a GPU: on a CPU comfy-kitchen runs its eager fallback (the weight dequantized, an fp32 matmul), which the CPU
tests already hold to ComfyUI's forward (tests/driver/test_quantized_weights.py). On a GPU, ComfyUI 0.33 picks a CUDA or
triton kernel per layout where the device has one (fp8 scaled matmul on Hopper; nvfp4 / mxfp8 only on Blackwell, the
fallback elsewhere) - the pool's workers must make the same choice from the same `quant_config` and `disabled` set.
Each layout: a checkpoint written by ComfyUI's / comfy-kitchen's own quantization code (the test module's writers),
loaded by ComfyUI's loader, sampled by KSampler and by Hybrid Sampler at degree 1 in one process (DynamicVRAM on
where ComfyUI turns it on), the two latents compared. Full: Flux.1 with one block of each kind (531M parameters, the
layer widths real Flux has); reduced (CPU, CI): the tiny SD3.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
FORMS = ("scaled_fp8", "float8_e4m3fn", "float8_e5m2", "int8_tensorwise", "nvfp4", "mxfp8")
# family, writer kwargs, latent shape, conditioning (tokens, width, pooled width), steps
FULL = ("flux", dict(depth=1, depth_single=1), (1, 16, 64, 64), (256, 32, 24), 2)
REDUCED = ("sd3", dict(depth=2, pos_embed_max_size=32), (1, 16, 24, 24), (7, 32, 24), 2)


def write_forms(folder: Path, reduced: bool) -> dict:
    """{form: path}: the model in each quantized form, written by ComfyUI's own code (needs ComfyUI imported)."""
    import torch
    from safetensors.torch import load_file, save_file
    sys.path[:0] = [str(HERE.parent / "tests" / d) for d in ("", "families", "driver")]
    from test_native_pool import _scaled_fp8
    from test_quantized_weights import _comfy_quant_file
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    family, kwargs, *_ = REDUCED if reduced else FULL
    src = folder / f"quant_{family}.safetensors"
    writer = {"flux": tc.write_flux, "sd3": tc.write_sd3}[family]
    writer(src, seed=41, dtype=torch.float32 if reduced else torch.bfloat16,
           **({} if reduced else {"device": "cuda"}), **kwargs)
    sd = load_file(str(src))
    out = {}
    for form in FORMS:
        out[form] = folder / f"quant_{family}_{form}.safetensors"
        save_file(_scaled_fp8(sd) if form == "scaled_fp8" else _comfy_quant_file(sd, form), str(out[form]))
    return out


def quant_child(files: dict, reduced: bool, cuda: bool) -> list:
    import torch
    from gpu_suite import _comfy, pool_nodes, rel, sampler_inputs
    comfy_nodes = _comfy(cuda)
    import comfy.sd
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    family, _, latent_shape, conditioning, steps = REDUCED if reduced else FULL
    cond, latent = sampler_inputs(family, latent_shape, conditioning)
    runtime, hp = pool_nodes(cuda)
    rows = []
    try:
        for form, path in files.items():
            row = {"form": form}
            try:
                with torch.inference_mode():  # as a ComfyUI server runs a prompt, its loader node included
                    model = comfy.sd.load_diffusion_model(path)
                    t = time.perf_counter()
                    ks = comfy_nodes.common_ksampler(model, 1, steps, 1.0, "euler", "simple", cond, cond, latent)
                    row["ksampler_s"] = round(time.perf_counter() - t, 3)
                    t = time.perf_counter()
                    hy = HybridSampler().sample(model, 1, steps, 1.0, "euler", "simple", cond, cond, latent, hp)
                    row["pool_first_s"] = round(time.perf_counter() - t, 3)
                row["rel"] = rel(hy[0]["samples"], ks[0]["samples"])
                row["finite"] = bool(hy[0]["samples"].isfinite().all())
            except Exception as e:  # noqa: BLE001 - one layout's failure is its row; the others still run
                import traceback
                row["error"] = f"{type(e).__name__}: {e}"[:600]
                traceback.print_exc()
            rows.append(row)
            print("QROW " + json.dumps(row), flush=True)
    finally:
        runtime.stop()
    return rows


def run_quant(cuda: bool, reduced: bool, folder: Path) -> list:
    from gpu_suite import _comfy
    _comfy(cuda)
    from comfyui_hybrid_parallel.workers.bridge.seams import has
    if not has("comfy.supported_models_base:BASE.quant_config"):
        return [{"form": "-", "error": "this ComfyUI (< 0.33) has no mixed-precision quantized checkpoints"}]
    files = {k: str(v) for k, v in write_forms(folder, reduced).items()}
    cmd = [sys.executable, str(Path(__file__)), json.dumps(files)] + (["--reduced"] if reduced else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(HERE.parent))
    rows = [json.loads(line[5:]) for line in res.stdout.splitlines() if line.startswith("QROW ")]
    if res.returncode or len(rows) < len(files):
        rows.append({"form": "-", "error": (res.stdout[-1500:] + res.stderr[-3000:]).strip()})
    return rows


def markdown(rows: list) -> list:
    lines = ["## ComfyUI's quantized layouts: Hybrid Sampler degree 1 vs KSampler, same file, one process", "",
             "| layout | KSampler s | pool first prompt s | rel | result |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['form']} | | | | error: {r['error'].splitlines()[-1][:160] if r['error'] else ''} |")
        else:
            lines.append(f"| {r['form']} | {r['ksampler_s']} | {r['pool_first_s']} | {r['rel']:.1e} | "
                         f"{'ok' if r['finite'] else 'not finite'} |")
    return lines + [""]


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("files")
    ap.add_argument("--reduced", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    quant_child(json.loads(a.files), a.reduced, torch.cuda.is_available() and not a.reduced)
