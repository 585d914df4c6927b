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


# the 2-rank cases (u2, r2, distrifusion2) on one world, then the 4-rank ones (u2r2, cfg2u2) on one
@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, {"ring_degree": 2},
                                     {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 1},
                                     {"ulysses_degree": 2, "ring_degree": 2}, {"cfg_degree": 2, "ulysses_degree": 2}],
                         ids=["u2", "r2", "distrifusion2", "u2r2", "cfg2u2"])
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


def test_wan_fun_camera_equals_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    """Wan 2.2 Fun Camera (ComfyUI's CameraWanModel, its own adapter): the camera embedding joins the patch
    embedding before the split; its camera conditions are split with the batch under cfg. Odd 5 x 7 token grid."""
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel import ParallelConfig

    path = tmp_path / "wan_camera.safetensors"
    tiny.write_wan(path, dim=256, ffn_dim=256, seed=95, model_type="camera_2.2", in_dim=36)  # (ComfyUI matches 36)
    base = load_diffusion_model(str(path)).model
    assert type(base).__name__ == "WAN21_Camera" and family_adapter(base.diffusion_model).family == "wan_camera"
    g = torch.Generator().manual_seed(96)
    inp = {"x": torch.randn(2, 36, 2, 10, 14, generator=g), "timestep": torch.rand(2, generator=g),
           "context": torch.randn(2, 6, 4096, generator=g),
           "camera_conditions": torch.randn(2, 24, 2, 80, 112, generator=g)}
    ref = comfy_forward(base, inp)
    assert rel(ref, comfy_forward(base, {k: v for k, v in inp.items() if k != "camera_conditions"})) > 1e-3
    for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_degree": 2}):
        config = ParallelConfig(**degrees)
        err = rel(pool_forward(cpu_pool, config, f"camera:{config.describe()}", base, inp), ref)
        print(f"Wan Fun Camera {config.describe()}: rel {err:.2e}")
        assert err <= 1e-5, (degrees, err)
