"""Write docs/works-with.md from workers/bridge/classified.py: every ComfyUI / KJNodes / GGUF node that outputs a MODEL,
GUIDER or CONDITIONING, by what the pack does with what it adds. tests/package/test_docs.py checks the file is what this
script writes (so the page never drifts from the table the capture is tested against).

    python scripts/make_works_with.py            (writes docs/works-with.md)
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

HEAD = """# Works with: every node that feeds a sampler

What the pack does with each node of ComfyUI 0.33 (and of ComfyUI-KJNodes and ComfyUI-GGUF) that outputs a MODEL,
GUIDER or CONDITIONING, when its output reaches Parallel Model or Hybrid Sampler. Written by
`scripts/make_works_with.py` from `workers/bridge/classified.py`; `tests/driver/test_every_node.py` runs every node on a tiny
model and checks that this is what the pack's capture decides, `tests/server_e2e/test_every_graph.py` compares the carried and
ComfyUI-run ones with KSampler and checks each refusal comes before any work, naming the node.

- **carried**: what the node adds travels to the workers and is applied there exactly (weight patches, hook LoRAs
  per conditioning, LoRA bypass, Skip Layer Guidance's block skips, the compute dtype, RoPE options, ...).
- **run by ComfyUI**: it acts around the model call (CFG functions, sampler wrappers, conditioning timing): ComfyUI's
  own sampler runs it in step mode (Parallel Model, Hybrid Sampler's default), exactly as under KSampler; Hybrid
  Sampler's loop mode and PipeFusion refuse it before any work (the workers' own loop does not call it).
- **plain**: nothing beyond the model call's own inputs (loaders, text encoders, conditioning the model reads,
  sampling schedules, guiders).
- **refused**: it acts inside ComfyUI's diffusion model in ComfyUI's own process (a Python patch, a swapped module,
  an attention override); the prompt stops before any worker starts or any step runs, with the node's name and what
  to do instead. Anything not listed here that puts something the pack does not know on a MODEL is refused the same
  way.
"""

TITLES = {"carried": "Carried to the workers", "step": "Run by ComfyUI (step mode; refused in loop mode / PipeFusion)",
          "plain": "Plain (nothing to carry)", "refused": "Refused before any work"}


def render() -> str:
    sys.path.insert(0, str(REPO.parent))
    from comfyui_hybrid_parallel.workers.bridge import classified
    lines = [HEAD]
    for verdict in ("carried", "step", "refused", "plain"):
        names = sorted(n for n, v in classified.NODES.items() if v == verdict)
        lines.append(f"## {TITLES[verdict]} ({len(names)})\n")
        lines.append(textwrap.fill(", ".join(f"`{n}`" for n in names), 118) + "\n")
    lines.append("## Not run by the test (classified from their code)\n")
    for name, (verdict, why) in sorted(classified.UNPROBED.items()):
        lines.append(f"- `{name}` ({verdict}): {why}")
    lines.append("")
    for name, (probe, why) in sorted(classified.BY_FAMILY.items()):
        lines.append(f"`{name}` is {classified.NODES[name]} on its family; the test's tiny models see it {probe}: {why}.")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    (REPO / "docs" / "works-with.md").write_text(render())
    print("wrote docs/works-with.md")
