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

What the pack does with each node of ComfyUI (0.30 in CI; 0.33's too, from waves 4-5) and of the packs users chain
(ComfyUI-KJNodes, ComfyUI-GGUF, Comfy-WaveSpeed, ComfyUI-CacheDiT: read in their code, run as the tests' stand-ins of
their mechanisms and by hand with the real packs) that outputs a MODEL, GUIDER or CONDITIONING, when its output reaches
Parallel Model or Hybrid Sampler. Written by
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

TAIL = """## Beyond what a node puts on the MODEL

- **Changed in place, outside ModelPatcher** (`workers/bridge/inplace.py`): the workers build their own model from
  ComfyUI's class and the weights, so a change made on ComfyUI's model object or code never reaches them. Refused
  before any work, naming the node (by the module that defined the replacement), in every mode: a method or torch hook
  put on the diffusion model or the BaseModel (ComfyUI-PuLID-Flux and PuLID_Flux_ll replace `forward_orig` on the
  instance; nunchaku's PuLID its `forward`), modules or tensors added to it (PuLID's `pulid_ca`), a method of one of
  ComfyUI's model classes or a function of its model code replaced module-wide (BrushNet's `apply_control`; an
  attention function swapped: pick the kernel with ComfyUI's own flag). ComfyUI's sampling code replaced (BrushNet's
  `comfy.samplers.sample`, AnimateDiff's `sampling_function`) runs in ComfyUI's process in step mode, as under
  KSampler, and is refused in the workers' own loop. What ComfyUI itself puts on its layers, the pack's own wrappers
  and a custom loader's layer classes are no change. Tested with the tests' stand-ins of each mechanism
  (`tests/server_e2e/test_in_place.py`, `tests/driver/test_in_place_check.py`).
- **Step caches**: ComfyUI's EasyCache and LazyCache run as listed above. Comfy-WaveSpeed's *Apply First Block Cache*
  on SD3 / 3.5 is carried in step mode: its wrapper is left out in ComfyUI's process and the workers apply its rule
  (the first block's residual compared with the last step's, the other blocks skipped below the threshold, its sigma
  window and run limit), the similarity all-reduced so every rank skips the steps one device skips - equal to KSampler
  with the node at degree 1 (bitwise), ulysses / ring / cfg 2 (`tests/server_e2e/test_first_block_cache.py`). On Flux
  and the UNets (where the node replaces the model's forward), in the workers' loop, with PipeFusion, DistriFusion,
  sharded weights or a compiled model it is refused before work, saying to use Parallel Config's `step_cache` or
  EasyCache. ComfyUI-CacheDiT is refused with the reason: it replaces the model's forward on ComfyUI's object when
  sampling starts.
- **Other packs' samplers** (Ultimate SD Upscale, Impact Pack's detailers and KSampler (pipe), Inspire's KSampler,
  Easy-Use's samplers) call ComfyUI's sampling with the MODEL, many times in a prompt, at changing sizes and denoise:
  through Parallel Model each sampling runs on the pool and equals the graph without the pack
  (`tests/server_e2e/test_other_pack_samplers.py`: four tiles of unequal sizes, denoise 0.35-1.0, ComfyUI's
  `common_ksampler` among them; d1 bitwise, u2 / cfg2 <= 1e-6).
- **ComfyUI-MultiGPU's loaders** (UNETLoaderMultiGPU, DisTorch2) in front of Parallel Model equal KSampler (tried by
  hand on ComfyUI 0.33 with the real pack, 5e-7): they only choose devices for ComfyUI's copy.
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
    lines.append("\n" + TAIL)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    (REPO / "docs" / "works-with.md").write_text(render())
    print("wrote docs/works-with.md")
