"""ComfyUI checkpoint -> diffusers: the converted model computes what ComfyUI computes.

For each family a tiny random checkpoint is written in ComfyUI's own format (from ComfyUI's own
classes), loaded by ComfyUI exactly as its loader nodes do, converted by
tests/converters (test references), built as a diffusers model, and the two forwards
(diffusion model) or decodes (VAE) must agree to 1e-4 of the output's magnitude. Latent sizes are
odd and non-square where ComfyUI accepts them, so the padding conventions are exercised.

Marker `comfy`: needs ComfyUI (scripts/setup_comfyui.sh); without it these tests fail, never skip.
The Flux.1 equivalence test is also `slow` (hidden 3072 is forced: ~55 s, ~6 GB RSS); a cheap
meta-device check of the Flux key mapping always runs.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import comfy_env
from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc

comfy_env.setup_comfy()  # before anything imports comfy.model_management (forces --cpu)

import comfy.model_base  # noqa: E402
import comfy.sd  # noqa: E402
import comfy.supported_models as sm  # noqa: E402
import comfy.utils  # noqa: E402

import converters as ck  # noqa: E402

pytestmark = pytest.mark.comfy

REL_TOL = 1e-4


def assert_matches(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != ComfyUI {tuple(ref.shape)}"
    scale = ref.abs().max().item()
    assert scale > 1e-2, f"{what}: ComfyUI output is ~0 ({scale}); the comparison would prove nothing"
    err = (out - ref).abs().max().item()
    assert err <= REL_TOL * scale, f"{what}: max |diffusers - ComfyUI| = {err:.3e} > {REL_TOL} x {scale:.3e}"


def load_comfy_unet(path):
    patcher = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float32})
    return patcher.model


def diffusers_from_file(path, family):
    sd = load_file(str(path))
    assert ck.detect_family(sd) == family
    cls, cfg, dsd = ck.convert(family, sd)
    return ck.build_model(cls, cfg, dsd), cfg


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("comfy_ckpts")


def test_missing_comfyui_fails_with_install_hint(tmp_path, monkeypatch):
    monkeypatch.setenv("COMFYUI_DIR", str(tmp_path))  # a directory without ComfyUI in it
    with pytest.raises(pytest.fail.Exception, match="scripts/setup_comfyui.sh"):
        comfy_env.setup_comfy()


def test_tiny_checkpoints_are_deterministic(tmp_path):
    a = tc.write_sd3(tmp_path / "a.safetensors", seed=3)
    b = tc.write_sd3(tmp_path / "b.safetensors", seed=3)
    c = tc.write_sd3(tmp_path / "c.safetensors", seed=4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["x_embedder.proj.weight"], c["x_embedder.proj.weight"])
    assert load_file(str(tmp_path / "a.safetensors")).keys() == a.keys()


def test_sd3_matches_comfy(ckpt_dir):
    path = ckpt_dir / "sd3.safetensors"
    tc.write_sd3(path)
    model = load_comfy_unet(path)
    assert isinstance(model, comfy.model_base.SD3) and isinstance(model.model_config, sm.SD3)
    dm, cfg = diffusers_from_file(path, "sd3")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 9, 13, generator=gen)  # odd, non-square: padded to the 2x2 patch
    ctx = torch.randn(2, 7, tc.TINY_CONTEXT_DIM, generator=gen)
    y = torch.randn(2, tc.TINY_POOLED_DIM, generator=gen)
    t = torch.tensor([500.0, 730.0])  # ComfyUI's SD3 timestep: sigma * 1000
    with torch.no_grad():
        ref = model.diffusion_model(x, t, context=ctx, y=y)
        out = ck.sd3.diffusers_to_comfy_output(dm(**ck.sd3.comfy_to_diffusers_inputs(x, t, ctx, y=y, config=cfg)), x.shape)
    assert_matches(out, ref, "sd3")


def test_wan_matches_comfy(ckpt_dir):
    path = ckpt_dir / "wan.safetensors"
    tc.write_wan(path)
    model = load_comfy_unet(path)
    assert isinstance(model, comfy.model_base.WAN21) and isinstance(model.model_config, sm.WAN21_T2V)
    dm, cfg = diffusers_from_file(path, "wan")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 16, 3, 9, 13, generator=gen)
    ctx = torch.randn(1, 7, 4096, generator=gen)
    t = torch.tensor([640.0])
    with torch.no_grad():
        ref = model.diffusion_model(x, t, ctx)
        out = ck.wan.diffusers_to_comfy_output(dm(**ck.wan.comfy_to_diffusers_inputs(x, t, ctx, config=cfg)), x.shape)
    assert_matches(out, ref, "wan")


def test_pixart_matches_comfy_across_resolutions(ckpt_dir):
    path = ckpt_dir / "pixart.safetensors"
    tc.write_pixart(path)
    model = load_comfy_unet(path)
    assert isinstance(model, comfy.model_base.PixArt) and isinstance(model.model_config, sm.PixArtSigma)
    dm, cfg = diffusers_from_file(path, "pixart")
    gen = torch.Generator().manual_seed(3)
    # ComfyUI's PixArt needs even sizes and (H+W)//2 >= 33; the second size switches pe from 1 to 2.
    for shape, pe in (((2, 4, 34, 36), 1), ((1, 4, 96, 98), 2)):
        assert ck.pixart.pe_scale(*shape[-2:]) == pe
        x = torch.randn(shape, generator=gen)
        ctx = torch.randn(shape[0], 8, 4096, generator=gen)
        t = torch.linspace(100.0, 900.0, shape[0])
        ck.pixart.set_resolution(dm, *shape[-2:])
        with torch.no_grad():
            ref = model.diffusion_model(x, t, ctx)
            out = ck.pixart.diffusers_to_comfy_output(dm(**ck.pixart.comfy_to_diffusers_inputs(x, t, ctx)), x.shape)
        assert_matches(out, ref, f"pixart {shape}")


def test_pixart_inputs_refuse_sizes_comfy_cannot_run():
    ctx = torch.zeros(1, 8, 4096)
    with pytest.raises(ValueError, match="even"):
        ck.pixart.comfy_to_diffusers_inputs(torch.zeros(1, 4, 35, 36), 1.0, ctx)
    with pytest.raises(ValueError, match="too small"):
        ck.pixart.comfy_to_diffusers_inputs(torch.zeros(1, 4, 32, 32), 1.0, ctx)


@pytest.mark.parametrize("guidance", [True, False], ids=["dev", "schnell"])
def test_flux_mapping_is_complete_on_meta(guidance):
    """Cheap guard for the slow test below: ComfyUI's Flux on the meta device converts to exactly
    the keys and shapes of diffusers' FluxTransformer2DModel built from the inferred config."""
    import diffusers
    import comfy.ops
    from comfy.ldm.flux.model import Flux, FluxParams

    comfy_flux = Flux(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=tc.TINY_POOLED_DIM,
                      context_in_dim=tc.TINY_CONTEXT_DIM, hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=2,
                      depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
                      guidance_embed=guidance, operations=comfy.ops.disable_weight_init, device="meta",
                      **tc.detected(FluxParams, txt_ids_dims=[]))
    sd = comfy_flux.state_dict()
    assert ck.detect_family(sd) == "flux"
    cls, cfg, dsd = ck.convert("flux", sd)
    assert cfg["guidance_embeds"] is guidance and cfg["num_layers"] == 2 and cfg["num_single_layers"] == 2
    with torch.device("meta"):
        ref = getattr(diffusers, cls)(**cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in dsd.items()} == {k: tuple(v.shape) for k, v in ref.items()}


@pytest.mark.slow
def test_flux_dev_matches_comfy(ckpt_dir):
    path = ckpt_dir / "flux.safetensors"
    tc.write_flux(path, guidance=True)  # bf16 on disk; both sides compute in float32
    model = load_comfy_unet(path)
    assert isinstance(model, comfy.model_base.Flux) and type(model.model_config) is sm.Flux
    dm, cfg = diffusers_from_file(path, "flux")
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 16, 9, 13, generator=gen)
    ctx = torch.randn(1, 7, tc.TINY_CONTEXT_DIM, generator=gen)
    y = torch.randn(1, tc.TINY_POOLED_DIM, generator=gen)
    t, g = torch.tensor([0.7]), torch.tensor([3.5])  # ComfyUI's Flux timestep is sigma
    with torch.no_grad():
        ref = model.diffusion_model(x, t, ctx, y=y, guidance=g)
        kwargs = ck.flux.comfy_to_diffusers_inputs(x, t, ctx, y=y, guidance=g, config=cfg)
        out = ck.flux.diffusers_to_comfy_output(dm(**kwargs), x.shape)
    assert_matches(out, ref, "flux dev")
    with pytest.raises(ValueError, match="guidance"):
        ck.flux.comfy_to_diffusers_inputs(x, t, ctx, y=y, config=cfg)


def test_detection_and_family_errors(ckpt_dir):
    sd = tc.write_wan(ckpt_dir / "wan_err.safetensors")
    prefixed = {f"model.diffusion_model.{k}": v for k, v in sd.items()}
    assert ck.detect_family(prefixed) == "wan"
    with pytest.raises(ck.CheckpointError, match="family='wan'"):
        ck.convert("sd3", sd)
    with pytest.raises(ck.CheckpointError, match="unknown family"):
        ck.convert("unet", sd)
    with pytest.raises(ck.CheckpointError, match="not a supported ComfyUI checkpoint"):
        ck.detect_family({"foo.weight": torch.zeros(1)})
    i2v = dict(sd, **{"img_emb.proj.0.bias": torch.zeros(4)})
    with pytest.raises(ck.CheckpointError, match="text-to-video"):
        ck.convert("wan", i2v)
