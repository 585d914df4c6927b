"""AuraFlow on the workers (ComfyUI's MMDiT of comfy/ldm/aura - not SD3's class of the same name), against ComfyUI's
own forward and KSampler.

The image tokens are split where they enter the first double (joint) layer, the text with its 8 register tokens stays
whole, the single layers run [text, local image], `final_linear` is gathered. ComfyUI's detection fixes the width at
3072: one double and one single layer are 0.55B parameters, loaded fp8 (ComfyUI computes in fp32 on CPU). Odd
latents (ComfyUI pads them to the patch grid) and a latent larger than the 8 x 8 position table (interpolated).
"""
import pytest
import torch

from test_native_pool import comfy, comfy_forward, pool_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy

CASES = ({"ulysses_degree": 2}, {"ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2}, {"cfg_degree": 2})


@pytest.fixture(scope="module")
def aura(comfy, tmp_path_factory):  # noqa: F811
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    path = tmp_path_factory.mktemp("aura") / "auraflow.safetensors"
    tiny.write_auraflow(path, seed=91)
    base = load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn}).model
    assert type(base).__name__ == "AuraFlow" and family_adapter(base.diffusion_model).family == "auraflow"
    return base


def _check(pool, base, cases, sizes):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    for degrees in cases:
        config = ParallelConfig(**degrees)
        for h, w in sizes:
            g = torch.Generator().manual_seed(92 + h)
            inp = {"x": torch.randn(2, 4, h, w, generator=g), "timestep": torch.rand(2, generator=g),
                   "context": torch.randn(2, 5, 2048, generator=g)}
            ref = comfy_forward(base, inp)
            out = pool_forward(pool, config, f"aura:{config.describe()}", base, inp)
            err = rel(out, ref)
            print(f"AuraFlow {config.describe()} {h}x{w}: rel {err:.2e}")
            assert out.shape == ref.shape and err <= 1e-5, (degrees, h, w, err)


def test_auraflow_equals_comfyui(aura, cpu_pool):
    """ulysses 2 x ring 2 on an odd latent (5 x 7 tokens after padding) here; every degree, and a latent beyond the
    position table, in the slow test."""
    _check(cpu_pool, aura, CASES[2:3], [(9, 13)])


@pytest.mark.slow
def test_auraflow_every_degree_equals_comfyui(aura, cpu_pool):
    _check(cpu_pool, aura, CASES, [(9, 13), (8, 12), (20, 18)])


@pytest.mark.slow
def test_auraflow_equals_ksampler_in_comfyui(server):
    """The real ComfyUI: AuraFlow loaded fp8 by UNETLoader, odd 13 x 9 latent, Parallel Model + KSampler under
    ulysses 2, ring 2, ulysses 2 x ring 2 and Hybrid Sampler cfg 2, against KSampler."""
    from comfy_server import assert_ok, latent, on_pool, workflow
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / "tiny_auraflow.safetensors"
    if not path.exists():
        tiny.write_auraflow(path, seed=93)

    def graph(tag, degrees=None, node="model"):
        g = workflow(None, tag, 104, 72, family="auraflow", weight_dtype="fp8_e4m3fn", steps=2)
        for k in ("6", "7", "8", "11"):
            g.pop(k, None)
        return g if degrees is None else on_pool(g, degrees, node)
    assert_ok(server, server.run(graph("aura_ref")))
    ref = latent(server, "aura_ref")
    for name, degrees, node in [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
                                ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"),
                                ("cfg2", {"cfg_degree": 2}, "sampler")]:
        assert_ok(server, server.run(graph(f"aura_{name}", degrees, node)))
        err = rel(latent(server, f"aura_{name}"), ref)
        print(f"AuraFlow {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)


@pytest.mark.slow
def test_auraflow_distrifusion_and_sharded_weights(aura, cpu_pool):
    from test_native_hunyuan_video import distrifusion_and_sharded
    g = torch.Generator().manual_seed(94)
    inp = {"x": torch.randn(2, 4, 9, 13, generator=g), "timestep": torch.rand(2, generator=g),
           "context": torch.randn(2, 5, 2048, generator=g)}
    errs = distrifusion_and_sharded(cpu_pool, "aura", aura, inp, pool_forward, comfy_forward(aura, inp))
    print(f"AuraFlow: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs
