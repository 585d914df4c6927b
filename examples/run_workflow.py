"""The README's main job: a real headless ComfyUI, our three nodes, a tiny embedded SD3 model, on CPU.

Writes a tiny random-init SD3 diffusion model and a 16-channel KL VAE in ComfyUI's own file
format (the default model embedded in the pack's tooling: no download), starts ComfyUI with the
pack in custom_nodes, posts two API prompts - KSampler -> VAEDecode, and Parallel Config ->
Hybrid Sampler -> Patch VAE Decode - saves both images, and prints their difference and timings.
"""
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from comfy_env import comfyui_dir, setup_comfy  # noqa: E402
from comfy_server import ComfyServer, workflow, write_checkpoints  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ulysses", type=int, default=2)
    ap.add_argument("--cfg-degree", type=int, default=1)
    ap.add_argument("--width", type=int, default=264)
    ap.add_argument("--height", type=int, default=200)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--base", default=None, help="ComfyUI base directory (default: a temp dir)")
    args = ap.parse_args()

    if comfyui_dir() is None:
        sys.exit("ComfyUI is not installed: run scripts/main_job.sh (it installs it)")
    comfy = setup_comfy()
    import torch
    from safetensors.torch import load_file

    base = Path(args.base or tempfile.mkdtemp(prefix="hp-main-"))
    srv = ComfyServer(comfy, base)
    write_checkpoints(base, ("sd3",))
    t0 = time.perf_counter()
    srv.start()
    print(f"ComfyUI ready in {time.perf_counter() - t0:.1f} s (base {base})")
    try:
        results = {}
        for tag, degrees in (("ksampler", None), ("hybrid", {"ulysses_degree": args.ulysses,
                                                              "cfg_degree": args.cfg_degree})):
            t = time.perf_counter()
            entry = srv.run(workflow(degrees, tag, args.width, args.height, args.steps, 4.0, png=True))
            dt = time.perf_counter() - t
            if entry.get("status", {}).get("status_str") != "success":
                errors = [m[1].get("exception_message", "") for m in entry.get("status", {}).get("messages", [])
                          if m[0] == "execution_error"]
                print(srv.tail(30))
                sys.exit(f"{tag} prompt failed: {entry.get('rejected') or errors}")
            results[tag] = (load_file(str(srv.output(f"img_{tag}.safetensors")))["images"], dt)
            print(f"{tag:9s}: {dt:6.2f} s  image {tuple(results[tag][0].shape)}")
        ref, par = results["ksampler"][0], results["hybrid"][0]
        diff = (par - ref).abs().max().item()
        rel = ((par.double() - ref.double()).norm() / ref.double().norm()).item()
        print(f"Hybrid Sampler (ulysses {args.ulysses}, cfg {args.cfg_degree}) vs KSampler: "
              f"max |diff| {diff:.2e}, relative {rel:.2e}")
        print("images:", ", ".join(sorted(str(p) for p in (base / "output").glob("*.png"))))
        if rel > 1e-4:
            sys.exit("the parallel image differs from the KSampler reference")
    finally:
        srv.stop()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
