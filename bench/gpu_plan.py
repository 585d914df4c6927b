"""The GPU suite's time on one H100, predicted before a GPU is lent: each section's seconds from what it does.

Why a prediction: a session lent a GPU has 15 minutes of device time in all (start, transfers, idle included) and one
command may run 10 minutes; the suite must end inside one command with room for a rerun of what failed, so its
sections are sized here, on a CPU machine, and a test holds their sum to the budget (9 minutes).

Each figure is a count of what the section does (processes started, pool worlds started, bytes written and loaded,
floating-point work, method rows) times a rate. The rates are assumptions for an H100 machine of the device tool
(16 cores, 128 GiB, one H100 80 GB), named below with where each comes from; the first GPU run writes the measured
`section_seconds` beside them (bench/results/gpu_suite.json), and the rates are corrected from it.
"""
from __future__ import annotations

BUDGET_S = 9 * 60

RATES = {
    # a fresh Python importing torch, ComfyUI 0.33 and its nodes, CUDA initialised (CPU here: 5-8 s)
    "process_s": 12.0,
    # a pool world started and its first model built on the GPU (CPU here: ~6 s for the first prompt)
    "world_s": 10.0,
    # random weights generated on the GPU, copied to the host and written by safetensors (page cache, NVMe)
    "write_bytes_per_s": 1.5e9,
    # a checkpoint read from the page cache into ComfyUI's model, or moved to the GPU (host -> device)
    "load_bytes_per_s": 3.0e9,
    # dense bf16 GEMM work at a diffusion model's shapes: half the 790 TFLOP/s measured on 8192^3 products
    "flops_per_s": 4.0e14,
    # one method row of doctor/methods.py on the tiny SD3 after its world is up (CPU here: 0.1-0.5 s)
    "method_row_s": 1.5,
    # one attention-kernel check (a few ms each; a dozen backends x dtypes x layouts)
    "kernel_check_s": 0.5,
}


def _flux_params(depth: int, depth_single: int) -> float:
    """Flux.1 at hidden 3072: one double block 340M parameters, one single block 141M, plus 50M outside."""
    return 340e6 * depth + 141e6 * depth_single + 50e6


def _wan_params(dim: int, ffn_dim: int, num_layers: int) -> float:
    return num_layers * (4 * dim * dim * 2 + 2 * dim * ffn_dim) + 0.4e9


def predict(suite) -> dict:
    """{section: predicted seconds} on an H100 for the full (non-reduced) suite whose constants `suite` holds."""
    r = RATES
    out = {}
    # session: two Flux models written (experts), one process, a world, ~10 prompts of 2 steps at 64x64
    fam, kw, latent, _, steps, _ = suite.session_full()
    p = _flux_params(kw["depth"], kw["depth_single"])
    tokens = (latent[-1] // 2) * (latent[-2] // 2) + 256
    out["session"] = 2 * p * 2 / r["write_bytes_per_s"] + r["process_s"] + r["world_s"] + \
        4 * p * 2 / r["load_bytes_per_s"] + 12 * steps * 2 * p * tokens / r["flops_per_s"] + 15.0  # + the warm wait
    # native: each model written once; per run two processes (KSampler; the pool at degree 1 with its world)
    native = 0.0
    for name, (fam, kw, latent, cond, steps) in suite.FULL_MODELS.items():
        p = _flux_params(kw["depth"], kw["depth_single"]) if fam == "flux" else _wan_params(**kw)
        stored = 2 if fam == "flux" else 1
        native += p * stored / r["write_bytes_per_s"]
        n = latent[-1] * latent[-2] // 4 * (latent[-3] if len(latent) == 5 else 1) + cond[0]
        for model, precision in suite.FULL_RUNS:
            if model != name:
                continue
            step = 2 * p * n / r["flops_per_s"]
            ks = r["process_s"] + p * stored / r["load_bytes_per_s"] + (2 * steps + 3) * step
            pool = ks + r["world_s"] + p * stored / r["load_bytes_per_s"]
            native += ks + pool
    out["native"] = native
    # quant: one Flux block of each kind in 6 layouts, one process, one world
    p = _flux_params(1, 1)
    out["quant"] = 7 * p * 2 / r["write_bytes_per_s"] + r["process_s"] + r["world_s"] + \
        6 * (2 * p / r["load_bytes_per_s"] + 2.0)
    # methods: the meshes of world <= 2 in the GPU's precisions, one world per mesh (kept across precisions)
    meshes, precisions = suite.full_methods()
    out["methods"] = r["process_s"] + meshes * r["world_s"] + meshes * precisions * r["method_row_s"]
    out["kernels"] = 24 * r["kernel_check_s"] + 5.0
    return {k: round(v, 1) for k, v in out.items()}


def table(pred: dict) -> str:
    lines = [f"{'section':<10} {'predicted s':>12}"] + [f"{k:<10} {v:>12.1f}" for k, v in pred.items()]
    lines.append(f"{'total':<10} {sum(pred.values()):>12.1f}   (budget {BUDGET_S} s: one command, a rerun beside it)")
    return "\n".join(lines)
