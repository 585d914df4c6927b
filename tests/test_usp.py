"""USP (Ulysses x Ring) on the four families: parallel output equals serial output on every rank."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, unparallelize
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
# latent (h, w) per family: one size that divides 2 and 4, one with an odd token count
SIZES = {"flux": [(4, 4), (5, 7)], "sd3": [(8, 8), (6, 10)], "pixart": [(8, 8), (6, 10)], "wan": [(4, 4), (6, 10)]}


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
    res = dist_pools(_world(degrees)).run(_usp_body, family, degrees, 5, 1, 6, 6, 9, 1, heads=3)
    assert max(e for e, _ in res) <= 1e-5


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
def test_bf16_parallel_close_to_bf16_serial(dist_pools, family):
    h, w = SIZES[family][1]
    res = dist_pools(4).run(_usp_body, family, dict(ulysses_degree=2, ring_degree=2), 3, 1, h, w, 9, 3,
                            dtype=torch.bfloat16)
    assert max(e for e, _ in res) <= 2e-2


def _degree_one_is_untouched():
    model = _model("pixart", tm.HEADS, torch.float32)
    ctx = context_for(ParallelConfig())
    return parallelize(model, ctx) is model and "forward" not in model.__dict__


def test_degree_one_is_a_no_op():
    from comfyui_hybrid_parallel.parallel import ParallelContext
    model = tm.build("pixart")
    ctx = ParallelContext(ParallelConfig())
    kw = tm.inputs("pixart", 0)
    before = tm.forward(model, kw)
    assert parallelize(model, ctx) is model and "forward" not in model.__dict__
    assert torch.equal(tm.forward(model, kw), before)
