"""The demo model's ComfyUI API prompts: KSampler -> VAE Decode, or the same through the pack's nodes.

Used by the main job (examples/run_workflow.py), the quality bench and the tests, so every one of them
runs the identical graph.
"""
from __future__ import annotations

import os
from pathlib import Path

from comfy_headless import sample_decode_save

from . import DIT_FILE, VAE_FILE, WEIGHTS

STEPS, CFG, SEED = 20, 4.0, 42


def install(base: Path) -> None:
    """Link the shipped weights into a ComfyUI base directory's models folders (UNETLoader / VAELoader)."""
    for sub, name in (("diffusion_models", DIT_FILE), ("vae", VAE_FILE)):
        folder = Path(base) / "models" / sub
        folder.mkdir(parents=True, exist_ok=True)
        link = folder / name
        if not link.exists():
            os.symlink(WEIGHTS / name, link)


def prompt(caption: str, tag: str, degrees: dict | None = None, *, seed: int = SEED, steps: int = STEPS,
           cfg: float = CFG, size: int = 64, batch: int = 1, png: bool = False, sampler: str = "euler",
           scheduler: str = "simple") -> dict:
    """API prompt drawing `caption`: KSampler -> VAEDecode when `degrees` is None, else Parallel Config
    (`degrees` over the defaults: CPU workers) -> Hybrid Sampler -> Parallel VAE Decode. The image and the latent
    are saved losslessly as output/img_<tag> / lat_<tag>.safetensors (and as <tag>_*.png when `png`)."""
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": DIT_FILE, "weight_dtype": "default"}},
        "2": {"class_type": "HPDemoTextEncode", "inputs": {"text": caption}},
        "3": {"class_type": "HPDemoTextEncode", "inputs": {"text": ""}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": size, "height": size, "batch_size": batch}},
        "6": {"class_type": "VAELoader", "inputs": {"vae_name": VAE_FILE}},
    }
    common = {"model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler,
              "scheduler": scheduler, "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
              "denoise": 1.0}
    return sample_decode_save(g, common, degrees, tag, png)
