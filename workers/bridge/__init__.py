"""The bridge to ComfyUI: the pack's code that reads ComfyUI's objects as the sampler receives them.

- capture.py: everything a MODEL and its conditioning carry besides the weights, channel by channel, with a verdict
  per sampling mode (known.py); refused before any work, naming the node (graph.py), where not carried exactly.
- carry.py: what travels with each model call (block skips, object values, hook groups) and how a rank rebuilds it.
- residency.py: the key of the weights the workers hold - exactly what is in them.
- classified.py: every node class that outputs a MODEL, GUIDER or CONDITIONING, and what the pack does with it.
"""
