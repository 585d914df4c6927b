"""The GPU suite's `session` section: what a real ComfyUI session costs on the device, side by side with KSampler.

Why here and not only in bench/bench_session.py: residency by bytes, the memory given back on "Unload models", a
rank sharing ComfyUI's GPU (ComfyUI's models there freed first), patches applied to a GPU copy - these are CUDA paths
that CPU tests only show with ComfyUI's model management stubbed. One fresh ComfyUI process runs, on ComfyUI's own
Flux (random weights; `--reduced`: the tiny SD3 on CPU ranks, as CI runs it):

- switch: KSampler's first prompt on a model ComfyUI holds, then the pool's first prompt after the workflow was
  opened (/warm: the spares and its world), ratio; the pool's warm prompt.
- lora: a LoRA's strength 0.5 -> 0.8, the next prompt's time, KSampler and the pool; the bytes that moved and the
  keys rewritten in place.
- experts: two models alternating (Wan 2.2's high / low pair) for 4 prompts: the pool's loads after each (no reload
  when both fit), the device's used memory.
- beside ComfyUI: ComfyUI's models loaded on the device before and after the pool's first load (a rank that shares
  ComfyUI's GPU frees them first, through ComfyUI's model management).
- release: "Unload models" (ComfyUI's unload_all_models, which the pack follows): the ranks' allocator bytes (GPU) or
  RSS (CPU) before and after.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# family, builder kwargs, latent shape, conditioning (tokens, width, pooled width), steps, ranks
FULL = ("flux", dict(depth=2, depth_single=4), (1, 16, 64, 64), (256, 32, 24), 2, 1)
REDUCED = ("sd3", dict(depth=2, pos_embed_max_size=32), (1, 16, 24, 24), (7, 32, 24), 2, 2)


def _device_used(cuda: bool):
    if not cuda:
        return None
    import torch
    free, total = torch.cuda.mem_get_info(0)
    return total - free


def session_child(ckpts: list, reduced: bool, cuda: bool) -> dict:
    import torch
    from gpu_suite import _comfy, pool_nodes, rel as rel_latent, sampler_inputs
    comfy_nodes = _comfy(cuda)
    import comfy.model_management as mm
    import comfy.sd
    from comfyui_hybrid_parallel.doctor.machine import dynamic_vram_on
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    from comfyui_hybrid_parallel.workers.driver.routes import node_config
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    family, _, latent_shape, conditioning, steps, ranks = REDUCED if reduced else FULL
    cond, latent = sampler_inputs(family, latent_shape, conditioning)
    widgets = {"ulysses_degree": ranks, "device": "cuda" if cuda else "cpu"}
    runtime, hp = pool_nodes(cuda, **widgets)
    runtime.follow_comfy_unload()  # as the pack does in a server: ComfyUI's unload releases the workers' models

    outs = {}  # the latents each scenario produced: the pool's are compared with KSampler's

    def ks(model, n=steps, keep=None):
        with torch.inference_mode():
            t = time.perf_counter()
            out = comfy_nodes.common_ksampler(model, 1, n, 1.0, "euler", "simple", cond, cond, latent)[0]
            if keep:
                outs[keep] = out["samples"]
            return round(time.perf_counter() - t, 3)

    def hy(model, n=steps, keep=None):
        with torch.inference_mode():
            t = time.perf_counter()
            out = HybridSampler().sample(model, 1, n, 1.0, "euler", "simple", cond, cond, latent, hp)[0]
            if keep:
                outs[keep] = out["samples"]
            return round(time.perf_counter() - t, 3)

    def rel(x, y):
        return rel_latent(outs[x], outs[y])
    a, b = (comfy.sd.load_diffusion_model(str(c)) for c in ckpts)
    row = {"family": family, "ranks": ranks, "device": "cuda" if cuda else "cpu", "dynamic_vram": dynamic_vram_on(),
           "patcher": type(a).__name__,
           "weight_bytes": sum(v.numel() * v.element_size() for v in a.model.diffusion_model.state_dict().values())}
    try:
        # switch: KSampler first, then the pool after the workflow was opened (its world started meanwhile)
        row["ksampler_first_s"], row["ksampler_warm_s"] = ks(a, keep="ks"), ks(a)
        row["comfy_models_before"] = len(mm.current_loaded_models)
        row["device_used_before"] = _device_used(cuda)
        runtime.warm(ranks, node_config("HybridParallelConfig", widgets))
        time.sleep(8.0)
        row["pool_first_s"], row["pool_warm_s"] = hy(a, keep="hy"), hy(a)
        row["hybrid_rel"] = rel("hy", "ks")
        (pm,) = ParallelModel().patch(a, hp)  # Parallel Model: KSampler itself on the pool's MODEL
        row["parallel_model_s"] = ks(pm, keep="pm")
        row["parallel_model_rel"] = rel("pm", "ks")
        row["comfy_models_after"] = len(mm.current_loaded_models)  # a rank on ComfyUI's GPU freed ComfyUI's first
        row["switch_ratio"] = round(row["pool_first_s"] / row["ksampler_first_s"], 3)
        # lora: strength 0.5 -> 0.8
        from bench_session import _lora  # a LoRA on every Linear of the blocks, ComfyUI's generic format
        lora = _lora(a.model.diffusion_model, rank=8)
        m1, m2 = (comfy.sd.load_lora_for_models(a, None, lora, s, 0)[0] for s in (0.5, 0.8))
        ks(m1)
        row["ksampler_lora_switch_s"] = ks(m2, keep="ks_lora")
        hy(m1)
        row["pool_lora_switch_s"] = hy(m2, keep="hy_lora")
        row["lora_rel"] = rel("hy_lora", "ks_lora")
        row["lora_moved_bytes"] = runtime._pool.last_load_bytes
        row["lora_keys_rewritten"] = runtime._pool.last_load.get("pages_rewritten")
        row["lora_ratio"] = round(row["pool_lora_switch_s"] / row["ksampler_lora_switch_s"], 3)
        # experts: a and b alternating, 1 step each
        loads, used, times = [], [], []
        start = runtime.health()[0]["loads"]
        for m in (a, b) * 2:
            times.append(hy(m, 1))
            loads.append(runtime.health()[0]["loads"] - start)  # 1 then 2, then no more: each expert loaded once
            used.append(_device_used(cuda))
        row["experts_s"], row["experts_loads"], row["experts_device_used"] = times, loads, used
        # release: ComfyUI's own unload (its /free, "Unload models") releases the ranks' models
        before = runtime.health()
        mm.unload_all_models()
        after = runtime.health()
        key = "device_reserved_bytes" if cuda else "rss_bytes"
        row["release_before"] = [r.get(key) for r in before]
        row["release_after"] = [r.get(key) for r in after]
        row["resident_after_release"] = [r.get("resident") for r in after]
    finally:
        runtime.stop()
    return row


def run_session(cuda: bool, reduced: bool, folder: Path) -> list:
    import torch
    from gpu_suite import _comfy
    _comfy(cuda)  # the checkpoint writers build ComfyUI's own classes
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    family, kwargs, *_ = REDUCED if reduced else FULL
    writer = {"flux": tc.write_flux, "sd3": tc.write_sd3}[family]
    dtype = torch.float32 if reduced else torch.bfloat16
    ckpts = []
    for seed in (5, 6):  # two models of the same shape: Wan 2.2's two experts
        path = folder / f"session_{family}_{seed}.safetensors"
        if not path.exists():
            writer(path, seed=seed, dtype=dtype, **({"device": "cuda"} if cuda and family == "flux" else {}), **kwargs)
        ckpts.append(str(path))
    cmd = [sys.executable, str(Path(__file__)), "--child", json.dumps(ckpts)] + (["--reduced"] if reduced else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=str(HERE.parent))
    got = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]
    if res.returncode or not got:
        return [{"error": (res.stdout[-1500:] + res.stderr[-3000:]).strip()}]
    print(got[0], flush=True)
    return got


def markdown(rows: list) -> list:
    """The report's lines for the session section."""
    lines = ["## A real session on the device, side by side with KSampler", ""]
    for r in rows:
        if "error" in r:
            lines += ["```", r["error"][-2000:], "```"]
            continue
        mib = 2 ** 20
        lines += [f"{r['family']} ({r['weight_bytes'] / 2**30:.2f} GiB of weights), {r['ranks']} rank(s) on "
                  f"{r['device']}; ComfyUI's patcher {r.get('patcher')} (DynamicVRAM "
                  f"{'on' if r.get('dynamic_vram') else 'off'}):", "",
                  "| scenario | KSampler | pool | note |", "|---|---|---|---|",
                  f"| first prompt on a model ComfyUI holds (workflow opened first) | {r['ksampler_first_s']} s | "
                  f"{r['pool_first_s']} s | {r['switch_ratio']}x; warm {r['ksampler_warm_s']} / {r['pool_warm_s']} s; "
                  f"Hybrid Sampler vs KSampler rel {r.get('hybrid_rel', float('nan')):.1e} |",
                  f"| Parallel Model -> KSampler | | {r.get('parallel_model_s')} s | vs KSampler rel "
                  f"{r.get('parallel_model_rel', float('nan')):.1e} |",
                  f"| LoRA strength 0.5 -> 0.8, next prompt | {r['ksampler_lora_switch_s']} s | "
                  f"{r['pool_lora_switch_s']} s | {r['lora_ratio']}x; moved {r['lora_moved_bytes'] / mib:.1f} MiB, "
                  f"{r['lora_keys_rewritten']} keys rewritten in place; vs KSampler rel "
                  f"{r.get('lora_rel', float('nan')):.1e} |",
                  f"| two experts alternating, 1 step | | {r['experts_s']} s | loads so far after each {r['experts_loads']}; "
                  f"device used {r['experts_device_used']} |",
                  f"| ComfyUI's models loaded, before / after the pool's first load | {r['comfy_models_before']} | "
                  f"{r['comfy_models_after']} | a rank sharing ComfyUI's GPU frees them first |",
                  f"| Unload models: ranks' {'allocator' if r['device'] == 'cuda' else 'RSS'} bytes before / after | "
                  f"{r['release_before']} | {r['release_after']} | resident after: {r['resident_after_release']} |",
                  ""]
    return lines


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", action="store_true")
    ap.add_argument("ckpts", nargs="?")
    ap.add_argument("--reduced", action="store_true")
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import torch
    print("ROW " + json.dumps(session_child(json.loads(a.ckpts), a.reduced,
                                            torch.cuda.is_available() and not a.reduced)), flush=True)
