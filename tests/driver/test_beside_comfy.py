"""Living beside ComfyUI on a GPU machine, checked with ComfyUI's model management and CUDA stubbed (these paths
are CUDA-only; the GPU suite measures them on a GPU): the ranks go to the GPUs ComfyUI does not compute on first,
the workers' environment undoes what ComfyUI set for itself (--cuda-device, cudaMallocAsync), and when a rank must
share ComfyUI's GPU, ComfyUI's models there make room before the weights travel."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from comfyui_hybrid_parallel.workers.launch import gpu_order, worker_env


def test_ranks_take_comfyuis_gpu_last():
    assert gpu_order(2, 4, 0) == ["cuda:1", "cuda:2"]
    assert gpu_order(4, 4, 0) == ["cuda:1", "cuda:2", "cuda:3", "cuda:0"]
    assert gpu_order(2, 4, 2) == ["cuda:0", "cuda:1"]
    assert gpu_order(3, 4, None) == ["cuda:0", "cuda:1", "cuda:2"]
    assert gpu_order(4, 2, 0) == ["cuda:1", "cuda:0", "cuda:1", "cuda:0"]  # ranks sharing GPUs (staged)


def test_worker_env_undoes_comfyuis_own_settings():
    comfy = {"CUDA_VISIBLE_DEVICES": "1", "HIP_VISIBLE_DEVICES": "1", "PATH": "/bin",
             "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,backend:cudaMallocAsync"}
    env = worker_env(comfy, comfy_cuda_device=1)
    assert "CUDA_VISIBLE_DEVICES" not in env and "HIP_VISIBLE_DEVICES" not in env and env["PATH"] == "/bin"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in worker_env({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})
    # a user's own restriction (Docker, a shell export) is left alone: it is not ComfyUI's --cuda-device
    assert worker_env({"CUDA_VISIBLE_DEVICES": "2,3"}, comfy_cuda_device=None)["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert comfy["CUDA_VISIBLE_DEVICES"] == "1"  # the driver's own environment is not touched


@pytest.fixture
def stub_comfy(monkeypatch):
    """comfy.cli_args / comfy.model_management stand-ins recording what the pack asks of them."""
    calls = []
    mm = types.ModuleType("comfy.model_management")
    mm.get_torch_device = lambda: torch.device("cuda", 0)
    mm.free_memory = lambda nbytes, device, keep_loaded=[]: calls.append(("free_memory", nbytes, str(device)))
    mm.soft_empty_cache = lambda force=False: calls.append(("soft_empty_cache",))
    cli = types.ModuleType("comfy.cli_args")
    cli.args = types.SimpleNamespace(cuda_device=None)
    pkg = types.ModuleType("comfy")
    pkg.model_management, pkg.cli_args = mm, cli
    monkeypatch.setitem(sys.modules, "comfy", pkg)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setitem(sys.modules, "comfy.cli_args", cli)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    return calls, cli


def test_comfy_gpus_reads_comfyuis_device_and_its_cuda_device_flag(stub_comfy, monkeypatch):
    from comfyui_hybrid_parallel.workers.bridge.host import comfy_gpus
    calls, cli = stub_comfy
    assert comfy_gpus() == {"count": 2, "driver": 0}
    cli.args.cuda_device = 3  # ComfyUI started with --cuda-device 3: it sees one GPU, the machine has 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: 4)
    assert comfy_gpus() == {"count": 4, "driver": 3, "comfy_cuda_device": 3}


class _Pool:
    """What Runtime.ensure_native uses of a pool, recording the order of calls."""

    def __init__(self, calls, devices):
        self.calls, self.devices, self.device = calls, devices, "cuda"
        self.world = None
        self.gpus = {"count": 2, "driver": 0}

    def ensure_world(self, config):
        self.calls.append(("ensure_world",))
        self.world = types.SimpleNamespace(devices=self.devices, resident=[])
        return self.world

    def ensure_model(self, config, key, *args, **kwargs):
        self.calls.append(("ensure_model", key))
        self.world.resident.append(key)
        return {"loaded": True}


@pytest.mark.parametrize("devices,frees", [(["cuda:1", "cuda:0"], True), (["cuda:1"], False)],
                         ids=["a-rank-on-comfyuis-gpu", "comfyuis-gpu-left-alone"])
def test_comfyuis_models_make_room_before_weights_travel_to_its_gpu(stub_comfy, devices, frees):
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.workers.driver.configs import HybridParallelConfig
    calls, _ = stub_comfy
    pool = _Pool(calls, devices)
    rt = Runtime(make_pool=lambda device: pool)
    hp = HybridParallelConfig(ParallelConfig(ulysses_degree=len(devices)) if len(devices) > 1 else ParallelConfig(),
                              device="cuda")
    rt._pool = pool  # as made for this device
    model = torch.nn.Linear(4, 4)  # 80 bytes of weights
    from comfyui_hybrid_parallel.workers.bridge import spec as native
    orig = native.family_adapter
    native.family_adapter = lambda dm: types.SimpleNamespace(family="sd3")
    try:
        rt.ensure_native(hp, "k1", {}, model, lineage="m")
        rt.ensure_native(hp, "k1", {}, model, lineage="m")  # resident: nothing travels, nothing freed again
    finally:
        native.family_adapter = orig
    expect = [("ensure_world",)] + ([("free_memory", 80, "cuda:0"), ("soft_empty_cache",)] if frees else []) + \
        [("ensure_model", "k1"), ("ensure_model", "k1")]
    assert calls == expect
