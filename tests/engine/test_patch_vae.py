"""Patch-parallel VAE decode on gloo worlds of 2, 3 and 4 ranks: its building blocks against torch's own ops, and the
options of `native_patch_decode` (what the ranks run for Patch VAE Decode) on ComfyUI's KL VAE class at tiny widths.

The building blocks: a patch convolution (dilated, not height-preserving, with and without `block_size`), a module
that pads its own input (ComfyUI's VideoConv3d: replicate and reflect), GroupNorm with statistics over every rank's
rows (and in each dtype as torch computes them). The decode options: "first" assembles the image on the axis' first
rank only, False returns each rank's rows and their offset, a decode over a sub-axis runs two decodes at once on one
world, and a latent too short for the ranks is refused before any communication. Every VAE class Patch VAE Decode
declares, end to end through the node and the pool against ComfyUI's VAEDecode: tests/families/test_patch_vae_native.py.
"""
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.comm import all_gather_uneven, split_sizes
from comfyui_hybrid_parallel.parallel.vae import PatchConv, PatchGroupNorm, world_axis
from comfyui_hybrid_parallel.parallel.vae.patch_ops import PaddedConv
from dist_harness import context_for

pytestmark = pytest.mark.dist
TOL = 1e-5


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@functools.lru_cache(maxsize=None)
def _comfy_kl():
    """ComfyUI's KL VAE (comfy.ldm.models.autoencoder.AutoencoderKL: SD's layout, quant convs, the mid attention) at
    tiny widths (32 and 64 channels, one upsampling: 2 pixel rows per latent row), seeded weights, and its declaration
    (parallel/vae/comfy_vaes.py). Built in the rank: ComfyUI is importable there as in the workers."""
    from comfy_env import setup_comfy
    setup_comfy()
    from comfy.ldm.models.autoencoder import AutoencoderKL

    from comfyui_hybrid_parallel.doctor.tiny_weights import _random_state_dict
    from comfyui_hybrid_parallel.parallel.vae.comfy_vaes import comfy_vae_for
    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 64, "in_channels": 3, "out_ch": 3, "ch": 32,
                "ch_mult": [1, 2], "num_res_blocks": 1, "attn_resolutions": [], "dropout": 0.0}
    with torch.device("meta"):
        model = AutoencoderKL(ddconfig=ddconfig, embed_dim=4)
    model.load_state_dict(_random_state_dict(model, 1234, torch.float32), assign=True)
    model.eval().requires_grad_(False)
    vae = comfy_vae_for(model)
    assert vae is not None, "ComfyUI's KL VAE is declared"
    return model, vae


def _decode(latent, ax, **kw):
    from comfyui_hybrid_parallel.parallel.vae.native import native_patch_decode
    model, vae = _comfy_kl()
    return native_patch_decode(model, vae, latent, ax, **kw)


def _serial(latent):
    with torch.no_grad():
        return _comfy_kl()[0].decode(latent)


def _local_rows_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    latent = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(3))
    full = _decode(latent, ax, gather=True)
    assert _rel(full, _serial(latent)) <= TOL
    rows, first = _decode(latent, ax, gather=False)
    assert rows.shape[-2] == split_sizes(7, n)[ax.rank] * 2
    torch.testing.assert_close(rows, full[..., first:first + rows.shape[-2], :], rtol=0, atol=0)
    return first


def test_gather_false_returns_local_rows(dist_pools):
    assert dist_pools(3).run(_local_rows_body, 3) == [0, 6, 10]


def _first_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    latent = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(4))
    full = _decode(latent, ax, gather=True)
    ctx.stats.reset()
    first = _decode(latent, ax, gather="first")
    sent = ctx.stats.snapshot().get("gather", {}).get("bytes", 0)
    return None if first is None else bool(torch.equal(first, full)), sent, full.numel() * full.element_size()


def test_gather_first_assembles_the_image_on_rank_0_only(dist_pools):
    """The pool returns rank 0's image: the others send their rows there and never hold the whole image."""
    res = dist_pools(3).run(_first_body, 3)
    assert [r[0] for r in res] == [True, None, None]
    full_bytes = res[0][2]
    assert res[0][1] == 0 and all(0 < r[1] < full_bytes for r in res[1:]), res


def _refusals_body(n):
    ctx = context_for(ParallelConfig(ulysses_degree=n))
    ax = world_axis(ctx)
    errors = []
    for call in (lambda: _decode(torch.randn(1, 4, 3, 6), ax),  # 3 rows over 4 ranks
                 lambda: _decode(torch.randn(1, 4, 8, 8), ax, block_size=0),
                 lambda: _decode(torch.randn(4, 8, 8), ax)):
        try:
            call()
        except ConfigError as e:
            errors.append(str(e))
    return errors, ctx.stats.total_bytes()


def test_bad_input_is_refused_before_any_communication(dist_pools):
    for errors, sent in dist_pools(4).run(_refusals_body, 4):
        assert len(errors) == 3, errors
        assert "3 rows tall cannot be split over 4 ranks" in errors[0] and "use at most 3 ranks" in errors[0], errors
        assert "block_size" in errors[1] and "(B, C, H, W)" in errors[2], errors
        assert sent == 0


def _sub_axis_body(seed):
    """Two independent decodes at once on a 4-rank world, each over a 2-rank ulysses group."""
    ctx = context_for(ParallelConfig(ulysses_degree=2, ring_degree=2))
    latent = torch.randn(1, 4, 5, 6, generator=torch.Generator().manual_seed(seed + ctx.ring.rank))
    return _rel(_decode(latent, ctx.ulysses, gather=True), _serial(latent))


def test_decode_over_a_sub_axis(dist_pools):
    assert all(r <= TOL for r in dist_pools(4).run(_sub_axis_body, 21))


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
