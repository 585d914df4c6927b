"""A ComfyUI server with the pack's head start (HP_SPARE_WORKERS on): nothing at ComfyUI's start; its fork server
(workers/forkserver.py: torch imported once) started when the frontend opens a workflow holding the pack's nodes
(/hybrid_parallel/warm), a headless prompt is queued, or HP_PRESTART names a prompt file; with the workflow's Parallel
Config the world itself forks from it before any prompt (ComfyUI imported on its ranks); the first prompt runs on
those processes, none started for it, and its result equals KSampler's."""
import time

import pytest
from safetensors.torch import load_file

from comfy_server import CountingServer, workflow, write_checkpoints
from comfyui_hybrid_parallel.workers.pool import WorkerPool
from test_pool_orphans import _parent, _survivors

pytestmark = pytest.mark.comfy


def _ready_world(srv, ranks: int, timeout_s: float = 120.0) -> dict:
    """The pool's status once a world of `ranks` workers is ready (or the last status seen at the deadline)."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = srv.get("/hybrid_parallel/pool")
        if (status["state"] == "ready" and len(status["workers"]) == ranks) or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def test_the_first_world_forks_from_the_head_start_and_a_headless_prompt_starts_its_world_when_queued(tmp_path):
    """One server, two clients. The frontend: opening a workflow starts the fork server, its Parallel Config's world
    forks from it before any prompt, and the prompt runs on those processes. A script posting /prompt at once (no
    frontend, no /warm; the pool stopped meanwhile): ComfyUI's on-prompt handler starts the prompt's world the moment
    it is queued - before ComfyUI executes any node. Both results equal KSampler's."""
    from comfy_env import setup_comfy
    srv = CountingServer(setup_comfy(), tmp_path, spares=2)
    write_checkpoints(tmp_path, ("sd3",))
    srv.start()
    try:
        time.sleep(2.0)
        # nothing before use: no process at ComfyUI's start, nor for a prompt without the pack's nodes
        assert srv.fork_server_pids() == [] and srv.worker_pids() == []
        entry = srv.run(workflow(None, "plain", 64, 64))
        assert entry["status"]["status_str"] == "success", (entry["status"], srv.tail())
        assert srv.fork_server_pids() == [] and srv.worker_pids() == []
        assert srv.post("/hybrid_parallel/warm", {}) == {"ok": True, "spares": 2, "world": None}  # a workflow opened
        deadline = time.monotonic() + 60
        while not srv.fork_server_pids() and time.monotonic() < deadline:
            time.sleep(0.2)
        servers = srv.fork_server_pids()
        assert len(servers) == 1 and srv.worker_pids() == [], servers  # the fork server alone: not a world
        assert srv.get("/hybrid_parallel/pool")["state"] == "none"
        # the frontend sends the workflow's Parallel Config: that world forks from it, before any prompt
        answer = srv.post("/hybrid_parallel/warm", {"config": {"ulysses_degree": 2, "device": "cpu"}})
        assert answer["ok"] and answer["world"], answer
        status = _ready_world(srv, 2)
        assert status["state"] == "ready" and status["warm_mesh"] == answer["world"], status
        workers = sorted(w["pid"] for w in status["workers"])
        assert workers == srv.worker_pids() and {_parent(p) for p in workers} == set(servers), (status, servers)
        assert status["prestart"]["mesh"] == status["mesh"] == "ulysses2", status  # the world the warm started
        for degrees, tag in ((None, "ref"), ({"ulysses_degree": 2}, "u2")):
            entry = srv.run(workflow(degrees, tag, 104, 72))
            assert entry["status"]["status_str"] == "success", (entry["status"], srv.tail())
        status = srv.get("/hybrid_parallel/pool")
        assert sorted(w["pid"] for w in status["workers"]) == workers, status  # no new process for the prompt
        ref, got = (load_file(str(srv.output(f"lat_{t}.safetensors")))["images"] for t in ("ref", "u2"))
        assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-4
        # a workflow whose only config node is Parallel GPUs: the frontend sends that node's widgets (it sent none
        # before, so such a workflow started no world ahead of its first prompt) - here the world already running
        answer = srv.post("/hybrid_parallel/warm", {"gpus": {"devices": "2", "preset": "split the image"}})
        assert answer["ok"] and answer["world"].startswith("ulysses2 on 2 "), answer
        assert srv.post("/hybrid_parallel/warm", {"gpus": {"devices": "2", "preset": "auto"}})["world"] is None
        status = srv.get("/hybrid_parallel/pool")
        assert sorted(w["pid"] for w in status["workers"]) == workers and status["mesh"] == "ulysses2", status

        # the headless client, on a stopped pool (another size: ComfyUI's cache would answer the same prompt)
        srv.post("/hybrid_parallel/pool/stop", {})
        assert _survivors(workers) == [] and srv.get("/hybrid_parallel/pool")["state"] == "none"
        before = srv.get("/hybrid_parallel/pool")
        entries = {tag: srv.run(workflow(degrees, tag, 96, 64)) for degrees, tag in
                   ((None, "ref_headless"), ({"ulysses_degree": 2}, "u2_headless"))}
        for entry in entries.values():
            assert entry["status"]["status_str"] == "success", (entry["status"], srv.tail())
        status = srv.get("/hybrid_parallel/pool")
        # the KSampler prompt holds none of the pack's nodes: only the u2 one warmed, from the moment it was queued -
        # before its execution started (the warm's own thread may be scheduled a few ms later on a loaded machine)
        assert status["prompt_warms"] == before["prompt_warms"] + 1, status
        assert status["warm_requests"] == before["warm_requests"], status
        assert status["prompt_warmed"]["mesh"] == status["mesh"] == "ulysses2", status
        started = {m[0]: m[1]["timestamp"] / 1000.0 for m in entries["u2_headless"]["status"]["messages"]}
        assert status["prompt_warmed"]["at"] <= started["execution_start"], (status["prompt_warmed"], started)
        headless = sorted(w["pid"] for w in status["workers"])
        assert {_parent(p) for p in headless} == set(servers), (headless, servers)  # forked by the same server
        ref, got = (load_file(str(srv.output(f"lat_{t}.safetensors")))["images"] for t in ("ref_headless", "u2_headless"))
        assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-4
    finally:
        srv.stop()
    assert _survivors(workers + headless + servers) == []  # they went with the server
    # the same ComfyUI restarted (its user directory kept: a Docker volume, a service restart): the world its last
    # queued prompt asked for starts with it, before any prompt - the script's first prompt finds it up
    kept = tmp_path / "user" / "hybrid_parallel_last_world.json"
    assert kept.is_file() and kept.stat().st_mode & 0o077 == 0, kept
    # (HP_PRESTART's prompt file takes the same path - prestart_config, then the runtime's warm - from its value:
    # test_prestart_values_start_what_they_name_or_say_the_fix)
    srv = CountingServer(setup_comfy(), tmp_path, spares=2)
    srv.start()
    try:
        status = _ready_world(srv, 2)
        assert status["state"] == "ready" and status["mesh"] == "ulysses2" and status["prompt_warms"] == 0, status
        assert status["prestart"]["mesh"] == "ulysses2", status  # started with ComfyUI, before any prompt
        assert "the last world a prompt asked for" in srv.tail(200), srv.tail()
        restarted = sorted(w["pid"] for w in status["workers"])
        assert restarted == srv.worker_pids() and {_parent(p) for p in restarted} == set(srv.fork_server_pids())
        entry = srv.run(workflow({"ulysses_degree": 2}, "u2_restarted", 104, 72))  # the script's first prompt
        assert entry["status"]["status_str"] == "success", (entry["status"], srv.tail())
        assert sorted(w["pid"] for w in srv.get("/hybrid_parallel/pool")["workers"]) == restarted  # none spawned
        ref, got = (load_file(str(srv.output(f"lat_{t}.safetensors")))["images"] for t in ("ref", "u2_restarted"))
        assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() <= 1e-4
    finally:
        srv.stop()
    assert _survivors(restarted) == []


def test_prestart_values_start_what_they_name_or_say_the_fix(tmp_path, monkeypatch):
    from comfyui_hybrid_parallel.workers.driver.routes import prestart_config, prestart_from_env
    hp, why = prestart_config('{"ulysses_degree": 2, "device": "cpu"}')
    assert hp.config.describe() == "ulysses2" and why == ""
    assert prestart_config("spares") == (None, "the fork server only (asked)")
    api = {"1": {"class_type": "UNETLoader", "inputs": {}},
           "9": {"class_type": "HybridParallelConfig", "inputs": {"ring_degree": 2, "device": "cpu", "x": ["1", 0]}}}
    f = tmp_path / "api.json"
    f.write_text(__import__("json").dumps(api))
    assert prestart_config(str(f))[0].config.describe() == "ring2"
    hp, why = prestart_config('{"1": {"class_type": "KSampler", "inputs": {}}}')
    assert hp is None and "no Parallel Config" in why
    hp, why = prestart_config('{"degrees": "auto"}')
    assert hp is None and "auto" in why and "the fork server only" in why
    hp, why = prestart_config('{"ulysses_degree": 3, "ring_degree": 3, "device": "cpu"}')  # 9 CPU ranks: refused
    assert hp is None and "the fork server only" in why, why
    (tmp_path / "ui.json").write_text('{"nodes": [], "links": []}')
    for bad, fix in ((str(tmp_path / "missing.json"), "no such file"), ("{not json", "not JSON"),
                     (str(tmp_path / "ui.json"), "saved by the frontend")):
        with pytest.raises(ValueError, match=fix):
            prestart_config(bad)
    started = []
    line = prestart_from_env(object(), "{not json", start=started.append)  # one line naming the fix, nothing started
    assert "HP_PRESTART" in line and "Export (API)" in line and started == []
    assert prestart_from_env(object(), "", start=started.append) == "" and started == []  # unset: nothing
    monkeypatch.setenv("HP_PRESTART", str(f))  # what a headless server's environment sets: that file's world
    line = prestart_from_env(object(), start=started.append, directory=str(tmp_path / "none"))
    assert line.startswith("hybrid parallel: HP_PRESTART starts ring2") and len(started) == 1, line
    started.clear()
    monkeypatch.delenv("HP_PRESTART")
    # unset, in a ComfyUI whose queued prompt fixed a world: that world, at the next start; HP_PRESTART=0: nothing
    from comfyui_hybrid_parallel.workers.driver.routes import LAST_WORLD, remember_world
    user = tmp_path / "user"
    user.mkdir()
    assert prestart_from_env(object(), "", start=started.append, directory=str(user)) == "" and started == []
    remember_world(("HybridParallelGPUs", {"devices": "2", "preset": "split the image"}), directory=str(user))
    assert (user / LAST_WORLD).stat().st_mode & 0o777 == 0o600
    line = prestart_from_env(object(), "", start=started.append, directory=str(user))
    assert "the last world a prompt asked for" in line and "ulysses2" in line and len(started) == 1, line
    assert prestart_from_env(object(), "0", start=started.append, directory=str(user)) == "" and len(started) == 1


def test_prompt_config_reads_the_api_prompts_config_node():
    from comfyui_hybrid_parallel.workers.driver.routes import prompt_config, warm_on_prompt
    prompt = {"1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "x"}},
              "2": {"class_type": "HybridParallelConfig", "inputs": {"ulysses_degree": 2, "device": "cpu",
                                                                     "cluster": ["9", 0]}}}
    assert prompt_config(prompt).config.describe() == "ulysses2"
    assert prompt_config({"2": {"class_type": "HybridParallelConfig", "inputs": {"degrees": "auto"}}}) is None
    assert prompt_config({"2": {"class_type": "HybridParallelConfig", "inputs": {"ulysses_degree": "x"}}}) is None
    assert prompt_config({"2": {"class_type": "HybridParallelGPUs", "inputs": {"preset": "auto"}}}) is None

    class Rt:
        calls = []

        def warm_for_prompt(self, n, hp, queued=None):
            assert queued is not None and abs(queued - time.time()) < 60  # when the handler saw the prompt
            self.calls.append(None if hp is None else hp.config.describe())
    rt = Rt()
    handler = warm_on_prompt(rt, start=lambda f: f())
    body = {"prompt": prompt, "client_id": "c"}
    assert handler(body) is body and rt.calls == ["ulysses2"]
    assert handler({"prompt": {"1": prompt["1"]}}) is not None and rt.calls == ["ulysses2"]  # not the pack's: nothing
    assert handler({"prompt": "garbage"}) == {"prompt": "garbage"} and handler(None) is None
    # a prompt holding a node the pack refuses (workers/bridge/classified.py) is refused at its sampler before any
    # work: queueing it starts nothing either; a node only ComfyUI runs starts nothing in the workers' loop only
    tome = {"7": {"class_type": "TomePatchModel", "inputs": {"ratio": 0.3}}}
    assert handler({"prompt": {**prompt, **tome}}) is not None and rt.calls == ["ulysses2"]
    loop = {**prompt, "2": {**prompt["2"], "inputs": {**prompt["2"]["inputs"], "sampling_mode": "loop"}}}
    rescale = {"7": {"class_type": "RescaleCFG", "inputs": {"multiplier": 0.7}}}
    assert handler({"prompt": {**loop, **rescale}}) is not None and rt.calls == ["ulysses2"]
    assert handler({"prompt": {**prompt, **rescale}}) is not None and rt.calls == ["ulysses2", "ulysses2"]


class _StandInPool:
    """A pool without processes: its world checks are WorkerPool's own (running, runs)."""

    def __init__(self, world, **attrs):
        self.world, self.split_kernel_worlds = world, True
        self.__dict__.update(attrs)

    running, runs = WorkerPool.running, WorkerPool.runs


def test_a_prompt_whose_cpu_world_is_up_starts_nothing():
    """The on-prompt warm-up starts work only where it can help: with the prompt's world already up on this machine's
    CPU cores, a prepare job would only slow that prompt's ranks (bench/bench_headless.py: the pool's warm prompt
    1.4-2x slower); a GPU world's prompt still makes sure the fork server runs."""
    from types import SimpleNamespace

    from comfyui_hybrid_parallel.workers.driver.routes import node_config
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    rt = Runtime()
    filled = []
    rt.keep_spares = filled.append
    rt.prestart = lambda hp: filled.append(("prestart", hp.config.describe()))
    cpu = node_config("HybridParallelConfig", {"ulysses_degree": 2, "device": "cpu"})
    key = cpu.config.world_key(True)
    rt._pool = _StandInPool(SimpleNamespace(alive=lambda: True, world_key=key))
    assert rt.warm_for_prompt(2, cpu) is None and filled == []  # its CPU world is up: nothing started
    other = node_config("HybridParallelConfig", {"cfg_degree": 2, "device": "cpu"})  # another (kernel) world
    assert other.config.world_key(True) != key
    assert rt.warm_for_prompt(2, other) == other.describe() and filled == [2, ("prestart", "cfg2")]  # head start, then it
    gpu = SimpleNamespace(config=cpu.config, device="cuda", cluster=None, describe=cpu.describe)
    filled.clear()
    assert rt.warm_for_prompt(2, gpu) is None and filled == [2]  # a GPU world up: the head start only


def test_a_prestart_leaves_a_running_world_of_another_shape_to_the_sampler(monkeypatch):
    """Parallel Config's prestart starts a world only where none is up (or the same one is): a running world of
    another shape is switched by the sampler after its checks, so a prompt they refuse (tp on a family that declares
    none) keeps it."""
    from types import SimpleNamespace

    from comfyui_hybrid_parallel.workers.driver.routes import node_config
    from comfyui_hybrid_parallel.workers.driver import runtime as runtime_module
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.workers.messages import ComfyRuntime
    monkeypatch.setattr(runtime_module, "comfy_runtime", ComfyRuntime)
    submitted = []
    rt = Runtime()
    running = node_config("HybridParallelConfig", {"ulysses_degree": 2, "ring_degree": 2, "device": "cpu"})
    world = SimpleNamespace(alive=lambda: True, world_key=running.config.world_key(True))
    rt._pool = _StandInPool(world, device="cpu",
                            submit=lambda config, kind, *a, **k: submitted.append((config.describe(), kind)))
    rt.pool = lambda hp: rt._pool
    rt.prestart(node_config("HybridParallelConfig", {"tp_degree": 2, "device": "cpu"}))
    assert rt.prestarted is None and rt._prestart is None and submitted == []  # the running world untouched
    same = node_config("HybridParallelConfig", {"ulysses_degree": 2, "cfg_degree": 2, "device": "cpu"})
    rt.prestart(same)  # the same world (4 ranks that intercept attention): ComfyUI imported in it ahead
    rt._prestart.join(10)
    rt._pool.world = None
    rt.prestart(node_config("HybridParallelConfig", {"tp_degree": 2, "device": "cpu"}))  # none up: started
    rt._prestart.join(10)
    assert submitted == [("cfg2·ulysses2", "prepare"), ("tp2", "prepare")], submitted
