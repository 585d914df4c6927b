"""Every node of ComfyUI (and of the third-party packs installed: ComfyUI-GGUF, KJNodes) that outputs a MODEL,
GUIDER or CONDITIONING is classified - carried, run by ComfyUI in the driver (step mode), plain, or refused - and the
classification is what the pack's capture decides for what the node actually adds.

tests/every_node_probe.py runs each node on a tiny model in its own process (ComfyUI's node registry as its server
loads it) and reports the capture's verdict; workers/bridge/classified.py says what the pack claims. A node missing
from the table fails here (the next ComfyUI release arrives as a list to classify); a node whose verdict changed
(ComfyUI moved what it adds) fails here; a node the probe could not run must be listed with the reason
(classified.UNPROBED), and one it can run again must leave that list. The carried and refused verdicts are compared
with KSampler / checked for the refusal before work in a real server in tests/server_e2e/test_every_graph.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from comfyui_hybrid_parallel.workers.bridge import classified

pytestmark = pytest.mark.comfy

HERE = Path(__file__).resolve().parents[1]  # tests/: the probe beside the shared fixtures


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    out = tmp_path_factory.mktemp("every_node") / "probe.json"
    env = dict(os.environ, HP_STRICT_COMM="0")
    run = subprocess.run([sys.executable, str(HERE / "every_node_probe.py"), str(out)], env=env, cwd=str(HERE),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_node_is_classified(probed):
    missing = sorted(set(probed) - set(classified.NODES))
    assert not missing, f"classify these nodes in workers/bridge/classified.py: {missing}"
    gone = sorted(c for c in classified.NODES if c not in probed)
    print(f"{len(probed)} nodes output a MODEL, GUIDER or CONDITIONING; {len(gone)} classified nodes not in this "
          f"ComfyUI: {gone[:20]}")


def test_the_verdicts_are_what_the_capture_decides(probed):
    wrong = {}
    for name, result in sorted(probed.items()):
        if "verdict" not in result:
            continue
        expected = classified.BY_FAMILY[name][0] if name in classified.BY_FAMILY else classified.NODES.get(name)
        if result["verdict"] != expected:
            wrong[name] = (expected, result["verdict"], [f"{f['what']} [{f['step']}/{f['loop']}]"
                                                        for f in result["found"]][:4])
    assert not wrong, json.dumps(wrong, indent=1)


def test_the_nodes_the_probe_cannot_run_are_listed_with_why(probed):
    skipped = {name for name, r in probed.items() if "skipped" in r}
    listed = set(classified.UNPROBED) & set(probed)  # (a node of a newer ComfyUI, or of a pack not installed: absent)
    assert skipped == listed, (
        f"not run and not listed: {sorted(skipped - set(classified.UNPROBED))}; "
        f"listed but the probe runs them now: {sorted(listed - skipped)}")
    counts = {}
    for r in probed.values():
        counts[r.get("verdict", "unprobed")] = counts.get(r.get("verdict", "unprobed"), 0) + 1
    print("probe verdicts:", counts)
