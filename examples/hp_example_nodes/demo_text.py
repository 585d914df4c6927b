"""The demo model's text encoder: a caption becomes fixed pseudo-random word vectors, no learnt weights.

Every word maps to a vector drawn from a generator seeded by the word's CRC-32, plus a sinusoidal
position code, padded to TOKENS tokens. The pooled vector binds each word to its place: the mean over
words of the word's vector times a fixed random sign pattern of its position, so "red ... on a gray
background" and "gray ... on a red background" pool differently (a plain mean would not). The demo
diffusion model learnt to read these (its context embedder and pooled-vector MLP are trained), so a real
text encoder is not needed and nothing is downloaded. The empty caption (CFG's negative) is all padding.
"""
from __future__ import annotations

import math
import zlib

import torch

TOKENS = 8  # context length the model sees
DIM = 64  # width of the word vectors (context) and of the pooled vector
_PAD = "<pad>"


def _word(word: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(word.encode()))
    return torch.randn(DIM, generator=g)


def _position(i: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(100.0) * torch.arange(0, DIM, 2, dtype=torch.float32) / DIM)
    ang = i * freqs
    return torch.stack([ang.sin(), ang.cos()], dim=1).flatten()


def _signs(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 + i)
    return torch.randint(0, 2, (DIM,), generator=g).float() * 2 - 1


def words(caption: str) -> list:
    return caption.lower().replace(",", " ").split()[:TOKENS]


def encode(caption: str) -> tuple:
    """(context (1, TOKENS, DIM), pooled (1, DIM)) for one caption."""
    ws = words(caption)
    vecs = [_word(w) for w in ws]
    context = torch.stack([(vecs[i] if i < len(ws) else _word(_PAD)) + 0.5 * _position(i) for i in range(TOKENS)])
    pooled = torch.stack([v * _signs(i) for i, v in enumerate(vecs)]).mean(0) if vecs else torch.zeros(DIM)
    return context.unsqueeze(0), pooled.unsqueeze(0)
