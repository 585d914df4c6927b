"""The driver room: what runs in ComfyUI's process between the nodes and the pool.

- runtime.py: the pool's runtime (one per ComfyUI: the worlds, the prestart, the switch between ComfyUI's copy and
  the ranks', progress and interrupts).
- auto.py: degrees "auto", decided per run when the latent and the cfg are known.
- run.py: the one run pipeline both Hybrid Sampler and Parallel Model go through - prepare (the degrees, the
  refusals, the memory check, the run record) and run (progress, the quiet driver, the patches on the workers).

The path of a prompt is monotone: nodes -> driver -> bridge (ComfyUI's surface) -> pool -> wire -> rank -> engine;
the bridge never imports this package.
"""
