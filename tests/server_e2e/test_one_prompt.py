"""One prompt, followed file by file (docs/architecture.md, "One prompt"): Parallel GPUs -> Parallel Model ->
KSampler on Flux at ulysses 2, in a real ComfyUI whose processes record the pack's files the prompt crossed
(tests/path_trace/sitecustomize.py): on the path (the stacks where the work leaves a process or a rank) and ran at
all - for the server's first prompt (which also starts the world) and for the next one, on the running pool. The doc's
lists are the paths counted here, so a change of the path shows as this test failing. Slow: its own server."""
import os
import re
import time
from pathlib import Path

import pytest

from comfy_server import CountingServer, assert_ok, workflow, write_checkpoints, write_flux_checkpoint

pytestmark = [pytest.mark.comfy, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
LIMIT = 15  # issue 66: a newcomer follows one prompt in at most this many product files (the first one too)


PROBE = "workers/driver/runtime.py:status"  # the test's own pool route (_settle), not the prompt


def _traced(out: Path) -> dict:
    """{epoch: {"path", "ran", "stack"}} over the prompt's processes: each line counts for the epoch its process last
    saw (ComfyUI's from the bump before its prompt; the fork server and the ranks from their start). The path is the
    files of the stacks, less those of the test's own probe."""
    found = {}
    for f in out.glob("*.txt"):
        now = None
        for line in f.read_text().splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "epoch":
                now = None if rest == "None" else int(rest)
            elif now is not None and kind in ("ran", "stack"):
                seen = found.setdefault(now, {"path": set(), "ran": set(), "stack": []})
                if kind == "ran":
                    seen["ran"].add(rest)
                elif PROBE not in rest:
                    seen["stack"].append(rest)
                    seen["path"].update(e.split(":")[0] for e in rest.split(" <- ")[1:])
    return {e: found[e] for e in sorted(found)}


def _settle(srv) -> None:
    """Every traced process sees the new epoch before the prompt: ComfyUI's at a route, the ranks (idle, blocked on
    their channel) at the health job the pool route sends when a world is up."""
    for _ in range(4):
        time.sleep(0.3)
        srv.get("/hybrid_parallel/pool")


def _documented() -> tuple:
    """(the numbered files of docs/architecture.md's "One prompt" section, the files its "first prompt" line adds)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## One prompt", 1)[1].split("\n## ", 1)[0]
    first = section.split("The first prompt", 1)[1].split(")", 1)[0]  # its sentence up to the count
    return re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M), re.findall(r"`([\w/]+\.py)`", first)


def test_one_prompt_is_followed_in_the_documented_files(tmp_path):
    from comfy_env import setup_comfy
    base, out = tmp_path / "base", tmp_path / "trace"
    out.mkdir()
    comfy_dir = setup_comfy()
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(REPO / "tests" / "path_trace"),
                                                     os.environ.get("PYTHONPATH")) if p),
           "HP_TRACE_DIR": str(out), "HP_TRACE_ROOT": str(REPO), "HP_STRICT_COMM": "0"}  # as users run it
    srv = CountingServer(comfy_dir, base, env=env)
    write_checkpoints(base, ("sd3",))  # (its VAE)
    write_flux_checkpoint(base)
    srv.start()
    try:
        g = workflow(None, "one_prompt", 64, 48, steps=2, family="flux")
        g["9"] = {"class_type": "HybridParallelGPUs", "inputs": {"devices": "cpu,cpu", "preset": "split the image"}}
        g["40"] = {"class_type": "HybridParallelModel", "inputs": {"model": ["1", 0], "parallel_config": ["9", 0]}}
        g["5"]["inputs"]["model"] = ["40", 0]
        for prompt in ("the first prompt", "a prompt on the running pool"):
            (out / "epoch").write_text(prompt)  # every process starts its sets again
            _settle(srv)
            assert_ok(srv, srv.run(g))  # (the workers served its model calls)
            g["2"]["inputs"]["seed"] += 1
    finally:
        srv.stop()
    prompts = list(_traced(out).values())
    assert len(prompts) == 2, len(prompts)
    for name, seen in zip(("first prompt", "prompt on the running pool"), prompts):
        print(f"{name}: {len(seen['path'])} files on the path, {len(seen['ran'] | seen['path'])} ran:\n  path: "
              f"{sorted(seen['path'])}\n  called on the way: {sorted(seen['ran'] - seen['path'])}\n  stacks:\n    " +
              "\n    ".join(seen["stack"]))
    first, warm = prompts[0]["path"], prompts[1]["path"]
    assert any(p.startswith("parallel/") for p in warm) and "nodes/model_node.py" in warm, sorted(warm)
    assert len(warm) <= LIMIT and len(first) <= LIMIT, (sorted(first), sorted(warm))
    listed, added = _documented()
    assert sorted(listed) == sorted(warm), (sorted(listed), sorted(warm))
    assert warm <= first and sorted(added) == sorted(first - warm), (sorted(added), sorted(first - warm))
