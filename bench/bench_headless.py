"""Headless API prompts in a real ComfyUI server, side by side with KSampler: what a script (or a Docker service)
that never opens the frontend pays for the pool's first prompt on a model ComfyUI already holds.

Why: nobody opens the workflow, so the frontend's /warm (spares + the workflow's world, started while the user edits)
never comes. Each run is a fresh server (as after a restart), the script posts at once, as soon as ComfyUI answers:
KSampler's prompt (its first: the checkpoint load and sampling), the same prompt again (KSampler warm), then the same
graph through Parallel Config (ulysses 2) -> Hybrid Sampler - the pool's first prompt, on the model ComfyUI loaded.
Client-side wall time from the post to /history's completion. Modes:

- queued:   the default (nothing before use): the prompt's world starts when it is queued (on-prompt handler).
- restarted: nothing set, a ComfyUI restarted after it ran the pool's prompt once (its user directory kept, as a
             Docker volume or a service restart keeps it): the world that prompt asked for starts with ComfyUI.
- prestart: HP_PRESTART names the API prompt file: the spares and its world start with ComfyUI.
- simple:   as queued, on README's first path: Parallel GPUs ("split the image", every device) -> Parallel Model in
            front of ComfyUI's own KSampler, instead of Parallel Config -> Hybrid Sampler.

Flux.1 in ComfyUI's format (hidden 3072: 1 double + 1 single block, 531M, bf16 file computed in fp32 on the CPU),
2 steps at 256 x 256 (a 32 x 32 latent), cfg 1; latents saved, no decode (the same on both sides).

    python bench/bench_headless.py [--runs 3] [--quick] [--modes queued,simple]
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE))

MODES = ("queued", "restarted", "prestart", "simple")
QUEUED = ("queued", "simple")  # nothing before the pack's first prompt


def _graph(degrees, tag: str, seed: int = 42) -> dict:
    from comfy_server import workflow
    g = workflow(degrees, tag, 256, 256, steps=2, cfg=1.0, family="flux")
    for k in ("7", "8", "11"):  # no decode: sampling only, the latent saved
        g.pop(k, None)
    g["5"]["inputs"]["seed"] = seed  # a warm prompt: another seed, or ComfyUI returns its cached latent
    return g


def _simple_graph(tag: str, seed: int = 42) -> dict:
    """KSampler's graph with its MODEL through Parallel GPUs -> Parallel Model (README's first path)."""
    g = _graph(None, tag, seed)
    g["9"] = {"class_type": "HybridParallelGPUs", "inputs": {"devices": "all", "preset": "split the image"}}
    g["40"] = {"class_type": "HybridParallelModel", "inputs": {"model": g["5"]["inputs"]["model"],
                                                               "parallel_config": ["9", 0]}}
    g["5"]["inputs"]["model"] = ["40", 0]
    return g


def _pool_graph(mode: str, tag: str, seed: int = 42) -> dict:
    return _simple_graph(tag, seed) if mode == "simple" else _graph({"ulysses_degree": 2}, tag, seed)


def one_run(mode: str, comfy_dir) -> dict:
    from _worlds import timed_prompt
    from comfy_server import ComfyServer, write_checkpoints, write_flux_checkpoint
    from comfyui_hybrid_parallel.workers.forkserver import default_count
    base = Path(tempfile.mkdtemp(prefix=f"hp-headless-{mode}-"))
    env = {}
    if mode == "prestart":
        path = base / "prompt_api.json"
        path.write_text(json.dumps({"prompt": _graph({"ulysses_degree": 2}, "u2")}))
        env["HP_PRESTART"] = str(path)
    write_checkpoints(base, ("sd3",))  # its VAE file is the graph's (not decoded)
    write_flux_checkpoint(base)
    if mode == "restarted":  # the life before the restart: the pool's prompt once
        before = ComfyServer(comfy_dir, base, spares=default_count(), env=env)
        before.start()
        try:
            timed_prompt(before, _graph({"ulysses_degree": 2}, "u2_before", seed=41))
        finally:
            before.stop()
    server = ComfyServer(comfy_dir, base, spares=default_count(), env=env)
    server.start()
    try:
        row = {"mode": mode, "ksampler_first_s": round(timed_prompt(server, _graph(None, "ks1")), 3),
               "ksampler_warm_s": round(timed_prompt(server, _graph(None, "ks2", seed=43)), 3)}
        # nothing set and no prompt of the pack's nodes yet: not one process of the pack's
        row["processes_before_pool_prompt"] = len(server.fork_server_pids()) + len(server.worker_pids())
        if mode in QUEUED and row["processes_before_pool_prompt"]:
            raise RuntimeError(f"a server whose prompts held none of the pack's nodes started "
                               f"{row['processes_before_pool_prompt']} process(es) of the pack")
        row.update({"pool_u2_first_s": round(timed_prompt(server, _pool_graph(mode, "u2")), 3),
                    "pool_u2_warm_s": round(timed_prompt(server, _pool_graph(mode, "u2b", seed=44)), 3)})
        status = server.get("/hybrid_parallel/pool")
        row["prestarted"] = (status.get("prestart") or {}).get("mesh")
        # the workers ran the pool's prompts (2 steps each, cfg 1: one model call a step), not ComfyUI's process
        row["pool_model_calls"] = sum(int(w.get("model_calls", 0)) for w in status.get("workers") or []
                                      if w.get("rank") == 0)
        if row["pool_model_calls"] < 4:
            raise RuntimeError(f"the pool's workers served {row['pool_model_calls']} model calls, not the 4 steps of "
                               f"its two prompts")
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)  # 1.4 GB of checkpoints per run
    row["ratio_first"] = round(row["pool_u2_first_s"] / row["ksampler_first_s"], 3)
    row["ratio_vs_ksampler_warm"] = round(row["pool_u2_first_s"] / row["ksampler_warm_s"], 3)
    print("ROW " + json.dumps(row), flush=True)
    return row


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run of each mode (bench/results/headless_quick)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - set(MODES) or not set(modes) & set(QUEUED):
        p.error(f"--modes: a comma-separated list of {', '.join(MODES)} holding queued or simple")
    if args.quick:
        args.runs = 1
    from _worlds import write_results
    from comfy_env import setup_comfy
    comfy_dir = setup_comfy()
    rows = [one_run(mode, comfy_dir) for _ in range(args.runs) for mode in modes]  # interleaved: same load
    lines = ["# Headless API prompts in a real ComfyUI (fresh server per run, Flux 531M fp32 on CPU, ulysses 2)", "",
             "| mode | KSampler first (s) | KSampler warm (s) | pool u2 first (s) | pool u2 warm (s) | "
             "pool first / KSampler first (median, range) | pool first / KSampler first undisturbed |",
             "|---|---|---|---|---|---|---|"]
    # with HP_PRESTART the ranks start beside KSampler's first prompt (same cores) and slow it: the pool's first is
    # also compared with KSampler's first where nothing else starts (the queued and simple runs' median)
    undisturbed = statistics.median(r["ksampler_first_s"] for r in rows if r["mode"] in QUEUED)
    for mode in modes:
        rs = [r for r in rows if r["mode"] == mode]

        def med(k):
            return round(statistics.median(r[k] for r in rs), 3)
        ratios = [r["ratio_first"] for r in rs]
        lines.append(f"| {mode} | {med('ksampler_first_s')} | {med('ksampler_warm_s')} | {med('pool_u2_first_s')} | "
                     f"{med('pool_u2_warm_s')} | {statistics.median(ratios):.2f}x ({min(ratios):.2f} - "
                     f"{max(ratios):.2f}) | **{med('pool_u2_first_s') / undisturbed:.2f}x** |")
    lines += ["", "queued: nothing set, a ComfyUI that never ran the pack - the world starts when the prompt is queued. "
              "restarted: nothing set, the same ComfyUI restarted after one pool prompt - the world its last prompt "
              "asked for starts with it. prestart: HP_PRESTART=<the API prompt file>, the spares and that world start "
              "with ComfyUI. simple: as queued, through Parallel GPUs -> Parallel Model -> KSampler (README's first "
              "path) instead of Parallel Config -> Hybrid Sampler. Each run a fresh server (restarted: its second "
              "life), the modes interleaved.", "",
              "Processes of the pack on a queued or simple server after its two KSampler prompts (none of the pack's "
              "nodes): "
              f"{sorted({r['processes_before_pool_prompt'] for r in rows if r['mode'] in QUEUED})} over the runs."]
    print("\n".join(lines))
    write_results("headless_quick" if args.quick else "headless", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
