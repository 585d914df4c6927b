"""One owner of eviction, on real ranks: when one rank is shorter of device memory than the others (the rank beside
ComfyUI's own models), every rank evicts the same model - the driver decides it from all their reports
(workers/residency.room) - and the next prompt runs. Each rank used to evict by its own free memory: that rank
dropped a model rank 0 kept, and the next "touch" of it failed a forward with a KeyError.

The devices are CPU ranks with a stand-in budget (HP_TEST_DEVICE_BYTES, workers/jobs.py): free = budget - what the
rank's models took. Rank 0 can hold both tiny models, rank 1 only one."""
from __future__ import annotations

import pytest
import torch

from test_native_pool import comfy_forward, inputs, load_model, pool_forward, rel

pytestmark = pytest.mark.comfy


def test_every_rank_evicts_the_same_model_when_one_is_short(tmp_path):
    from comfy_env import setup_comfy
    setup_comfy()
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge.spec import host_tensors
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    base = load_model(tmp_path, "sd3", "fp32")
    model = base.model
    weights = sum(v.numel() * v.element_size() for v in host_tensors(model.diffusion_model).values())
    budget = f"{3 * weights},{int(1.5 * weights)}"
    config = ParallelConfig(ulysses_degree=2)
    inp = inputs("sd3", model, seed=5)
    ref = comfy_forward(model, inp)
    with WorkerPool(device="cpu", max_models=3, env={"HP_TEST_DEVICE_BYTES": budget}) as pool:
        assert rel(pool_forward(pool, config, "a", model, inp), ref) <= 1e-5
        assert [[s.key for s in r.slots] for r in pool.world.reports] == [["a"], ["a"]]
        # "b" does not fit beside "a" on rank 1: every rank answers "short", then every rank evicts "a"
        assert rel(pool_forward(pool, config, "b", model, inp), ref) <= 1e-5
        assert [[s.key for s in r.slots] for r in pool.world.reports] == [["b"], ["b"]]
        assert pool.last_load["loaded"] and pool.world.needs["b"] == {0: weights, 1: weights}
        # the next prompt runs (what rank 0 alone kept would have been "touched" and failed on rank 1), and "a" back
        out = pool.submit(config, "forward", {"key": "b", "structure": {"transformer_options": {}}}, dict(inp))
        assert rel(out.tensors["out"], ref) <= 1e-5
        assert rel(pool_forward(pool, config, "a", model, inp), ref) <= 1e-5
        assert [[s.key for s in r.slots] for r in pool.world.reports] == [["a"], ["a"]]
        health = pool.submit(config, "health", {}).per_rank
        assert all(h["resident"] == ["a"] for h in health), health
    with WorkerPool(device="cpu", env={"HP_TEST_DEVICE_BYTES": f"{3 * weights},{weights // 2}"}) as pool:
        with pytest.raises(MemoryError, match=r"do not fit rank 1's device.*with nothing else resident"):
            pool_forward(pool, config, "a", model, inp)
        assert [[s.key for s in r.slots] for r in pool.world.reports] == [[], []]  # nothing built anywhere
    assert torch.equal(comfy_forward(model, inp), ref)
