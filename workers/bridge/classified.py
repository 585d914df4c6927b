"""Every node class of ComfyUI (and of the third-party packs the tests install) that outputs a MODEL, GUIDER or
CONDITIONING, classified: what the pack does with what it adds. tests/test_every_node.py runs each against this
table in a real ComfyUI; a node missing here fails that test - a new ComfyUI release arrives as a list to classify.

- PLAIN: adds nothing the capture refuses or carries beyond the model call's own inputs (loaders, text encoders,
  conditioning that becomes model inputs, sampling schedules run by ComfyUI's sampler, guiders ComfyUI runs itself).
- CARRIED: what it adds is carried exactly (a test compares it with KSampler).
- STEP: what it adds runs in ComfyUI's process (CFG functions, sampler wrappers): exact in step mode; the workers'
  own loop refuses it before any work.
- REFUSED: refused before any work, naming the node.
The verdicts are what the capture (workers/bridge/capture.py) decides from what each node puts on a MODEL; this table
only names them, and is checked against the capture node by node.
"""
from __future__ import annotations

PLAIN, CARRIED, STEP, REFUSED = "plain", "carried", "step", "refused"

OWN = ("HybridParallelGPUs", "HybridParallelConfig", "HybridSampler", "HybridPatchVAEDecode", "HybridParallelCluster",
       "HybridParallelModel")

NODES: dict = {}


def unclassified(class_types) -> list:
    """The classes among `class_types` that may have put something on a MODEL or conditioning (not PLAIN, not the
    pack's own): the nodes a refusal names when nothing else tells which one it was."""
    return [c for c in class_types if c not in OWN and NODES.get(c) != PLAIN]


def refused_in(prompt: dict, loop: bool) -> list:
    """The node classes of an API prompt that the pack refuses (in the workers' loop also the STEP ones): a prompt
    holding one is refused when its sampler runs, so queueing it starts no workers (nodes/routes.warm_on_prompt)."""
    bad = (REFUSED, STEP) if loop else (REFUSED,)
    return sorted({n.get("class_type") for n in prompt.values() if isinstance(n, dict) and
                   NODES.get(n.get("class_type")) in bad})
