"""What a carried patch costs on the pool, beside what it costs ComfyUI, and how fast a refusal comes back.

Why: a carried patch must not make the pool slower relative to KSampler than the plain graph is (the workers switch
hook weights per cond batch, skip blocks in Skip Layer Guidance's extra call, inject a bypass LoRA around each call).
One real server, the tiny SD3 (width 256, 4 joint blocks) at 512 x 512 (1024 image tokens), 4 steps, cfg 4: each
kind of graph runs under KSampler and through Parallel Model at ulysses 2, warm (its first run discarded), `--runs`
times interleaved; the table gives the medians and pool / KSampler beside the plain graph's ratio. Then a graph the
pack refuses (a patch inside the model): the time from the post to the error and whether any worker process started.

    python bench/bench_graphs.py [--runs 3] [--quick]
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent / "tests" / "server_e2e")]
sys.path.insert(0, str(HERE))

W = H = 512
STEPS = 4
LORA = "tiny_lora.safetensors"
KINDS = ("plain", "hook", "hook_keyframes", "slg", "bypass")


def _kind(kind: str) -> dict:
    """The model_nodes / cond_nodes of test_every_graph's graph for one kind."""
    from test_every_graph import SLG, _hooked_positive
    if kind == "hook":
        return {"cond_nodes": _hooked_positive(keyframes=False)}
    if kind == "hook_keyframes":
        return {"cond_nodes": _hooked_positive(keyframes=True)}
    if kind == "slg":
        return {"model_nodes": {"20": SLG}}
    if kind == "bypass":
        return {"model_nodes": {"20": {"class_type": "LoraLoaderBypassModelOnly",
                                       "inputs": {"lora_name": LORA, "strength_model": 0.8}}}}
    return {}


def _graph(kind: str, tag: str, degrees, seed: int) -> dict:
    import test_every_graph as t
    t.W, t.H = W, H
    g = t._graph(tag, degrees, "model", steps=STEPS, **_kind(kind))
    g["5"]["inputs"]["seed"] = seed  # another seed each run, or ComfyUI returns its cached latent
    return g


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="one run per kind (bench/results/graphs_quick)")
    args = p.parse_args(argv)
    runs = 1 if args.quick else args.runs
    from _worlds import timed_prompt, write_results
    from comfy_env import setup_comfy
    from comfy_server import ComfyServer, write_checkpoints
    from conftest import _write_tiny_lora
    comfy_dir = setup_comfy()
    base = Path(tempfile.mkdtemp(prefix="hp-graphs-"))
    server = ComfyServer(comfy_dir, base)
    write_checkpoints(base, ("sd3",))
    _write_tiny_lora(base / "models" / "loras" / LORA)
    server.start()
    rows = []
    try:
        seed = 100
        for kind in KINDS:  # warm-up: each kind's first prompt on each side (loads, world start) not measured
            for degrees in (None, {"ulysses_degree": 2}):
                seed += 1
                timed_prompt(server, _graph(kind, f"w_{kind}_{seed}", degrees, seed))
        times = {(k, side): [] for k in KINDS for side in ("ksampler", "pool")}
        for _ in range(runs):
            for kind in KINDS:
                for side, degrees in (("ksampler", None), ("pool", {"ulysses_degree": 2})):
                    seed += 1
                    times[(kind, side)].append(timed_prompt(server, _graph(kind, f"r_{kind}_{seed}", degrees, seed)))
        for kind in KINDS:
            ks, pool = statistics.median(times[(kind, "ksampler")]), statistics.median(times[(kind, "pool")])
            rows.append({"kind": kind, "ksampler_s": round(ks, 3), "pool_u2_s": round(pool, 3),
                         "ratio": round(pool / ks, 3), "runs": runs})
        # a refused graph: from the post to the error, and no worker started for it
        from test_every_graph import _graph as graph
        server.post("/free", {"unload_models": True, "free_memory": True})
        before = set(server.worker_pids())
        tome = {"class_type": "TomePatchModel", "inputs": {"ratio": 0.3}}
        t = time.perf_counter()
        entry = server.run(graph("refused", {"cfg_degree": 2}, "model", model_nodes={"20": tome}))
        took = time.perf_counter() - t
        assert entry["status"]["status_str"] == "error", entry["status"]
        started = sorted(set(server.worker_pids()) - before)
        rows.append({"kind": "refused (TomePatchModel, cfg 2: a world not running)", "refusal_s": round(took, 3),
                     "workers_started": len(started)})
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    plain = next(r["ratio"] for r in rows if r["kind"] == "plain")
    lines = [f"# Carried patches on the pool vs KSampler (tiny SD3, {W}x{H}, {STEPS} steps, cfg 4, ulysses 2 on a "
             f"CPU, warm, median of {runs})", "",
             "| graph | KSampler (s) | pool u2 (s) | pool / KSampler | plain graph's ratio |", "|---|---|---|---|---|"]
    for r in rows:
        if "ratio" in r:
            lines.append(f"| {r['kind']} | {r['ksampler_s']} | {r['pool_u2_s']} | {r['ratio']:.2f}x | {plain:.2f}x |")
    refusal = rows[-1]
    lines += ["", f"Refused graph: error after {refusal['refusal_s']:.2f} s from the post (the whole prompt, ComfyUI's "
              f"own nodes included), {refusal['workers_started']} worker processes started for it."]
    print("\n".join(lines))
    write_results("graphs_quick" if args.quick else "graphs", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
