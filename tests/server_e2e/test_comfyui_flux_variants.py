"""LongCat-Image and Ovis-Image in a real ComfyUI (0.33+): ComfyUI builds both in its own Flux class, so the pack runs
them under the Flux plan (it tells classes apart by name) - each gets its own check here, never silent inheritance.

LongCat-Image: 3584-wide text, no pooled vector or guidance, text ids on two axes and RoPE shifts that its model class
sets per call (`rope_options`, which travel to the workers). Ovis-Image: "yak" gated MLPs and a text RMSNorm, text
ids on two axes; under tensor parallel its double blocks' MLPs match none of the Flux layout's patterns and stay
whole on every rank. Width 256 (ComfyUI 0.33 reads it), one block of each kind, odd 13 x 9 latent.
"""
import pytest

from comfy_server import PARTS, part_of
from comfy_server import FAMILIES, equal_ksampler, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler"),
         ("tp2", {"tp_degree": 2}, "model")]


def _write(server, variant):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, FAMILIES[variant]["unet"], "comfy.ldm.flux.model",
                     lambda p: tiny.write_flux_variant(p, variant=variant, seed=67 + (variant == "ovis")))


def _graph(variant, tag, degrees=None, node="model"):
    g = workflow(None, tag, 104, 72, family=variant, steps=2)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("variant", ["longcat", "ovis"])
def test_flux_variant_equals_ksampler(server, variant, part):
    import comfy.sd
    name = _write(server, variant)
    base = comfy.sd.load_diffusion_model(str(server.base / "models" / "diffusion_models" / name)).model
    expected = {"longcat": "LongCatImage", "ovis": "Flux"}[variant]
    assert type(base).__name__ == expected and base.diffusion_model.params.txt_ids_dims == [1, 2], type(base)
    equal_ksampler(server, lambda *a: _graph(variant, *a), variant, part_of(CASES, part))
