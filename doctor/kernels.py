"""Attention kernels with log-sum-exp, checked where ring attention would pick them.

Why: ring attention merges partial results by their LSE; a kernel whose LSE is missing, padded or
in another base gives wrong images with no error. Each backend that `parallel.attention` offers on
a device and dtype is compared with a float64 reference (output and LSE) on a length that no block
size divides, then three uneven key blocks are merged as a ring would (which only works with a
right LSE), and one call at a realistic size is timed.
"""
from __future__ import annotations

import torch

from ..parallel.attention import attention_with_lse, available_backends, merge_attention
from .machine import median_ms

# relative output bound and absolute LSE bound per input dtype (fp32 kernels round like fp32; half kernels
# accumulate in fp32 but read half inputs)
BOUNDS = {torch.float32: (1e-5, 1e-4), torch.float16: (5e-3, 5e-3), torch.bfloat16: (2e-2, 2e-2)}


def _reference(q, k, v, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    return torch.softmax(s, dim=-1) @ v.double(), lse


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(device, dtype, seed: int, strided: bool, b=1, h=4, length=77, d=64):
    """q, k, v (b, h, length, d); strided: as ring attention gets them after Ulysses, (b, h, length, d) views of
    one (length, 3, b, h, d) buffer, none contiguous. 77: no power-of-two block divides it."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        buf = torch.randn(length, 3, b, h, d, generator=g).to(device, dtype)
        return tuple(buf[:, t].permute(1, 2, 0, 3) for t in range(3))
    return tuple(torch.randn(b, h, length, d, generator=g).to(device, dtype) for _ in range(3))


def check_one(device: torch.device, dtype: torch.dtype, backend: str, seed: int, quick: bool,
              strided: bool = False) -> dict:
    q, k, v = _inputs(device, dtype, seed, strided)
    length, d = q.shape[2], q.shape[3]
    scale = d ** -0.5
    row = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "backend": backend,
           "layout": "strided" if strided else "contiguous"}
    try:
        ref_out, ref_lse = _reference(q.cpu(), k.cpu(), v.cpu(), scale)
        out, lse = attention_with_lse(q, k, v, scale, backend=backend)
        row["out_rel"] = _rel(out.cpu(), ref_out)
        row["lse_abs"] = (lse.cpu().double() - ref_lse).abs().max().item()
        merged, merged_lse = None, None
        for lo, hi in ((0, 20), (20, 51), (51, length)):  # a ring of three uneven key blocks
            bo, bl = attention_with_lse(q, k[:, :, lo:hi], v[:, :, lo:hi], scale, backend=backend)
            merged, merged_lse = merge_attention(merged, merged_lse, bo, bl)
        row["ring_rel"] = _rel(merged.cpu(), ref_out)
        out_bound, lse_bound = BOUNDS[dtype]
        row["bound"] = out_bound
        row["ok"] = (row["out_rel"] <= out_bound and row["ring_rel"] <= out_bound and row["lse_abs"] <= lse_bound)
        if not row["ok"]:
            row["error"] = (f"out rel {row['out_rel']:.1e}, ring merge rel {row['ring_rel']:.1e} (bound {out_bound:.0e}), "
                            f"LSE abs {row['lse_abs']:.1e} (bound {lse_bound:.0e})")
        if not strided:
            row["ms"], row["timed_shape"] = _time(device, dtype, backend, quick)
    except Exception as e:  # noqa: BLE001 - a kernel that raises is a failed check, reported with its message
        row.update(ok=False, error=f"{type(e).__name__}: {e}")
    return row


def _time(device, dtype, backend, quick):
    """One attention call at a size where the kernel, not the launch, is timed."""
    length = (1024 if quick else 4096) if device.type == "cuda" else (256 if quick else 1024)
    heads = 24 if device.type == "cuda" else 8
    q, k, v = (torch.randn(1, heads, length, 128, device=device, dtype=dtype) for _ in range(3))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    attention_with_lse(q, k, v, backend=backend)  # warm-up (kernel selection, workspace)
    if sync:
        sync()
    return median_ms(lambda: attention_with_lse(q, k, v, backend=backend), repeat=3 if quick else 5,
                     sync=sync), [1, heads, length, 128]


def check_kernels(devices, quick: bool = False) -> list:
    rows = []
    for device in devices:
        dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
        for i, dtype in enumerate(dtypes):
            for backend in available_backends(device, dtype):
                for strided in (False, True):
                    rows.append(check_one(device, dtype, backend, seed=100 + i, quick=quick, strided=strided))
    return rows


def kernel_table(rows) -> str:
    lines = [f"{'device':8s} {'dtype':9s} {'backend':15s} {'layout':10s} {'out rel':>9s} {'ring rel':>9s} "
             f"{'LSE abs':>9s} {'ms/call':>9s}  result"]
    for r in rows:
        num = lambda k: f"{r[k]:9.1e}" if isinstance(r.get(k), float) else f"{'-':>9s}"  # noqa: E731
        ms = f"{r['ms']:9.2f}" if "ms" in r else f"{'-':>9s}"
        lines.append(f"{r['device']:8s} {r['dtype']:9s} {r['backend']:15s} {r.get('layout', '-'):10s} "
                     f"{num('out_rel')} {num('ring_rel')} "
                     f"{num('lse_abs')} {ms}  {'ok' if r['ok'] else 'FAIL: ' + r.get('error', '')}")
    return "\n".join(lines)
