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


def test_backend_selection_is_visible_and_checked():
    assert select_backend(torch.device("cpu"), torch.float32) == "cpu_flash"
    cuda = available_backends(torch.device("cuda"), torch.float32)
    assert cuda[-2:] == ["cuda_efficient", "math"] and "cuda_flash" not in cuda  # torch's flash op needs fp16/bf16
    assert "flash_attn" not in available_backends(torch.device("cpu"), torch.bfloat16)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        select_backend(torch.device("cpu"), torch.float32, "cuda_flash")
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend(torch.device("cpu"), torch.float32, "xformers")
