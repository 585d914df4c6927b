"""Flux.2, Chroma and Flux Kontext edits in a real ComfyUI, against KSampler (`slow`: detection forces their size).

Flux.2: 48 heads x 128 and one block of each kind are 2.2B parameters (fp8 file, 2.2 GB); Chroma: 24 heads x 128
and a 5120-wide guidance network, 0.8B. Both run in ComfyUI's Flux / Chroma classes with Flux's sequence plan.
Parallel Model + KSampler with ulysses 2, ring 2, ulysses 2 x ring 2 and cfg 2 vs KSampler on the same graph,
2 steps, odd latents (Flux.2: 128-channel latent at 16x, 7 x 5; Chroma: 13 x 9).
"""
import pytest

from comfy_server import assert_ok, latent, parallel_model, rel, workflow

pytestmark = [pytest.mark.comfy, pytest.mark.slow]

CASES = [("u2", {"ulysses_degree": 2}), ("r2", {"ring_degree": 2}),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}), ("cfg2", {"cfg_degree": 2})]


def _run(server, family, size, write):
    path = server.base / "models" / "diffusion_models" / f"tiny_{family}.safetensors"
    if not path.exists():
        write(path)

    def graph(tag, degrees=None):
        g = workflow(None, tag, *size, family=family, steps=2)
        for k in ("6", "7", "8", "11"):
            g.pop(k, None)
        if degrees is not None:
            g["5"]["inputs"]["model"] = parallel_model(g, degrees)
        return g
    assert_ok(server, server.run(graph(f"{family}_ref")))
    ref = latent(server, f"{family}_ref")
    for name, degrees in CASES:
        assert_ok(server, server.run(graph(f"{family}_{name}", degrees)))
        err = rel(latent(server, f"{family}_{name}"), ref)
        print(f"{family} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (family, name, err)


def test_chroma_equals_ksampler(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    _run(server, "chroma", (104, 72), lambda p: tiny.write_chroma(p, seed=31))


def test_flux2_equals_ksampler(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    _run(server, "flux2", (112, 80), lambda p: tiny.write_flux2(p, seed=37))


def test_flux_kontext_reference_latent_equals_ksampler(server):
    """Flux Kontext edits: ReferenceLatent puts an encoded image into the conditioning; its tokens join the image
    sequence inside ComfyUI's Flux (ref_latents) and are split with it. Flux.1's width is forced (531M)."""
    from comfy_server import on_pool, write_flux_checkpoint
    write_flux_checkpoint(server.base)

    def graph(tag, degrees=None):
        g = workflow(None, tag, 104, 72, family="flux", steps=2)
        for k in ("7", "8", "11"):
            g.pop(k, None)
        g["30"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1,
                                                          "color": 0x9a3c5e}}
        g["31"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["30", 0], "vae": ["6", 0]}}
        g["32"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["2", 0], "latent": ["31", 0]}}
        g["33"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["3", 0], "latent": ["31", 0]}}
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["32", 0], ["33", 0]
        return g if degrees is None else on_pool(g, degrees)
    assert_ok(server, server.run(graph("kontext_ref")))
    ref = latent(server, "kontext_ref")
    for name, degrees in CASES:
        assert_ok(server, server.run(graph(f"kontext_{name}", degrees)))
        err = rel(latent(server, f"kontext_{name}"), ref)
        print(f"Flux Kontext (reference latent) {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)
