"""What differs on NCCL and CUDA where no CPU collective shows it (issue: CUDA and NCCL), checked without a GPU:
how asynchronous work is completed, the process-group timeout per backend, and the backend a world picks.
The device discipline itself (host tensors in collectives, collective order) is parallel/strict.py, on for the
whole test session."""
import pathlib
import re

import pytest
import torch

from comfyui_hybrid_parallel.parallel.comm import complete
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import launch

REPO = pathlib.Path(__file__).resolve().parents[2]


class _Work:
    def __init__(self):
        self.calls = []

    def wait(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return True


def test_cuda_work_is_completed_without_blocking_the_host():
    """torch waits on the host whenever wait() gets a timeout: on CUDA that would stall the host at every layer
    (DistriFusion's K/V, PipeFusion's activations, the VAE halo), so CUDA work gets a plain, stream-ordered wait."""
    w = _Work()
    complete(w, torch.device("cuda", 1), 30.0)
    assert w.calls == [((), {})]
    w = _Work()
    complete(w, torch.device("cpu"), 30.0)
    (args, kwargs), = w.calls
    assert kwargs["timeout"].total_seconds() == 30.0
    w = _Work()
    complete(w, torch.device("cpu"), None)
    assert w.calls == [((), {})]


def test_no_work_is_waited_on_with_a_timeout_outside_complete():
    offenders = []
    for path in (REPO / "parallel").rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.wait\((timeout=|self\.timeout\b|datetime)", line) and path.name != "comm.py":
                offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "wait through parallel.comm.complete (a timeout blocks the host on CUDA):\n" + \
        "\n".join(offenders)


def test_collective_timeout_per_backend(monkeypatch):
    monkeypatch.delenv("HP_COLLECTIVE_TIMEOUT_S", raising=False)
    assert launch.collective_timeout("gloo") == launch.GLOO_COLLECTIVE_TIMEOUT_S == 120.0
    # NCCL's watchdog counts from enqueue: a long forward queued on a slow GPU is not a hang
    assert launch.collective_timeout("nccl") == launch.NCCL_COLLECTIVE_TIMEOUT_S >= 1800.0
    assert launch.collective_timeout("nccl", 45.0) == 45.0  # the pool's explicit value wins
    monkeypatch.setenv("HP_COLLECTIVE_TIMEOUT_S", "600")
    assert launch.collective_timeout("nccl") == launch.collective_timeout("gloo") == 600.0
    monkeypatch.setenv("HP_COLLECTIVE_TIMEOUT_S", "ten minutes")
    with pytest.raises(ValueError, match="HP_COLLECTIVE_TIMEOUT_S must be a number of seconds"):
        launch.collective_timeout("gloo")
    with pytest.raises(ValueError, match="> 0"):
        launch.collective_timeout("gloo", 0)


def _world(tmp_path, devices=(), **degrees):
    from comfyui_hybrid_parallel.workers.transport import new_prefix
    w = launch.World(ParallelConfig(devices=devices, **degrees), tmpdir=str(tmp_path), generation=1,
                     shm_prefix=new_prefix(), fake=None, device_kind="cuda" if devices else "cpu", max_models=1)
    w.devices = w._devices()
    return w


def test_a_world_of_gpus_talks_nccl_and_one_of_cpus_gloo(tmp_path):
    assert _world(tmp_path, ("cuda:1", "cuda:0"), ulysses_degree=2).backend() == "nccl"
    assert _world(tmp_path, ulysses_degree=2).backend() == "gloo"
    assert _world(tmp_path, ("cpu", "cpu"), ulysses_degree=2).backend() == "gloo"
