"""Image quality of the stale methods and of step caching, on the trained demo model, in a real ComfyUI.

The demo model (examples/demo_model: trained by the pack's script, shipped) draws the eight test captions
(shapes.TEST_SCENES, seeds 100..107, 20 euler steps, CFG 4, 64 x 64) through KSampler -> VAE Decode (the serial
reference) and through Parallel Config -> Hybrid Sampler -> Parallel VAE Decode with each config below, on 2 CPU
workers (gloo). Per config, averaged over the 8 pictures: PSNR and SSIM of the image vs the serial one
(scikit-image; `pip install -e .[bench]`), the relative error of the final latent, how many pictures the
checker (the classifier trained with the model) finds as asked (shape, colour and background), the steps a step
cache skipped (from ComfyUI's log) and the median seconds ComfyUI executed a prompt (warm). Writes
bench/results/quality.{json,md} and quality.png (the first four captions: serial, then each stale config).

    .venv/bin/python bench/bench_quality.py           # ~10 min on 2 cores
"""
import argparse
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from _worlds import RESULTS, write_results

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

WARMUPS = (1, 2, 4)
STEPS = 20


def configs():
    out = [("ulysses 2 (exact)", {"ulysses_degree": 2})]
    out += [(f"DistriFusion 2, warmup {w}", {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": w})
            for w in WARMUPS]
    out += [(f"PipeFusion pp2 x 2 patches, warmup {w}", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": w})
            for w in WARMUPS]
    out += [(f"PipeFusion pp2 x 4 patches, warmup {w}", {"pp_degree": 2, "num_pipeline_patch": 4, "warmup_steps": w})
            for w in WARMUPS]
    out += [(f"step cache {t}, loop ulysses 2", {"ulysses_degree": 2, "sampling_mode": "loop", "step_cache": t})
            for t in (0.2, 0.5, 1.0)]
    out += [(f"step cache {t}, PipeFusion pp2 x 2, warmup 2",
             {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2, "step_cache": t}) for t in (0.5,)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two captions, warmup 1 only")
    args = ap.parse_args()
    try:
        from skimage.metrics import peak_signal_noise_ratio, structural_similarity
    except ImportError:
        sys.exit("bench_quality needs scikit-image: .venv/bin/pip install -e '.[bench]'")
    from safetensors.torch import load_file

    from comfy_headless import ComfyServer
    from comfyui_hybrid_parallel.doctor.machine import find_comfyui
    from demo_model import shapes
    from demo_model.check import Checker
    from demo_model.workflow import install, prompt

    scenes = list(shapes.TEST_SCENES[:2] if args.quick else shapes.TEST_SCENES)
    todo = [c for c in configs() if not args.quick or "warmup 2" not in c[0] and "warmup 4" not in c[0]]
    base = Path(tempfile.mkdtemp(prefix="hp-bench-quality-"))
    srv = ComfyServer(find_comfyui(), base)
    install(base)
    srv.start()
    checker = Checker()

    def run(tag, degrees, i, scene):
        entry = srv.run(prompt(scene.caption, tag, degrees, seed=100 + i, steps=STEPS))
        if entry.get("status", {}).get("status_str") != "success":
            raise RuntimeError(f"{tag}: {entry.get('rejected') or entry.get('status')}\n{srv.tail(40)}")
        dt = srv.seconds(entry)
        img = load_file(str(srv.output(f"img_{tag}.safetensors")))["images"]
        lat = load_file(str(srv.output(f"lat_{tag}.safetensors")))["images"]
        hits = re.findall(r"step cache - skipped ([0-9.]+)/", srv.tail(400))
        return img, lat, dt, float(hits[-1]) if hits and degrees and degrees.get("step_cache") else 0.0

    rows, grid = [], {}
    try:
        ref = {}
        serial_times = []
        for i, scene in enumerate(scenes):
            # another seed (ComfyUI would answer an identical prompt from its cache); it loads the model once
            run("warm", None, 900 + i, scene)
            img, lat, dt, _ = run(f"serial{i}", None, i, scene)
            ref[i] = (img, lat)
            serial_times.append(dt)
        grid["serial (KSampler)"] = [ref[i][0] for i in range(min(4, len(scenes)))]
        right = sum(checker.right(s.caption, ref[i][0]) for i, s in enumerate(scenes))
        rows.append({"config": "serial (KSampler)", "psnr_db": float("inf"), "ssim": 1.0, "latent_rel_err": 0.0,
                     "as_asked": right, "n": len(scenes), "skipped_steps": 0.0,
                     "s_per_prompt": statistics.median(serial_times)})
        print(f"{'serial (KSampler)':45s} as asked {right}/{len(scenes)}", flush=True)
        for name, degrees in todo:
            psnr, ssim, err, times, skipped, right, pics = [], [], [], [], [], 0, []
            run("warm", degrees, 900, scenes[0])  # the pool's world and weights for this mesh (another seed)
            for i, scene in enumerate(scenes):
                img, lat, dt, sk = run(f"q{i}", degrees, i, scene)
                a, b = ref[i][0][0].numpy(), img[0].numpy()
                psnr.append(min(peak_signal_noise_ratio(a, b, data_range=1.0), 100.0))
                ssim.append(float(structural_similarity(a, b, channel_axis=-1, data_range=1.0)))  # numpy float32: not JSON
                err.append(((lat.double() - ref[i][1].double()).norm() / ref[i][1].double().norm()).item())
                times.append(dt)
                skipped.append(sk)
                right += checker.right(scene.caption, img)
                if i < 4:
                    pics.append(img)
            if "exact" not in name:
                grid[name] = pics
            rows.append({"config": name, "psnr_db": statistics.mean(psnr), "ssim": statistics.mean(ssim),
                         "latent_rel_err": statistics.mean(err), "as_asked": right,
                         "n": len(scenes),
                         "skipped_steps": statistics.mean(skipped), "s_per_prompt": statistics.median(times)})
            r = rows[-1]
            print(f"{name:45s} PSNR {r['psnr_db']:6.2f} dB  SSIM {r['ssim']:.4f}  latent {r['latent_rel_err']:.2e}  "
                  f"as asked {right}/{len(scenes)}  skipped {r['skipped_steps']:.1f}  {r['s_per_prompt']:.2f} s",
                  flush=True)
    finally:
        srv.stop()

    header = (f"| config (2 CPU ranks) | PSNR vs serial (dB) | SSIM vs serial | latent rel. error | checker: shape, "
              f"colour and background as asked | steps skipped (of {STEPS}) | s / prompt |\n|---|---|---|---|---|---|---|")

    def fmt_psnr(v):
        return "∞ (identical)" if v == float("inf") else ("≥ 100" if v >= 100 else f"{v:.1f}")
    lines = [f"| {r['config']} | {fmt_psnr(r['psnr_db'])} | {r['ssim']:.4f} | {r['latent_rel_err']:.1e} | "
             f"{r['as_asked']}/{r['n']} | {r['skipped_steps']:.1f} | "
             f"{r['s_per_prompt']:.2f} |" for r in rows]
    setup = (f"demo model (examples/demo_model: MMDiT depth 3, TAESD 16 channels), {len(scenes)} test captions, "
             f"seeds 100..{99 + len(scenes)}, 64 x 64, {STEPS} euler steps, CFG 4, real ComfyUI 0.3.75, CPU")
    name = "quality" + ("_quick" if args.quick else "")
    write_results(name, rows, f"{setup}\n\n{header}\n" + "\n".join(lines), extra={"setup": setup})
    _save_grid(grid, Path(RESULTS) / f"{name}.png")


def _save_grid(grid: dict, path: Path, scale: int = 2) -> None:
    """Rows: serial, then each stale config; columns: the first captions. Labels on the left."""
    from PIL import Image, ImageDraw
    names = list(grid)
    n_cols = max(len(v) for v in grid.values())
    cell, label_w, pad = 64 * scale, 300, 4
    canvas = Image.new("RGB", (label_w + n_cols * (cell + pad), len(names) * (cell + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for r, name in enumerate(names):
        y = pad + r * (cell + pad)
        draw.text((4, y + cell // 2 - 6), name, fill=(0, 0, 0))
        for c, img in enumerate(grid[name]):
            tile = Image.fromarray((img[0].clamp(0, 1) * 255).round().to(torch.uint8).numpy())
            canvas.paste(tile.resize((cell, cell), Image.NEAREST), (label_w + c * (cell + pad), y))
    canvas.save(path)
    print(f"grid: {path}")


if __name__ == "__main__":
    main()
