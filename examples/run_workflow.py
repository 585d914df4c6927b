"""The README's main job: a real headless ComfyUI draws a caption with the pack's demo model, on CPU.

Starts ComfyUI with the pack in custom_nodes and the shipped demo model (examples/demo_model: trained by the
pack's own script, nothing downloaded) in its models folders, and posts the same caption twice over:
KSampler -> VAE Decode, and Parallel Config -> Hybrid Sampler -> Parallel VAE Decode. Prints what the checker
(the classifier trained with the model) sees in each picture, their difference, the first prompt's time (another
seed; it loads the model, starts the workers) and the warm one's (ComfyUI's own execution times), and saves one
PNG: KSampler's picture, the Hybrid Sampler's, and their difference.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from comfy_headless import ComfyServer  # noqa: E402
from demo_model import shapes  # noqa: E402
from demo_model.workflow import install, prompt  # noqa: E402


def side_by_side(images: list, labels: list, path: Path, scale: int = 4) -> None:
    """One PNG: the pictures (1, H, W, 3) in [0, 1] next to each other, each enlarged `scale` times, labelled."""
    from PIL import Image, ImageDraw

    tiles = [Image.fromarray((im[0].clamp(0, 1) * 255).round().byte().numpy()).resize(
        (im.shape[2] * scale, im.shape[1] * scale), Image.NEAREST) for im in images]
    w, h = tiles[0].size
    pad, text_h = 8, 16
    canvas = Image.new("RGB", (len(tiles) * (w + pad) + pad, h + text_h + 2 * pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for i, (tile, label) in enumerate(zip(tiles, labels)):
        x = pad + i * (w + pad)
        canvas.paste(tile, (x, pad + text_h))
        draw.text((x, pad // 2), label, fill=(0, 0, 0))
    canvas.save(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caption", default=shapes.TEST_SCENES[3].caption,  # a cross: no shape is less ambiguous
                    help="'a <colour> <shape> on a <background> background' (see examples/demo_model/shapes.py)")
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--cfg-degree", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--base", default=None, help="ComfyUI base directory (default: a temp dir)")
    ap.add_argument("--save", default=None, help="where to write the side-by-side PNG (default: <base>/output)")
    args = ap.parse_args()

    from comfyui_hybrid_parallel.doctor.machine import find_comfyui
    comfy = find_comfyui()
    if comfy is None:
        sys.exit("ComfyUI is not installed: run scripts/main_job.sh (it installs it)")
    from safetensors.torch import load_file

    from demo_model.check import Checker

    print(f"caption: {args.caption!r}")
    try:
        shapes.parse(args.caption)  # a caption the demo model was not taught fails here, with the grammar
    except ValueError as e:
        sys.exit(str(e))
    base = Path(args.base or tempfile.mkdtemp(prefix="hp-main-"))
    srv = ComfyServer(comfy, base)
    install(base)
    t0 = time.perf_counter()
    srv.start()
    print(f"ComfyUI ready in {time.perf_counter() - t0:.1f} s (base {base})")
    degrees = {"ulysses_degree": args.ulysses, "cfg_degree": args.cfg_degree}
    label = " x ".join(f"{k.split('_')[0]} {v}" for k, v in degrees.items() if v > 1) or "degree 1"
    try:
        results = {}
        for tag, deg in (("ksampler", None), ("hybrid", degrees)):
            times = []
            # the first prompt on another seed: ComfyUI would serve an identical prompt from its cache
            for run, seed in (("first", args.seed + 1), ("warm", args.seed)):
                entry = srv.run(prompt(args.caption, f"{tag}_{run}", deg, seed=seed, steps=args.steps))
                if entry.get("status", {}).get("status_str") != "success":
                    errors = [m[1].get("exception_message", "") for m in entry.get("status", {}).get("messages", [])
                              if m[0] == "execution_error"]
                    print(srv.tail(30))
                    sys.exit(f"{tag} prompt failed: {entry.get('rejected') or errors}")
                times.append(srv.seconds(entry))  # ComfyUI's own execution time of the prompt
            image = load_file(str(srv.output(f"img_{tag}_warm.safetensors")))["images"]
            results[tag] = (image, times)
            print(f"{tag:9s}: first prompt {times[0]:6.2f} s, warm {times[1]:6.2f} s")
        ref, par = results["ksampler"][0], results["hybrid"][0]
        diff = (par - ref).abs()
        rel = ((par.double() - ref.double()).norm() / ref.double().norm()).item()
        speedup = results["ksampler"][1][1] / results["hybrid"][1][1]
        why = (" (a 3.8M-parameter model on 16 image + 8 text tokens: a matmul of 12-24 rows costs what reading its "
               "weights costs, so half the rows save ~20 %, and each step adds 6 all-to-alls; docs/development.md, "
               "Quick start)"
               if speedup < 1 else "")
        print(f"Hybrid Sampler ({label}) vs KSampler: max |diff| {diff.max().item():.2e}, relative {rel:.2e}; "
              f"warm speedup {speedup:.2f}x{why}")
        checker = Checker()
        for tag in ("ksampler", "hybrid"):
            seen = checker.scenes(results[tag][0])[0]
            print(f"checker sees in {tag}'s picture: {seen.caption!r}"
                  f" ({'as asked' if seen == shapes.parse(args.caption) else 'NOT as asked'})")
        out = Path(args.save) if args.save else base / "output" / "side_by_side.png"
        out.parent.mkdir(parents=True, exist_ok=True)
        amp = 1e4
        side_by_side([ref, par, (diff * amp).clamp(0, 1)],
                     ["KSampler", f"Hybrid Sampler ({label})", f"|difference| x {amp:.0e}"], out)
        print(f"side by side: {out}")
        if rel > 1e-4:
            sys.exit("the parallel image differs from the KSampler reference")
    finally:
        srv.stop()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
