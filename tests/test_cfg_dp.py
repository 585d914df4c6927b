"""CFG parallel and data parallel (the batch split over cfg x dp), alone and composed with USP."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from test_usp import _usp_body

pytestmark = pytest.mark.dist


def _world(d):
    n = 1
    for v in d.values():
        n *= v
    return n


CASES = [
    # (degrees, batch): batch 2 is one cond + one uncond; 3 over dp2 is uneven; 1 < ranks falls back
    (dict(cfg_degree=2), 2),
    (dict(cfg_degree=2), 4),
    (dict(cfg_degree=2), 1),
    (dict(cfg_degree=2), 3),  # e.g. [cond, area cond, uncond]: split 2 + 1, still exact
    (dict(dp_degree=2), 3),
    (dict(dp_degree=2), 1),
    (dict(dp_degree=2, cfg_degree=2), 4),
    (dict(dp_degree=2, cfg_degree=2), 6),
    (dict(dp_degree=2, cfg_degree=2), 3),
    (dict(cfg_degree=2, ulysses_degree=2), 2),
    (dict(dp_degree=2, ring_degree=2), 3),
    (dict(dp_degree=4), 5),
]


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
@pytest.mark.parametrize("degrees, batch", CASES,
                         ids=[f"{ParallelConfig(**d).describe()}-b{b}" for d, b in CASES])
def test_batch_parallel_equals_serial(dist_pools, family, degrees, batch):
    h, w = {"flux": (3, 5), "sd3": (6, 10), "pixart": (6, 10), "wan": (4, 6)}[family]
    res = dist_pools(_world(degrees)).run(_usp_body, family, degrees, 17 + batch, batch, h, w, 9, 3)
    assert max(e for e, _ in res) <= 1e-5
    if batch >= degrees.get("dp_degree", 1) * degrees.get("cfg_degree", 1):
        assert all(s.get("all_gather") for _, s in res), "the batch was not split and gathered"


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
def test_cfg2_ulysses2_ring2_eight_processes(dist_pools, family):
    h, w = {"flux": (5, 3), "sd3": (6, 10), "pixart": (6, 10), "wan": (4, 6)}[family]
    degrees = dict(cfg_degree=2, ulysses_degree=2, ring_degree=2)
    res = dist_pools(8).run(_usp_body, family, degrees, 99, 2, h, w, 11, 1)
    assert max(e for e, _ in res) <= 1e-5


def _batch_layout_body(batch):
    """Which samples each rank computes: cfg-major, so [cond..., uncond...] puts conds on cfg rank 0."""
    from comfyui_hybrid_parallel.parallel import split_sizes
    from dist_harness import context_for
    ctx = context_for(ParallelConfig(dp_degree=2, cfg_degree=2))
    ax = ctx.axis("batch")
    sizes = split_sizes(batch, ax.size)
    start = sum(sizes[: ax.rank])
    return ctx.coords["cfg"], list(range(start, start + sizes[ax.rank]))


def test_cfg_rank_zero_gets_the_conditional_half(dist_pools):
    res = dist_pools(4).run(_batch_layout_body, 4)  # ComfyUI order: [cond0, cond1, uncond0, uncond1]
    for cfg_rank, samples in res:
        assert all((s < 2) == (cfg_rank == 0) for s in samples), res
