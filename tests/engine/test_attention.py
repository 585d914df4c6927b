"""Attention kernels with LSE against a float64 reference, and the LSE merge against full attention."""
import math

import pytest
import torch

from comfyui_hybrid_parallel.parallel.attention import (attention_with_lse, available_backends, merge_attention,
                                                        select_backend)


def _reference(q, k, v, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.double(), lse


def _qkv(seed, B=2, H=3, Lq=11, Lk=13, D=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g).to(dtype) * 2 for L in (Lq, Lk, Lk)]


@pytest.mark.parametrize("backend", available_backends(torch.device("cpu"), torch.float32))
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_backends_match_float64(backend, seed):
    q, k, v = _qkv(seed)
    scale = 1 / math.sqrt(16)
    out, lse = attention_with_lse(q, k, v, scale, backend=backend)
    ref_out, ref_lse = _reference(q, k, v, scale)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    assert (lse.double() - ref_lse).abs().max() < 1e-4
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert lse.abs().min() > 0, "a zero LSE would silently break ring merges"


def test_bf16_cpu_flash_lse_is_fp32():
    q, k, v = _qkv(3, dtype=torch.bfloat16)
    out, lse = attention_with_lse(q, k, v, backend="cpu_flash")
    ref_out, ref_lse = _reference(q, k, v, 1 / 4)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert (lse.double() - ref_lse).abs().max() < 2e-2
    assert (out.double() - ref_out).abs().max() < 5e-2


@pytest.mark.parametrize("backend", ["cpu_flash", "math"])
@pytest.mark.parametrize("splits", [[13], [5, 8], [1, 4, 0, 8], [3, 3, 3, 4]])
def test_merge_equals_full_attention(backend, splits):
    q, k, v = _qkv(sum(splits) + len(splits))
    ref_out, ref_lse = _reference(q, k, v, 0.25)
    out = lse = None
    start = 0
    for n in splits:  # includes an empty block, which must not change the result
        o, l = attention_with_lse(q, k[:, :, start:start + n], v[:, :, start:start + n], 0.25, backend=backend)
        out, lse = merge_attention(out, lse, o, l)
        start += n
    assert (out.double() - ref_out).abs().max() < 1e-5
    assert (lse.double() - ref_lse).abs().max() < 1e-4


def _ulysses_views(seed, B=2, H=3, L=11, D=16, dtype=torch.float32):
    """q, k, v as ring attention gets them after Ulysses: strided (B, H, L, D) views of one (L, 3, B, H, D)
    buffer, none of them contiguous."""
    g = torch.Generator().manual_seed(seed)
    buf = (torch.randn(L, 3, B, H, D, generator=g) * 2).to(dtype)
    return [buf[:, t].permute(1, 2, 0, 3) for t in range(3)]


@pytest.mark.parametrize("backend", available_backends(torch.device("cpu"), torch.float32))
def test_lse_on_strided_inputs_matches_float64(backend):
    q, k, v = _ulysses_views(5)
    assert not any(t.is_contiguous() for t in (q, k, v))
    out, lse = attention_with_lse(q, k, v, 0.25, backend=backend)
    ref_out, ref_lse = _reference(q, k, v, 0.25)
    assert (lse.double() - ref_lse).abs().max() < 1e-4
    assert (out.double() - ref_out).abs().max() < 1e-5
    # a key block narrowed out of a strided buffer, as ring's own block is
    o2, l2 = attention_with_lse(q, k[:, :, 2:9], v[:, :, 2:9], 0.25, backend=backend)
    r2, rl2 = _reference(q, k[:, :, 2:9], v[:, :, 2:9], 0.25)
    assert (o2.double() - r2).abs().max() < 1e-5 and (l2.double() - rl2).abs().max() < 1e-4


def test_merge_updates_the_running_result_in_place():
    """One full-size fp32 tensor per ring step (the running result), not four (Wan 720p: ~0.8 GB each)."""
    q, k, v = _qkv(7, Lk=20)
    out, lse = merge_attention(None, None, *attention_with_lse(q, k[:, :, :9], v[:, :, :9], 0.25))
    ptr = out.data_ptr()
    o, l = attention_with_lse(q, k[:, :, 9:], v[:, :, 9:], 0.25)
    expect = out - torch.sigmoid(l - lse).unsqueeze(-1) * (out - o)
    out, lse = merge_attention(out, lse, o, l)
    assert out.data_ptr() == ptr
    assert (out - expect).abs().max() < 1e-6
    bo, bl = attention_with_lse(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.25)  # a bf16 block into fp32
    out, lse = merge_attention(out, lse, bo, bl)
    assert out.dtype == torch.float32 and out.data_ptr() == ptr


def test_flash_kernels_need_ampere(monkeypatch):
    """torch's flash op and flash-attn refuse to launch below sm80: a Turing / Volta GPU gets the efficient kernel."""
    from comfyui_hybrid_parallel.parallel import attention
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(attention, "_capability", lambda index: (7, 5))
    assert available_backends(cuda0, torch.bfloat16) == ["cuda_efficient", "math"]
    with pytest.raises(ValueError, match="cannot run on cuda"):
        select_backend(cuda0, torch.float16, "cuda_flash")
    monkeypatch.setattr(attention, "_capability", lambda index: (9, 0))
    assert available_backends(cuda0, torch.bfloat16)[-3:] == ["cuda_flash", "cuda_efficient", "math"]
    monkeypatch.setattr(attention, "_flash_attn_available", lambda: True)
    assert available_backends(cuda0, torch.float16)[0] == "flash_attn"


def test_flash_attn_import_is_tried_once():
    from comfyui_hybrid_parallel.parallel import attention
    attention._flash_attn_available.cache_clear()
    for _ in range(3):
        available_backends(torch.device("cuda", 0), torch.float32)  # fp32: never asks
        attention._flash_attn_available()
    assert attention._flash_attn_available.cache_info().misses == 1


def test_backend_selection_is_visible_and_checked(monkeypatch):
    from comfyui_hybrid_parallel.parallel import attention
    monkeypatch.setattr(attention, "_capability", lambda index: (8, 0))
    assert select_backend(torch.device("cpu"), torch.float32) == "cpu_flash"
    cuda = available_backends(torch.device("cuda"), torch.float32)
    assert cuda[-2:] == ["cuda_efficient", "math"] and "cuda_flash" not in cuda  # torch's flash op needs fp16/bf16
    assert "flash_attn" not in available_backends(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        select_backend(torch.device("cpu"), torch.float32, "cuda_flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(torch.device("cpu"), torch.float32, "xformers")
