"""USP attention: Ulysses all-to-all inside Ring attention, exact versus serial.

Each sequence-parallel rank holds a contiguous shard of the image tokens (the
shards follow `split_sizes(S, sp)`, so any token count works). Joint (MMDiT)
text comes in one of two ways:

* split (SD3, Flux, Qwen-Image, Chroma: parallel/plan.py splits the text stream
  like the image when it has a token per rank): a rank's q/k/v hold its text
  shard and its image shard, and since unmasked attention does not care in which
  order the gathered rows sit, the caller passes the joint shard lengths as
  `seq_sizes` and `text_len=0` - no text-specific path at all;
* replicated (families whose plan keeps it whole, or a text shorter than the
  degree): every rank holds the *whole* text, handled as xDiT's "front/rear"
  joint strategy:

* Ulysses: one all-to-all carries image q, k and v together (sequence-sharded, all
  heads -> block-of-sequence, head-sharded); the replicated text q/k/v are sliced
  to this rank's heads and copied into the same buffer, in front of (or behind) the
  received image rows, so attention reads text+image without a cat. Back, one
  all-to-all returns every rank its image rows for all heads *and* this rank's text
  heads (the text output's all-gather over heads, counted as such), received straight
  into the output tensor.
* Ring: every rank's queries (its text + its image block) visit every ring
  rank's image K/V block; the text K/V join the rank's own block only, so they
  are counted exactly once. Partial results merge with their log-sum-exp.

Buffers are laid out so that each collective's chunks are contiguous slices of the
tensor needed next: (tokens, q|k|v, B, heads, D) on the way in (one source rank =
a run of tokens), (heads, B, tokens, D) on the way out (one source rank = a run of
heads). Attention then reads strided (B, H, L, D) views of them.

Head counts that do not divide the Ulysses degree give uneven head shards
(exact, at the cost of balance); ring blocks of different sizes are padded for
the transfer and trimmed before use, so padding never enters a softmax.
"""
from __future__ import annotations

import torch

from .attention import attention_with_lse, merge_attention
from .comm import RingExchange, all_to_all_buffers, weighted_sizes


def _ring_attention(q, k, v, image, scale, ring, block_sizes, backend):
    """q (B,H,Lq,D) against the K/V blocks of all ring ranks: this rank's own k/v whole (text + image),
    the other ranks' image rows only (`image`: (start, length) of the image rows in k/v)."""
    out = lse = None
    if ring.size == 1:
        return attention_with_lse(q, k, v, scale, backend)
    k_img, v_img = k.narrow(2, *image), v.narrow(2, *image)
    pad = max(block_sizes) - k_img.shape[2]
    send_k = torch.nn.functional.pad(k_img, (0, 0, 0, pad)) if pad else k_img
    send_v = torch.nn.functional.pad(v_img, (0, 0, 0, pad)) if pad else v_img
    pending = RingExchange([send_k, send_v], ring)
    o, l = attention_with_lse(q, k, v, scale, backend)  # overlaps the first transfer
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


def _offsets(sizes):
    """Start of each chunk of `sizes` laid end to end."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def _own_chunk_stays(me, n):
    """Whether this rank's own chunk is copied straight into place instead of travelling through the
    all-to-all. torch packs the received chunks back to back, so a zero-length own chunk is only possible
    where it sits at an end of the receive buffer: the first or last rank (every rank at degree 2). Elsewhere
    it goes through the collective, which copies it locally."""
    return me == 0 or me == n - 1


def _received(start, length, own, me, stays):
    """(start, length) of the part of a receive region the collective writes: all of it, or all but this
    rank's own chunk at its front (rank 0) or back (last rank) when that chunk stays home."""
    if not stays:
        return start, length
    return (start + own, length - own) if me == 0 else (start, length - own)


def _heads_to_tokens(q, k, v, ax, head_sizes, shards, text_len, text_first):
    """Ulysses in: (B, H, T + S_me, D) x3 -> (B, H_me, T + S_block, D) x3, one all-to-all for q, k and v.

    The receive buffer is (T + S_block, 3, B, H_me, D): source rank j's image rows for q|k|v are one
    contiguous run of tokens, so the all-to-all writes them in place; the replicated text, sliced to this
    rank's heads, is copied into its rows next to them. The send buffer holds, per destination j,
    (S_me, 3, B, H_j, D), filled by one strided copy per tensor (see `_own_chunk_stays` for this rank's own).
    """
    me, (B, H, _, D) = ax.rank, q.shape
    S_me, T, S_block = shards[me], text_len, sum(shards)
    img_in, txt_in = (T, 0) if text_first else (0, S_me)        # where image / text rows start in q
    img_out, txt_out = (T, 0) if text_first else (0, S_block)   # ... and in the block layout
    h_off, row_off = _offsets(head_sizes), _offsets(shards)
    stays = _own_chunk_stays(me, ax.size)
    recv = torch.empty((T + S_block, 3, B, head_sizes[me], D), dtype=q.dtype, device=q.device)
    send_counts = [0 if j == me and stays else S_me * 3 * B * h * D for j, h in enumerate(head_sizes)]
    send = torch.empty(sum(send_counts), dtype=q.dtype, device=q.device)
    slots = send.split(send_counts)
    for t, x in enumerate((q, k, v)):
        img = x.narrow(2, img_in, S_me)
        for j, h in enumerate(head_sizes):
            dst = recv.narrow(0, img_out + row_off[me], S_me) if j == me and stays else \
                slots[j].view(S_me, 3, B, h, D)
            dst[:, t].copy_(img.narrow(1, h_off[j], h).permute(2, 0, 1, 3))
        if T:
            recv[txt_out:txt_out + T, t].copy_(x.narrow(2, txt_in, T).narrow(1, h_off[me], head_sizes[me])
                                               .permute(2, 0, 1, 3))
    recv_counts = [0 if j == me and stays else s * 3 * B * head_sizes[me] * D for j, s in enumerate(shards)]
    rows = _received(img_out, S_block, S_me, me, stays)
    all_to_all_buffers(send, recv.narrow(0, *rows).view(-1), send_counts, recv_counts, ax)
    return tuple(recv[:, t].permute(1, 2, 0, 3) for t in range(3))


def _attend_and_return(attend, ax, head_sizes, shards, text_len, text_first, B, D, like):
    """Ulysses out: attention rows of the (B, H_me, T + S_block, D) block -> (B, H, T + S_me, D), text and
    image in one all-to-all, overlapped with this rank's own rows.

    `attend(start, n)` gives the block's output rows [start, start + n) (B, H_me, n, D) - computed on demand
    (plain attention: query rows are independent) or sliced from a finished output (ring). The rows that
    leave this rank - the text and the other ranks' image shards - are computed first and sent
    asynchronously; this rank's own image rows are computed while they travel (when its own chunk stays
    home, see `_own_chunk_stays`). The result is received straight into a (H, B, T + S_me, D) tensor
    (source rank j's heads are one contiguous run) and returned as a (B, H, L, D) view of it. What goes to
    rank j is this rank's heads for j's image rows plus all text rows: the image part is the Ulysses return
    trip ("all_to_all" bytes), the text part the all-gather of the text output over heads ("all_gather").
    """
    me, U = ax.rank, ax.size
    T, S_me, H_me, H = text_len, shards[me], head_sizes[me], sum(head_sizes)
    img_blk, txt_blk = (T, 0) if text_first else (0, sum(shards))
    h_off, row_off = _offsets(head_sizes), _offsets(shards)
    stays = _own_chunk_stays(me, U)
    result = torch.empty((H, B, T + S_me, D), dtype=like.dtype, device=like.device)
    send_counts = [0 if j == me and stays else H_me * B * (T + s) * D for j, s in enumerate(shards)]
    send = torch.empty(sum(send_counts), dtype=like.dtype, device=like.device)
    slots = send.split(send_counts)
    text = attend(txt_blk, T).transpose(0, 1) if T else None

    def place(j, dst):
        img_at, txt_at = (T, 0) if text_first else (0, shards[j])
        dst.narrow(2, img_at, shards[j]).copy_(attend(img_blk + row_off[j], shards[j]).transpose(0, 1))
        if T:
            dst.narrow(2, txt_at, T).copy_(text)

    for j, s in enumerate(shards):
        if not (j == me and stays):
            place(j, slots[j].view(H_me, B, T + s, D))
    recv_counts = [0 if j == me and stays else h * B * (T + S_me) * D for j, h in enumerate(head_sizes)]
    counted = {"all_to_all": [0 if j == me else H_me * B * s * D for j, s in enumerate(shards)]}
    if T:
        counted["all_gather"] = [0 if j == me else H_me * B * T * D for j in range(U)]
    finish = all_to_all_buffers(send, result.narrow(0, *_received(0, H, H_me, me, stays)).view(-1), send_counts,
                                recv_counts, ax, counted=counted, async_op=True)
    if stays:
        place(me, result.narrow(0, h_off[me], H_me))
    finish()
    return result.transpose(0, 1)


def usp_attention(q, k, v, *, ctx, seq_sizes, text_len=0, text_first=True, scale=None, backend="auto",
                  overlap=None, kernel=None):
    """Drop-in for F.scaled_dot_product_attention on sequence-sharded inputs.

    q, k, v: (B, H, text_len + S_local, D), text at the front (`text_first`) or
    the back; `seq_sizes[i]` is the image shard length of sp rank i.
    Returns the attention output in the same layout as the inputs (possibly a strided view).
    `overlap`: split the attention by query rows to overlap the return all-to-all (default: on CUDA only).
    `kernel(q, k, v) -> out`, (B, H, L, D) in and out: the local attention of pure Ulysses (no ring, backend
    "auto"), where no log-sum-exp is needed - the kernel the user picked in ComfyUI (sage, flash, sub-quadratic
    ...), so the sequence ranks compute what one device would; default torch's SDPA. Ring attention merges
    partial results by their LSE and always runs parallel/attention.py's kernels.
    """
    ulysses, ring = ctx.ulysses, ctx.ring
    # sp rank = ring_rank * U + ulysses_rank: my Ulysses group holds ring block `ring.rank`.
    U = ulysses.size
    block_shards = [[seq_sizes[r * U + u] for u in range(U)] for r in range(ring.size)]
    block_sizes = [sum(b) for b in block_shards]
    my_shards = block_shards[ring.rank]
    head_sizes = weighted_sizes(q.shape[1], getattr(ctx, "head_weights", None), U)
    if U > 1:  # (B, H, T + S_loc, D) -> (B, H_u, T + S_block, D)
        q, k, v = _heads_to_tokens(q, k, v, ulysses, head_sizes, my_shards, text_len, text_first)
    image = (text_len if text_first else 0, block_sizes[ring.rank])  # image rows of the block in q/k/v
    plain = ring.size == 1 and backend == "auto"
    # Overlap (GPU): query rows computed as the return trip needs them, the collective running meanwhile on its
    # own stream. On a CPU the collective and the kernel share the cores and three smaller attention calls cost
    # more than they hide (~10 ms per Flux-like forward here, bench_ulysses_peer): one call.
    if plain and kernel is None:
        def kernel(q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
    if plain and U > 1 and (q.is_cuda if overlap is None else overlap):
        def attend(start, n):
            return kernel(q.narrow(2, start, n), k, v)
    else:
        if plain:
            out = kernel(q, k, v)
        else:
            out, _ = _ring_attention(q, k, v, image, scale, ring, block_sizes, backend)
        if U == 1:
            return out

        def attend(start, n):
            return out.narrow(2, start, n)
    # back: (B, H_u, T + S_block, D) -> (B, H, T + S_loc, D)
    return _attend_and_return(attend, ulysses, head_sizes, my_shards, text_len, text_first, q.shape[0],
                              q.shape[3], q)
