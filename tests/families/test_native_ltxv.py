"""LTX-Video on the workers (ComfyUI's LTXVModel), against ComfyUI's own forward.

Patch size 1 (a token per latent voxel), RoPE over (frame, row, col) computed for the whole video and split per
block, per-token timesteps (a noise mask) split with the tokens, the sequence gathered at `norm_out`. Fresh random
inputs; token counts that divide the degree and that do not (3 x 5 x 7 = 105); each precision ComfyUI loads LTXV in
(fp32, bf16, fp16 weights and fp8 `weight_dtype`); DistriFusion and sharded weights; LTXVAddGuide's keyframe
conditioning (and, on ComfyUI 0.33, the refusal of a guide whose strength builds an attention mask). ComfyUI 0.33
hands the blocks the RoPE table as a (matrix, split_mode) tuple, older ones as a tensor: both are split.
"""
import pytest
import torch

from test_native_lumina2 import _pool_forward as _forward  # plain values (the frame rate) in the JSON part
from test_native_pool import comfy, comfy_forward, rel, tolerance  # noqa: F401

pytestmark = pytest.mark.comfy


def _model(tmp_path, weight_dtype):
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    stored = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(weight_dtype, torch.float32)
    path = tmp_path / f"ltxv_{weight_dtype}.safetensors"
    tiny.write_ltxv(path, seed=81, dtype=stored)
    opts = {"dtype": torch.float8_e4m3fn} if weight_dtype == "fp8_e4m3fn" else {}
    return load_diffusion_model(str(path), model_options=opts).model


def _inputs(base, frames, h, w, seed, per_token=False):
    dtype = base.manual_cast_dtype or base.diffusion_model.dtype
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[:, 4:] = 0
    t = torch.rand(2, frames * h * w, generator=g) if per_token else torch.rand(2, generator=g)
    return {"x": torch.randn(2, 128, frames, h, w, generator=g).to(dtype), "timestep": t,
            "context": torch.randn(2, 6, 4096, generator=g).to(dtype), "attention_mask": mask, "frame_rate": 24}


# fp32 with the slow set: tests/server_e2e/test_comfyui_ltxv.py runs the same degrees in fp32 against KSampler in CI
@pytest.mark.parametrize("weight_dtype", [pytest.param("fp32", marks=pytest.mark.slow),
                                          pytest.param("bf16", marks=pytest.mark.slow),
                                          pytest.param("fp16", marks=pytest.mark.slow), "fp8_e4m3fn"])
def test_ltxv_equals_comfyui(comfy, cpu_pool, tmp_path, weight_dtype):  # noqa: F811
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    base = _model(tmp_path, weight_dtype)
    assert family_adapter(base.diffusion_model).family == "ltxv"
    cases = [({"ulysses_degree": 2}, (3, 5, 7), False), ({"ring_degree": 2}, (2, 4, 6), True),
             ({"ulysses_degree": 2, "ring_degree": 2}, (3, 5, 7), True), ({"cfg_degree": 2}, (3, 5, 7), False)]
    for degrees, (f, h, w), per_token in cases:
        config = ParallelConfig(**degrees)
        inp = _inputs(base, f, h, w, seed=82 + h, per_token=per_token)
        ref = comfy_forward(base, inp)
        out = _forward(cpu_pool, config, f"ltxv:{weight_dtype}:{config.describe()}", base, inp)
        err = rel(out, ref)
        print(f"LTXV {weight_dtype} {config.describe()} {f}x{h}x{w} per-token {per_token}: rel {err:.2e}")
        assert out.shape == ref.shape and err <= tolerance(base), (degrees, err)


def test_ltxv_distrifusion_and_sharded_weights(comfy, cpu_pool, tmp_path):  # noqa: F811
    from test_native_hunyuan_video import distrifusion_and_sharded
    base = _model(tmp_path, "fp32")
    inp = _inputs(base, 3, 5, 7, seed=88)
    errs = distrifusion_and_sharded(cpu_pool, "ltxv", base, inp, _forward, comfy_forward(base, inp))
    print(f"LTX-Video: {errs}")
    assert all(e <= 1e-5 for e in errs.values()), errs


def _guide_inputs(base, strength, seed=91):
    """LTXVAddGuide's conditioning on a (3 + 1)-frame latent, built as ComfyUI's node builds it: the guide's latent
    frame appended to the video, its pixel coordinates (keyframe_idxs: the model's own patchifier, placed at pixel
    frame 8), a noise mask of 1 - strength over the guide (and, to make ComfyUI 0.33 drop guide tokens before the
    blocks, a negative patch), per-token timesteps, and ComfyUI 0.33's guide entry. Older ComfyUIs ignore the
    entry and the mask's negative values (their forward takes **kwargs): each is compared with its own forward."""
    from comfy.ldm.lightricks.symmetric_patchifier import latent_to_pixel_coords
    dm = base.diffusion_model
    dtype = base.manual_cast_dtype or dm.dtype
    g = torch.Generator().manual_seed(seed)
    f, h, w = 3, 5, 7
    x = torch.randn(2, 128, f + 1, h, w, generator=g)
    _, coords = dm.patchifier.patchify(x[:1, :, f:])
    keyframe_idxs = latent_to_pixel_coords(coords, dm.vae_scale_factors, causal_fix=True)
    keyframe_idxs[:, 0] += 8
    mask = torch.ones(2, 1, f + 1, h, w)
    mask[:, :, f] = 1.0 - strength
    mask[:, :, f, :2, :3] = -1.0  # dropped guide tokens (ComfyUI 0.33's grid mask)
    t = torch.rand(2, 1, generator=g) * mask.flatten(1)
    attention = torch.ones(2, 6, dtype=torch.int64)
    attention[:, 4:] = 0
    return {"x": x.to(dtype), "timestep": t, "context": torch.randn(2, 6, 4096, generator=g).to(dtype),
            "attention_mask": attention, "frame_rate": 24,
            "keyframe_idxs": keyframe_idxs.expand(2, *keyframe_idxs.shape[1:]).contiguous(), "denoise_mask": mask, "guide_attention_entries": [{"pre_filter_count": h * w, "strength": strength,
                                                               "pixel_mask": None, "latent_shape": [1, h, w]}]}


def test_ltxv_guides_equal_comfyui(comfy, cpu_pool, tmp_path):  # noqa: F811
    """LTXVAddGuide's keyframe conditioning under ulysses, ring and cfg: the guide tokens are repositioned (and on
    ComfyUI 0.33 partly dropped) before the first block, so the split carries them. A guide of strength other than 1
    makes ComfyUI 0.33 weight the attention with a mask over the whole sequence: refused under ulysses/ring with the
    reason, and exact under cfg (no sequence split)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    base = _model(tmp_path, "fp32")
    inp = _guide_inputs(base, 1.0)
    ref = comfy_forward(base, inp)
    moved = {**inp, "keyframe_idxs": inp["keyframe_idxs"].clone()}
    moved["keyframe_idxs"][:, 0] += 16
    assert rel(comfy_forward(base, moved), ref) > 1e-3, "the keyframe positions changed nothing"
    for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_degree": 2}):
        config = ParallelConfig(**degrees)
        err = rel(_forward(cpu_pool, config, f"ltxv_guide:{config.describe()}", base, inp), ref)
        print(f"LTXV guide strength 1 {config.describe()}: rel {err:.2e}")
        assert err <= 1e-5, (degrees, err)
    weak = _guide_inputs(base, 0.5)
    with pytest.raises(Exception, match="strength other than 1"):
        _forward(cpu_pool, ParallelConfig(ulysses_degree=2), "ltxv_guide:u2", base, weak)
    config = ParallelConfig(cfg_degree=2)
    err = rel(_forward(cpu_pool, config, "ltxv_guide:cfg2", base, weak), comfy_forward(base, weak))
    print(f"LTXV guide strength 0.5 cfg2: rel {err:.2e}")
    assert err <= 1e-5, err
