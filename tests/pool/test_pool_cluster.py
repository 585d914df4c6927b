"""Two torchrun launch groups on loopback form one world with the driver's pool (cluster.py)."""
import os
import socket
import subprocess
import time

import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers import WorkerPool
from comfyui_hybrid_parallel.workers.cluster import Cluster, ClusterError, read_authkey_file
from comfyui_hybrid_parallel.workers.launch import StartupError
from test_native_pool import comfy, comfy_forward, inputs, load_model, pool_forward, rel  # noqa: F401 (fixture)

pytestmark = pytest.mark.dist


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster(tmp_path, **kw) -> Cluster:
    return Cluster(nnodes=2, nproc_per_node=1, authkey_file=str(tmp_path / "pool.key"),
                   control=f"127.0.0.1:{_port()}", master_port=_port(), **kw)


@pytest.mark.slow  # CI: the Parallel Cluster node's world over two launch groups (server_e2e/test_comfyui_cluster.py)
def test_two_launch_groups_on_loopback(comfy, tmp_path):
    cluster = _cluster(tmp_path)
    cluster.authkey()  # made (0600) before the other machine's group starts, as a user would copy it
    log = open(tmp_path / "group1.log", "w")
    other = subprocess.Popen(cluster.join_command(1), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    pool = WorkerPool(device="cpu", cluster=cluster, start_timeout_s=120, job_timeout_s=120)
    try:
        cfg = ParallelConfig(ulysses_degree=2)
        base = load_model(comfy, "sd3", "fp32").model  # ComfyUI's own SD3, as UNETLoader loads it
        # weights and inputs reach the other group by broadcast from rank 0 (no shared /dev/shm there)
        for seed, odd in enumerate((False, True)):  # 8 x 12 and 9 x 13 latents (the odd one uneven over 2 ranks)
            inp = inputs("sd3", base, seed=40 + seed, odd=odd)
            out = pool_forward(pool, cfg, "sd3", base, inp)
            assert rel(out, comfy_forward(base, inp)) <= 1e-5
        health = pool.health()
        assert [x["rank"] for x in health] == [0, 1] and len({x["pid"] for x in health}) == 2
        with pytest.raises(ClusterError, match="nproc_per_node"):
            pool.ensure_world(ParallelConfig(ulysses_degree=4))
    finally:
        pool.close()
    other.wait(timeout=30)  # the other group ends with the pool: its workers see the stop, torchrun exits
    log.close()
    assert other.returncode == 0, (tmp_path / "group1.log").read_text()[-3000:]


def test_missing_launch_group_names_the_command_to_run(tmp_path):
    cluster = _cluster(tmp_path)
    pool = WorkerPool(device="cpu", cluster=cluster, start_timeout_s=8)
    try:
        t0 = time.monotonic()
        with pytest.raises(StartupError, match=r"(?s)missing ranks: \[0, 1\].*--node-rank=1"):
            pool.ensure_world(ParallelConfig(ulysses_degree=2))
        assert time.monotonic() - t0 < 30
    finally:
        pool.close()


def test_key_file_must_be_private(tmp_path):
    cluster = _cluster(tmp_path)
    key = cluster.authkey()
    assert len(key) == 32 and oct(os.stat(cluster.authkey_file).st_mode & 0o777) == "0o600"
    os.chmod(cluster.authkey_file, 0o644)
    with pytest.raises(ClusterError, match="chmod 600"):
        read_authkey_file(cluster.authkey_file)
    with pytest.raises(ClusterError, match="host:port"):
        Cluster(nnodes=2, nproc_per_node=1, authkey_file="k", control="nohost")


def test_a_cluster_rank_keeps_broadcast_weights_on_the_host():
    """A cluster rank receives every tensor by broadcast (NCCL: through its GPU); model weights then stay on the host
    like a local rank's mapped weights, so TP / PipeFusion / sharding cut them before anything moves to the GPU
    (engine.add) and the GPU never holds the whole model transiently; the job's other tensors stay on the device."""
    import types

    import torch

    from comfyui_hybrid_parallel.workers.jobs import landing_device
    from comfyui_hybrid_parallel.workers.transport import WEIGHT_PREFIX
    gpu_rank = types.SimpleNamespace(device=torch.device("cuda", 1))
    assert landing_device(gpu_rank, WEIGHT_PREFIX + "double_blocks.0.img_attn.qkv.weight") == torch.device("cpu")
    assert landing_device(gpu_rank, "x") == torch.device("cuda", 1)
    assert landing_device(types.SimpleNamespace(device=torch.device("cpu")), "context") == torch.device("cpu")
