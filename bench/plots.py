"""PNG plots from the section results (called by run_all; matplotlib is optional, with a message if absent)."""
from __future__ import annotations

import os


def _plt():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print("matplotlib is not installed: no plots (bash bench/run.sh installs it)")
        return None


def _machine(d):
    m = d["meta"]
    return f"{m.get('device')}, {m.get('cores')} cores, torch {m.get('torch')}, {m.get('backend')}"


def comm_vs_n(plt, d, path):
    """Bytes per rank per step against N, per method: measured (markers), exact formula (line), xDiT table (dashed)."""
    rows = [r for r in d["rows"] if r.get("ratio") and r["method"] not in ("cfg", "dp")
            and (r["method"] != "distrifusion" or r["step"] == 1)]
    marker = {"ulysses": "o", "ring": "s", "usp": "D", "distrifusion": "x", "tp": "^", "pipefusion": "v"}
    fams = sorted({r["family"] for r in rows if r["method"] != "pipefusion"})
    fig, axes = plt.subplots(1, len(fams) + 1, figsize=(5.2 * (len(fams) + 1), 4.2), squeeze=False)
    for ax, fam in zip(axes[0], fams + ["pipefusion"]):
        sel = [r for r in rows if (r["family"] == fam and r["method"] != "pipefusion") or
               (fam == "pipefusion" and r["method"] == "pipefusion")]
        # one resolution per panel: the most common latent of the family (the one measured at every N)
        if not sel:
            continue
        lat = max({tuple(r["latent"]) for r in sel}, key=lambda l: sum(tuple(r["latent"]) == l for r in sel))
        for key in sorted({(r["method"], r["family"]) for r in sel}):
            pts = sorted((r for r in sel if (r["method"], r["family"]) == key and tuple(r["latent"]) == lat),
                         key=lambda r: r["N"])
            if not pts:
                continue
            ns = [r["N"] for r in pts]
            label = key[0] if fam != "pipefusion" else f"pipefusion ({key[1]})"
            line, = ax.plot(ns, [r["analytic_bytes"] / r["N"] for r in pts], "-", alpha=0.6)
            ax.plot(ns, [r["measured_bytes"] / r["N"] for r in pts], marker.get(key[0], "o"), color=line.get_color(),
                    label=label, markersize=7, fillstyle="none")
            if all(r.get("xdit_table_bytes_per_device") for r in pts) and fam != "pipefusion":
                ax.plot(ns, [r["xdit_table_bytes_per_device"] for r in pts], "--", color=line.get_color(), alpha=0.4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (ranks)")
        ax.set_ylabel("bytes sent per rank per step")
        ax.set_title(f"{fam} latent {lat[0]}×{lat[1]}" if fam != "pipefusion" else "PipeFusion (per rank, async step)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("Measured (markers) vs exact analytic (—) vs xDiT table (--), fp32, " + _machine(d), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scaling(plt, d, path):
    rows = d["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["method"] for r in rows]
    ax.bar(names, [r["speedup"] for r in rows], color="tab:blue", alpha=0.8, label="speedup (median)")
    ax.plot(names, [r["speedup_min"] for r in rows], "k_", markersize=14, label="speedup (min)")
    ax.axhline(2.0, color="gray", lw=0.8, ls=":", label="ideal 2×")
    ax.axhline(1.85, color="tab:green", lw=0.8, ls="--", label="target CFG/DP 1.85×")
    ax.axhline(1.6, color="tab:orange", lw=0.8, ls="--", label="target USP 1.6×")
    ax.set_ylabel("2 ranks × 1 thread vs 1 × 1")
    ax.set_title("CPU scaling, " + _machine(d), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(plt, mem, vae, path):
    labels, params, acts = [], [], []
    for r in (mem or {}).get("rows", []):
        labels.append(f"{r['method']}{r['degree']}")
        params.append(r["params_per_rank_MiB"] / r["params_deg1_MiB"])
        acts.append(r["peak_ratio"])
    for r in (vae or {}).get("rows", []):
        labels.append(f"VAE {r['vae'].split(' (')[0]} {r['ranks']}")
        params.append(1.0)
        acts.append(r["patch_peak_max"] / r["serial_peak"])
    if not labels:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(labels)), 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], params, 0.4, label="parameters per rank / degree 1")
    ax.bar([x + 0.2 for x in xs], acts, 0.4, label="peak activations per rank / degree 1")
    ax.set_xticks(list(xs), labels, rotation=20, fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("Memory per rank vs degree 1, " + _machine(mem or vae), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _median_min_bars(ax, labels, median, minimum, color, tick_kw) -> None:
    """Bars of the medians, crosses at the minima (the least disturbed runs on a shared machine)."""
    ax.bar(range(len(labels)), median, color=color, label="median")
    ax.plot(range(len(labels)), minimum, "kx", label="min")
    ax.set_xticks(range(len(labels)), labels, **tick_kw)


def performance(plt, data: dict, path: str) -> bool:
    """The speed issue's targets in one figure: cold first prompt and config change vs KSampler (native), degree-1
    overhead (overhead), Ulysses vs diffusers' own (peer), and the many-GPU PREDICTION beside xDiT's Flux number."""
    native, over, peer, cost = (data.get(k) for k in ("native", "overhead", "peer", "costmodel"))
    if not any((native, over, peer, cost)):
        return False
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.4))
    ax = axes[0]
    if native:
        rows = [r for r in native["rows"] if r.get("ranks")]
        labels = [f"{r['precision']} {r['sampler'].replace('Hybrid ', '')}" for r in rows]
        colors = ["tab:cyan" if "spares" in r["sampler"] else "tab:blue" for r in rows]
        ax.bar(range(len(rows)), [r["first_ratio"] for r in rows], color=colors,
               label="first prompt / KSampler's (light: with spare interpreters)")
        ax.set_xticks(range(len(rows)), labels, rotation=50, ha="right", fontsize=7)
        ax.set_ylim(0, max(r["first_ratio"] for r in rows) * 1.3)
        for i, r in enumerate(rows):
            if r.get("change_s") is not None:
                ax.annotate(f"+{r['change_s'] - r['warm_s']:.2f} s", (i, r["first_ratio"]),
                            ha="center", va="bottom", fontsize=6)
        ax.axhline(1.5, ls="--", c="gray", label="target 1.5x at N = 2")
        ax.set(ylabel="ratio", title="Cold first prompt vs KSampler (Flux 531M)\n(+x s: a config change over a warm prompt)")
        ax.legend(fontsize=8)
    ax = axes[1]
    if over:
        rows = over["rows"]
        _median_min_bars(ax, [f"{r['model']}\n{r['comparison'].replace('ComfyUI, ', 'KSampler, ')}" for r in rows],
                         [r["ratio_median"] for r in rows], [r["ratio_min"] for r in rows], "tab:orange",
                         dict(fontsize=7, rotation=45, ha="right"))
        ax.axhline(1.02, ls="--", c="gray", label="target 1.02x")
        ax.set(ylabel="pool / in-process time per step", title="Degree-1 overhead")
        ax.legend(fontsize=8)
    ax = axes[2]
    if peer:
        rows = peer["rows"]
        _median_min_bars(ax, [r["method"].replace(" Ulysses", "\nUlysses").replace(" Ring", "\nRing") for r in rows],
                         [r["median_ms"] for r in rows], [r["min_ms"] for r in rows], "tab:green", {})
        ax.set(ylabel="ms per forward", title="Ulysses vs diffusers' own (2 ranks x 1 thread)")
        ax.legend(fontsize=8)
    ax = axes[3]
    if cost:
        for (model, link), style in zip(sorted({(r["model"], r["link"]) for r in cost["rows"]}), ("o-", "s--", "^-", "v--")):
            best = {}
            for r in cost["rows"]:
                if (r["model"], r["link"]) == (model, link):
                    best[r["n"]] = min(best.get(r["n"], 1e9), r["step_s"])
            ns = sorted(best)
            ax.plot(ns, [best[1] / best[n] for n in ns], style, label=f"{model}, {link}")
        x = cost.get("xdit_flux") or {}
        if x.get("serial_s") and x.get("ulysses4_s"):
            ax.plot([4], [x["serial_s"] / x["ulysses4_s"]], "r*", ms=12, label="xDiT published, Flux Ulysses-4 (compiled)")
        ax.plot([1, 8], [1, 8], ":", c="gray")
        ax.set(xlabel="GPUs", ylabel="speedup per step", title="PREDICTION on H100s (cost model)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def make_all(data: dict, outdir: str, suffix: str = "") -> list:
    plt = _plt()
    if plt is None:
        return []
    out = []
    if "comm" in data:
        p = os.path.join(outdir, f"comm_bytes_vs_n{suffix}.png")
        comm_vs_n(plt, data["comm"], p)
        out.append(p)
    if "scaling" in data:
        p = os.path.join(outdir, f"scaling{suffix}.png")
        scaling(plt, data["scaling"], p)
        out.append(p)
    p = os.path.join(outdir, f"memory{suffix}.png")
    if memory(plt, data.get("memory"), data.get("vae"), p):
        out.append(p)
    p = os.path.join(outdir, f"performance{suffix}.png")
    if performance(plt, data, p):
        out.append(p)
    return out
