"""Patch-parallel VAE decode equals the serial decode, on gloo worlds of 2, 3 and 4 ranks.

Tiny random diffusers VAEs (AutoencoderKL with 4 and 16 latent channels, Wan 2.1
and a Wan 2.2-style residual/patchified Wan VAE), odd and even latent heights,
non-square widths, 1/2/5 latent frames, with and without `block_size`. Each rank
builds each model once (fixed seed), decodes serially and in parallel, and
compares; the serial decode is repeated after the parallel one to prove the
VAE was restored.

The last part runs ComfyUI's own Wan 2.2 VAE (comfy/ldm/wan/vae2_2.py) through
the node's converter and compares the split decode with ComfyUI's decode (fp32
and bf16), and checks which ComfyUI VAEs Parallel VAE Decode refuses, before any
worker starts.
"""
import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.comm import all_gather_uneven, split_sizes
from comfyui_hybrid_parallel.parallel.vae import PatchConv, PatchGroupNorm, patch_decode, world_axis
from comfyui_hybrid_parallel.parallel.vae.patch_ops import PaddedConv
from comfyui_hybrid_parallel.parallel.vae.decode import _unscale
from dist_harness import context_for

pytestmark = pytest.mark.dist
TOL = 1e-5


@functools.lru_cache(maxsize=None)
def _vae(kind: str, z: int):
    from diffusers import AutoencoderKL, AutoencoderKLWan

    torch.manual_seed(1234 + z)
    if kind == "kl":
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=z, block_out_channels=(16, 16, 32),
                            down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                            layers_per_block=1, norm_num_groups=8, scaling_factor=0.37, shift_factor=0.11)
    elif kind == "wan":
        vae = AutoencoderKLWan(base_dim=8, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True], latents_mean=[0.1 * i for i in range(z)],
                               latents_std=[1.0 + 0.1 * i for i in range(z)])
    else:  # Wan 2.2 style: residual up blocks with DupUp3D shortcuts, 2x2 patchified output
        vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=8, z_dim=z, dim_mult=[1, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True], is_residual=True, in_channels=12,
                               out_channels=12, patch_size=2, latents_mean=[0.0] * z, latents_std=[1.0] * z)
    with torch.no_grad():  # random init gives near-zero outputs in places; spread the weights a little
        for p in vae.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return vae.eval()


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _decode_body(n, kind, z, shape, block_size, seed, unscale=False):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    vae = _vae(kind, z)
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    modules_before = [(name, id(m)) for name, m in vae.named_modules()]
    with torch.no_grad():
        ref_in = _unscale(vae, latent) if unscale else latent
        serial = vae.decode(ref_in).sample
    par = patch_decode(vae, latent, ax, block_size=block_size, unscale=unscale)
    assert [(name, id(m)) for name, m in vae.named_modules()] == modules_before
    with torch.no_grad():
        again = vae.decode(ref_in).sample
    torch.testing.assert_close(again, serial, rtol=0, atol=0)
    assert par.shape == serial.shape, (par.shape, serial.shape)
    return {"rel": _rel(par, serial), "stats": ctx.stats.snapshot()}


KL_CASES = [  # (n, z, latent shape, block_size)
    (2, 4, (1, 4, 7, 10), None),
    (2, 16, (2, 16, 8, 6), 3),
    (3, 4, (1, 4, 9, 5), None),
    (3, 4, (1, 4, 4, 7), None),  # 1 latent row on two ranks: fewer rows than the conv's reach
    (3, 16, (1, 16, 13, 11), 5),
    (4, 4, (1, 4, 13, 6), 2),
    (4, 16, (1, 16, 8, 8), None),
]


@pytest.mark.parametrize("n, z, shape, block_size", KL_CASES)
def test_kl_patch_decode_matches_serial(dist_pools, n, z, shape, block_size):
    res = dist_pools(n).run(_decode_body, n, "kl", z, shape, block_size, seed=sum(shape) + n)
    for r in res:
        assert r["rel"] <= TOL, res
    assert all(r["stats"]["halo"]["bytes"] > 0 for r in res)


WAN_CASES = [  # (n, kind, z, latent shape (B, C, T, H, W), block_size)
    (2, "wan", 4, (1, 4, 1, 7, 6), None),
    (2, "wan", 16, (1, 16, 2, 8, 5), 2),
    (3, "wan", 4, (1, 4, 5, 9, 4), None),
    (4, "wan", 4, (1, 4, 2, 13, 6), 3),
    (3, "wan22", 4, (1, 4, 2, 7, 6), None),
    (4, "wan22", 4, (1, 4, 1, 9, 5), 2),
]


@pytest.mark.parametrize("n, kind, z, shape, block_size", WAN_CASES)
def test_wan_patch_decode_matches_serial(dist_pools, n, kind, z, shape, block_size):
    res = dist_pools(n).run(_decode_body, n, kind, z, shape, block_size, seed=sum(shape) * 7 + n, timeout=240)
    for r in res:
        assert r["rel"] <= TOL, res


@pytest.mark.parametrize("kind, shape", [("kl", (1, 4, 9, 6)), ("wan", (1, 4, 2, 7, 5))])
def test_unscale_option(dist_pools, kind, shape):
    res = dist_pools(2).run(_decode_body, 2, kind, 4, shape, None, seed=5, unscale=True)
    assert all(r["rel"] <= TOL for r in res), res


def _local_rows_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    vae = _vae("kl", 4)
    latent = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(3))
    full = patch_decode(vae, latent, ax)
    rows, first = patch_decode(vae, latent, ax, gather=False)
    assert rows.shape[-2] == split_sizes(7, n)[ax.rank] * 4
    torch.testing.assert_close(rows, full[..., first:first + rows.shape[-2], :], rtol=0, atol=0)
    return first


def test_gather_false_returns_local_rows(dist_pools):
    assert dist_pools(3).run(_local_rows_body, 3) == [0, 12, 20]


def _first_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    vae = _vae("kl", 4)
    latent = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(4))
    full = patch_decode(vae, latent, ax)
    ctx.stats.reset()
    first = patch_decode(vae, latent, ax, gather="first")
    sent = ctx.stats.snapshot().get("gather", {}).get("bytes", 0)
    return None if first is None else bool(torch.equal(first, full)), sent, full.numel() * full.element_size()


def test_gather_first_assembles_the_image_on_rank_0_only(dist_pools):
    """The pool returns rank 0's image: the others send their rows there and never hold the whole image."""
    res = dist_pools(3).run(_first_body, 3)
    assert [r[0] for r in res] == [True, None, None]
    full_bytes = res[0][2]
    assert res[0][1] == 0 and all(0 < r[1] < full_bytes for r in res[1:])


def _too_small_body(n, height):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    latent = torch.randn(1, 4, height, 6)
    try:
        patch_decode(_vae("kl", 4), latent, world_axis(ctx))
    except ConfigError as e:
        return str(e), ctx.stats.total_bytes()
    return None, ctx.stats.total_bytes()


def test_too_small_latent_errors_before_communication(dist_pools):
    res = dist_pools(4).run(_too_small_body, 4, 3)
    for msg, sent in res:
        assert msg is not None and "use at most 3 ranks" in msg and "3 rows" in msg, msg
        assert sent == 0


def _bad_input_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    errors = []
    for call in (lambda: patch_decode(_vae("kl", 4), torch.randn(1, 4, 8, 8), ax, block_size=0),
                 lambda: patch_decode(nn.Conv2d(4, 3, 3), torch.randn(1, 4, 8, 8), ax),
                 lambda: patch_decode(_vae("kl", 4), torch.randn(4, 8, 8), ax)):
        try:
            call()
        except ConfigError as e:
            errors.append(str(e))
    return errors, ctx.stats.total_bytes()


def test_bad_input_is_refused(dist_pools):
    errors, sent = dist_pools(2).run(_bad_input_body, 2)[0]
    assert len(errors) == 3 and "block_size" in errors[0] and "AutoencoderKL" in errors[1] and "latent" in errors[2]
    assert sent == 0


def _ops_body(n, seed):
    """The building blocks alone: a dilated, not height-preserving conv and GroupNorm with per-patch offsets."""
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 8, 23, 7, generator=g)
    x = x + torch.arange(23).view(1, 1, 23, 1) * 0.5  # rows differ in mean: patch means != global mean
    sizes = split_sizes(23, n)
    start = sum(sizes[: ax.rank])
    mine = x.narrow(2, start, sizes[ax.rank])
    out = {}
    torch.manual_seed(seed)
    conv = nn.Conv2d(8, 5, (5, 3), padding=(1, 1), dilation=(2, 1))  # reach 8, pads 1: output 23+2-8 = 17 rows
    ref = conv(x)
    for bs in (None, 2):
        with torch.no_grad():
            y = PatchConv(conv, ax, block_size=bs)(mine)
        got = all_gather_uneven(y, dim=2, ax=ax)
        out[f"conv{bs}"] = _rel(got, ref.detach())
    # a module that pads its own input and convolves without padding (ComfyUI's VideoConv3d: replicate; reflect too)
    video = torch.randn(1, 8, 3, 23, 7, generator=g) + torch.arange(23).view(1, 1, 1, 23, 1) * 0.5
    vmine = video.narrow(3, start, sizes[ax.rank])
    for mode, pad in (("replicate", (1, 1, 1, 1, 2, 0)), ("reflect", (1, 1, 1, 1, 0, 0))):
        padded = nn.Module()
        padded.conv = nn.Conv3d(8, 5, 3)
        with torch.no_grad():
            ref = padded.conv(F.pad(video, pad, mode=mode))
            for bs in (None, 3):
                y = PaddedConv(padded, ax, pad, mode, block_size=bs).forward(vmine)
                out[f"{mode}{bs}"] = _rel(all_gather_uneven(y, dim=3, ax=ax), ref)
            y = PaddedConv(padded, ax, pad, "constant").forward(vmine)  # zero rows at the borders: they differ
            out[f"{mode}_zero_borders_differ"] = 0.0 if _rel(all_gather_uneven(y, dim=3, ax=ax), ref) > 1e-3 else 1.0
    norm = nn.GroupNorm(4, 8)
    with torch.no_grad():
        norm.weight.normal_(generator=g)
        norm.bias.normal_(generator=g)
        ref = norm(x)
        y = PatchGroupNorm(norm, ax)(mine)
    out["gn"] = _rel(y, ref.narrow(2, start, sizes[ax.rank]))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_patch_conv_and_group_norm(dist_pools, n):
    for r in dist_pools(n).run(_ops_body, n, seed=11 * n):
        assert all(v <= TOL for v in r.values()), r


def test_naive_group_norm_would_fail():
    """The check above can fail: per-patch statistics (the old DistVAE bug) differ from the global ones."""
    x = torch.randn(1, 8, 23, 7) + torch.arange(23).view(1, 1, 23, 1) * 0.5
    ref = F.group_norm(x, 4)
    naive = torch.cat([F.group_norm(p, 4) for p in x.split(split_sizes(23, 2), dim=2)], dim=2)
    assert _rel(naive, ref) > 1e-2


def _sub_axis_body(seed):
    """Two independent decodes at once on a 4-rank world, each over a 2-rank ulysses group."""
    ctx = context_for(ParallelConfig(ulysses_degree=2, ring_degree=2))
    vae = _vae("kl", 4)
    latent = torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(seed + ctx.ring.rank))
    with torch.no_grad():
        serial = vae.decode(latent).sample
    return _rel(patch_decode(vae, latent, ctx.ulysses), serial)


def test_decode_over_a_sub_axis(dist_pools):
    assert all(r <= TOL for r in dist_pools(4).run(_sub_axis_body, 21))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.float64, 1e-12),
                                        (torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_group_norm_dtypes_match_native(dtype, tol):
    """Statistics stay in fp32 (fp64 for fp64) like native group_norm; a 1-rank axis runs the same code."""
    from comfyui_hybrid_parallel.parallel import AxisGroup, CommStats

    ax = AxisGroup("world", 0, 1, [0], None, CommStats())
    norm = nn.GroupNorm(4, 8).to(dtype)
    x = (torch.randn(2, 8, 9, 7) * 3 + 1).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        assert _rel(PatchGroupNorm(norm, ax)(x).double(), norm(x).double()) <= tol


# ---- ComfyUI's own VAEs: what Parallel VAE Decode splits (the Wan 2.2 VAE) and what it refuses, before any worker ----
# ComfyUI runs in the test process only (the ranks get the converted diffusers twin as plain tensors, so they never
# import ComfyUI). The Wan 2.2 VAE is ComfyUI's class at small widths (dim 8, decoder 16, z 48): VAELoader only takes
# the 705M-parameter size (doctor/tiny_checkpoints.write_wan22_vae), which tests/server_e2e/test_comfyui_ti2v.py decodes.


@pytest.fixture(scope="module")
def comfy():
    """ComfyUI importable in this process (CPU); never in the ranks."""
    from comfy_env import setup_comfy
    return setup_comfy()


@pytest.fixture(scope="module")
def comfy_wan22(comfy, tmp_path_factory):
    """(ComfyUI's Wan 2.2 VAE with random weights, the diffusers (class, config, state dict) Parallel VAE Decode makes
    of it), through the same file and converter as the node: doctor.write_wan22_vae -> converters.to_diffusers."""
    from safetensors.torch import load_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from converters import to_diffusers
    path = tmp_path_factory.mktemp("wan22_vae") / "wan22_vae_small.safetensors"
    tc.write_wan22_vae(path, dim=8, dec_dim=16, seed=22, dtype=torch.float32)
    vae = tc.wan22_vae(8, 16, device="cpu")
    vae.load_state_dict(load_file(str(path)), strict=True)
    family, config, dsd = to_diffusers(vae.eval(), "vae_wan")
    assert family == "vae_wan" and config["is_residual"] and config["patch_size"] == 2 and config["z_dim"] == 48
    return vae, ("AutoencoderKLWan", config, dsd)


def _comfy_images(vae, latent, dtype):
    """What ComfyUI's VAEDecode returns for this VAE (comfy.sd.VAE.decode: decode in the VAE dtype, .float(),
    clamp((x + 1) / 2, 0, 1), channels last), before it folds frames into the batch; and the raw decode."""
    model = vae if dtype == torch.float32 else copy.deepcopy(vae).to(dtype)  # the fp32 weights stay untouched
    with torch.no_grad():
        raw = model.decode(latent.to(dtype)).float()
    return torch.clamp((raw + 1.0) / 2.0, 0.0, 1.0).movedim(1, -1), raw


def _twin_body(n, twin, latent, dtype_name):
    from converters import build_model
    from converters.vae import diffusers_to_comfy_images
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    model = build_model(*twin, dtype=getattr(torch, dtype_name))
    out = patch_decode(model, latent, world_axis(ctx))
    assert out.dtype == getattr(torch, dtype_name)  # decoded in the VAE's dtype, as ComfyUI does
    return diffusers_to_comfy_images(out) if ctx.rank == 0 else None


WAN22_CASES = [  # (ranks, latent (B, 48, T, H, W)): heights that split evenly and heights that do not
    (2, (1, 48, 2, 4, 3)),
    (2, (1, 48, 3, 5, 4)),
    (4, (1, 48, 2, 8, 3)),
    (4, (1, 48, 1, 7, 5)),
]


@pytest.mark.comfy
@pytest.mark.parametrize("n, shape", WAN22_CASES)
def test_wan22_vae_patch_decode_equals_comfyui(dist_pools, comfy_wan22, n, shape):
    """ComfyUI's Wan 2.2 VAE decode (residual up blocks with DupUp3D shortcuts, causal caches, the 2x2 unpatchify)
    split over n ranks by rows equals ComfyUI's serial VAEDecode images: fp32 <= 1e-5 relative."""
    vae, twin = comfy_wan22
    latent = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + n))
    ref, raw = _comfy_images(vae, latent, torch.float32)
    assert raw.shape[2:] == (4 * shape[2] - 3, 16 * shape[3], 16 * shape[4])
    inside = ((raw > -1) & (raw < 1)).float().mean().item()
    assert 0.2 < inside < 1.0, f"the random VAE's output should be mostly inside [-1, 1] and clamp somewhere: {inside}"
    got = dist_pools(n).run(_twin_body, n, twin, latent, "float32", timeout=240)[0]
    err = _rel(got, ref)
    print(f"Wan 2.2 VAE {shape} over {n} ranks: images relative error vs ComfyUI {err:.2e}")
    assert err <= TOL, err


@pytest.mark.comfy
def test_wan22_vae_patch_decode_bf16(dist_pools, comfy_wan22):
    """A bf16 VAE (ComfyUI's choice on GPUs) decodes in bf16 on the ranks, a float32 latent cast as ComfyUI casts it;
    the split costs no more than bf16 itself: its error vs ComfyUI's bf16 decode stays within twice ComfyUI's own
    bf16-vs-fp32 difference."""
    vae, twin = comfy_wan22
    latent = torch.randn(1, 48, 2, 5, 3, generator=torch.Generator().manual_seed(16))
    ref_bf16, _ = _comfy_images(vae, latent, torch.bfloat16)
    ref_fp32, _ = _comfy_images(vae, latent, torch.float32)
    own = _rel(ref_bf16, ref_fp32)
    got = dist_pools(2).run(_twin_body, 2, twin, latent, "bfloat16", timeout=240)[0]
    err = _rel(got, ref_bf16)
    print(f"Wan 2.2 VAE bf16 over 2 ranks: {err:.2e} vs ComfyUI bf16 (ComfyUI bf16 vs fp32: {own:.2e})")
    assert 0 < own < 5e-2 and err <= 2 * own, (err, own)


