"""Hybrid Parallel Cluster node and Parallel Config's `cluster` input: validation before any worker starts."""
import os
import shlex

import pytest

from comfyui_hybrid_parallel.nodes.cluster_node import ClusterNode
from comfyui_hybrid_parallel.workers.cluster import join_commands
from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
from comfyui_hybrid_parallel.workers.driver.configs import check_placement

WIDGETS = dict(dp_degree=1, cfg_degree=1, ulysses_degree=2, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
               warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")


def _cluster(tmp_path, **kw):
    args = dict(nnodes=2, nproc_per_node=1, address="10.0.0.7", control_port=29601, master_port=29501,
                key_file=str(tmp_path / "k.key"))
    return ClusterNode.configure(**{**args, **kw})


def test_join_command_names_this_machine_the_ports_and_the_key(tmp_path):
    nc = _cluster(tmp_path, nnodes=3, nproc_per_node=4)
    cmds = join_commands(nc.cluster)
    assert len(cmds) == 2
    for n, cmd in enumerate(cmds, start=1):
        argv = shlex.split(cmd)
        assert f"--node-rank={n}" in argv and "--nnodes=3" in argv and "--nproc-per-node=4" in argv
        assert "--master-addr=10.0.0.7" in argv and "--master-port=29501" in argv
        assert argv[argv.index("--driver") + 1] == "10.0.0.7:29601"
        assert argv[argv.index("--authkey-file") + 1] == str(tmp_path / "k.key")
    out = ClusterNode().build(nnodes=2, nproc_per_node=1, address="10.0.0.7", control_port=29601, master_port=29501,
                              key_file=str(tmp_path / "k.key"))
    assert oct(os.stat(tmp_path / "k.key").st_mode & 0o777) == "0o600"
    assert any(join_commands(out["result"][0].cluster)[0] in t for t in out["ui"]["text"])


@pytest.mark.parametrize("bad, match", [
    (dict(address="10.0.0.7:29600"), "no port"),
    (dict(address=""), "address must be"),
    (dict(control_port=29500, master_port=29500), "two different ports"),
])
def test_bad_cluster_is_a_clear_error(tmp_path, bad, match):
    with pytest.raises(ValueError, match=match):
        _cluster(tmp_path, **bad)


def test_parallel_config_checks_the_cluster_against_the_degrees(tmp_path):
    nc = _cluster(tmp_path, nnodes=2, nproc_per_node=2)
    with pytest.raises(ValueError, match=r"needs 2 workers .* nnodes 2 x nproc_per_node 2 = 4; change the degrees"):
        ParallelConfigNode.configure(**WIDGETS, cluster=nc)
    hp = ParallelConfigNode.configure(**{**WIDGETS, "ulysses_degree": 4}, cluster=nc)
    assert hp.cluster is nc and "over 2 machines" in hp.describe()
    with pytest.raises(ValueError, match="devices list cannot be combined with a cluster"):
        check_placement(ParallelConfigNode.configure(**{**WIDGETS, "ulysses_degree": 4}, devices="cpu,cpu,cpu,cpu",
                                                     cluster=nc).config, "cpu", nc)


def test_placement_counts_this_machines_launch_group_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HP_MAX_CPU_WORKERS", "4")
    big = _cluster(tmp_path, nnodes=8, nproc_per_node=4)  # 32 ranks, 4 here: fits
    hp = ParallelConfigNode.configure(**{**WIDGETS, "ulysses_degree": 32}, cluster=big)
    check_placement(hp.config, "cpu", big)
    with pytest.raises(ValueError, match="limit of 4"):
        check_placement(hp.config, "cpu")  # the same world on this machine alone does not
