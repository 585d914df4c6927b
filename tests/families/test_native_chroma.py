"""Chroma on the workers (ComfyUI's Chroma class: Flux's blocks, a distilled guidance network), against ComfyUI's
own forward. Detection fixes 24 heads x 128 and a 5120-wide approximator: with one block of each kind the model
has ~0.8B parameters (fp8 here), so the test is `slow` (HP_FULL=1; run before resolving). Ulysses 2, Ring 2 and
CFG 2, odd and even latents, fresh random inputs.
"""
import pytest
import torch

from test_native_pool import comfy, comfy_forward, pool_forward, rel  # noqa: F401

pytestmark = [pytest.mark.comfy, pytest.mark.slow]


def test_chroma_equals_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = tmp_path / "chroma.safetensors"
    tiny.write_chroma(path, seed=61)
    base = load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn}).model
    assert type(base.diffusion_model).__name__ == "Chroma" and family_adapter(base.diffusion_model).family == "chroma"
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_degree": 2}):
        config = ParallelConfig(**degrees)
        for odd in (True, False):
            g = torch.Generator().manual_seed(62 + odd)
            h, w = (9, 13) if odd else (8, 12)
            inp = {"x": torch.randn(2, 16, h, w, generator=g).to(dtype),
                   "context": torch.randn(2, 7, 32, generator=g).to(dtype),
                   "guidance": torch.zeros(2), "timestep": torch.rand(2, generator=g)}
            ref = comfy_forward(base, inp)
            out = pool_forward(cpu_pool, config, f"chroma:{config.describe()}", base, inp)
            err = rel(out, ref)
            print(f"Chroma {config.describe()} {'odd' if odd else 'even'}: rel {err:.2e}")
            assert out.shape == ref.shape and err <= 1e-5, err
