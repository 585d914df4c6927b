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
    h, w = {"flux": (3, 5), "sd3": (6, 10), "pixart": (32, 34), "wan": (4, 6)}[family]
    res = dist_pools(_world(degrees)).run(_usp_body, family, degrees, 17 + batch, batch, h, w, 9, 3)
    assert max(e for e, _ in res) <= 1e-5
    if batch >= degrees.get("dp_degree", 1) * degrees.get("cfg_degree", 1):
        assert all(s.get("all_gather") for _, s in res), "the batch was not split and gathered"


# eight processes: SD3 (joint attention) and Wan (cross attention) in CI, Flux (43 s) and PixArt with the slow set
@pytest.mark.parametrize("family", [pytest.param("flux", marks=pytest.mark.slow), "sd3",
                                    pytest.param("pixart", marks=pytest.mark.slow), "wan"])
def test_cfg2_ulysses2_ring2_eight_processes(dist_pools, family):
    h, w = {"flux": (5, 3), "sd3": (6, 10), "pixart": (34, 38), "wan": (4, 6)}[family]
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


class _AnyUNet(torch.nn.Module):
    """Stands for a model no family adapter knows (ComfyUI's UNet signature): every tensor argument whose first
    dimension is the batch is split, ControlNet-style nested residuals included; a non-batch tensor is not."""

    def __init__(self, dtype):
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1).to(dtype)
        self.ctx = torch.nn.Linear(12, 4).to(dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g).to(dtype) * 0.3)

    def forward(self, x, timesteps=None, context=None, y=None, control=None, transformer_options={}, **kwargs):
        h = self.conv(x) * (1 + timesteps[:, None, None, None] / 1000)
        h = h + self.ctx(context).mean(1)[:, :, None, None] + y[:, :4, None, None]
        for r in control["input"]:
            h = h + r
        return h + kwargs["table"].sum()  # a shared table (its first dim is not the batch): used whole


def _any_body(degrees, seed, batch, dtype):
    from comfyui_hybrid_parallel.parallel import parallelize
    from comfyui_hybrid_parallel.parallel.models import ANY
    from dist_harness import context_for
    ctx = context_for(ParallelConfig(**degrees))
    model = _AnyUNet(dtype)
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    kw = dict(x=r(batch, 4, 5, 7), timesteps=torch.rand(batch, generator=g) * 1000, context=r(batch, 3, 12),
              y=r(batch, 6), control={"input": [r(batch, 4, 5, 7), r(batch, 4, 5, 7)]}, table=r(batch + 1, 2),
              transformer_options={"cond_or_uncond": [0, 1]})
    with torch.no_grad():
        serial = model(**kw)
        parallelize(model, ctx, plan=ANY.comfy_plan)
        par = model(**kw)
    return (par.double() - serial.double()).norm().item() / serial.double().norm().item(), ctx.stats.snapshot()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("degrees, batch", [(dict(cfg_degree=2), 2), (dict(dp_degree=2), 3), (dict(cfg_degree=2), 1)],
                         ids=["cfg2-b2", "dp2-b3", "cfg2-b1"])
def test_a_model_no_adapter_knows_splits_its_batch_exactly(dist_pools, degrees, batch, dtype):
    """parallel/models/any_model.py: CFG / data parallel of a whole model per rank equals the serial model."""
    res = dist_pools(2).run(_any_body, degrees, 31 + batch, batch, dtype)
    assert max(e for e, _ in res) <= 1e-5, res  # bf16 / fp16 come out bitwise here (rows are independent)
    if batch >= 2:
        assert all(s.get("all_gather") for _, s in res), "the batch was not split and gathered"


def _any_refused_body():
    from comfyui_hybrid_parallel.parallel import parallelize
    from comfyui_hybrid_parallel.parallel.models import ANY
    from dist_harness import context_for
    try:
        parallelize(_AnyUNet(torch.float32), context_for(ParallelConfig(ulysses_degree=2)), plan=ANY.comfy_plan)
    except ValueError as e:
        return str(e)
    return "not refused"


def test_a_model_no_adapter_knows_is_refused_sequence_parallel(dist_pools):
    assert all("no family adapter: only cfg_degree and dp_degree" in m for m in dist_pools(2).run(_any_refused_body))
