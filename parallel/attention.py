"""Attention kernels that return the log-sum-exp, and the merge of partial results.

Ring attention computes softmax attention over key blocks one at a time and
merges the partial outputs with their log-sum-exp (LSE); a kernel that returned
a zero or missing LSE would silently give wrong results, so every backend here
returns a real one and is unit-tested against a float64 reference.

Layout everywhere: q, k, v are (B, H, L, D) like `F.scaled_dot_product_attention`;
out is (B, H, L, D) in the input dtype; lse is (B, H, L) float32, natural log.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch

BACKENDS = ("flash_attn", "cuda_flash", "cuda_efficient", "cpu_flash", "math")


@functools.cache
def _flash_attn_available() -> bool:
    """Whether flash-attn imports - asked once per process (ring attention asks at every block of every layer,
    and a failed import is retried by Python every time)."""
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001 - missing or broken install: just not available
        return False
    return True


@functools.cache
def _capability(index: int) -> tuple:
    import torch.cuda
    return torch.cuda.get_device_capability(index)


def _flash_capable(device: torch.device) -> bool:
    """FlashAttention-2 kernels (torch's and flash-attn's) need an Ampere or newer GPU (sm80+); on Turing and
    Volta they refuse to launch, where the memory-efficient kernel runs."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 0)


def available_backends(device: torch.device, dtype: torch.dtype) -> list:
    """Backends that can run on this device/dtype, best first."""
    if device.type == "cuda":
        out = []
        half = dtype in (torch.float16, torch.bfloat16) and _flash_capable(device)
        if half and _flash_attn_available():
            out.append("flash_attn")
        if half:
            out.append("cuda_flash")
        out.append("cuda_efficient")
        out.append("math")
        return out
    if device.type == "cpu":
        return ["cpu_flash", "math"]
    return ["math"]


def select_backend(device: torch.device, dtype: torch.dtype, preferred: str = "auto") -> str:
    """The backend `attention_with_lse` will use; `preferred` may force one (clear error if unusable)."""
    avail = available_backends(device, dtype)
    if preferred in ("auto", None):
        return avail[0]
    if preferred not in BACKENDS:
        raise ValueError(f"unknown attention backend {preferred!r}; choose one of {('auto',) + BACKENDS}")
    if preferred not in avail:
        raise ValueError(f"attention backend {preferred!r} cannot run on {device.type}/{dtype}; "
                         f"available here: {avail}")
    return preferred


def _math(q, k, v, scale):
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()).to(q.dtype), lse


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None,
                       backend: str = "auto"):
    """Softmax attention of q over k/v, returning (out, lse)."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    name = select_backend(q.device, q.dtype, backend)
    if k.shape[-2] == 0:  # no keys: contributes nothing; lse=-inf makes the merge ignore it
        return (torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), device=q.device, dtype=torch.float32))
    if name in ("cuda_flash", "cuda_efficient", "flash_attn") and any(t.stride(-1) != 1 for t in (q, k, v)):
        # the CUDA kernels read rows of D contiguous elements; Ulysses hands ring strided views of its buffers
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if name == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
        return out, lse.float()
    if name == "cuda_flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
        return res[0], res[1].float()
    if name == "cuda_efficient":
        res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
        return res[0], res[1][..., : q.shape[-2]].float()
    if name == "flash_attn":
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                      return_attn_probs=True)
        return out.transpose(1, 2), lse.float()
    return _math(q, k, v, scale)


def merge_attention(out: Optional[torch.Tensor], lse: Optional[torch.Tensor], block_out: torch.Tensor,
                    block_lse: torch.Tensor):
    """Fold one block's (out, lse) into the running result, in fp32, numerically stably.

    out' = out - sigmoid(lse_b - lse) * (out - out_b);  lse' = lse - logsigmoid(lse - lse_b)
    (equivalent to the softmax-weighted average, without exponentiating large LSEs).
    """
    if out is None:
        return block_out.float(), block_lse
    lse_e, blse_e = lse.unsqueeze(-1), block_lse.unsqueeze(-1)
    # Blocks without keys carry lse=-inf: keep the running result unchanged (avoid inf-inf = nan).
    w = torch.where(torch.isneginf(blse_e), torch.zeros_like(blse_e), torch.sigmoid(blse_e - lse_e))
    w = torch.where(torch.isneginf(lse_e), torch.ones_like(w), w)
    # out - w * (out - block_out), in place: the running result is the only full-size fp32 tensor (Wan 720p at
    # ring 2 holds ~0.8 GB per layer call in it; the out-of-place form made three more of that size)
    new_out = out.lerp_(block_out.float() if block_out.dtype != out.dtype else block_out, w)
    new_lse = torch.where(torch.isneginf(block_lse), lse,
                          torch.where(torch.isneginf(lse), block_lse,
                                      lse - torch.nn.functional.logsigmoid(lse - block_lse)))
    return new_out, new_lse
