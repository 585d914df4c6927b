"""Node logic without the engine: Parallel Config validation, loop-mode choices, and the runtime's
model residency (convert once, reload after a restart, a new key per patch set) on fake workers."""
import os

import pytest
import torch

from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
from comfyui_hybrid_parallel.workers.bridge.loop_mode import check_loop_mode, uses_loop_mode
from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
from comfyui_hybrid_parallel.workers import WorkerPool

DEFAULTS = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
                warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")


def _build(**kw):
    return ParallelConfigNode().build(**{**DEFAULTS, **kw})


def test_parallel_config_reports_world_and_groups():
    out = _build(cfg_degree=2, ulysses_degree=2)
    hp = out["result"][0]
    assert hp.config.world_size == 4 and hp.device == "cpu" and hp.mode == "auto"
    text = "\n".join(out["ui"]["text"])
    assert "4 cpu worker(s)" in text and "step mode" in text and "cfg: [[0, 2], [1, 3]]" in text
    assert "loop mode" in "\n".join(_build(pp_degree=2)["ui"]["text"])


@pytest.mark.parametrize("kw,match", [
    (dict(cfg_degree=3), "cfg_degree"),
    (dict(pp_degree=2, num_pipeline_patch=1), "num_pipeline_patch"),
    (dict(tp_degree=2, pp_degree=2), "tp_degree"),
    (dict(pp_degree=2, sampling_mode="step"), "sampling_mode"),
    (dict(devices="cpu,cpu,cpu", ulysses_degree=2), "devices"),
])
def test_parallel_config_errors_say_what_to_change(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        _build(**kw)
    assert str(e.value).startswith("Parallel Config:")


def test_loop_mode_choices():
    assert not uses_loop_mode(_build()["result"][0])
    assert uses_loop_mode(_build(sampling_mode="loop")["result"][0])
    assert uses_loop_mode(_build(pp_degree=2)["result"][0])
    check_loop_mode("dpmpp_2m")
    with pytest.raises(ValueError, match="heun.*step mode"):
        check_loop_mode("heun")


def test_idle_workers_exit_after_the_idle_timeout(monkeypatch):
    """HP_IDLE_TIMEOUT_S (off by default): no node run for that long and the workers exit, nothing held; a run in
    progress is never stopped, and the next prompt starts them again."""
    import time
    monkeypatch.setenv("HP_IDLE_TIMEOUT_S", "0.6")
    rt = Runtime(make_pool=lambda device: WorkerPool(fake="serve", device=device))
    hp = _build(ulysses_degree=2)["result"][0]
    try:
        with rt.track("sample"):
            rt.pool(hp).ensure_model(hp.config, "m|usp", "sd3", state_dict={"w": torch.ones(2)})
            pids = [h["pid"] for h in rt.pool(hp).health()]
            time.sleep(1.0)  # longer than the timeout, but a job runs: nothing stops
            assert rt._pool is not None and rt._pool.world is not None
        deadline = time.monotonic() + 10
        while rt._pool is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert rt._pool is None and rt.status()["state"] == "none"
        for pid in pids:
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"worker {pid} still runs after the idle timeout")
        with rt.track("sample"):
            rt.pool(hp).ensure_model(hp.config, "m|usp", "sd3", state_dict={"w": torch.ones(2)})
        assert rt._pool is not None
    finally:
        monkeypatch.delenv("HP_IDLE_TIMEOUT_S")
        rt.stop()


def test_parallel_config_refuses_what_this_machine_cannot_place(monkeypatch):
    """Checked in the node, before any worker starts: a CUDA device that is not there, a CPU world beyond
    twice the cores (HP_MAX_CPU_WORKERS raises it)."""
    import os

    import torch

    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    kw = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
              warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device is 'cuda' but torch sees no CUDA device.*'cpu'"):
        ParallelConfigNode().build(**{**kw, "device": "cuda"})
    with pytest.raises(ValueError, match="device 'cuda:0' does not exist here"):
        ParallelConfigNode().build(**{**kw, "ulysses_degree": 2, "devices": "cuda:0,cuda:1"})
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        ParallelConfigNode().build(**{**kw, "devices": "tpu:0"})
    monkeypatch.delenv("HP_MAX_CPU_WORKERS", raising=False)
    limit = 2 * (os.cpu_count() or 1)
    ParallelConfigNode().build(**{**kw, "dp_degree": limit})
    with pytest.raises(ValueError, match=f"{limit + 1} CPU worker processes.*limit of {limit}.*HP_MAX_CPU_WORKERS"):
        ParallelConfigNode().build(**{**kw, "dp_degree": limit + 1})
    monkeypatch.setenv("HP_MAX_CPU_WORKERS", str(limit + 1))
    ParallelConfigNode().build(**{**kw, "dp_degree": limit + 1})


def test_a_stopping_pool_shows_as_stopping_not_failed():
    """While its world tears down the panel says "stopping" (the probe saw "failed" in 94 of 771 polls)."""
    rt = Runtime(make_pool=lambda device: WorkerPool(fake="serve", device=device))
    hp = ParallelConfigNode().build(dp_degree=1, cfg_degree=1, ulysses_degree=2, ring_degree=1, pp_degree=1,
                                    num_pipeline_patch=0, warmup_steps=1, tp_degree=1, method="usp", device="cpu",
                                    attention="auto")["result"][0]
    try:
        pool = rt.pool(hp)
        pool.submit(hp.config, "steps", {"n": 1})
        world = pool.world
        assert rt.status()["state"] == "ready"
        world.state = "stopping"  # what teardown() sets until the last worker is collected
        assert rt.status()["state"] == "stopping"
        world.state = "idle"
    finally:
        rt.stop()


