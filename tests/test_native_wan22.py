"""Wan 2.2 TI2V (ComfyUI's WAN22 class, 48-channel latents): per-frame timesteps under every sequence method.

With a noise mask (Wan22ImageToVideoLatent's start frame, SetLatentNoiseMask) ComfyUI's WAN22 turns the
timestep into one value per latent frame; the model embeds it per frame and each block repeats it against
its tokens. Split naively, a rank's tokens met the wrong frames' modulation (45 % relative error, silently);
the plan now hands each rank the per-token rows of its own shard. Checked against ComfyUI's own forward on
fresh random per-frame timesteps (the first frame at 0, as an image-conditioned start frame), odd and even
latents, Ulysses, Ring, USP and CFG, DistriFusion's synchronous step, fp32 and fp8 weights.
"""
import pytest
import torch

from test_native_pool import comfy, comfy_forward, pool_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy


@pytest.fixture(scope="module")
def wan22(comfy):  # noqa: F811  (the fixture: ComfyUI imported, a temp folder)
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = comfy / "wan22_ti2v.safetensors"
    tiny.write_wan(path, dim=256, ffn_dim=256, seed=41, in_dim=48, out_dim=48)
    models = {p: load_diffusion_model(str(path), model_options=o).model
              for p, o in (("fp32", {}), ("fp8_e4m3fn", {"dtype": torch.float8_e4m3fn}))}
    assert all(type(m).__name__ == "WAN22" for m in models.values())  # ComfyUI's detection: the 2.2 5B class
    return models



def _inputs(seed, odd):
    g = torch.Generator().manual_seed(seed)
    h, w = (9, 13) if odd else (8, 12)
    t = torch.rand(2, 3, generator=g) * 1000
    t[:, 0] = 0.0  # the conditioned start frame
    return {"x": torch.randn(2, 48, 3, h, w, generator=g), "timestep": t,
            "context": torch.randn(2, 7, 4096, generator=g)}


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2}, {"ulysses_degree": 2, "ring_degree": 2},
                                     {"cfg_degree": 2, "ulysses_degree": 2},
                                     {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1}],
                         ids=["u2", "r2", "u2r2", "cfg2u2", "distrifusion2"])
def test_per_frame_timesteps_equal_comfyui(wan22, cpu_pool, degrees):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(**degrees)
    for precision, base in wan22.items():
        for odd in (True, False):
            inp = _inputs(50 + odd, odd)
            ref = comfy_forward(base, inp)
            uniform = comfy_forward(base, {**inp, "timestep": inp["timestep"][:, 1:2].expand(-1, 3).contiguous()})
            assert rel(uniform, ref) > 1e-2  # the per-frame values matter: a wrong mapping cannot pass
            out = pool_forward(cpu_pool, config, f"w22:{config.describe()}:{config.method}:{precision}", base, inp)
            err = rel(out, ref)
            print(f"Wan 2.2 per-frame timesteps {config.describe()} {config.method} {precision} "
                  f"{'odd' if odd else 'even'}: rel {err:.2e}")
            assert err <= 1e-5, err
