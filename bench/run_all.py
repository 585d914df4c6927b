"""The whole benchmark suite in one command: every section, then one summary table and the plots.

    python -m bench.run_all [--quick] [--only SECTION[,SECTION]]     (or: bash bench/run.sh ...)

Why each section runs as its own subprocess (the scripts in bench/): a hang or
crash in one section is reported and the others still run; each starts with a
clean torch and a clean sys.path (ComfyUI's top-level `nodes` module must not
meet the pack's `nodes/`, which `python -m` from the repo root would put first);
and each script also runs alone. Sections write bench/results/<name>[_quick].json
with the machine that produced them (_worlds.machine_info); this script reads
them back, writes bench/results/summary[_quick].md / .json and the PNG plots
(bench/plots.py). With --only, the summary also includes the latest results of
the other sections, each with its own machine line.
Nothing here names a device: on CUDA the same scripts use NCCL and one GPU per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")

# name: (script, result files, extra args, timeout s (full run))
SECTIONS = {
    "comm": ("comm_volume.py", ["comm_volume"], [], 240),
    "transport": ("bench_transport.py", ["transport"], [], 120),
    "overhead": ("bench_overhead.py", ["overhead"], [], 300),
    "scaling": ("bench_scaling.py", ["scaling"], [], 300),
    "memory": ("bench_memory.py", ["memory"], [], 240),
    "vae": ("bench_vae_native.py", ["vae_native"], [], 1800),
    "native": ("bench_native.py", ["native"], [], 3600),
    "reliability": ("bench_reliability.py", ["reliability"], [], 900),
    "shard": ("bench_shard.py", ["shard"], [], 900),
    "stepcache": ("bench_stepcache.py", ["stepcache"], [], 1500),
    "peer": ("bench_ulysses_peer.py", ["ulysses_peer"], [], 600),
    "costmodel": ("bench_costmodel.py", ["costmodel"], [], 300),
    "auto": ("bench_auto.py", ["auto"], [], 1200),
    "quality": ("bench_quality.py", ["quality"], [], 1800),
    "session": ("bench_session.py", ["session"], [], 1800),
    "headless": ("bench_headless.py", ["headless"], [], 1200),
    "uneven": ("bench_uneven.py", ["uneven"], [], 600),
    "fbcache": ("bench_fbcache.py", ["fbcache"], [], 900),
    "in_place": ("bench_in_place.py", ["in_place"], [], 300),
}
TITLES = {
    "comm": "Communication volume per diffusion step (counters vs analytic)",
    "transport": "Transport: driver ↔ pool round trip per step",
    "overhead": "Degree-1 overhead: through the pool vs in-process",
    "scaling": "CPU scaling: 2 ranks × 1 thread vs 1 rank × 1 thread",
    "memory": "Memory per rank: TP and PipeFusion",
    "vae": "Memory per rank: Patch VAE Decode on ComfyUI's VAEs vs VAE Decode and VAE Decode (Tiled)",
    "native": "ComfyUI's own model on the workers: host memory and cold first prompt vs KSampler",
    "reliability": "Pool reliability in a real ComfyUI: interrupt, hung and killed ranks, stop, soak",
    "shard": "Weight sharding: per-rank weights, peak gathered, time per step vs unsharded",
    "stepcache": "Step caching across ranks (EasyCache's rule in the workers' loop): speedup and error vs no cache",
    "peer": "Ulysses vs diffusers' own context parallelism (Flux-like, 2 ranks × 1 thread)",
    "costmodel": "Cost model: CPU calibration, predicted vs measured here, PREDICTED s/step for Flux / Wan on 1-8 H100s",
    "auto": "Parallel Config degrees auto vs degree 1 through the nodes and pool: never slower?",
    "quality": "Stale methods and step caching on the trained demo model: PSNR / SSIM / latent error vs serial",
    "session": "A real session vs KSampler: LoRA switch, KSampler -> pool, two experts, host memory vs N",
    "headless": "Headless API prompts in a real server: the pool's first prompt vs KSampler's: never used, restarted, "
                "HP_PRESTART",
    "uneven": "Ranks of different speeds: even split vs split by probed speed",
    "fbcache": "First Block Cache (Comfy-WaveSpeed's rule) on the pool vs on one device: speed-up and exactness",
    "in_place": "The in-place check per prompt at 12-14B (ComfyUI's classes on the meta device)",
}


def _load(name: str, quick: bool):
    for n in ([f"{name}_quick", name] if quick else [name]):
        path = os.path.join(RESULTS, f"{n}.json")
        if os.path.exists(path):
            with open(path) as f:
                data = json.load(f)
            md_path = os.path.join(RESULTS, f"{n}.md")
            data["markdown"] = open(md_path).read() if os.path.exists(md_path) else ""
            data["file"] = n
            return data
    return None


def run_section(name: str, quick: bool) -> dict:
    script, _, extra, timeout = SECTIONS[name]
    args = [sys.executable, os.path.join(HERE, script)] + (["--quick"] if quick else []) + extra
    if quick and name == "vae":
        args += ["--worlds", "2"]
    print(f"== {name}: {' '.join(os.path.basename(a) for a in args[1:])}", flush=True)
    t = time.perf_counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    try:
        p = subprocess.run(args, cwd=os.path.dirname(HERE), env=env, timeout=timeout, capture_output=True, text=True)
        rc, tail = p.returncode, (p.stdout + p.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        rc, tail = "timeout", f"{name} ran past {timeout} s\n" + ((e.stdout or b"")[-2000:].decode(errors="replace")
                                                                   if isinstance(e.stdout, bytes) else str(e.stdout or ""))
    wall = time.perf_counter() - t
    print(f"   {name}: rc={rc} in {wall:.0f} s", flush=True)
    if rc != 0:
        print(tail, flush=True)
    return {"rc": rc, "wall_s": wall, "log_tail": tail if rc != 0 else ""}


def _meta_line(meta: dict) -> str:
    return (f"{meta.get('device')} · {meta.get('cpu')} · {meta.get('cores')} cores · torch {meta.get('torch')} · "
            f"{meta.get('backend')}{' · flash-attn ' + str(meta['flash_attn']) if meta.get('flash_attn') else ''} · "
            f"load avg {meta.get('load_avg_1m') or 0:.1f} · {meta.get('when')}")


def headline(data: dict) -> list:
    """One line per target of issue 10, from whatever sections have results (an older file format is skipped)."""
    try:
        return _headline(data)
    except (KeyError, TypeError, ValueError) as e:
        return [f"(headline unavailable: {type(e).__name__} {e}; rerun the sections)"]


def _headline(data: dict) -> list:
    out = ["| check | measured | target | machine |", "|---|---|---|---|"]

    def add(check, value, target, d):
        out.append(f"| {check} | {value} | {target} | {d['meta'].get('device')}, {d['meta'].get('cores')} cores |")

    d = data.get("comm")
    if d:
        rows = [r for r in d["rows"] if r.get("ratio")]
        lo, hi = min(r["ratio"] for r in rows), max(r["ratio"] for r in rows)
        add(f"comm bytes measured / analytic ({len(rows)} cases, N = "
            f"{','.join(str(n) for n in sorted({r['N'] for r in rows}))})", f"{lo:.4f} – {hi:.4f}", "within ±5 %", d)
        xs = [r["image_vs_xdit"] for r in rows if r.get("image_vs_xdit")]
        add("image-attention bytes / xDiT table·(N−1)/N", f"{min(xs):.3f} – {max(xs):.3f}", "≈ 1 (padding)", d)
    d = data.get("transport")
    if d:
        for r in d["rows"]:
            if r["bytes"] and ("Flux" in r["case"] or "Wan" in r["case"] or "SD3" in r["case"]) and "payload" not in r["case"]:
                add(f"transport: {r['case']}", f"{r['overhead_beyond_copy_ms']:.2f} ms beyond the copy", "≤ 1 ms", d)
    d = data.get("overhead")
    if d:
        for r in d["rows"]:
            added = (f"; the pool adds {r['added_us_per_step']:.0f} µs per step"
                     if r.get("added_us_per_step", 0) > 0 else "")
            add(f"degree-1 overhead, {r['model']} model, {r['comparison']} ({r['baseline_ms']:.0f} ms/step)",
                f"{r['ratio_median']:.3f}× (min {r['ratio_min']:.3f}×){added}", "≤ 1.02×", d)
    d = data.get("scaling")
    if d:
        targets = {"CFG": "≥ 1.85×", "DP": "≥ 1.85×", "Ulysses": "≥ 1.6×", "Ring": "≥ 1.6×"}
        for r in d["rows"]:
            add(f"CPU scaling {r['method']} (serial {r['serial_ms']:.0f} ms/step)",
                f"{r['speedup']:.2f}× ({100 * r['efficiency']:.0f} %)", targets.get(r["method"], "–"), d)
    d = data.get("memory")
    if d:
        for r in d["rows"]:
            add(f"{r['method']} degree {r['degree']}: params / activations per rank vs degree 1",
                f"{r['params_per_rank_MiB'] / r['params_deg1_MiB']:.2f} / {r['peak_ratio']:.2f}", "–", d)
    d = data.get("vae")
    if d:
        for r in d["rows"]:
            add(f"Patch VAE Decode {r['vae']} on {r['ranks']} ranks: peak activations per rank vs VAE Decode",
                f"{r['patch_peak_max'] / r['serial_peak']:.2f}", "≈ 1/N", d)
    d = data.get("native")
    if d:
        for r in d["rows"]:
            if r.get("ranks"):
                add(f"Flux {r['size']} {r['precision']} N={r['ranks']}: extra host memory (weights part) / "
                    f"first prompt vs KSampler", f"{r['extra_x_weights']:.2f}× ({r['weights_extra_x']:.2f}×) / "
                    f"{r['first_ratio']:.2f}×", "≤ 1.1× / ≤ 1.5× at N=2", d)
    d = data.get("reliability")
    if d:
        for mode, trials in d["interrupts"].items():
            add(f"interrupt, {mode} mode: seconds / steps after it (max of {len(trials)})",
                f"{max(t['seconds'] for t in trials):.2f} s / {max(t['steps_after'] for t in trials)}", "≤ 2 s", d)
        for k, (v, _) in d["faults"].items():
            add(k, f"{v}", "interrupt ≤ 2 s, stall ≤ 10 s + 1, stop < 0.5 s", d)
        soak = d["soak"]
        add(f"soak {soak['prompts']} prompts: RSS growth / pool files left", f"{soak['rss_growth_pct']} % / "
            f"{soak['pool files in shm after']}", "flat / the live arenas", d)
    d = data.get("shard")
    if d:
        for r in d["rows"]:
            if r["shard_weights"] != "none":
                unsharded = next(b for b in d["rows"] if b["config"] == r["config"] and b["precision"] == r["precision"]
                                 and b["shard_weights"] == "none")
                add(f"shard_weights={r['shard_weights']}, {r['config']}, {r['precision']}: weights per rank / time "
                    f"per step vs unsharded", f"{r['per_rank_MiB'] / r['weights_MiB']:.2f} / "
                    f"{r['ms_per_step'] / unsharded['ms_per_step']:.2f}×", "≤ 1/N + two blocks / –", d)
    d = data.get("stepcache")
    if d:
        for r in d["rows"]:
            if r["threshold"]:
                add(f"step cache {r['threshold']}, {r['config']}: steps skipped / speedup / rel. error vs uncached",
                    f"{r['skipped_steps']:g} of {r['steps']} / {r['speedup']:.2f}× / {r['rel_err_vs_uncached']:.1e}",
                    "measured (random weights)", d)
    d = data.get("quality")
    if d:
        for r in d["rows"]:
            if r["config"].startswith(("DistriFusion", "PipeFusion", "step cache")):
                add(f"{r['config']} (demo model): PSNR / SSIM vs serial, pictures as asked",
                    f"{r['psnr_db']:.1f} dB / {r['ssim']:.3f} / {r['as_asked']}/{r['n']}", "measured", d)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs of every section (minutes)")
    ap.add_argument("--only", default="", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    ap.add_argument("--no-run", action="store_true", help="only rebuild the summary and plots from results/")
    a = ap.parse_args(argv)
    chosen = [s.strip() for s in a.only.split(",") if s.strip()] or list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    t0 = time.perf_counter()
    status = {}
    if not a.no_run:
        for name in chosen:
            status[name] = run_section(name, a.quick)
    data = {n: d for n in SECTIONS if (d := _load(SECTIONS[n][1][0], a.quick))}
    sys.path.insert(0, HERE)
    import _worlds
    import plots

    pngs = plots.make_all(data, RESULTS, suffix="_quick" if a.quick else "")
    machine = _worlds.machine_info()
    md = [f"# Benchmark summary{' (quick run)' if a.quick else ''}", "",
          f"Command: `python -m bench.run_all{' --quick' if a.quick else ''}"
          f"{' --only ' + a.only if a.only else ''}`; summary written on: {_meta_line(machine)}.", "",
          "## Targets of issue 10", ""] + headline(data)
    for n, d in data.items():
        md += ["", f"## {TITLES[n]}", "", f"Machine: {_meta_line(d['meta'])} (`results/{d['file']}.json`)", "",
               d["markdown"].strip()]
    if pngs:
        md += ["", "## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in pngs]
    failed = {n: s for n, s in status.items() if s["rc"] != 0}
    if failed:
        md += ["", "## Sections that failed in this run", ""] + [f"- {n}: rc={s['rc']}" for n, s in failed.items()]
    stem = "summary_quick" if a.quick else "summary"
    with open(os.path.join(RESULTS, f"{stem}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(RESULTS, f"{stem}.json"), "w") as f:
        json.dump({"machine": machine, "quick": a.quick, "status": status,
                   "sections": {n: {"file": d["file"], "meta": d["meta"], "rows": d["rows"]} for n, d in data.items()},
                   "plots": [os.path.basename(p) for p in pngs]}, f, indent=1, default=str)
    print("\n".join(headline(data)))  # noqa
    print(f"\nwrote bench/results/{stem}.md, {stem}.json and {len(pngs)} plots in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
