"""Quantized .gguf files of the tests' tiny checkpoints, written with gguf-py (the format ComfyUI-GGUF reads).

Q8_0 is gguf-py's own quantizer; gguf-py has no K-quant quantizer (only dequantizers), so Q4_K blocks are
written here (`quantize_q4_k`), and checked against gguf-py's dequantizer (tests/driver/test_gguf_weights.py).
Which tensors are quantized follows ComfyUI-GGUF's converter in spirit: weights with two or more dimensions
whose rows are whole blocks; biases, norms and 1-D tensors stay F32 (or F16)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

QK_K = 256


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of a float array whose last dimension is a multiple of 256: (rows, 144 * blocks) uint8.

    A block holds 256 values as 8 sub-blocks of 32 with a 6-bit scale and a 6-bit min each (themselves scaled by
    the block's fp16 d and dmin) and 4-bit values: x = d * sc * q - dmin * m."""
    rows = x.reshape(-1, x.shape[-1]).astype(np.float32)
    blocks = rows.reshape(-1, 8, 32)                          # (n blocks, sub-block, value)
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = blocks.max(axis=2)
    scale, offset = (hi - lo) / 15.0, -lo                     # per sub-block
    d = (scale.max(axis=1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(offset, dmin32, out=np.zeros_like(offset), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[:, :, None]
    base = (dmin32 * m)[:, :, None]
    q = np.clip(np.rint(np.divide(blocks + base, step, out=np.zeros_like(blocks), where=step > 0)), 0, 15).astype(np.uint8)
    scales = np.zeros((len(blocks), 12), dtype=np.uint8)
    for j in range(4):
        scales[:, j] = sc[:, j] | ((sc[:, j + 4] >> 4) << 6)
        scales[:, j + 4] = m[:, j] | ((m[:, j + 4] >> 4) << 6)
        scales[:, j + 8] = (sc[:, j + 4] & 0xF) | ((m[:, j + 4] & 0xF) << 4)
    flat = q.reshape(-1, 4, 2, 32)                            # (block, 64-value chunk, low/high half, value)
    qs = (flat[:, :, 0, :] | (flat[:, :, 1, :] << 4)).reshape(-1, 128)
    out = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales, qs], axis=1)
    return out.reshape(rows.shape[0], -1)


def quantize(x: np.ndarray, qtype) -> np.ndarray:
    import gguf
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        return quantize_q4_k(x)
    return gguf.quants.quantize(x.reshape(-1, x.shape[-1]).astype(np.float32), qtype)


def write_gguf(path: Path, sd: dict, arch: str, qtypes=("Q8_0",), float_type: str = "F32") -> dict:
    """Write `sd` (name -> tensor) as a .gguf file: every weight of 2+ dimensions whose last dimension is a whole
    number of blocks is quantized, cycling through `qtypes` (a mixed file, as Q4_K_M files are; a type whose block
    does not divide the rows gives way to the next); the rest is
    `float_type`. Returns {name: type name} of what was written."""
    import gguf
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    written, i = {}, 0
    for name, t in sd.items():
        a = t.detach().float().numpy()
        fits = [gguf.GGMLQuantizationType[q] for q in qtypes[i % len(qtypes):] + qtypes[:i % len(qtypes)]
                if a.ndim >= 2 and a.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]][0] == 0]
        qtype = fits[0] if fits else None
        if qtype is not None and name.endswith(".weight"):
            q = quantize(a, qtype)
            writer.add_tensor(name, q.reshape(*a.shape[:-1], q.shape[-1]), raw_dtype=qtype)
            written[name] = qtype.name
            i += 1
        else:
            ftype = gguf.GGMLQuantizationType[float_type]
            writer.add_tensor(name, a.astype(np.float16 if float_type == "F16" else np.float32), raw_dtype=ftype)
            written[name] = ftype.name
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def gguf_from_safetensors(src: Path, dst: Path, arch: str, **kw) -> dict:
    from safetensors.torch import load_file
    return write_gguf(dst, {k: v.to(torch.float32) for k, v in load_file(str(src)).items()}, arch, **kw)
