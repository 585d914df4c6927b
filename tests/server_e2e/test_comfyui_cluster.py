"""A world over two machines, set up from the nodes, in a real ComfyUI (two launch groups on loopback).

The user's flow: a Hybrid Parallel Cluster node feeds Parallel Config; the prompt starts launch group 0
next to ComfyUI and waits; the Workers panel (GET /hybrid_parallel/pool) shows the command for the other
machine; running exactly that command completes the world and the prompt, whose output equals KSampler's.
"""
import os
import shlex
import socket
import subprocess
import time

import pytest

from comfy_server import error_text, latent, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cluster_graph(tag, key_file, control_port, master_port, **cluster):
    g = workflow({"ulysses_degree": 2}, tag, W, H)
    g["30"] = {"class_type": "HybridParallelCluster", "inputs": {
        "nnodes": 2, "nproc_per_node": 1, "address": "127.0.0.1", "control_port": control_port,
        "master_port": master_port, "key_file": str(key_file), "join_timeout_s": 120, **cluster}}
    g["9"]["inputs"]["cluster"] = ["30", 0]
    return g


def _join_commands(server, prompt_id, timeout_s=60.0) -> list:
    """What the Workers panel shows while the prompt waits for the other machine."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = server.get("/hybrid_parallel/pool")
        if status.get("join_commands"):
            return status["join_commands"]
        h = server.get(f"/history/{prompt_id}")
        assert prompt_id not in h, f"the prompt ended before the other machine joined: {h[prompt_id]['status']}"
        time.sleep(0.1)
    raise TimeoutError(server.tail())


def test_cluster_node_world_over_two_launch_groups_equals_ksampler(server, tmp_path):
    ref = server.run(workflow(None, "cluster_ref", W, H))
    assert ref["status"]["status_str"] == "success", server.tail()
    key = tmp_path / "cluster.key"
    g = _cluster_graph("cluster_u2", key, _port(), _port())
    resp = server.post("/prompt", {"prompt": g})
    assert "prompt_id" in resp, resp
    pid = resp["prompt_id"]
    commands = _join_commands(server, pid)
    assert len(commands) == 1 and "--node-rank=1" in commands[0] and str(key) in commands[0]
    assert oct(os.stat(key).st_mode & 0o777) == "0o600"  # the node made the key, private
    log = open(tmp_path / "machine1.log", "w")
    other = subprocess.Popen(shlex.split(commands[0]), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        entry = server.wait(pid, timeout_s=300)
        assert entry["status"]["status_str"] == "success", (entry["status"], server.tail(),
                                                            (tmp_path / "machine1.log").read_text()[-3000:])
        texts = [t for out in entry["outputs"].values() for t in out.get("text", [])]
        assert any(commands[0] in t for t in texts), texts  # Parallel Config's text shows the same command
        err = rel(latent(server, "cluster_u2"), latent(server, "cluster_ref"))
        assert err <= 1e-5, err
        workers = server.get("/hybrid_parallel/pool")["workers"]
        assert [w["rank"] for w in workers] == [0, 1] and len({w["pid"] for w in workers}) == 2

        # a config without the cluster replaces that pool: the other machine's launch group ends cleanly
        back = server.run(workflow({"ulysses_degree": 2}, "after_cluster", W, H))
        assert back["status"]["status_str"] == "success", server.tail()
        assert server.get("/hybrid_parallel/pool")["join_commands"] is None
        other.wait(timeout=60)
        assert other.returncode == 0, (tmp_path / "machine1.log").read_text()[-3000:]
    finally:
        if other.poll() is None:
            other.kill()
        log.close()


def test_cluster_that_does_not_match_the_degrees_is_refused_before_any_worker(server, tmp_path):
    g = _cluster_graph("cluster_bad", tmp_path / "k.key", _port(), _port(), nnodes=3)
    entry = server.run(g)
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "nnodes 3 x nproc_per_node 1 = 3" in msg and "change the degrees or the cluster" in msg, msg
    assert server.get("/hybrid_parallel/pool")["join_commands"] is None
