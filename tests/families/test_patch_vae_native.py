"""Patch VAE Decode on ComfyUI's own VAE modules, end to end through the node and the worker pool, against ComfyUI's
VAE.decode (what VAE Decode returns).

The workers build the VAE model ComfyUI's detection builds from the weights (workers/bridge/build.build_native_vae)
and split its decode by rows with the declared stand-ins (parallel/vae/native.py, comfy_vaes.py). Every VAE class
declared is here, with random weights in ComfyUI's format: the KL VAE as SD (quant convs, 4 channels), as Flux.1
(AutoencodingEngine, 16 channels) and as Flux.2 (batch-norm latent un-shuffled into 2x2 pixel blocks), TAESD with 4
and 16 channels, the Wan 2.1 and Wan 2.2 video VAEs, TAEHV (16 and 48 channels: the frame-by-frame memory blocks),
HunyuanVideo 1.0 (Kandinsky 5's video VAE) and 1.5, LTX-2's video VAE; over 2, 3 and 4 ranks (4: slow), latents
whose heights do and do not divide, with and without `block_size`; a bf16 VAE. The VAEs nobody declared, and latents
that do not fit, are refused before any worker starts.
"""
import types

import pytest
import torch

pytestmark = pytest.mark.comfy

TOL = 1e-5


@pytest.fixture(scope="module")
def comfy():
    from comfy_env import setup_comfy
    return setup_comfy()


SCALE, SHIFT = 1.7, 0.3  # TAESD's latent scale and shift (a real file stores its own; these make them matter)


def _random_taesd_sd(z: int, seed: int) -> dict:
    """A ComfyUI TAESD state dict (encoder, decoder, vae_scale, vae_shift) with torch's default conv init."""
    import torch.nn as nn
    from comfy.taesd.taesd import TAESD
    torch.manual_seed(seed)
    model = TAESD(latent_channels=z)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.Conv2d.reset_parameters(m)  # comfy.ops.disable_weight_init.Conv2d's own is a no-op
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["vae_scale"], sd["vae_shift"] = torch.tensor(SCALE), torch.tensor(SHIFT)
    return sd


def _flux2_sd(seed: int) -> dict:
    """The SD KL VAE's weights with Flux.2's batch-norm statistics (ComfyUI then decodes 4 x 4 = 16-channel latents
    at twice the downscale: channels un-shuffled into 2 x 2 pixel blocks before the decoder)."""
    import tempfile

    from safetensors.torch import load_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    with tempfile.TemporaryDirectory() as d:
        tc.write_kl_vae(f"{d}/kl.safetensors", style="sd", seed=seed)
        sd = load_file(f"{d}/kl.safetensors")
    g = torch.Generator().manual_seed(seed)
    sd["bn.running_mean"] = torch.randn(16, generator=g) * 0.3
    sd["bn.running_var"] = torch.rand(16, generator=g) + 0.5
    sd["bn.num_batches_tracked"] = torch.tensor(10)
    return sd


@pytest.fixture(scope="module")
def vaes(comfy, tmp_path_factory):
    """name -> ComfyUI's VAE (comfy.sd.VAE from a state dict, as VAELoader builds it)."""
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    d = tmp_path_factory.mktemp("vaes")
    tc.write_kl_vae(d / "kl4.safetensors", style="sd", seed=41)
    tc.write_kl_vae(d / "kl16.safetensors", style="flux", seed=42)
    tc.write_wan_vae(d / "wan21.safetensors", seed=43)
    tc.write_wan22_vae(d / "wan22.safetensors", seed=44)
    sds = {name: comfy.utils.load_torch_file(str(d / f"{name}.safetensors"))
           for name in ("kl4", "kl16", "wan21", "wan22")}
    sds["flux2"] = _flux2_sd(45)
    sds["taesd4"], sds["taesd16"] = _random_taesd_sd(4, seed=46), _random_taesd_sd(16, seed=47)
    from comfy.taesd.taehv import TAEHV

    from comfyui_hybrid_parallel.doctor.tiny_checkpoints import _random_state_dict
    for z in (16, 48):  # lighttaew2_1 (fp32 weights: no latent format) and Wan 2.2's taew2_2
        with torch.device("meta"):
            taehv = TAEHV(latent_channels=z)
        sds[f"taehv{z}"] = _random_state_dict(taehv, 50 + z, torch.float32)
    out = {name: comfy.sd.VAE(sd=sd) for name, sd in sds.items()}
    assert type(out["flux2"].first_stage_model).__name__ == "AutoencoderKL" and out["flux2"].latent_channels == 16
    assert type(out["kl16"].first_stage_model).__name__ == "AutoencodingEngine"
    return out


@pytest.fixture(scope="module")
def hunyuan10(comfy, tmp_path_factory):
    """HunyuanVideo 1.0's 3-D KL VAE with random weights (its detection fixes the 128-wide, 4-level layout), built by
    ComfyUI's VAE from the file as VAELoader does."""
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    path = tmp_path_factory.mktemp("hv10") / "hunyuan_video_vae.safetensors"
    tc.write_hunyuan_video_vae(path, seed=60)
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(path)))
    # ComfyUI 0.3.75: VideoConv3d (pads itself); later: CarriedConv3d (padded and carried by conv_carry_causal_3d)
    assert type(vae.first_stage_model.decoder.conv_in).__name__ in ("VideoConv3d", "CarriedConv3d")
    return vae


def test_hunyuan_video_10_vae_replicate_padding(hunyuan10, runtime):
    """HunyuanVideo 1.0's 3-D KL decoder: every 3x3x3 conv pads by replicating rows (and frames in front), so a band
    gets its neighbours' rows at inner borders and repeats its own edge row only at the image's true top and bottom;
    the mid attention spans every frame's pixels (keys and values gathered over all ranks). 2 ranks, an odd latent
    height (tests/engine/test_patch_vae.py checks the padded-conv stand-in alone, replicate and reflect). 3 latent frames:
    later ComfyUIs run the up levels in 2-frame chunks, each conv's padded input frames carried into the next."""
    _assert_decode_equals(runtime, hunyuan10, torch.randn(1, 16, 3, 5, 4, generator=torch.Generator().manual_seed(61)),
                          2, "HunyuanVideo 1.0")


@pytest.mark.slow  # 4 processes on 2 cores
def test_hunyuan_video_10_vae_over_4_ranks(hunyuan10, runtime):
    """The same over 4 ranks: a 6-row latent split 2/2/1/1, so two ranks hold a single latent row."""
    _assert_decode_equals(runtime, hunyuan10, torch.randn(1, 16, 2, 6, 4, generator=torch.Generator().manual_seed(64)),
                          4, "HunyuanVideo 1.0")


@pytest.fixture(scope="module")
def ltx2(comfy, tmp_path_factory):
    """LTX-2's video VAE at tiny widths, built by ComfyUI's VAE from the file and its header as VAELoader (and an LTX-2
    checkpoint's loader) does: the configuration comes from the header."""
    import comfy.sd
    import comfy.utils

    from comfyui_hybrid_parallel.doctor import tiny_vaes
    path = tmp_path_factory.mktemp("ltx2") / "ltx2_video_vae.safetensors"
    tiny_vaes.write_ltx2_vae(path, seed=70)
    sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    vae = comfy.sd.VAE(sd=sd, metadata=metadata)
    model = vae.first_stage_model
    assert type(model).__name__ == "VideoVAE" and not model.timestep_conditioning
    assert model.decoder.conv_in.conv.padding_mode == "zeros"
    return vae


@pytest.mark.slow  # a 33-frame decode ~6000 pixels tall (its last level: twice ComfyUI's chunk budget), twice
def test_ltx2_video_vae_frame_chunks_agree(ltx2, runtime):
    """Later ComfyUIs' LTX decoder cuts each level's output into frame chunks by the bytes it holds (at most
    get_max_chunk_size: 32 to 128 MiB by the device's memory). The latent is sized so that the last level's top band
    (k + 1 latent rows) holds more than the budget and the bottom band (k rows) not: alone, the top band would cut 2
    chunks and the bottom one 1, and their convolutions would exchange border rows with different calls. Every band
    cuts the serial decode's 3 chunks (the bytes summed over the ranks)."""
    from comfy.ldm.lightricks.vae import causal_video_autoencoder as cva
    if not hasattr(cva, "get_max_chunk_size"):
        pytest.skip("this ComfyUI's LTX decoder does not chunk frames")
    budget = cva.get_max_chunk_size(torch.device("cpu"))  # the workers run on this machine's CPU as well
    frames, width = 33, 20  # 5 latent frames; 8 channels at the last level, 8 pixel rows and columns per latent one
    row_bytes = 8 * 4 * frames * 8 * (width * 8)
    k = budget // row_bytes
    assert row_bytes * k <= budget < row_bytes * (k + 1)
    latent = torch.randn(1, 128, 5, 2 * k + 1, width, generator=torch.Generator().manual_seed(75))
    with torch.inference_mode():  # as ComfyUI runs a node (its chunked decode adds into split views in place)
        _assert_decode_equals(runtime, ltx2, latent, 2, "LTX-2 (frame chunks)")


HV15_DDCONFIG = {"block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
                 "num_res_blocks": 2, "ffactor_spatial": 16, "ffactor_temporal": 4, "downsample_match_channel": True,
                 "upsample_match_channel": True, "z_channels": 32}


@pytest.mark.slow  # detection fixes an 871M-parameter decoder (3.5 GB in fp32)
def test_hunyuan_video_15_vae_prepadded_convs(comfy, runtime):
    """HunyuanVideo 1.5's VAE: its 3x3x3 convs are padded by their caller (replicated rows, the previous 2-frame
    chunk's last frames in front), the up stages run 2-frame chunks carrying conv inputs across them, the mid
    attention spans every frame. 2 ranks, an odd latent height, 3 latent frames (two chunks after the first)."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    from comfyui_hybrid_parallel.doctor.tiny_checkpoints import _random_state_dict
    with torch.device("meta"):
        model = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.EmptyRegularizer"},
            encoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Encoder", "params": HV15_DDCONFIG},
            decoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Decoder", "params": HV15_DDCONFIG})
    sd = {f"decoder.{k}": v for k, v in _random_state_dict(model.decoder, 62, torch.float32).items()}
    vae = comfy.sd.VAE(sd=sd)  # (detection reads decoder keys only; the encoder is not used by a decode)
    del sd
    assert type(vae.first_stage_model.decoder).__qualname__ == "Decoder" and vae.latent_channels == 32
    _assert_decode_equals(runtime, vae, torch.randn(1, 32, 3, 5, 4, generator=torch.Generator().manual_seed(63)), 2,
                          "HunyuanVideo 1.5")


@pytest.fixture(scope="module")
def runtime():
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    rt = Runtime()
    yield rt
    rt.stop()


def _node(runtime):
    from comfyui_hybrid_parallel.nodes.vae_node import PatchVAEDecode
    node = PatchVAEDecode()
    node.runtime = runtime
    return node


def _hp(n):
    from comfyui_hybrid_parallel.workers.driver.configs import HybridParallelConfig
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    return HybridParallelConfig(ParallelConfig(ulysses_degree=n), device="cpu")


def _vae_decode(vae, latent):
    """ComfyUI's VAEDecode node: VAE.decode, frames folded into the batch."""
    images = vae.decode(latent)
    return images.reshape(-1, *images.shape[-3:]) if images.ndim == 5 else images


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# The 2-rank decodes first (after HunyuanVideo 1.0's above), then CASES 2 ranks, 3 ranks, then LTX-2 3 ranks, 2
# ranks: one world switch per change of ranks, in file order
def test_bf16_vae_decodes_in_bf16(comfy, vaes, runtime):
    """A bf16 VAE (ComfyUI's choice on GPUs) decodes in bf16 on the workers, the latent cast as ComfyUI casts it: the
    split's only difference is rounding (GroupNorm statistics in fp32, attention kernel), within bf16's."""
    import comfy.sd
    sd = {k: v.to(torch.bfloat16) for k, v in vaes["kl16"].first_stage_model.state_dict().items()}
    vae = comfy.sd.VAE(sd=sd, dtype=torch.bfloat16)
    assert vae.vae_dtype == torch.bfloat16
    latent = torch.randn(1, 16, 3, 2, generator=torch.Generator().manual_seed(48))  # odd: a 2/1 row split (CPU bf16 convs are slow)
    ref = _vae_decode(vae, latent)
    (got,) = _node(runtime).decode({"samples": latent}, vae, _hp(2))
    err = _rel(got, ref)
    print(f"Patch VAE Decode bf16 KL: rel {err:.2e}")
    assert err <= 2e-2, err


def test_the_driver_copy_becomes_the_workers_pages(comfy, vaes, runtime):
    """ComfyUI's own VAE weights are what the workers map (one host copy): after a decode each of them lives in a
    shared-memory file's pages, and ComfyUI's VAE still decodes the same."""
    import comfy.sd
    vae = comfy.sd.VAE(sd={k: v.clone() for k, v in vaes["kl4"].first_stage_model.state_dict().items()})
    latent = torch.randn(1, 4, 6, 6, generator=torch.Generator().manual_seed(49))
    before = _vae_decode(vae, latent)
    w = vae.first_stage_model.decoder.conv_in.weight
    ptr = w.untyped_storage().data_ptr()
    _node(runtime).decode({"samples": latent}, vae, _hp(2))
    w = vae.first_stage_model.decoder.conv_in.weight
    assert w.untyped_storage().data_ptr() != ptr
    assert torch.equal(_vae_decode(vae, latent), before)


_slow = pytest.mark.slow  # CI keeps one 3-rank case per kind of decoder; the full matrix runs with -m slow
CASES = [  # (VAE, ranks, latent shape, block_size): heights that divide and heights that do not; grouped by ranks
    ("kl4", 2, (2, 4, 10, 6), 0), ("kl16", 2, (1, 16, 9, 7), 0), ("flux2", 2, (1, 16, 5, 4), 0),
    ("taesd4", 2, (1, 4, 7, 6), 0), ("wan21", 2, (1, 16, 3, 7, 6), 0), ("wan22", 2, (1, 48, 2, 5, 2), 0),
    ("kl4", 3, (1, 4, 7, 5), 3), pytest.param("kl16", 3, (1, 16, 6, 4), 0, marks=_slow),
    pytest.param("taesd16", 3, (1, 16, 6, 5), 4, marks=_slow), ("wan21", 3, (1, 16, 2, 6, 5), 2),
    pytest.param("wan22", 3, (1, 48, 2, 6, 3), 0, marks=_slow), ("taehv16", 3, (1, 16, 3, 7, 5), 0),
    pytest.param("taehv48", 3, (1, 48, 2, 5, 4), 0, marks=_slow),
    # 4 ranks (slow: 4 processes on 2 cores): heights 9 and 10 split 3/2/2/2 and 3/3/2/2
    pytest.param("kl16", 4, (1, 16, 9, 7), 0, marks=_slow), pytest.param("kl4", 4, (1, 4, 10, 6), 2, marks=_slow),
    pytest.param("wan21", 4, (1, 16, 2, 9, 6), 0, marks=_slow), pytest.param("taesd4", 4, (1, 4, 9, 6), 0, marks=_slow),
    pytest.param("taehv16", 4, (1, 16, 2, 10, 5), 0, marks=_slow),
]


def _id(c):
    c = c.values if hasattr(c, "values") else c
    return f"{c[0]}-{c[1]}r-{c[2][-2]}rows"


@pytest.mark.parametrize("name, n, shape, block_size", CASES, ids=[_id(c) for c in CASES])
def test_patch_vae_decode_equals_vae_decode(vaes, runtime, name, n, shape, block_size):
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + n))
    _assert_decode_equals(runtime, vaes[name], latent, n, name, block_size)


# 3 ranks first: this test runs after the CASES above, whose last CI world has 3 ranks (one world switch fewer)
LTX2_CASES = [(3, (1, 128, 2, 6, 3)), (2, (1, 128, 3, 5, 4))]


@pytest.mark.parametrize("n, shape", LTX2_CASES, ids=[f"{n}r-{s[-2]}rows" for n, s in LTX2_CASES])
def test_ltx2_video_vae(ltx2, runtime, n, shape):
    """LTX-2's video VAE (LTX's VideoVAE, configured from the file's header, which the workers get with the weights):
    causal convs padding time with frame copies and space with zeros, depth-to-space upsampling (channels into 2x2
    pixel blocks, rows in order), pixel norms over channels, a 4x4 unpatchify. Heights that do and do not divide."""
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(71 + n))
    if not hasattr(ltx2.first_stage_model, "config"):  # ComfyUI 0.3.75: refused, the workers could not rebuild it
        msg = _refuse(ltx2.first_stage_model, latent, n)
        assert "keeps no copy of the configuration" in msg, msg
        return
    _assert_decode_equals(runtime, ltx2, latent, n, "LTX-2")


def _assert_decode_equals(runtime, vae, latent, n, name, block_size=0):
    """Parallel VAE Decode over `n` ranks equals ComfyUI's VAE Decode (float32 images, ≤ TOL)."""
    ref = _vae_decode(vae, latent)
    (got,) = _node(runtime).decode({"samples": latent}, vae, _hp(n), block_size=block_size)
    err = _rel(got, ref)
    print(f"Patch VAE Decode {name} {tuple(latent.shape)} over {n} ranks (block {block_size}): rel {err:.2e}")
    assert got.shape == ref.shape and got.dtype == torch.float32 and err <= TOL, (name, err)
    assert 0.05 < (ref < 1).float().mean().item(), "the decode is not clamped flat: the test proves something"


def _refuse(first_stage_model, latent, ranks=2, **vae_attrs):
    """Patch VAE Decode's error for what it must refuse, with a pool that fails the test if anything started."""
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime

    def no_pool(device):
        raise AssertionError("a worker pool was started for a decode that must be refused first")
    node = _node(Runtime(make_pool=no_pool))
    with pytest.raises(ValueError) as e:
        node.decode({"samples": latent}, types.SimpleNamespace(first_stage_model=first_stage_model, **vae_attrs),
                    _hp(ranks))
    return str(e.value)


def test_vaes_nobody_declared_are_refused_before_any_worker(comfy, vaes):
    """HunyuanImage 2.1's VAE (a KL engine with another decoder) and HunyuanVideo 1.5's non-refiner variant are
    refused naming the class, why and VAE Decode; so are a latent of the wrong rank (an image latent for HunyuanVideo
    1.0's VAE) and one too short for the ranks. Nothing starts a pool."""
    from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    with torch.device("meta"):
        hi21 = {"block_out_channels": [128, 256, 512, 512, 1024, 1024], "in_channels": 3, "out_channels": 3,
                "num_res_blocks": 2, "ffactor_spatial": 32, "downsample_match_channel": True,
                "upsample_match_channel": True, "z_channels": 64}
        hunyuan_image = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.hunyuan_video.vae.Encoder", "params": hi21},
            decoder_config={"target": "comfy.ldm.hunyuan_video.vae.Decoder", "params": hi21})
        hv15 = dict(HV15_DDCONFIG, refiner_vae=False)
        hunyuan15_plain = AutoencodingEngine(
            regularizer_config={"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"},
            encoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Encoder", "params": hv15},
            decoder_config={"target": "comfy.ldm.hunyuan_video.vae_refiner.Decoder", "params": hv15})
        hunyuan10 = AutoencoderKL(ddconfig=tc.HUNYUAN_VIDEO_VAE_DDCONFIG, embed_dim=16)
    msg = _refuse(hunyuan_image, torch.zeros(1, 64, 4, 4))
    assert "HunyuanImage 2.1's decoder" in msg and "VAE Decode (Tiled)" in msg, msg
    msg = _refuse(hunyuan15_plain, torch.zeros(1, 32, 2, 4, 4))
    assert "non-refiner variant" in msg, msg
    msg = _refuse(hunyuan10, torch.zeros(1, 16, 4, 4))  # declared (KL3D): a video latent it needs
    assert "HunyuanVideo 1.0's 3-D KL video VAE" in msg and "video (B, C, T, H, W)" in msg, msg
    msg = _refuse(vaes["wan22"].first_stage_model, torch.zeros(1, 48, 4, 4))
    assert "video (B, C, T, H, W)" in msg and "(1, 48, 4, 4)" in msg, msg
    msg = _refuse(vaes["kl16"].first_stage_model, torch.zeros(1, 16, 3, 8), ranks=4)
    assert "3 rows tall cannot be split over 4 ranks" in msg and "at most 3 ranks" in msg, msg


def test_video_vaes_refused_with_their_reason_before_any_worker(comfy):
    """LTX-Video 0.9.1+'s VAE (timestep conditioned: its decode mixes unseeded noise into the latent) and 0.9.0's
    (reflect padding in space), MiniMax H3's
    (a ViT decoder over internally tiled frames) and CogVideoX's (a causal conv that convolves outside its child
    conv) are refused with the written reason, before any worker starts."""
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    with torch.device("meta"):
        ltxv = VideoVAE(version=1)
    msg = _refuse(ltxv, torch.zeros(1, 128, 2, 4, 4))
    assert "timestep conditioned" in msg and "unseeded" in msg and "VAE Decode" in msg, msg
    with torch.device("meta"):
        ltxv_090 = VideoVAE(version=0)  # not conditioned; no spatial_padding_mode in its configuration: reflect
    msg = _refuse(ltxv_090, torch.zeros(1, 128, 2, 4, 4))
    assert "padding_mode='reflect'" in msg or not hasattr(ltxv_090, "config"), msg  # (0.3.75: refused before that)
    import importlib.util
    if importlib.util.find_spec("comfy.ldm.minimax") is not None:  # (ComfyUIs after 0.3.75)
        import comfy.ldm.minimax.vae as minimax
        with torch.device("meta"):
            h3 = minimax.MiniMaxH3VideoVAE()
        msg = _refuse(h3, torch.zeros(1, 24, 2, 4, 4))
        assert "MiniMax H3" in msg and "tile" in msg, msg
    if importlib.util.find_spec("comfy.ldm.cogvideo") is not None:
        from comfy.ldm.cogvideo.vae import AutoencoderKLCogVideoX
        with torch.device("meta"):
            cog = AutoencoderKLCogVideoX(latent_channels=16)
        msg = _refuse(cog, torch.zeros(1, 16, 2, 4, 4))
        assert "CogVideoX" in msg and "fast path" in msg, msg


def test_flux2_tae_is_refused_before_any_worker(comfy):
    """Flux.2's TAE (taef2: a TAESD whose decoder un-shuffles 128 latent channels into 2x2 pixel blocks and whose
    first blocks hold a GroupNorm; ComfyUIs after 0.3.75) is built by ComfyUI only with VAELoader's metadata, which
    the workers' rebuild from the weights does not get: refused naming it, before any worker starts."""
    import comfy.taesd.taesd as taesd
    if not hasattr(taesd, "DecoderFlux2"):
        pytest.skip("this ComfyUI has no Flux.2 TAE")
    with torch.device("meta"):
        model = taesd.TAESD(latent_channels=128)
    msg = _refuse(model, torch.zeros(1, 128, 4, 4))
    assert "taef2" in msg and "VAE Decode" in msg, msg


def test_every_written_refusal_names_a_class_of_this_comfyui(comfy):
    """The refused VAEs' reasons and the declarations are keyed by class names: each must name a class of the
    ComfyUI in use (a typo would silently fall back to the generic message, or refuse a module), except the names of
    RENAMED, one side of which it must have (each side is checked by the run on the ComfyUI that has it), and those of
    ADDED_LATER, checked where their module imports."""
    import importlib

    from comfyui_hybrid_parallel.parallel.vae.comfy_vaes import ADDED_LATER, DECLARED, RENAMED, REFUSED

    def exists(name):
        module, _, cls = name.rpartition(".")
        try:
            return isinstance(getattr(importlib.import_module(module), cls, None), type)
        except ImportError:
            return False
    names = [n for key in REFUSED for n in key.split("/")]
    names += [n for v in DECLARED for n in (*v.classes, *v.row_local, *v.attention, *v.convs, *v.padded,
                                                *v.prepadded, *((v.decoder,) if v.decoder else ()))]
    partner = {a: b for pair in RENAMED for a, b in (pair, pair[::-1])}
    for pair in RENAMED:
        assert any(exists(n) for n in pair), pair
    for name in names:
        if name in ADDED_LATER and not _module_imports(name):
            continue
        assert exists(name) or (name in partner and exists(partner[name])), name


def _module_imports(name: str) -> bool:
    import importlib
    try:
        importlib.import_module(name.rpartition(".")[0])
        return True
    except ImportError:
        return False
