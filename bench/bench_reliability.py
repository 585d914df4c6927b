"""Reliability figures of the pool in a real ComfyUI server, re-measured on every change.

Why a benchmark and not tests: these are times and counts to watch (the tests assert the behaviour with
generous bounds; this prints the figures). One ComfyUI server (tiny SD3, CPU, ulysses 2) measures:

- interrupt latency, in sampler steps run after ComfyUI's interrupt and in seconds, step and loop mode,
  several times in a row (the outside probe saw 6-10 steps now and then, typically the third of a series);
- interrupt while one rank is stopped (SIGSTOP): seconds until the prompt ends, and the next prompt;
- a stopped rank without interrupt: seconds until the prompt fails naming it (HP_STALL_TIMEOUT_S);
- a killed rank (SIGKILL): seconds until the prompt fails;
- stop: seconds for the pool/stop route until every worker is gone;
- soak: N prompts in a row, RSS of ComfyUI + workers before / after, pool files left in /dev/shm.

    python bench/bench_reliability.py [--trials 5] [--soak 30] [--quick]
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)

W, H = 104, 72
LONG = 5000


def _queue(server, graph) -> str:
    resp = server.post("/prompt", {"prompt": graph, "client_id": str(uuid.uuid4())})
    if "prompt_id" not in resp:
        raise RuntimeError(f"prompt rejected: {resp}")
    return resp["prompt_id"]


def _wait(server, pid, timeout_s=300.0) -> dict:
    return server.wait(pid, timeout_s)


def _log_size(server) -> int:
    return os.path.getsize(server.base / "comfyui.log")


def _steps_since(server, offset: int) -> int:
    """The highest 'k/LONG' progress of ComfyUI's bar written after byte `offset` of the log."""
    with open(server.base / "comfyui.log", "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    done = [int(m) for m in re.findall(rf"(\d+)/{LONG} \[", text)]
    return max(done) if done else 0


def _wait_steps(server, offset: int, n: int, timeout_s=120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        k = _steps_since(server, offset)
        if k >= n:
            return k
        time.sleep(0.02)
    raise TimeoutError(server.tail())


def _wait_job_step(server, n: int, timeout_s=120.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = server.get("/hybrid_parallel/pool").get("job") or {}
        if job.get("kind") == "sample" and (job.get("step") or 0) >= n:
            return job["step"]
        time.sleep(0.02)
    raise TimeoutError(server.tail())


def _workers(server) -> list:
    return server.worker_pids()


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def _shm_files() -> int:
    from comfyui_hybrid_parallel.workers.transport import shm_dir
    return len([n for n in os.listdir(shm_dir()) if n.startswith("chp-")])


def _status(entry) -> str:
    msgs = [m[0] for m in entry["status"].get("messages", [])]
    return "interrupted" if "execution_interrupted" in msgs else entry["status"]["status_str"]


def measure_interrupts(server, mode: str, trials: int) -> list:
    from comfy_server import workflow
    out = []
    degrees = {"ulysses_degree": 2, **({"sampling_mode": "loop"} if mode == "loop" else {})}
    for i in range(trials):
        off = _log_size(server)
        pid = _queue(server, workflow(degrees, f"rel_int_{mode}_{i}", W, H, steps=LONG))
        if mode == "step":  # KSampler's own progress bar, in the server log
            _wait_steps(server, off, 3)
            at = _steps_since(server, off)
        else:  # loop mode: the steps the workers reported (the pool route's job)
            at = _wait_job_step(server, 3)
        t = time.monotonic()
        server.post("/interrupt", {})
        entry = _wait(server, pid)
        took = time.monotonic() - t
        end = _steps_since(server, off) if mode == "step" else server.get("/hybrid_parallel/pool")["last_job"]["step"]
        out.append({"trial": i + 1, "steps_after": end - at, "seconds": round(took, 2), "status": _status(entry)})
    return out


def _sampling(server, tag: str) -> tuple:
    """Queue a long ulysses-2 prompt and wait until it samples: (prompt id, worker pids)."""
    from comfy_server import workflow
    off = _log_size(server)
    pid = _queue(server, workflow({"ulysses_degree": 2}, tag, W, H, steps=LONG))
    _wait_steps(server, off, 3)
    return pid, _workers(server)


def _resume(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGCONT)
        except ProcessLookupError:
            pass


def measure_faults(server) -> dict:
    from comfy_server import workflow
    res = {}
    # a stopped rank + interrupt
    pid, ws = _sampling(server, "rel_hang_int")
    os.kill(ws[-1], signal.SIGSTOP)
    time.sleep(0.3)
    t = time.monotonic()
    server.post("/interrupt", {})
    entry = _wait(server, pid)
    res["interrupt with a stopped rank: s to end"] = (round(time.monotonic() - t, 2), _status(entry))
    t = time.monotonic()
    entry = server.run(workflow({"ulysses_degree": 2}, "rel_after_hang_int", W, H, steps=2))
    res["next prompt after it: s"] = (round(time.monotonic() - t, 2), _status(entry))
    _resume(ws)
    # a stopped rank, no interrupt
    pid, ws = _sampling(server, "rel_hang")
    t = time.monotonic()
    os.kill(ws[-1], signal.SIGSTOP)
    entry = _wait(server, pid)
    text = str(entry["status"].get("messages", ""))
    res["stopped rank: s until the prompt fails"] = (round(time.monotonic() - t, 2),
                                                     "named" if "sent nothing" in text else _status(entry))
    _resume(ws)
    # a killed rank
    pid, ws = _sampling(server, "rel_kill")
    t = time.monotonic()
    os.kill(ws[-1], signal.SIGKILL)
    entry = _wait(server, pid)
    res["killed rank: s until the prompt fails"] = (round(time.monotonic() - t, 2), _status(entry))
    # stop
    server.run(workflow({"ulysses_degree": 2}, "rel_before_stop", W, H, steps=1))
    ws = _workers(server)
    t = time.monotonic()
    server.post("/hybrid_parallel/pool/stop", {})
    while any(os.path.exists(f"/proc/{p}") for p in ws) and time.monotonic() - t < 30:
        time.sleep(0.01)
    res["pool stop: s until every worker is gone"] = (round(time.monotonic() - t, 2), "")
    return res


def measure_soak(server, n: int) -> dict:
    from comfy_server import workflow
    server.run(workflow({"ulysses_degree": 2}, "rel_soak_warm", W, H, steps=2))
    pids = [server.proc.pid] + _workers(server)
    before = sum(_rss(p) for p in pids)
    ok = 0
    for i in range(n):
        entry = server.run(workflow({"ulysses_degree": 2}, f"rel_soak_{i % 3}", W, H, steps=2))
        ok += entry["status"]["status_str"] == "success"
    after = sum(_rss(p) for p in [server.proc.pid] + _workers(server))
    return {"prompts": n, "succeeded": ok, "rss_before_mib": round(before / 2 ** 20, 1),
            "rss_after_mib": round(after / 2 ** 20, 1), "rss_growth_pct": round(100 * (after - before) / before, 2),
            "pool files in shm after": _shm_files()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--soak", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="3 trials, a 10-prompt soak")
    args = p.parse_args(argv)
    if args.quick:
        args.trials, args.soak = 3, 10
    from _worlds import write_results
    from comfy_env import setup_comfy
    from comfy_server import ComfyServer, write_checkpoints
    comfy_dir = setup_comfy()
    base = Path(tempfile.mkdtemp(prefix="hp-reliability-"))
    server = ComfyServer(comfy_dir, base)
    write_checkpoints(base, ("sd3",))
    server.start()
    try:
        interrupts = {m: measure_interrupts(server, m, args.trials) for m in ("step", "loop")}
        faults = measure_faults(server)
        soak = measure_soak(server, args.soak)
    finally:
        server.stop()
    rows, lines = [], ["# Pool reliability in a real ComfyUI (tiny SD3, CPU, ulysses 2)", "",
                       "| measurement | value | note |", "|---|---|---|"]
    for mode, trials in interrupts.items():
        steps = [t["steps_after"] for t in trials]
        secs = [t["seconds"] for t in trials]
        statuses = sorted({t["status"] for t in trials})
        lines.append(f"| interrupt, {mode} mode: steps after it, per trial | {steps} | ended {', '.join(statuses)} |")
        lines.append(f"| interrupt, {mode} mode: seconds, per trial | {secs} | target <= 2 s |")
        rows += [{"measurement": f"interrupt {mode}", **t} for t in trials]
    for k, (v, note) in faults.items():
        lines.append(f"| {k} | {v} | {note} |")
        rows.append({"measurement": k, "value": v, "note": note})
    for k, v in soak.items():
        lines.append(f"| soak: {k} | {v} | |")
    rows.append({"measurement": "soak", **soak})
    write_results("reliability_quick" if args.quick else "reliability", rows, "\n".join(lines), extra={"interrupts": interrupts, "faults": faults,
                                                                "soak": soak})


if __name__ == "__main__":
    main()
