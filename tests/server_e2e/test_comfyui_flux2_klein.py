"""Flux.2 Klein in a real ComfyUI (0.33+): ComfyUI's Flux2 class at Klein's sizes, against KSampler.

ComfyUI 0.33 reads a Flux.2 model's width from its weights (0.3.75 forced 6144: tests/server_e2e/test_comfyui_flux2_chroma.py,
slow), so the Klein variant - narrower, no guidance embedder, Qwen3 text - is checked on its own small model (width
256, 2 heads), not inherited from the Flux.2 check: text-to-image and the edit Klein's templates run (a reference
latent through ReferenceLatent, joined to the image sequence by Flux.2's default "index" method). 128-channel
latents at 16x: 7 x 5 (35 tokens, odd) and 8 x 6 (48); the reference 5 x 4.
"""
import pytest

from comfy_server import PARTS, one_world, part_of
from comfy_server import FAMILIES, equal_ksampler, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "model"),
         ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler")]


def _write(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, FAMILIES["flux2_klein"]["unet"], "comfy.ldm.flux.model",
                     lambda p: tiny.write_flux2_klein(p, seed=53))


def _reference(server):
    """A random 128-channel latent in the server's input folder (LoadLatent's format)."""
    import torch
    from safetensors.torch import save_file
    path = server.base / "input" / "klein_ref.latent"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        g = torch.Generator().manual_seed(59)
        save_file({"latent_tensor": torch.randn(1, 128, 4, 5, generator=g),
                   "latent_format_version_0": torch.tensor([])}, str(path))
    return path.name


def _graph(size, tag, degrees=None, node="model", edit=None, weight_dtype="default"):
    g = workflow(None, tag, *size, family="flux2_klein", steps=2, weight_dtype=weight_dtype)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    if edit is not None:
        g["30"] = {"class_type": "LoadLatent", "inputs": {"latent": edit}}
        g["32"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["2", 0], "latent": ["30", 0]}}
        g["33"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["3", 0], "latent": ["30", 0]}}
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["32", 0], ["33", 0]
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("size,part", [((112, 80), "ci"), pytest.param((112, 80), "rest", marks=pytest.mark.slow),
                                       pytest.param((128, 96), "ci", marks=pytest.mark.slow)],
                         ids=["odd", "odd-rest", "even"])
def test_flux2_klein_equals_ksampler(server, size, part):
    _write(server)
    cases = part_of(CASES, part) if size == (112, 80) else one_world(CASES)
    equal_ksampler(server, lambda *a: _graph(size, *a), f"klein_{size[0]}", cases)


@pytest.mark.parametrize("part", PARTS)
def test_flux2_klein_edit_equals_ksampler(server, part):
    _write(server)
    ref = _reference(server)
    equal_ksampler(server, lambda *a: _graph((112, 80), *a, edit=ref), "klein_edit", part_of(CASES[:4], part))


@pytest.mark.slow
def test_flux2_klein_fp8_weights_equal_ksampler(server):
    """UNETLoader's fp8_e4m3fn weight dtype: fp8 storage, computed in fp32 on CPU (manual cast) - the exact bound."""
    _write(server)
    equal_ksampler(server, lambda *a: _graph((112, 80), *a, weight_dtype="fp8_e4m3fn"), "klein_fp8",
                   [CASES[0], CASES[3]])
