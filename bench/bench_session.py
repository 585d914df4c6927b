"""A real session, side by side with KSampler: what switching and holding cost, not one prompt on a resident model.

Why: people switch LoRA strengths, go back and forth between KSampler and the pool, alternate two experts, and
leave ComfyUI running. Each scenario runs in a fresh process (as after a ComfyUI restart), KSampler's side and the
pool's side in the same process, on ComfyUI's own Flux.1 (hidden 3072: 1 double + 1 single block, 531M; --big: 3 +
3, 1.5B) in fp32 (ComfyUI's default on a CPU), 2 steps on a 32x32 latent:

- lora:   a rank-16 LoRA on every attention qkv and MLP of the model, strength 0.5 then 0.8: the second prompt's
          time (the switch) - KSampler re-patches its copy, the pool moves only the patch (bytes shown).
- switch: the same graph with KSampler, then with Hybrid Sampler (ulysses 2, and 4): the pool's first prompt on a
          model ComfyUI already holds, cold and with the workflow opened first (/warm: the spares and its world),
          against KSampler's first prompt (three fresh processes: medians and ranges; the LoRA scenario too).
- experts: two models (a Wan 2.2-like high / low pair: two Flux 531M with different weights) alternating for 3
          prompts of 1 step each: loads per prompt (a reload would show), seconds per prompt.
- memory: host memory (PSS of ComfyUI's process, its workers and the pool's files) after a prompt, against the
          weight bytes, for KSampler alone and the pool at N = 2 and 4: what the pool adds beyond ComfyUI's copy.

    python bench/bench_session.py [--big] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(HERE))

SIZES = {"531M": (1, 1), "1.5B": (3, 3)}
SPARES_HEAD_START_S = 8.0  # the workflow is opened (spares, its world) well before a prompt switches samplers
SWITCH_RUNS = 3


def _checkpoint(size: str, seed: int) -> str:
    from comfy_env import setup_comfy
    setup_comfy()
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = ROOT / "build" / "bench-ckpt" / f"flux_{size}_s{seed}.safetensors"
    if not path.exists():
        depth, single = SIZES[size]
        tc.write_flux(path, depth=depth, depth_single=single, seed=seed)
    return str(path)


def _lora(dm, rank: int = 16, seed: int = 3) -> dict:
    """A LoRA in ComfyUI's generic format on every Linear of the blocks (qkv, proj, MLP)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, mod in dm.named_modules():
        if isinstance(mod, torch.nn.Linear) and ("blocks." in name) and "mod" not in name:
            k = f"diffusion_model.{name}"
            sd[f"{k}.lora_up.weight"] = torch.randn(mod.out_features, rank, generator=g) * 0.02
            sd[f"{k}.lora_down.weight"] = torch.randn(rank, mod.in_features, generator=g) * 0.02
    return sd


def _comfy():
    from bench_native import _comfy_nodes
    return _comfy_nodes()


def _pss(pid: int) -> int:
    from bench_native import _pss as pss
    return pss(pid)


def _hp(ranks: int):
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    return ParallelConfigNode().build(dp_degree=1, cfg_degree=1, ulysses_degree=ranks, ring_degree=1, pp_degree=1,
                                      num_pipeline_patch=0, warmup_steps=1, tp_degree=1, method="usp",
                                      device="cpu", attention="auto")["result"][0]


def _inputs():
    import torch
    g = torch.Generator().manual_seed(0)
    cond = [[torch.randn(1, 7, 32, generator=g), {"pooled_output": torch.randn(1, 24, generator=g), "guidance": 3.5}]]
    return cond, {"samples": torch.zeros(1, 16, 32, 32)}


def child(args) -> dict:
    import torch
    comfy_nodes = _comfy()
    import comfy.sd
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    cond, latent = _inputs()
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    # as in a server: Parallel Config shares the runtime, so it prestarts the workers before the sampler runs
    runtime = HybridSampler.runtime = ParallelConfigNode.runtime = Runtime()
    steps = 2

    def ks(model, n=steps):
        with torch.inference_mode():
            t = time.perf_counter()
            comfy_nodes.common_ksampler(model, 1, n, 1.0, "euler", "simple", cond, cond, latent)
            return time.perf_counter() - t

    def hy(model, ranks, n=steps):
        with torch.inference_mode():
            t = time.perf_counter()
            HybridSampler().sample(model, 1, n, 1.0, "euler", "simple", cond, cond, latent, _hp(ranks))
            return time.perf_counter() - t
    row = {"scenario": args.scenario, "size": args.size}
    base = comfy.sd.load_diffusion_model(args.ckpt)
    weight_bytes = sum(v.numel() * v.element_size() for v in base.model.diffusion_model.state_dict().values())
    row["weight_bytes"] = weight_bytes
    try:
        if args.scenario == "lora":
            lora = _lora(base.model.diffusion_model)
            m1, m2 = (comfy.sd.load_lora_for_models(base, None, lora, s, 0)[0] for s in (0.5, 0.8))
            ks(m1)  # warm at the first strength
            row["ksampler_switch_s"] = round(ks(m2), 3)
            hy(m1, 2)
            row["pool_switch_s"] = round(hy(m2, 2), 3)
            row["pool_switch_bytes"] = runtime._pool.last_load_bytes
            from comfyui_hybrid_parallel.workers.bridge.patches import encode
            from comfyui_hybrid_parallel.workers.transport import nbytes
            row["patch_bytes"] = nbytes(encode(m2.patches)[1])
        elif args.scenario == "switch":
            row["ksampler_first_s"] = round(ks(base), 3)
            row["ksampler_warm_s"] = round(ks(base), 3)
            for n in (2, 4):
                runtime.stop()
                row[f"pool_u{n}_first_s"] = round(hy(base, n), 3)
            for n in (2, 4):  # the product's case: the workflow was opened first - /warm with its Parallel Config
                runtime.stop()  # started the spares and that world from them, as the route does
                from comfyui_hybrid_parallel.workers.driver.routes import node_config
                runtime.warm(n, node_config("HybridParallelConfig", {"ulysses_degree": n, "device": "cpu"}))
                time.sleep(SPARES_HEAD_START_S)
                row[f"pool_u{n}_spares_first_s"] = round(hy(base, n), 3)
        elif args.scenario == "experts":
            other = comfy.sd.load_diffusion_model(args.ckpt2)
            row["ksampler_s"] = [round(ks(m, 1), 3) for m in (base, other) * 3]
            times, loads = [], []
            for m in (base, other) * 3:
                times.append(round(hy(m, 2, 1), 3))
                loads.append(runtime._pool.health()[0]["loads"])
            row["pool_s"], row["pool_loads_after_each"] = times, loads
        elif args.scenario == "memory":
            before = _pss(os.getpid())
            if args.ranks == 0:
                ks(base)
                row["host_bytes"] = _pss(os.getpid())
            else:
                hy(base, args.ranks)
                from comfyui_hybrid_parallel.workers.bridge.host import trim_host_heap
                trim_host_heap()
                pool = runtime._pool
                from comfyui_hybrid_parallel.workers.transport import shm_dir
                files = sum(os.path.getsize(os.path.join(shm_dir(), n)) for n in os.listdir(shm_dir())
                            if n.startswith(pool.shm_prefix))
                row["host_bytes"] = (_pss(os.getpid()) + sum(_pss(p.pid) for p in pool.world.procs) + files
                                     + (_pss(pool.fork_server_pid) if pool.fork_server_pid else 0))
            row["ranks"], row["process_before_bytes"] = args.ranks, before
    finally:
        runtime.stop()
    print("ROW " + json.dumps(row), flush=True)
    return row


def _median_switch(runs: list) -> dict:
    """The switch rows' median times, and each ratio as "median (min - max)" of the per-run ratios (each run's pool
    side against that run's own KSampler first prompt)."""
    import statistics
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0] if k.endswith("_s")}
    for label, key in (("u2", "pool_u2_first_s"), ("u4", "pool_u4_first_s"), ("u2_spares", "pool_u2_spares_first_s"),
                       ("u4_spares", "pool_u4_spares_first_s")):
        ratios = [r[key] / r["ksampler_first_s"] for r in runs]
        out[f"ratio_{label}"] = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} - {max(ratios):.2f})"
    return out


def _median_lora(runs: list) -> dict:
    """The LoRA rows' median times and the pool / KSampler switch ratio as "median (min - max)" over the runs."""
    import statistics
    out = {**runs[0], **{k: round(statistics.median(r[k] for r in runs), 3) for k in ("ksampler_switch_s",
                                                                                      "pool_switch_s")}}
    ratios = [r["pool_switch_s"] / r["ksampler_switch_s"] for r in runs]
    out["ratio"] = f"{statistics.median(ratios):.2f}x ({min(ratios):.2f} - {max(ratios):.2f})"
    return out


def _run(scenario, size, ckpt, ckpt2=None, ranks=0) -> dict:
    cmd = [sys.executable, str(Path(__file__)), "--child", "--scenario", scenario, "--size", size, "--ckpt", ckpt,
           "--ranks", str(ranks)] + (["--ckpt2", ckpt2] if ckpt2 else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "HP_STRICT_COMM": "0"})
    rows = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]
    if res.returncode or not rows:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    print(rows[0], flush=True)
    return rows[0]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="the 1.5B model too (memory scenario)")
    ap.add_argument("--quick", action="store_true", help="accepted for run_all: the session runs are short already")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scenario"), ap.add_argument("--size"), ap.add_argument("--ckpt"), ap.add_argument("--ckpt2")
    ap.add_argument("--ranks", type=int, default=0)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return
    from _worlds import write_results
    ckpt, ckpt2 = _checkpoint("531M", 5), _checkpoint("531M", 6)
    # the switch is short and this VM's timings move by 10-15 %: three fresh processes, each side by side
    switches = [_run("switch", "531M", ckpt) for _ in range(SWITCH_RUNS)]
    loras = [_run("lora", "531M", ckpt) for _ in range(SWITCH_RUNS)]
    rows = [*loras, *switches, _run("experts", "531M", ckpt, ckpt2)]
    for size in ["531M"] + (["1.5B"] if args.big else []):
        c = ckpt if size == "531M" else _checkpoint(size, 5)
        for n in (0, 2, 4):
            rows.append(_run("memory", size, c, ranks=n))
    by = {r["scenario"]: r for r in rows if r["scenario"] != "memory"}
    ex = by["experts"]
    sw, lo = _median_switch(switches), _median_lora(loras)
    mib = 2 ** 20
    lines = ["# A real session, side by side with KSampler (this VM, CPU, Flux.1 in ComfyUI's format, fp32)", "",
             "| scenario | KSampler | Hybrid Sampler | note |", "|---|---|---|---|",
             f"| LoRA strength 0.5 -> 0.8, next prompt (s, median of {len(loras)} runs) | {lo['ksampler_switch_s']} | "
             f"{lo['pool_switch_s']} (u2) | ratio {lo['ratio']}; moved {lo['pool_switch_bytes'] / mib:.1f} MiB = the "
             f"patch ({lo['patch_bytes'] / mib:.1f} MiB), weights {lo['weight_bytes'] / mib:.0f} MiB |",
             f"| KSampler -> pool, first prompt on a loaded model (s, median of {len(switches)} runs) | "
             f"{sw['ksampler_first_s']} (its own first; warm {sw['ksampler_warm_s']}) | u2 {sw['pool_u2_first_s']}, u4 "
             f"{sw['pool_u4_first_s']}; the workflow opened first (/warm: spares + its world): u2 "
             f"{sw['pool_u2_spares_first_s']}, u4 {sw['pool_u4_spares_first_s']} | ratio (median, per run) cold u2 "
             f"{sw['ratio_u2']}, u4 {sw['ratio_u4']}; opened first u2 {sw['ratio_u2_spares']}, u4 "
             f"{sw['ratio_u4_spares']} |",
             f"| two experts alternating, 1 step each (s per prompt) | {ex['ksampler_s']} | {ex['pool_s']} | pool loads "
             f"after each prompt {ex['pool_loads_after_each']} (2 = each expert loaded once) |", "",
             "Host memory after a prompt (PSS of ComfyUI's process + workers + the pool's files):", "",
             "| model | sampler | host MiB | beyond KSampler (x weights) |", "|---|---|---|---|"]
    for size in ["531M"] + (["1.5B"] if args.big else []):
        mem = {r["ranks"]: r for r in rows if r["scenario"] == "memory" and r["size"] == size}
        ref = mem[0]["host_bytes"] - mem[0]["process_before_bytes"]
        for n, r in sorted(mem.items()):
            host = r["host_bytes"] - r["process_before_bytes"]
            label = "KSampler" if n == 0 else f"Hybrid u{n}"
            lines.append(f"| Flux {size} | {label} | {host / mib:.0f} | {(host - ref) / r['weight_bytes']:.2f} |")
    write_results("session", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
