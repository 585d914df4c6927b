"""Patch-parallel VAE decode equals the serial decode, on gloo worlds of 2, 3 and 4 ranks.

Tiny random diffusers VAEs (AutoencoderKL with 4 and 16 latent channels, Wan 2.1
and a Wan 2.2-style residual/patchified Wan VAE), odd and even latent heights,
non-square widths, 1/2/5 latent frames, with and without `block_size`. Each rank
builds each model once (fixed seed), decodes serially and in parallel, and
compares; the serial decode is repeated after the parallel one to prove the
VAE was restored.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.comm import all_gather_uneven, split_sizes
from comfyui_hybrid_parallel.parallel.vae import PatchConv, PatchGroupNorm, patch_decode, world_axis
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
