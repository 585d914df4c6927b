"""The memory planner (parallel/memory.py): what a rank holds, predicted before any worker starts; refusals name
the numbers and the fix. The K/V buffers it predicts are the ones the implementation allocates (counted on a real
2-rank DistriFusion run); the refusals are shown on published model sizes against real GPU capacities."""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, unparallelize
from comfyui_hybrid_parallel.parallel.config import ConfigError
from comfyui_hybrid_parallel.parallel.costmodel import ModelShape, shape_from_module
from comfyui_hybrid_parallel.parallel.memory import check_fits, rank_memory
from dist_harness import context_for
import tiny_models as tm

GIB = 2**30
WAN14B = ModelShape.dit("wan", blocks=40, hidden=5120, heads=40, mlp_ratio=13824 / 5120, patch=(1, 2, 2))
FLUX12B = ModelShape.dit("flux", blocks=19, single_blocks=38, hidden=3072, heads=24)
WAN_720P = (1, 16, 21, 90, 160)   # 1280 x 720, 81 frames
FLUX_1024 = (1, 16, 128, 128)


def test_distrifusion_on_wan_720p_is_refused_with_the_numbers_and_usp_fits():
    config = ParallelConfig(ulysses_degree=2, method="distrifusion")
    mem = rank_memory(WAN14B, 28 * GIB, config, WAN_720P, text=512, batch=2, act_bytes=2)
    kv = mem.items["DistriFusion K/V buffers"]
    assert kv > 300 * GIB and mem.largest()[0] == "DistriFusion K/V buffers"
    with pytest.raises(ConfigError) as e:
        check_fits(mem, 80 * GIB, "cuda:0 (H100)", config)
    msg = str(e.value)
    assert "DistriFusion K/V buffers" in msg and "80.0 GiB" in msg and "method 'usp'" in msg
    usp = rank_memory(WAN14B, 28 * GIB, ParallelConfig(ulysses_degree=2), WAN_720P, text=512, batch=2, act_bytes=2)
    assert "DistriFusion K/V buffers" not in usp.items and usp.total < 72 * GIB
    check_fits(usp, 80 * GIB, "cuda:0 (H100)", ParallelConfig(ulysses_degree=2))


def test_weights_that_fit_no_card_are_refused_and_sharding_fits():
    serial = ParallelConfig()
    mem = rank_memory(FLUX12B, 24 * GIB, serial, FLUX_1024, text=256, batch=1, act_bytes=2)
    with pytest.raises(ConfigError, match=r"(?s)weights 24\.0 GiB.*shard_weights 'all'"):
        check_fits(mem, 24 * GIB, "cuda:0 (RTX 4090)", serial)
    sharded = ParallelConfig(ulysses_degree=4, shard_weights="all")
    mem4 = rank_memory(FLUX12B, 24 * GIB, sharded, FLUX_1024, text=256, batch=1, act_bytes=2)
    assert mem4.items["weights (shard)"] == 6 * GIB and mem4.total < 22 * GIB
    check_fits(mem4, 24 * GIB, "cuda:0 (RTX 4090)", sharded)
    tp = rank_memory(FLUX12B, 24 * GIB, ParallelConfig(tp_degree=2), FLUX_1024, text=256, batch=1, act_bytes=2)
    assert tp.items["weights (tensor-parallel slice)"] == 12 * GIB


def test_cpu_ranks_share_one_copy_of_the_weights():
    config = ParallelConfig(ulysses_degree=4)
    mem = rank_memory(FLUX12B, 24 * GIB, config, FLUX_1024, text=256, batch=1, act_bytes=4, cpu=True)
    assert mem.shared_weights
    check_fits(mem, 40 * GIB, "this machine's RAM", config, ranks_on_host=4, weight_bytes=24 * GIB)
    with pytest.raises(ConfigError, match="4 ranks on this machine's RAM"):
        check_fits(mem, 24 * GIB, "this machine's RAM", config, ranks_on_host=4, weight_bytes=24 * GIB)


def _distrifusion_buffers(family, seed):
    model = tm.build(family)
    kw = tm.inputs(family, seed, batch=2, h=6, w=10, text=9)
    ctx = context_for(ParallelConfig(ulysses_degree=2, method="distrifusion", warmup_steps=1))
    parallelize(model, ctx)
    try:
        from comfyui_hybrid_parallel.parallel.distrifusion import distrifusion_state
        state = distrifusion_state(model)
        for i in range(3):  # a synchronous step, then two stale ones: both exchanges allocated
            state.set_step(i, total_steps=4)
            tm.forward(model, kw)
        held = sum(t.numel() * t.element_size() for ex in state._exchanges if ex is not None
                   for t in [ex.send, *ex.recv])
    finally:
        unparallelize(model)
    shape = shape_from_module(model)
    latent = (2, kw["x"].shape[1], 6, 10) if family != "flux" else None
    return held, shape, latent


@pytest.mark.dist
def test_predicted_distrifusion_buffers_are_the_ones_allocated(dist_pools):
    held, shape, latent = dist_pools(2).run(_distrifusion_buffers, "sd3", 3)[0]
    mem = rank_memory(shape, 0, ParallelConfig(ulysses_degree=2, method="distrifusion"), latent, text=9, batch=2,
                      act_bytes=4)
    assert held > 0 and mem.items["DistriFusion K/V buffers"] == held


def test_weight_sharding_says_what_it_moves_per_forward():
    from comfyui_hybrid_parallel.parallel.memory import shard_traffic
    assert shard_traffic(24 * GIB, ParallelConfig(ulysses_degree=4)) == ""
    note = shard_traffic(24 * GIB, ParallelConfig(ulysses_degree=4, shard_weights="all"))
    assert "gathers 18.0 GiB" in note and "ms over NVLink" in note and "0.8 s over PCIe" in note
