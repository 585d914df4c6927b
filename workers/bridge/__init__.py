"""The bridge to ComfyUI: the only product code that imports ComfyUI or looks its modules up (tests/driver/test_comfy_seams.py
scans for it), so the next ComfyUI changes this folder.

- seams.py: every ComfyUI symbol the pack relies on, checked when the pack loads (one clear line if one is missing).
- capture.py: everything a MODEL and its conditioning carry besides the weights, channel by channel, with a verdict
  per sampling mode (known.py); refused before any work, naming the node (graph.py), where not carried exactly.
- carry.py: what travels with each model call (block skips, object values, hook groups) and how a rank rebuilds it.
- residency.py: the key of the weights the workers hold - exactly what is in them.
- classified.py: every node class that outputs a MODEL, GUIDER or CONDITIONING, and what the pack does with it.
- sampling.py: ComfyUI's sampler, noise, sigmas, previews, progress, interrupt and wrapper kinds, as the nodes call them.
- host.py: ComfyUI's process beside the pool - its host copy of the weights, its model management and DynamicVRAM,
  its GPUs, its unload and interrupt.
- build.py: the workers' side - ComfyUI imported as the driver's is configured, its model and VAE built from the spec.
- patches.py: ComfyUI's weight patches (LoRA...) travelling and applied on the ranks with ComfyUI's own code.
- loader_types.py: a custom loader's (GGUF) and ComfyUI's quantized tensors and ops carried to the workers.
"""
