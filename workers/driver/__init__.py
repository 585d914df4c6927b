"""The driver room: what runs in ComfyUI's process between the nodes and the pool.

- runtime.py: the pool's runtime (one per ComfyUI: the worlds, the prestart, the switch between ComfyUI's copy and
  the ranks', progress and interrupts).
- auto.py: degrees "auto", decided per run when the latent and the cfg are known.
- run.py: the one run pipeline both Hybrid Sampler and Parallel Model go through - prepare (the degrees, the
  refusals, the memory check, the run record) and run (progress, the quiet driver, the patches on the workers).
- plan.py: a run's plan (the capture of the graph, the residency key, ComfyUI's model spec, what travels with each
  call) and its refusals, in order; run_record.py: the frozen plan and the run's mutable state.
- step.py: step mode's link to the pool (each model call the proxy reads becomes a typed forward job, sent once);
  loop.py: loop mode's and PipeFusion's sequence (the captured conditioning, one typed loop job).
- configs.py: the PARALLEL_CONFIG wire type and the widget rules; routes.py: the panel's routes and the headless
  warm-up.

The path of a prompt is monotone: nodes -> driver -> bridge (ComfyUI's surface) -> pool -> wire -> rank -> engine;
the bridge never imports this package.
"""
