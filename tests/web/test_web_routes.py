"""The web extension's server routes on the real ComfyUI server (the session's one, tests/conftest.py).

The mesh route must say exactly what a prompt would do (the node's validation, parallel/mesh.py's
groups); the pool route must follow the real pool through start, a run, a stop and a dead worker.
"""
import json
import os
import signal
import time
import urllib.request
import uuid

import pytest

from comfy_server import workflow
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.parallel.mesh import rank_coords, rank_groups

pytestmark = pytest.mark.comfy

W, H = 104, 72
STATES = {"none", "starting", "ready", "busy", "stopping", "failed"}


def _mesh(server, **degrees):
    q = "&".join(f"{k}={v}" for k, v in degrees.items())
    return server.get(f"/hybrid_parallel/mesh?{q}")


def test_mesh_route_is_parallel_mesh(server):
    """xDiT's 16-device example (dp2·cfg2·pp2·sp2): the groups of parallel/mesh.py, every rank's coordinates."""
    p = _mesh(server, dp_degree=2, cfg_degree=2, pp_degree=2, ulysses_degree=2)
    cfg = ParallelConfig(dp_degree=2, cfg_degree=2, pp_degree=2, ulysses_degree=2)
    assert p["ok"] and p["world_size"] == 16 and p["picture"]
    groups = rank_groups(cfg)
    for ax in ("dp", "cfg", "pp", "sp", "ring", "ulysses", "tp"):
        assert p["groups"][ax] == groups[ax], ax
    assert p["groups"]["cfg"][:2] == [[0, 4], [1, 5]] and p["groups"]["pp"][:2] == [[0, 2], [1, 3]]
    assert p["groups"]["sp"][:2] == [[0, 1], [2, 3]]
    assert [r["coords"] for r in p["ranks"]] == [rank_coords(cfg, r) for r in range(16)]
    for r in p["ranks"]:  # each rank's group index points at a group that holds it
        assert all(r["rank"] in p["groups"][ax][i] for ax, i in r["group"].items())
    assert p["degrees"] == {"dp": 2, "cfg": 2, "pp": 2, "ring": 1, "ulysses": 2, "tp": 1, "sp": 2}
    # the same answer under ComfyUI's /api prefix (what the frontend's fetchApi calls)
    assert server.get("/api/hybrid_parallel/mesh?dp_degree=2&cfg_degree=2&pp_degree=2&ulysses_degree=2") == p


def test_mesh_route_defaults_and_unknown_widgets(server):
    p = server.get("/hybrid_parallel/mesh?some_future_widget=1")
    assert p["ok"] and p["world_size"] == 1 and len(p["ranks"]) == 1
    assert p["ranks"][0]["device"]  # a device label for every rank


def test_mesh_route_error_is_the_nodes_error(server):
    """Invalid degrees: the message a prompt would fail with (the node's validation), not a second copy of it."""
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    p = _mesh(server, tp_degree=2, pp_degree=2)
    assert p == {"ok": False, "error": p["error"]}
    defaults = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, num_pipeline_patch=0, warmup_steps=1,
                    method="usp", device="auto", attention="auto")
    with pytest.raises(ValueError) as e:
        ParallelConfigNode().build(tp_degree=2, pp_degree=2, **defaults)
    assert p["error"] == str(e.value)
    assert "tp_degree" in p["error"] and "pp_degree" in p["error"]
    bad = _mesh(server, ulysses_degree="two")
    assert not bad["ok"] and "ulysses_degree" in bad["error"]
    listed = _mesh(server, ulysses_degree=2, devices="cuda:0")
    assert not listed["ok"] and "1 device(s)" in listed["error"]


def test_mesh_route_does_not_draw_huge_worlds(server):
    p = _mesh(server, dp_degree=64, ulysses_degree=64)
    assert p["ok"] and p["world_size"] == 4096 and not p["picture"] and "ranks" not in p


def test_mesh_route_answers_a_million_rank_world_at_once(server):
    """The outside probe: this query used to list a million ranks on ComfyUI's event loop (20 s, every other
    request waiting). The answer now costs the same as any other (a regression guard, not a speed target:
    the bound is 100x what it takes)."""
    t = time.monotonic()
    p = _mesh(server, dp_degree=64, ulysses_degree=64, ring_degree=64, tp_degree=4)
    took = time.monotonic() - t
    assert p["ok"] and p["world_size"] == 64 ** 3 * 4 and not p["picture"], p
    assert p["text"] == [p["describe"]]  # described by its degrees, no group listing
    assert "CPU worker processes" in p["placement"] and "HP_MAX_CPU_WORKERS" in p["placement"]
    assert took < 2.0, took


def test_mesh_route_draws_a_plan_this_machine_cannot_place(server):
    """xDiT's 16-device example is drawn on a 2-core CPU machine too (the picture plans a GPU box), with what a
    prompt here would refuse; a world this machine can run has no such note."""
    p = _mesh(server, dp_degree=2, cfg_degree=2, pp_degree=2, ulysses_degree=2, device="cpu")
    if (os.cpu_count() or 1) * 2 < 16:
        assert p["ok"] and p["picture"] and "16 CPU worker processes" in p["placement"], p.get("placement")
    assert _mesh(server, ulysses_degree=2, device="cpu")["placement"] is None


def _post(server, path):
    req = urllib.request.Request(server.url + path, data=b"{}", method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        import json
        return json.load(r)


def _pool(server):
    s = server.get("/hybrid_parallel/pool")
    assert s["state"] in STATES, s
    return s


def _until(fn, timeout_s=120, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"


def test_pool_route_follows_a_run_a_stop_and_a_dead_worker(server):
    # a long ulysses2 run: busy with a step count, then the panel's stop button interrupts it
    resp = server.post("/prompt", {"prompt": workflow({"ulysses_degree": 2}, "web_busy", W, H, steps=5000),
                                   "client_id": str(uuid.uuid4())})
    pid = resp["prompt_id"]
    busy = _until(lambda: (lambda s: s if s["state"] == "busy" and (s["job"] or {}).get("step", 0) >= 2 else None)(
        _pool(server)), what="a busy pool with steps")
    assert busy["job"]["kind"] == "sample" and busy["job"]["total"] == 5000 and busy["world_size"] == 2
    assert len(busy["workers"]) == 2 and all(w["pid"] for w in busy["workers"])
    stopped = _post(server, "/hybrid_parallel/pool/stop")
    assert stopped["ok"] and stopped["cancelled"] and "ulysses2" in stopped["stopped"]
    entry = _until(lambda: (lambda h: h.get(pid) if h.get(pid, {}).get("status", {}).get("completed") is not None
                            else None)(server.get(f"/history/{pid}")), what="the stopped prompt to end")
    assert entry["status"]["status_str"] == "error"
    assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"]), entry["status"]
    after = _pool(server)
    assert after["state"] == "none" and after["workers"] == []
    assert _until(lambda: not any(_alive(w["pid"]) for w in busy["workers"]), 30, "the workers to exit")

    # the next prompt starts the pool again: ready, per-rank pid / device / memory / resident models. Its own seed:
    # ComfyUI (0.33) would otherwise serve an earlier test's identical sampler node from its cache, with no pool run
    g = workflow({"ulysses_degree": 2}, "web_ready", W, H, steps=2)
    g["5"]["inputs"]["seed"] = 90413
    entry = server.run(g)
    assert entry["status"]["status_str"] == "success", entry["status"]
    ready = _pool(server)
    assert ready["state"] == "ready" and ready["job"] is None and ready["mesh"].startswith("ulysses2"), json.dumps(ready)[:3000]
    assert [w["rank"] for w in ready["workers"]] == [0, 1]
    for w in ready["workers"]:
        assert _alive(w["pid"]) and w["device"] and w["rss_bytes"] > 0
        assert any(m.startswith("sd3 ") for m in w["models"]) and any(m.startswith("vae ") for m in w["models"])
    last = ready["last_job"]
    assert last["ok"] and last["kind"] == "vae_decode"
    # the mesh picture's memory line: the plan this run was checked against before any worker started
    mem = server.get("/hybrid_parallel/mesh?ulysses_degree=2")["memory"]
    assert mem["this_mesh"] and mem["mesh"] == "ulysses2" and mem["model"] == "OpenAISignatureMMDITWrapper", mem
    assert mem["per_rank"] == sum(mem["items"].values()) and mem["items"]["weights"] == mem["weights"] > 0, mem
    assert mem["capacity"] > mem["per_rank"] and mem["ranks_on_host"] == 2 and mem["where"], mem
    assert not server.get("/hybrid_parallel/mesh?ulysses_degree=1&cfg_degree=2")["memory"]["this_mesh"]

    # a worker that dies while idle: failed, with the dead rank shown; the next job restarts the world
    os.kill(ready["workers"][1]["pid"], signal.SIGKILL)
    failed = _until(lambda: (lambda s: s if s["state"] == "failed" else None)(_pool(server)), 30,
                    "the failed state")
    assert any(w["state"].startswith("exited") for w in failed["workers"])


def test_parallel_config_starts_the_workers_before_the_sampler(server):
    """A cold first prompt overlaps the world start and ComfyUI's import on the ranks with model loading:
    ComfyUI runs Parallel Config (a coroutine) before the loaders, and it brings the workers up in the
    background - the prestart of this mesh begins before the sampler starts, with ComfyUI imported. (Cold: the
    session's server may hold another test's world, which a prestart leaves to the sampler to switch.)"""
    server.post("/hybrid_parallel/pool/stop", {})
    # ring 2: the next test's world (ulysses 2: the same two ranks that intercept attention), a Parallel Config the
    # prompts before did not hold (ComfyUI serves a node whose inputs did not change from its cache: no prestart)
    degrees = {"ring_degree": 2}
    entry = server.run(workflow(degrees, "prestart_order", W, H, steps=1))
    assert entry["status"]["status_str"] == "success", entry["status"]
    ready = _until(lambda: (lambda s: s if s["state"] == "ready" and s["mesh"] == "ring2" else None)(
        _pool(server)), 120, "the ring2 workers")
    assert ready["prestart"]["mesh"] == "ring2"
    assert ready["prestart"]["started"] < ready["last_started"]["sample"], ready
    assert ready["world_size"] == 2 and len(ready["workers"]) == 2
    assert all(w.get("comfy_imported") for w in ready["workers"]), ready["workers"]


def test_comfyuis_unload_models_releases_the_workers_models(server):
    """ComfyUI's /free (the UI's "Unload models") unloads ComfyUI's models; the workers drop theirs as well and give
    the memory back, the processes staying warm; the next prompt loads again and succeeds."""
    entry = server.run(workflow({"ulysses_degree": 2}, "free_before", W, H, steps=1))
    assert entry["status"]["status_str"] == "success", entry["status"]
    loaded = _until(lambda: (lambda s: s if s["state"] == "ready" and all(w["models"] for w in s["workers"])
                             else None)(_pool(server)), what="workers holding models")
    pids = [w["pid"] for w in loaded["workers"]]
    server.post("/free", {"unload_models": True, "free_memory": True})
    freed = _until(lambda: (lambda s: s if s["workers"] and not any(w["models"] for w in s["workers"]) else None)(
        _pool(server)), 60, "the workers to drop their models")
    assert [w["pid"] for w in freed["workers"]] == pids and all(_alive(p) for p in pids)
    entry = server.run(workflow({"ulysses_degree": 2}, "free_after", W, H, steps=1))
    assert entry["status"]["status_str"] == "success", entry["status"]
