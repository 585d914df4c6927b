"""Parallel VAE Decode splits ComfyUI's TAESD (comfy/taesd/taesd.py) by rows, equal to ComfyUI's own VAE.decode.

ComfyUI's TAESD with random weights (torch's default init: ComfyUI's ops skip it, so every conv gets the torch
base class's reset_parameters) and non-trivial vae_scale / vae_shift (1.7 / 0.3), for 4 latent channels
(taesd, taesdxl) and 16 (taesd3, taef1), goes through `comfy.sd.VAE(sd=...)` (the reference: what VAEDecode returns
as IMAGE) and through the node's converter (nodes.runtime.to_diffusers -> diffusers AutoencoderTiny). The ranks get
the twin as plain tensors (they never import ComfyUI) and decode the latent split by rows over 1, 2, 3 and 4 gloo
ranks, heights that divide by the rank count and heights that do not, with and without `block_size`. The node
itself (check_vae, the latent's scale/shift, the IMAGE mapping) runs against a pool whose workers are those gloo
ranks; which VAEs check_vae accepts and refuses is checked before any worker could start.
"""
import types

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

    from comfyui_hybrid_parallel.nodes.runtime import to_diffusers
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
    from comfyui_hybrid_parallel.parallel.checkpoints import build_model
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
    from comfyui_hybrid_parallel.parallel.checkpoints.vae import diffusers_to_comfy_images, taesd_latent_in
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
    from comfyui_hybrid_parallel.parallel.checkpoints import build_model
    from comfyui_hybrid_parallel.parallel.checkpoints.vae import diffusers_to_comfy_images, taesd_latent_in
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
    from comfyui_hybrid_parallel.parallel.checkpoints import build_model
    from comfyui_hybrid_parallel.parallel.checkpoints.vae import diffusers_to_comfy_images
    vae, twin = taesd(16)
    latent = torch.randn(1, 16, 4, 4, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = vae.decode(latent)
        plain = diffusers_to_comfy_images(build_model(*twin).decode(latent).sample)
    assert _rel(plain, ref) > 1e-2


class _GlooPool:
    """A stand-in for the worker pool whose workers are the test's gloo ranks: ensure_model keeps the twin the node
    converted, submit("vae_decode") runs what a worker's job does (patch_decode over the world) and returns rank 0's
    full decoder output, as workers/jobs.py job_vae_decode does."""

    def __init__(self, dist_pools, device):
        self.dist_pools, self.device, self.models, self.submitted = dist_pools, device, {}, []

    def ensure_model(self, config, key, family, diffusers_config, state_dict=None, **kw):
        sd = state_dict() if callable(state_dict) else state_dict
        self.models[key] = (family, ("AutoencoderTiny", diffusers_config, sd))
        return {"loaded": True}

    def submit(self, config, kind, values, tensors, cancel=None):
        assert kind == "vae_decode"
        family, twin = self.models[values["key"]]
        assert family == "vae_taesd"
        self.submitted.append((dict(values), tensors["latent"]))
        out, _ = _decode(self.dist_pools, config.world_size, twin, tensors["latent"], values.get("block_size"))
        return types.SimpleNamespace(tensors={"image": out})

    def close(self):
        pass


@pytest.mark.parametrize("n, z, shape, block_size", [(2, 4, (1, 4, 7, 6), 0), (3, 16, (1, 16, 6, 5), 4)])
def test_patch_vae_decode_node_equals_vae_decode(dist_pools, taesd, n, z, shape, block_size):
    """The node end to end on the driver (check_vae, to_diffusers, the latent's scale/shift, IMAGE layout) with the
    decode on n gloo ranks: its IMAGE equals ComfyUI's VAEDecode's to 1e-5."""
    from comfyui_hybrid_parallel.nodes.config_node import HybridParallelConfig
    from comfyui_hybrid_parallel.nodes.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.vae_node import PatchVAEDecode
    vae, _ = taesd(z)
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + 17))
    with torch.no_grad():
        ref = vae.decode(latent)  # what ComfyUI's VAEDecode returns for an image latent
    pools = []
    node = PatchVAEDecode()
    node.runtime = Runtime(make_pool=lambda device: pools.append(_GlooPool(dist_pools, device)) or pools[-1])
    hp = HybridParallelConfig(ParallelConfig(ulysses_degree=n), device="cpu")
    with torch.no_grad():
        (got,) = node.decode({"samples": latent}, vae, hp, block_size=block_size)
    err = _rel(got, ref)
    print(f"Parallel VAE Decode, TAESD z={z} {shape} over {n} ranks: IMAGE relative error vs VAE Decode {err:.2e}")
    assert got.shape == ref.shape and got.dtype == torch.float32 and err <= TOL, err
    (values, sent), = pools[0].submitted
    assert values.get("block_size") == (block_size or None)
    torch.testing.assert_close(sent, (latent - SHIFT) * SCALE, rtol=0, atol=0)  # ComfyUI's affine, bit for bit


def _refuse(first_stage_model, latent, ranks=2):
    """Parallel VAE Decode's error for a VAE it must refuse, with a pool that fails the test if anything started."""
    from comfyui_hybrid_parallel.nodes.config_node import HybridParallelConfig
    from comfyui_hybrid_parallel.nodes.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.vae_node import PatchVAEDecode

    def no_pool(device):
        raise AssertionError("a worker pool was started for a decode that must be refused first")
    node = PatchVAEDecode()
    node.runtime = Runtime(make_pool=no_pool)
    hp = HybridParallelConfig(ParallelConfig(ulysses_degree=ranks), device="cpu")
    with pytest.raises(ValueError) as e:
        node.decode({"samples": latent}, types.SimpleNamespace(first_stage_model=first_stage_model), hp)
    return str(e.value)


def test_check_vae_accepts_taesd_and_refuses_others(comfy):
    """TAESD with 4 and 16 latent channels is 'vae_taesd'; a latent that does not fit it, a TAESD whose layers are
    not AutoencoderTiny's, and the video TAEHV (taew2_2) are refused before any pool starts, naming VAE Decode."""
    from comfy.taesd.taehv import TAEHV
    from comfy.taesd.taesd import TAESD

    from comfyui_hybrid_parallel.nodes.vae_node import check_vae
    with torch.device("meta"):
        small, large = TAESD(latent_channels=4), TAESD(latent_channels=16)
        taehv = TAEHV(latent_channels=48, latent_format=None)
    assert check_vae(small, torch.zeros(1, 4, 8, 8)) == "vae_taesd"
    assert check_vae(large, torch.zeros(1, 16, 3, 5)) == "vae_taesd"
    assert check_vae(large) == "vae_taesd"

    msg = _refuse(large, torch.zeros(1, 4, 8, 8))
    assert "image (B, C, H, W) latents with 16 channels" in msg and "(1, 4, 8, 8)" in msg, msg
    msg = _refuse(small, torch.zeros(1, 4, 2, 8, 8))
    assert "latents with 4 channels" in msg, msg

    with torch.device("meta"):
        odd = TAESD(latent_channels=4)
        odd.taesd_decoder[6] = nn.Conv2d(64, 64, 3, padding=1)  # a conv where the first x2 upsample belongs
    msg = _refuse(odd, torch.zeros(1, 4, 8, 8))
    assert "cannot split this VAE" in msg and "decoder layout" in msg and "VAE Decode" in msg, msg

    msg = _refuse(taehv, torch.zeros(1, 48, 2, 3, 5))
    assert "comfy.taesd.taehv.TAEHV" in msg and "VAE Decode (Tiled)" in msg, msg


def test_non_nearest_upsampling_is_refused():
    """AutoencoderTiny with bilinear upsampling mixes neighbouring rows: patch decode refuses it (even on one rank,
    before any decode), naming the module."""
    from diffusers import AutoencoderTiny
    vae = AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                          num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1), upsample_fn="bilinear")
    with pytest.raises(ConfigError, match=r"decoder\.layers\.\d+: only nearest upsampling"):
        patch_decode(vae, torch.zeros(1, 4, 4, 4), _local_axis())
