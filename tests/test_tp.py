"""Tensor parallel (plain-tensor col/row sharding, parallel/tp.py) alone and with USP/CFG: equal to serial; shards really shrink."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize
from comfyui_hybrid_parallel.parallel.tp import local_param_bytes
from dist_harness import context_for
import tiny_models as tm

pytestmark = pytest.mark.dist


def _tp_body(family, degrees, seed, batch, h, w, heads=tm.HEADS):
    ctx = context_for(ParallelConfig(**degrees))
    model = tm.build(family, heads=heads)  # sharding replaces weights: a fresh model per call
    full_bytes = local_param_bytes(model)
    kw = tm.inputs(family, seed, batch=batch, h=h, w=w, text=9)
    serial = tm.forward(model, kw)
    parallelize(model, ctx)
    par = tm.forward(model, kw)
    return tm.rel_err(par, serial), local_param_bytes(model) / full_bytes


SIZES = {"flux": (3, 5), "sd3": (6, 10), "pixart": (6, 10), "wan": (6, 10)}


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
@pytest.mark.parametrize("degrees", [dict(tp_degree=2), dict(tp_degree=4), dict(tp_degree=2, ulysses_degree=2),
                                     dict(tp_degree=2, ring_degree=2), dict(tp_degree=2, cfg_degree=2)],
                         ids=lambda d: ParallelConfig(**d).describe())
def test_tp_equals_serial(dist_pools, family, degrees):
    world = ParallelConfig(**degrees).world_size
    h, w = SIZES[family]
    res = dist_pools(world).run(_tp_body, family, degrees, 11, 2, h, w)
    assert max(e for e, _ in res) <= 1e-5, res
    fraction = res[0][1]
    assert fraction < 0.9, f"parameters per rank did not shrink under tp ({fraction:.2f} of degree 1)"


def _refusal_body(family, heads):
    ctx = context_for(ParallelConfig(tp_degree=4))
    model = tm.build(family, heads=heads)
    try:
        parallelize(model, ctx)
    except ValueError as e:
        return str(e), local_param_bytes(model) == local_param_bytes(tm.build(family, heads=heads))
    return None, None


def test_heads_not_divisible_by_tp_is_a_clear_error(dist_pools):
    res = dist_pools(4).run(_refusal_body, "pixart", 6)
    msg, untouched = res[0]
    assert "tp_degree=4 does not divide the model's 6 attention heads" in msg and "[1, 2, 3, 6]" in msg
    assert untouched, "the model was modified before the error"
