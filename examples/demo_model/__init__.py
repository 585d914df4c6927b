"""The pack's demo model: a tiny text-to-image model trained by `train.py` on pictures `shapes.py` draws.

Shipped in `weights/` (ComfyUI's own formats: the diffusion model for UNETLoader, the VAE for VAELoader,
plus the classifier that checks a picture); the text encoder is `../hp_example_nodes/demo_text.py` (the
Demo Text Encode node).
"""
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent / "weights"
DIT_FILE = "hp_demo_dit.safetensors"
VAE_FILE = "hp_demo_vae.safetensors"
CLASSIFIER_FILE = "hp_demo_classifier.safetensors"
