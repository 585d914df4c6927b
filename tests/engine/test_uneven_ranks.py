"""Ranks of different speeds (parallel/context.ParallelContext.set_speeds): the image sequence - and, without ring,
Ulysses' heads - is shared out in proportion to each rank's speed, so the slowest rank does not set the pace; the
output still equals the serial forward (the split moves, the maths does not)."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, ParallelContext, parallelize, unparallelize
from comfyui_hybrid_parallel.parallel.comm import split_sizes, weighted_sizes
from comfyui_hybrid_parallel.parallel.plan_inputs import _RunState
from dist_harness import context_for
import tiny_models as tm

pytestmark = pytest.mark.dist


def test_weighted_sizes():
    assert weighted_sizes(10, [2, 1]) == [7, 3]
    assert weighted_sizes(100, [1, 0.5, 0.5, 2]) == [25, 13, 12, 50]
    assert sum(weighted_sizes(37, [3, 1, 1.7])) == 37
    assert weighted_sizes(3, [100, 1, 1]) == [1, 1, 1]  # every rank keeps a token
    assert weighted_sizes(9, None, 4) == split_sizes(9, 4)


def test_close_speeds_split_evenly_and_bad_ones_are_refused():
    ctx = ParallelContext(ParallelConfig())
    with pytest.raises(ValueError, match="1 positive numbers"):
        ctx.set_speeds([1.0, 2.0])
    ctx.set_speeds([1.0])
    assert ctx.sp_weights is None and ctx.head_weights is None


def _body(family, degrees, speeds, seed, h, w, text):
    ctx = context_for(ParallelConfig(**degrees))
    ctx.set_speeds(speeds)
    model = tm.build(family, heads=4)
    kw = tm.inputs(family, seed, batch=2, h=h, w=w, text=text)
    serial = tm.forward(model, kw)
    seen = {}
    real = _RunState.sizes_for

    def spy(self, *args, **kwargs):  # the split every hook of this forward uses
        seen["seq"] = real(self, *args, **kwargs)
        return seen["seq"]
    parallelize(model, ctx)
    weights = ctx.sp_weights, ctx.head_weights
    _RunState.sizes_for = spy
    try:
        par = tm.forward(model, kw)
    finally:
        _RunState.sizes_for = real
        unparallelize(model)
        ctx.set_speeds(None)
    return (tm.rel_err(par, serial), seen, *weights)


@pytest.mark.parametrize("family,size", [("sd3", (6, 10)), ("flux", (5, 7)), ("wan", (6, 10))])
@pytest.mark.parametrize("degrees,speeds", [
    (dict(ulysses_degree=2), [2.0, 1.0]),
    (dict(ring_degree=2), [1.0, 3.0]),
    (dict(ulysses_degree=2, ring_degree=2), [1.0, 2.0, 1.0, 1.5]),
], ids=["u2", "r2", "u2r2"])
def test_uneven_ranks_equal_serial(dist_pools, family, size, degrees, speeds):
    world = len(speeds)
    res = dist_pools(world).run(_body, family, degrees, speeds, 7, *size, 9)
    for err, seen, _, _ in res:
        assert err <= 1e-5, res
    seq = res[0][1]["seq"]
    assert seq == weighted_sizes(sum(seq), speeds) and seq != split_sizes(sum(seq), world), seq
    assert res[0][2] == speeds and res[0][3] == (speeds if degrees == dict(ulysses_degree=2) else None)
