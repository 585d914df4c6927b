"""USP attention: Ulysses all-to-all inside Ring attention, exact versus serial.

Each sequence-parallel rank holds a contiguous shard of the image tokens (the
shards follow `split_sizes(S, sp)`, so any token count works) and, for MMDiT
models, the *whole* text sequence (replicated). Strategy for joint text+image
attention (as xDiT's "front/rear" joint strategy):

* Ulysses: image q/k/v go through an all-to-all (sequence-sharded, all heads ->
  block-of-sequence, head-sharded); the replicated text q/k/v are simply sliced
  to this rank's heads. After attention the image output goes back through the
  reverse all-to-all and the text output is all-gathered over heads, so every
  rank again holds the full text stream.
* Ring: every rank's queries (its text + its image block) visit every ring
  rank's image K/V block; the text K/V join the rank's own block only, so they
  are counted exactly once. Partial results merge with their log-sum-exp.

Head counts that do not divide the Ulysses degree give uneven head shards
(exact, at the cost of balance); ring blocks of different sizes are padded for
the transfer and trimmed before use, so padding never enters a softmax.
"""
from __future__ import annotations

import torch

from .attention import attention_with_lse, merge_attention
from .comm import RingExchange, all_gather_uneven, all_to_all, split_sizes


def _ring_attention(q, k, v, scale, ring, block_sizes, backend, extra_kv=None):
    """q (B,H,Lq,D) against the image K/V blocks of all ring ranks (+ extra_kv on the own block)."""
    out = lse = None
    own_k, own_v = k, v
    if extra_kv is not None:
        own_k, own_v = torch.cat([extra_kv[0], k], dim=2), torch.cat([extra_kv[1], v], dim=2)
    if ring.size == 1:
        return attention_with_lse(q, own_k, own_v, scale, backend)
    biggest = max(block_sizes)
    pad = biggest - k.shape[2]
    send_k = torch.nn.functional.pad(k, (0, 0, 0, pad)) if pad else k
    send_v = torch.nn.functional.pad(v, (0, 0, 0, pad)) if pad else v
    pending = RingExchange([send_k, send_v], ring)
    o, l = attention_with_lse(q, own_k, own_v, scale, backend)  # overlaps the first transfer
    out, lse = merge_attention(out, lse, o, l)
    for step in range(1, ring.size):
        blk_k, blk_v = pending.wait()
        if step < ring.size - 1:
            pending = RingExchange([blk_k, blk_v], ring)
        src = (ring.rank - step) % ring.size
        n = block_sizes[src]
        o, l = attention_with_lse(q, blk_k[:, :, :n], blk_v[:, :, :n], scale, backend)
        out, lse = merge_attention(out, lse, o, l)
    return out.to(q.dtype), lse


def usp_attention(q, k, v, *, ctx, seq_sizes, text_len=0, text_first=True, scale=None, backend="auto"):
    """Drop-in for F.scaled_dot_product_attention on sequence-sharded inputs.

    q, k, v: (B, H, text_len + S_local, D), text at the front (`text_first`) or
    the back; `seq_sizes[i]` is the image shard length of sp rank i.
    Returns the attention output in the same layout as the inputs.
    """
    ulysses, ring = ctx.ulysses, ctx.ring
    n_heads = q.shape[1]

    def split_text(x):
        if text_len == 0:
            return None, x
        return (x[:, :, :text_len], x[:, :, text_len:]) if text_first else (x[:, :, -text_len:], x[:, :, :-text_len])

    (qt, qi), (kt, ki), (vt, vi) = split_text(q), split_text(k), split_text(v)
    # sp rank = ring_rank * U + ulysses_rank: my Ulysses group holds ring block `ring.rank`.
    U = ulysses.size
    block_shards = [[seq_sizes[r * U + u] for u in range(U)] for r in range(ring.size)]
    block_sizes = [sum(b) for b in block_shards]
    head_sizes = split_sizes(n_heads, U)
    h0 = sum(head_sizes[: ulysses.rank])
    h1 = h0 + head_sizes[ulysses.rank]

    if U > 1:  # (B, H, S_loc, D) -> (B, H_u, S_block, D)
        my_shards = block_shards[ring.rank]
        qi, ki, vi = (all_to_all(x, scatter_dim=1, gather_dim=2, ax=ulysses, gather_sizes=my_shards)
                      for x in (qi, ki, vi))
        if text_len:
            qt, kt, vt = qt[:, h0:h1], kt[:, h0:h1], vt[:, h0:h1]

    queries = qi if text_len == 0 else (torch.cat([qt, qi], dim=2))
    extra = None if text_len == 0 else (kt, vt)
    if ring.size == 1 and backend == "auto":
        keys = ki if extra is None else torch.cat([kt, ki], dim=2)
        vals = vi if extra is None else torch.cat([vt, vi], dim=2)
        out = torch.nn.functional.scaled_dot_product_attention(queries, keys, vals, scale=scale)
    else:
        out, _ = _ring_attention(queries, ki, vi, scale, ring, block_sizes, backend, extra)
    out_t, out_i = (None, out) if text_len == 0 else (out[:, :, :text_len], out[:, :, text_len:])

    if U > 1:  # back: (B, H_u, S_block, D) -> (B, H, S_loc, D)
        out_i = all_to_all(out_i, scatter_dim=2, gather_dim=1, ax=ulysses, gather_sizes=head_sizes,
                           scatter_sizes=block_shards[ring.rank])
        if text_len:
            out_t = all_gather_uneven(out_t.contiguous(), dim=1, ax=ulysses, sizes=head_sizes)
    if text_len == 0:
        return out_i
    return torch.cat([out_t, out_i], dim=2) if text_first else torch.cat([out_i, out_t], dim=2)
