"""USP (Ulysses x Ring) on four families of ComfyUI's own classes (tests/tiny_models.py): parallel output equals
serial output on every rank."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, split_sizes, unparallelize
from dist_harness import context_for
import tiny_models as tm

pytestmark = pytest.mark.dist

_models = {}


def _model(family, heads, dtype):
    key = (family, heads, dtype)
    if key not in _models:
        _models[key] = tm.build(family, heads=heads, dtype=dtype)
    return _models[key]


def _usp_body(family, cfg_kwargs, seed, batch, h, w, text, frames, heads=tm.HEADS, dtype=torch.float32):
    ctx = context_for(ParallelConfig(**cfg_kwargs))
    model = _model(family, heads, dtype)
    kw = tm.inputs(family, seed, batch=batch, h=h, w=w, text=text, frames=frames, dtype=dtype)
    serial = tm.forward(model, kw)
    parallelize(model, ctx)
    try:
        par = tm.forward(model, kw)
    finally:
        unparallelize(model)
    assert par.shape == serial.shape
    return tm.rel_err(par, serial), ctx.stats.snapshot()


DEGREES = [dict(ulysses_degree=2), dict(ring_degree=2), dict(ulysses_degree=4), dict(ring_degree=4),
           dict(ulysses_degree=2, ring_degree=2)]
# latent (h, w) per family (Flux: its token grid): one token count that divides 2 and 4, one odd
SIZES = {"flux": [(4, 4), (5, 7)], "sd3": [(8, 8), (6, 10)], "pixart": [(32, 34), (34, 38)], "wan": [(4, 4), (6, 10)]}


def _world(d):
    return d.get("ulysses_degree", 1) * d.get("ring_degree", 1)


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
@pytest.mark.parametrize("degrees", DEGREES, ids=lambda d: ParallelConfig(**d).describe())
@pytest.mark.parametrize("size_i", [0, 1], ids=["even", "odd"])
def test_usp_equals_serial(dist_pools, family, degrees, size_i):
    h, w = SIZES[family][size_i]
    batch, text, frames = (1, 8, 2) if size_i == 0 else (2, 13, 5)
    seed = hash((family, size_i, tuple(sorted(degrees.items())))) % 10_000
    res = dist_pools(_world(degrees)).run(_usp_body, family, degrees, seed, batch, h, w, text, frames)
    errs = [e for e, _ in res]
    assert max(errs) <= 1e-5, errs
    assert all(s for _, s in res), "no communication counted: the model did not run in parallel"


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_long_text_lengths(dist_pools, family):
    """Text lengths like 77 and 333 (CLIP / T5 padding) with an odd image token count."""
    for text in (77, 333):
        res = dist_pools(4).run(_usp_body, family, dict(ulysses_degree=2, ring_degree=2), text, 1, 6 if family == "sd3" else 5, 10 if family == "sd3" else 3, text, 1)
        assert max(e for e, _ in res) <= 1e-5


@pytest.mark.parametrize("degrees", [dict(ulysses_degree=2, ring_degree=2), dict(ring_degree=4)],
                         ids=lambda d: ParallelConfig(**d).describe())
def test_wan_long_video_frame_counts(dist_pools, degrees):
    """21 latent frames (an 81-frame video) on an odd 3x5 token grid per frame: 315 tokens over 4 ranks."""
    res = dist_pools(4).run(_usp_body, "wan", degrees, 21, 1, 6, 10, 7, 21)
    assert max(e for e, _ in res) <= 1e-5


@pytest.mark.parametrize("family", ["flux", "pixart"])
@pytest.mark.parametrize("degrees", [dict(ulysses_degree=2), dict(ulysses_degree=4), dict(ulysses_degree=2, ring_degree=2)],
                         ids=lambda d: ParallelConfig(**d).describe())
def test_heads_not_divisible_by_ulysses_are_exact(dist_pools, family, degrees):
    """3 heads over 2 or 4 Ulysses ranks: uneven head shards (one rank may hold none), still exact."""
    h, w = SIZES[family][1]
    res = dist_pools(_world(degrees)).run(_usp_body, family, degrees, 5, 1, h, w, 9, 1, heads=3)
    assert max(e for e, _ in res) <= 1e-5


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
def test_bf16_parallel_close_to_bf16_serial(dist_pools, family):
    h, w = SIZES[family][1]
    res = dist_pools(4).run(_usp_body, family, dict(ulysses_degree=2, ring_degree=2), 3, 1, h, w, 9, 3,
                            dtype=torch.bfloat16)
    assert max(e for e, _ in res) <= 2e-2


def test_degree_one_is_a_no_op():
    from comfyui_hybrid_parallel.parallel import ParallelContext
    model = tm.build("pixart")
    ctx = ParallelContext(ParallelConfig())
    kw = tm.inputs("pixart", 0, h=32, w=34)
    before = tm.forward(model, kw)
    assert parallelize(model, ctx) is model and "forward" not in model.__dict__
    assert torch.equal(tm.forward(model, kw), before)


def _usp_attention_body(cfg_kwargs, heads, seq, text, text_first, batch, seed, overlap=None):
    """usp_attention alone against serial SDPA, inputs as a (B,H,L,D) view of (B,L,H,D) (how q, k, v often arrive)."""
    import torch.nn.functional as F
    from comfyui_hybrid_parallel.parallel.usp import usp_attention

    ctx = context_for(ParallelConfig(**cfg_kwargs))
    g = torch.Generator().manual_seed(seed)
    img = [torch.randn(batch, heads, seq, 8, generator=g) for _ in range(3)]
    txt = [torch.randn(batch, heads, text, 8, generator=g) for _ in range(3)]

    def join(t, i):
        return torch.cat([t, i], 2) if text_first else torch.cat([i, t], 2)

    sizes, r = split_sizes(seq, ctx.sp.size), ctx.sp.rank
    start = sum(sizes[:r])
    ref = F.scaled_dot_product_attention(*(join(t, i) for t, i in zip(txt, img)))
    ref_t, ref_i = (ref[:, :, :text], ref[:, :, text:]) if text_first else (ref[:, :, seq:], ref[:, :, :seq])
    expect = join(ref_t, ref_i.narrow(2, start, sizes[r]))
    q, k, v = (join(t, i.narrow(2, start, sizes[r])).transpose(1, 2).contiguous().transpose(1, 2)
               for t, i in zip(txt, img))
    out = usp_attention(q, k, v, ctx=ctx, seq_sizes=sizes, text_len=text, text_first=text_first, overlap=overlap)
    assert out.shape == expect.shape
    return float((out - expect).abs().max()), ctx.stats.snapshot()


@pytest.mark.parametrize("degrees, heads, seq, text", [
    (dict(ulysses_degree=3), 5, 11, 7),                 # a middle rank: its own chunk travels too; uneven heads
    (dict(ulysses_degree=4), 3, 10, 5),                 # one rank holds no head
    (dict(ulysses_degree=2), 4, 3, 0),                  # image-only self-attention
    (dict(ulysses_degree=2, ring_degree=2), 3, 9, 6),   # Ulysses inside ring blocks of different sizes
    (dict(ulysses_degree=3), 6, 2, 4),                  # fewer tokens than ranks: an empty shard
], ids=lambda x: ParallelConfig(**x).describe() if isinstance(x, dict) else str(x))
@pytest.mark.parametrize("text_first", [True, False], ids=["text_first", "text_last"])
@pytest.mark.parametrize("overlap", [None, True], ids=["one_call", "overlapped"])
def test_usp_attention_stacked_exchange_equals_serial(dist_pools, degrees, heads, seq, text, text_first, overlap):
    """The one-all-to-all q/k/v exchange and the text-carrying return trip, against serial attention:
    uneven heads and shards, text in front or behind, batch 2; the text bytes count as the all-gather they
    replace (this rank's heads, unpadded, to every other Ulysses rank). Both return trips: one attention call
    (CPU default) and query rows split to overlap the collective (the CUDA default)."""
    U = degrees.get("ulysses_degree", 1)
    res = dist_pools(_world(degrees)).run(_usp_attention_body, degrees, heads, seq, text, text_first, 2, seq + heads,
                                          overlap)
    assert max(e for e, _ in res) <= 1e-5, res
    for i, (_, snap) in enumerate(res):
        h_me = split_sizes(heads, U)[i % U]
        assert snap.get("all_gather", {}).get("bytes", 0) == 4 * 2 * h_me * text * 8 * (U - 1)

