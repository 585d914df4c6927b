"""Parallel VAE Decode splits ComfyUI's TAESD (comfy/taesd/taesd.py) by rows, equal to ComfyUI's own VAE.decode.

ComfyUI's TAESD with random weights (torch's default init: ComfyUI's ops skip it, so every conv gets the torch
base class's reset_parameters) and non-trivial vae_scale / vae_shift (1.7 / 0.3), for 4 latent channels
(taesd, taesdxl) and 16 (taesd3, taef1), goes through `comfy.sd.VAE(sd=...)` (the reference: what VAEDecode returns
as IMAGE) and through the node's converter (converters.to_diffusers -> diffusers AutoencoderTiny). The ranks get
the twin as plain tensors (they never import ComfyUI) and decode the latent split by rows over 1, 2, 3 and 4 gloo
ranks, heights that divide by the rank count and heights that do not, with and without `block_size`. This is the
diffusers library API (parallel/vae/decode.py); the node decodes with ComfyUI's own TAESD module
(tests/families/test_patch_vae_native.py).
"""
import pytest
import torch
import torch.nn as nn

from comfyui_hybrid_parallel.parallel import AxisGroup, CommStats, ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.comm import split_sizes
from comfyui_hybrid_parallel.parallel.vae import patch_decode, world_axis
from dist_harness import context_for

pytestmark = [pytest.mark.dist, pytest.mark.comfy]
TOL = 1e-5
SCALE, SHIFT = 1.7, 0.3


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI importable in this process (CPU); never in the ranks."""
    from comfy_env import setup_comfy
    return setup_comfy()


def _random_taesd_sd(z: int, seed: int) -> dict:
    """A ComfyUI TAESD state dict (encoder, decoder, vae_scale, vae_shift) with torch's default conv init."""
    from comfy.taesd.taesd import TAESD
    torch.manual_seed(seed)
    model = TAESD(latent_channels=z)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.Conv2d.reset_parameters(m)  # comfy.ops.disable_weight_init.Conv2d's own is a no-op
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    sd["vae_scale"], sd["vae_shift"] = torch.tensor(SCALE), torch.tensor(SHIFT)
    return sd


@pytest.fixture(scope="module")
def taesd(comfy):
    """z -> (ComfyUI's VAE for the TAESD, the (class, config, state dict) twin Parallel VAE Decode ships to workers)."""
    import comfy.sd

    from converters import to_diffusers
    made = {}

    def get(z: int):
        if z not in made:
            vae = comfy.sd.VAE(sd=_random_taesd_sd(z, seed=100 + z), dtype=torch.float32)
            assert vae.latent_channels == z
            family, config, dsd = to_diffusers(vae.first_stage_model, "vae_taesd")
            assert family == "vae_taesd" and config["latent_channels"] == z
            assert config["num_decoder_blocks"] == [3, 3, 3, 1] and config["num_encoder_blocks"] == [1, 3, 3, 3]
            made[z] = vae, ("AutoencoderTiny", config, dsd)
        return made[z]
    return get


def _local_axis():
    return AxisGroup("world", 0, 1, [0], None, CommStats())


def _decode_body(n, twin, latent, block_size):
    """One rank: build the twin, decode its rows of `latent`; rank 0 returns the full decoder output."""
    from converters import build_model
    ctx = context_for(ParallelConfig(ulysses_degree=n)) if n > 1 else None
    ax = world_axis(ctx) if ctx is not None else _local_axis()
    model = build_model(*twin)
    out = patch_decode(model, latent, ax, block_size=block_size)
    halo = ctx.stats.snapshot().get("halo", {}).get("bytes", 0) if ctx is not None else 0
    return (out if ax.rank == 0 else None), halo


def _decode(dist_pools, n, twin, latent, block_size=None):
    """(rank 0's decoder output, halo bytes per rank) of a patch decode over n ranks (n = 1: in this process)."""
    if n == 1:
        out, halo = _decode_body(1, twin, latent, block_size)
        return out, [halo]
    res = dist_pools(n).run(_decode_body, n, twin, latent, block_size, timeout=240)
    return res[0][0], [r[1] for r in res]


def _rel(a, b):
    return float((a - b).norm() / b.norm())


CASES = [  # (ranks, latent channels, latent (B, C, H, W), block_size); the comment: latent rows per rank
    (1, 4, (1, 4, 6, 5), None),
    (1, 16, (1, 16, 5, 7), None),
    (2, 4, (1, 4, 8, 6), None),    # 4 4
    (2, 16, (1, 16, 7, 5), None),  # 4 3
    (3, 4, (2, 4, 7, 6), None),    # 3 2 2, batch 2
    (3, 16, (1, 16, 9, 4), 5),     # 3 3 3, convs in chunks of 5 output rows
    (4, 4, (1, 4, 5, 3), None),    # 2 1 1 1: one-row patches, fewer rows than a conv's reach
    (4, 16, (1, 16, 8, 6), None),  # 2 2 2 2
    (4, 4, (1, 4, 11, 5), 3),      # 3 3 3 2
]


@pytest.mark.parametrize("n, z, shape, block_size", CASES)
def test_taesd_patch_decode_equals_comfyui(dist_pools, taesd, n, z, shape, block_size):
    """The split decode, mapped to IMAGE as the node maps it, equals ComfyUI's VAE.decode: fp32 <= 1e-5 relative."""
    from converters.vae import diffusers_to_comfy_images, taesd_latent_in
    vae, twin = taesd(z)
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) * 3 + n))
    with torch.no_grad():
        ref = vae.decode(latent)
    assert ref.shape == (shape[0], 8 * shape[2], 8 * shape[3], 3)
    inside = ((ref > 0) & (ref < 1)).float().mean().item()
    assert 0.2 < inside < 1.0, f"the random TAESD's images should be mostly inside (0, 1) and clamp somewhere: {inside}"
    out, halos = _decode(dist_pools, n, twin, taesd_latent_in(latent, SCALE, SHIFT), block_size)
    got = diffusers_to_comfy_images(out)
    err = _rel(got, ref)
    print(f"TAESD z={z} {shape} over {n} rank(s), block_size={block_size}: images relative error vs ComfyUI {err:.2e}")
    assert got.shape == ref.shape and err <= TOL, err
    if n > 1:
        assert all(h > 0 for h in halos), halos  # the rows really were split: every rank exchanged halos


def test_a_split_without_halos_would_fail(taesd, comfy):
    """The comparison above can fail: decoding each rank's rows on their own (zero padding at the patch borders)
    differs from ComfyUI's decode by far more than the tolerance with these random weights."""
    from converters import build_model
    from converters.vae import diffusers_to_comfy_images, taesd_latent_in
    vae, twin = taesd(4)
    model = build_model(*twin)
    latent = torch.randn(1, 4, 8, 6, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = vae.decode(latent)
        parts = taesd_latent_in(latent, SCALE, SHIFT).split(split_sizes(8, 2), dim=2)
        naive = torch.cat([model.decode(p).sample for p in parts], dim=2)
    assert _rel(diffusers_to_comfy_images(naive), ref) > 1e-3


def test_scale_and_shift_are_applied_as_comfyui_does(taesd):
    """Without ComfyUI's (z - vae_shift) * vae_scale the twin decodes something else: the affine matters here."""
    from converters import build_model
    from converters.vae import diffusers_to_comfy_images
    vae, twin = taesd(16)
    latent = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = vae.decode(latent)
        plain = diffusers_to_comfy_images(build_model(*twin).decode(latent).sample)
    assert _rel(plain, ref) > 1e-2


def test_non_nearest_upsampling_is_refused():
    """AutoencoderTiny with bilinear upsampling mixes neighbouring rows: patch decode refuses it (even on one rank,
    before any decode), naming the module."""
    from diffusers import AutoencoderTiny
    vae = AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                          num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), upsample_fn="bilinear")
    with pytest.raises(ConfigError, match=r"decoder\.layers\.\d+: only nearest upsampling"):
        patch_decode(vae, torch.zeros(1, 4, 4, 4), _local_axis())
