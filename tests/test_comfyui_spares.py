"""A ComfyUI server with the pack's spare interpreters (workers/spares.py): none at ComfyUI's start, started when the
frontend opens a workflow holding the pack's nodes (/hybrid_parallel/warm); with the workflow's Parallel Config the
world itself forms from them before any prompt (ComfyUI imported on its ranks); the first prompt runs on those
processes, none spawned, and its result equals KSampler's."""
import time

import pytest
from safetensors.torch import load_file

from comfy_server import ComfyServer, workflow, write_checkpoints
from test_pool_orphans import _survivors

pytestmark = pytest.mark.comfy


def test_the_first_world_takes_the_spares(tmp_path):
    from comfy_env import setup_comfy
    srv = ComfyServer(setup_comfy(), tmp_path, spares=2)
    write_checkpoints(tmp_path, ("sd3",))
    srv.start()
    try:
        time.sleep(2.0)
        assert srv.worker_pids(spares=True) == []  # nothing before use: no process at ComfyUI's start
        assert srv.post("/hybrid_parallel/warm", {}) == {"ok": True, "spares": 2, "world": None}  # a workflow opened
        deadline = time.monotonic() + 60
        while len(srv.worker_pids(spares=True)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        spares = srv.worker_pids(spares=True)
        assert len(spares) == 2 and all(is_spare for _, is_spare in spares), spares
        assert srv.get("/hybrid_parallel/pool")["state"] == "none"  # nothing started: they are not a world
        # the frontend sends the workflow's Parallel Config: that world forms from the spares, before any prompt
        answer = srv.post("/hybrid_parallel/warm", {"config": {"ulysses_degree": 2, "device": "cpu"}})
        assert answer["ok"] and answer["world"], answer
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = srv.get("/hybrid_parallel/pool")
            if status["state"] == "ready" and len(status["workers"]) == 2:
                break
            time.sleep(0.5)
        assert status["state"] == "ready" and status["warm_mesh"] == answer["world"], status
        assert sorted(w["pid"] for w in status["workers"]) == [pid for pid, _ in spares], (status, spares)
        assert status["prestart"]["mesh"] == status["mesh"] == "ulysses2", status  # the world the warm started
        for degrees, tag in ((None, "ref"), ({"ulysses_degree": 2}, "u2")):
            entry = srv.run(workflow(degrees, tag, 104, 72))
            assert entry["status"]["status_str"] == "success", (entry["status"], srv.tail())
        status = srv.get("/hybrid_parallel/pool")
        workers = sorted(w["pid"] for w in status["workers"])
        assert workers == [pid for pid, _ in spares], (workers, spares)  # no new process was spawned
        ref, got = (load_file(str(srv.output(f"lat_{t}.safetensors")))["images"] for t in ("ref", "u2"))
        assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-4
    finally:
        srv.stop()
    assert _survivors([pid for pid, _ in spares]) == []  # they went with the server
