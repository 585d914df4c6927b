"""Parallel Model: MODEL + PARALLEL_CONFIG -> MODEL whose diffusion model runs on the worker pool.

Why a model patch rather than another sampler: people sample with KSamplerAdvanced (Wan 2.2's two experts
need start/end steps and leftover noise), SamplerCustom and SamplerCustomAdvanced (guiders, custom sigmas).
All of them end in the MODEL's apply_model, so the same APPLY_MODEL wrapper Hybrid Sampler installs (step
mode: one pool forward per model call, everything around it ComfyUI's code) makes every one of them run
on the pool. An OUTER_SAMPLE wrapper re-derives the residency key from the patcher that actually samples
(a LoRA applied after this node changes the weights) and restarts the call count per run (DistriFusion's
warmup), since ComfyUI caches this node's output across prompts. It also resolves degrees "auto" there: the
latent and the cfg are known only to the guider, at the run.
"""
from __future__ import annotations

from ..workers.bridge.fbcache import without_fbcache_wrapper
from ..workers.bridge.graph import executing, given
from ..workers.bridge.prepare import (WRAPPER_KEY, check_not_multigpu, check_not_on_pool, guider_inputs, guider_of,
                                      guider_run, host_clone, without_compile_wrapper)
from ..workers.bridge.sampling import APPLY_MODEL, OUTER_SAMPLE, add_wrapper
from ..workers.driver.plan import capture_run, pool_state
from ..workers.driver.run import prepare_run, running
from ..workers.driver.step import step_wrapper


class ParallelModel:
    DESCRIPTION = ("Makes any sampler node (KSampler, KSamplerAdvanced, SamplerCustom, SamplerCustomAdvanced, ...) "
                   "run the diffusion model across the devices of a Parallel Config. Same result as the graph "
                   "without this node (exactly for the exact methods). PipeFusion and loop mode need the whole "
                   "denoising loop: use Hybrid Sampler for those.")
    CATEGORY = "Hybrid Parallel"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model, with its diffusion model on the workers.",)
    FUNCTION = "patch"
    runtime = None  # set by the pack's entry point

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "A diffusion model (any family Hybrid Sampler runs)."}),
            "parallel_config": ("PARALLEL_CONFIG", {"tooltip": "From Parallel GPUs or Parallel Config. Degrees "
                                "'auto' is decided at each run, when the latent and the cfg are known."}),
        }, "hidden": {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}}  # (to name a node whose patch is refused)

    def patch(self, model, parallel_config, prompt=None, unique_id=None):
        hp = parallel_config
        if hp.config.pp_degree > 1:
            raise ValueError(f"Parallel Model: PipeFusion (pp_degree={hp.config.pp_degree}) runs the whole denoising "
                             f"loop in the workers, which a model patch cannot; use Hybrid Sampler, or pp_degree 1")
        if hp.mode == "loop":
            raise ValueError("Parallel Model runs each model call on the workers (step mode); sampling_mode 'loop' "
                             "needs Hybrid Sampler - set sampling_mode to auto or step")
        check_not_on_pool(model, "Parallel Model")
        check_not_multigpu(model, "Parallel Model")
        # refusals now, before any worker starts: what the graph put on the MODEL so far (the sampler's run checks
        # the whole of it again, with what nodes after this one added and the conditioning)
        first = pool_state(model, hp, capture_run(model, hp, "Parallel Model", given(prompt, unique_id), mode="step"))
        m = host_clone(model)  # ComfyUI's copy stays on the host (a non-dynamic patcher under DynamicVRAM)
        runtime = self.runtime
        # this run's config and record: degrees "auto" is decided per run, when the latent is known, and the record
        # from the guider's whole graph (what nodes after this one added)
        chosen = {"hp": hp, "run": first}

        def outer_sample(executor, *args, **kwargs):
            guider = guider_of(executor)
            patcher, conds, model_options = guider_run(guider)  # the patcher sampling now (maybe LoRA'd after this)
            shape, cfg, negative, positive = guider_inputs(guider, args, kwargs)
            # the run pipeline Hybrid Sampler goes through: degrees, refusals, the memory check (before any load, in
            # Hybrid Sampler's words), the run record from the guider's whole graph (what nodes after this one added)
            chosen["hp"], chosen["run"] = prepare_run(runtime, hp, patcher, "Parallel Model", executing(), shape=shape,
                                                      cfg=cfg, positive=positive, negative=negative, mode="step",
                                                      conds=conds, model_options=model_options)
            without_compile_wrapper(model_options=model_options)  # this run's
            without_fbcache_wrapper(model_options=model_options)  # First Block Cache's rule runs on the workers
            with running(runtime, chosen["hp"], patcher, chosen["run"]):
                return executor(*args, **kwargs)

        add_wrapper(m, OUTER_SAMPLE, WRAPPER_KEY, outer_sample)
        add_wrapper(m, APPLY_MODEL, WRAPPER_KEY,
                    step_wrapper(runtime, lambda: chosen["hp"], lambda: chosen["run"]))
        return (m,)
