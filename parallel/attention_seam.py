"""The attention swap: how a declared self-attention module's attention becomes USP (or another method's) attention.

Two entry points, one path (`attend`), so every interceptor accepts exactly the same calls:

* ComfyUI's seam: ComfyUI's DiTs call `optimized_attention(..., transformer_options=...)`, and its
  `wrap_attn` hands the call to `transformer_options["optimized_attention_override"]` when set.
  `comfy_attention_override` is that override: inside a declared attention module it runs USP
  attention, anywhere else ComfyUI's own kernel unchanged.
* `SDPAInterceptor`, a TorchFunctionMode that swaps `F.scaled_dot_product_attention` inside the
  declared module, for ComfyUI code that calls torch's kernel directly (PixArt's attention).

Kept apart from parallel/plan.py (which decides *where* sequences are split and gathered) because
DistriFusion and PipeFusion's KV buffer parse the same SDPA calls (`sdpa_arguments`).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .comm import all_gather_uneven
from .usp import usp_attention

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def attend(applied, q, k, v, scale=None, kernel=None):
    """USP (or the method's) attention for q/k/v in (B, H, L, D) inside the declared module now running.
    `kernel`: USP's local attention where it needs no LSE (usp_attention); another method ignores it."""
    state = applied.state
    if state.seq_sizes is None:
        raise RuntimeError("self-attention ran on a sequence that was never split: plan inconsistent")
    spec = state.attention
    local = state.seq_sizes[applied.ctx.sp.rank]
    text_len = q.shape[2] - local  # whatever q holds beyond the local image shard is text (joint attention)
    if text_len < 0 or k.shape[2] != q.shape[2]:
        raise RuntimeError(f"attention in a declared self-attention module has q length {q.shape[2]} and k length "
                           f"{k.shape[2]} for a local image shard of {local} tokens: the family plan is inconsistent")
    sizes = state.seq_sizes
    if text_len and state.text_sizes is not None:
        # Split text: each rank holds [its text shard, its image shard] (or the reverse), and attention without a
        # mask is the same whatever order the gathered rows take - so the joint rows are one sharded sequence.
        mine = state.text_sizes[applied.ctx.sp.rank]
        if text_len != mine:
            raise RuntimeError(f"joint attention holds {text_len} text tokens where this rank's text shard has "
                               f"{mine}: the family plan is inconsistent")
        sizes, text_len = [t + s for t, s in zip(state.text_sizes, sizes)], 0
    backend = getattr(applied.ctx, "attention_backend", "auto")
    if applied.attention_fn is not None:
        return applied.attention_fn(q, k, v, ctx=applied.ctx, seq_sizes=sizes, text_len=text_len,
                                    text_first=spec.text_first, scale=scale, backend=backend)
    return usp_attention(q, k, v, ctx=applied.ctx, seq_sizes=sizes, text_len=text_len, text_first=spec.text_first,
                         scale=scale, backend=backend, kernel=kernel)


def sdpa_arguments(args, kwargs, who: str):
    """(q, k, v, rest) of an F.scaled_dot_product_attention call, refusing what sequence-split attention
    cannot compute (mask, causal, dropout, GQA). One parser for every interceptor (USP, DistriFusion,
    PipeFusion's KV buffer), so they accept exactly the same calls."""
    rest = dict(zip(_SDPA_ARGS, args))
    rest.update(kwargs or {})
    q, k, v = rest.pop("query"), rest.pop("key"), rest.pop("value")
    if rest.get("attn_mask") is not None or rest.get("is_causal") or rest.get("dropout_p", 0.0) or \
            rest.get("enable_gqa"):
        raise NotImplementedError(f"{who} supports unmasked, non-causal self-attention without dropout/GQA; "
                                  f"this model's self-attention uses one of those")
    for name in ("attn_mask", "is_causal", "dropout_p", "enable_gqa"):
        rest.pop(name, None)
    return q, k, v, rest


class SDPAInterceptor(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to USP attention; everything else runs unchanged."""

    def __init__(self, applied):
        super().__init__()
        self.applied = applied

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, rest = sdpa_arguments(args, kwargs, "sequence-parallel attention")
        return attend(self.applied, q, k, v, scale=rest.get("scale"))


_COMFY_ATTN_ARGS = ("q", "k", "v", "heads", "mask", "attn_precision", "skip_reshape", "skip_output_reshape")


def comfy_attention_override(applied):
    """ComfyUI's `optimized_attention_override(func, q, k, v, heads, ...)` for this applied plan.

    Outside a declared attention module (cross-attention, ComfyUI's other calls) it runs ComfyUI's
    own kernel `func` unchanged. Inside, q/k/v arrive as (B, L, H*D), or (B, H, L, D) with
    `skip_reshape`; the result leaves in the layout ComfyUI's kernel would have returned. Ulysses' local
    attention (a share of the heads over the whole sequence) runs ComfyUI's kernel too: `applied.kernel`, the
    one the driver picked, else `func` - with this call's precision, on (B, H_rank, L, D).
    """
    def override(func, *args, **kwargs):
        if applied.state.attention is None:
            return func(*args, **kwargs)
        a = dict(zip(_COMFY_ATTN_ARGS, args))
        a.update(kwargs)
        q, k, v, heads = a["q"], a["k"], a["v"], int(a["heads"])
        if a.get("mask") is not None:
            raise NotImplementedError("sequence-parallel attention does not support an attention mask; "
                                      "this model passed one to its self-attention")
        if applied.state.attention.gather_kv:  # whole queries, sharded keys: the model's kernel on whole keys
            dim = 2 if a.get("skip_reshape") else 1   # (B, H, L, D) or (B, L, H*D)
            a["k"], a["v"] = (all_gather_uneven(t.contiguous(), dim, applied.ctx.sp, sizes=applied.state.seq_sizes)
                              for t in (k, v))
            return func(**a)
        if not a.get("skip_reshape"):
            b, _, inner = q.shape
            q, k, v = (t.view(b, t.shape[1], -1, inner // heads).transpose(1, 2) for t in (q, k, v))
        if a.get("enable_gqa") and k.shape[1] != q.shape[1]:  # grouped K/V heads: each serves q heads // kv heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        pad = k.shape[2] - q.shape[2] if applied.state.attention.query_tail else 0
        if pad > 0:  # queries for the keys' last rows only (Attention.query_tail): zero rows for the prefix's
            q = torch.cat([q.new_zeros(q.shape[:2] + (pad, q.shape[3])), q], dim=2)
        base = applied.kernel or func
        precision = a.get("attn_precision")

        def kernel(q, k, v):  # ComfyUI's signature; no transformer_options: the override is not asked again
            if not q.numel():  # no heads here (more ranks than heads, e.g. under TP) or no rows: ComfyUI's
                return q.new_empty(q.shape[:-1] + v.shape[-1:])  # kernels cannot reshape an empty tensor
            return base(q, k, v, q.shape[1], attn_precision=precision, skip_reshape=True, skip_output_reshape=True)
        out = attend(applied, q, k, v, kernel=kernel)
        if pad > 0:
            out = out[:, :, pad:]
        if a.get("skip_output_reshape"):
            return out
        b, h, n, d = out.shape
        return out.transpose(1, 2).reshape(b, n, h * d)
    return override


def attention_wrapper(applied, spec):
    """Wrap a declared attention module's forward: while it runs, `applied.state.attention` says which spec the
    attention call inside belongs to; for the SDPA seam the interceptor is on."""
    def make(old):
        @functools.wraps(old)
        def forward(*args, **kwargs):
            outer = applied.state.attention
            applied.state.attention = spec
            try:
                if spec.seam == "comfy":
                    return old(*args, **kwargs)
                with SDPAInterceptor(applied):
                    return old(*args, **kwargs)
            finally:
                applied.state.attention = outer
        return forward
    return make
