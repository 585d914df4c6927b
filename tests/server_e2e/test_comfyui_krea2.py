"""Krea 2 in a real ComfyUI (0.33+): ComfyUI's SingleStreamDiT on the workers, against KSampler.

Width 256 (2 heads of the fixed 128, one K/V head), two blocks, on an odd 13 x 9 latent (35 image tokens + 7 caption
tokens in one stream, 42: split 21 / 21 - and 13 x 9 + a reference image in the edit case): Parallel Model + KSampler
with ulysses 2, ring 2, ulysses 2 x ring 2, Hybrid Sampler with cfg 2; and an edit with a reference latent under the
index_timestep_zero method (the references' tokens modulated with t = 0 from a position in the joined stream).
"""
import pytest

from comfy_server import PARTS, one_world, part_of
from comfy_server import FAMILIES, equal_ksampler, error_text, latent, on_pool, rel, tiny_unet, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]


@pytest.fixture(scope="module")
def krea2(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, FAMILIES["krea2"]["unet"], "comfy.ldm.krea2.model", lambda p: tiny.write_krea2(p, seed=41))


def _graph(tag, degrees=None, node="model", edit=False):
    g = workflow(None, tag, W, H, family="krea2", weight_dtype="fp8_e4m3fn", steps=2)
    for k in ("7", "8", "11"):  # no decode: the latent is what is compared (the VAE encodes the reference)
        g.pop(k, None)
    if edit:
        g["30"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1,
                                                          "color": 0x9a3c5e}}
        g["31"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["30", 0], "vae": ["6", 0]}}
        for k, ref, method in (("2", "32", "34"), ("3", "33", "35")):
            g[ref] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": [k, 0], "latent": ["31", 0]}}
            g[method] = {"class_type": "FluxKontextMultiReferenceLatentMethod",
                         "inputs": {"conditioning": [ref, 0], "reference_latents_method": "index_timestep_zero"}}
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["34", 0], ["35", 0]
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("part", PARTS)
def test_krea2_equals_ksampler(server, krea2, part):
    equal_ksampler(server, _graph, "krea2", part_of(CASES + [
        ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler"),
        # DistriFusion with every step synchronous (warmup = steps): the stale-K/V path's plumbing, exact
        ("df_u2", {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 2}, "sampler")], part))


def test_krea2_edit_timestep_zero_references_equal_ksampler(server, krea2):
    ref = equal_ksampler(server, lambda *a: _graph(*a, edit=True), "krea2_edit", one_world(CASES))
    assert rel(latent(server, "krea2_ref"), ref) > 1e-3  # the reference changes the result: it reached the model


def test_krea2_tensor_parallel_is_refused_with_the_fix(server, krea2):
    entry = server.run(_graph("krea2_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "Krea 2" in msg and "ulysses/ring/cfg" in msg, msg
