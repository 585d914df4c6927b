"""Hybrid Sampler: KSampler's inputs and ComfyUI's own sampling, with the diffusion model on the pool.

Step mode: ComfyUI runs the sampler exactly as KSampler does, each model call on the workers (workers/driver/step.py,
through the proxy of workers/bridge/proxy.py); loop mode and PipeFusion run the whole loop in the workers
(workers/driver/loop.py, ComfyUI's conditioning read by workers/bridge/loop_mode.py). Everything is prepared and refused before
any worker starts, by the run pipeline both samplers share (workers/driver/run.py).
"""
from __future__ import annotations

from ..workers.bridge.graph import given
from ..workers.bridge.loop_mode import check_loop_mode, check_loop_sampling, ksampler_latent, uses_loop_mode
from ..workers.bridge.fbcache import without_fbcache_wrapper
from ..workers.bridge.prepare import WRAPPER_KEY, check_not_on_pool, host_clone, without_compile_wrapper
from ..workers.bridge.sampling import APPLY_MODEL, add_wrapper, ksample, ksample_with, samplers_and_schedulers
from ..workers.driver.loop import make_loop_sampler
from ..workers.driver.run import prepare_run, running
from ..workers.driver.step import step_wrapper


class HybridSampler:
    DESCRIPTION = ("A drop-in KSampler that runs the diffusion model across the devices of a Parallel Config. "
                   "Same inputs and the same result as KSampler (exactly, at degree 1 and for the exact methods).")
    CATEGORY = "Hybrid Parallel"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"
    runtime = None  # set by the pack's entry point

    @classmethod
    def INPUT_TYPES(cls):
        samplers, schedulers = samplers_and_schedulers()
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model: Flux.1 / Kontext / Chroma / Flux.2, SD3 / 3.5, "
                                "Qwen-Image, Wan 2.1 / 2.2, HunyuanVideo 1.5, Lumina 2, PixArt-Sigma (README: "
                                "supported models)."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True,
                             "tooltip": "The random seed used for creating the noise."}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 10000, "tooltip": "Denoising steps."}),
            "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                              "tooltip": "Classifier-free guidance scale."}),
            "sampler_name": (samplers, {"tooltip": "ComfyUI's sampler."}),
            "scheduler": (schedulers, {"tooltip": "ComfyUI's scheduler."}),
            "positive": ("CONDITIONING", {"tooltip": "What to include."}),
            "negative": ("CONDITIONING", {"tooltip": "What to exclude."}),
            "latent_image": ("LATENT", {"tooltip": "The latent to denoise."}),
            "parallel_config": ("PARALLEL_CONFIG", {"tooltip": "From Parallel GPUs (simple) or Parallel Config."}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "Below 1.0 keeps part of the input latent (img2img)."}),
        }, "hidden": {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}}  # (to name a node whose patch is refused)

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               parallel_config, denoise=1.0, prompt=None, unique_id=None):
        latent_image = ksampler_latent(model, latent_image)  # KSampler's empty latent, before its shape is read
        check_not_on_pool(model, "Hybrid Sampler")
        # the degrees, the refusals, the memory check and the run record: everything before any worker starts
        hp, state = prepare_run(self.runtime, parallel_config, model, "Hybrid Sampler", given(prompt, unique_id),
                                shape=tuple(latent_image["samples"].shape), cfg=cfg, positive=positive,
                                negative=negative, conds={"positive": positive, "negative": negative})
        loop = uses_loop_mode(hp)
        if loop:
            check_loop_mode(sampler_name)  # before any work
            check_loop_sampling(model)  # a sampling the workers' loop computes
        m = host_clone(model)  # ComfyUI's copy of the diffusion model stays on the host (see host_clone)
        without_compile_wrapper(m)  # the workers compile their own model (compile_spec)
        without_fbcache_wrapper(m)  # the workers apply First Block Cache's rule (workers/bridge/fbcache.py)
        add_wrapper(m, APPLY_MODEL, WRAPPER_KEY, step_wrapper(self.runtime, hp, state))
        with running(self.runtime, hp, m, state, total=steps):
            return self._run(m, hp, state, loop, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                             latent_image, denoise, preview_from=model)

    def _run(self, m, hp, state, loop, seed, steps, cfg, sampler_name, scheduler, positive, negative,
             latent_image, denoise, preview_from):
        if not loop:  # step mode: ComfyUI's KSampler, one pool forward per model call
            return self._step_mode(m, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                                   denoise, preview_from)
        return self._loop_mode(m, hp, state, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                               latent_image, denoise, preview_from)

    @staticmethod
    def _step_mode(m, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise, preview_from):
        """What KSampler does (nodes.common_ksampler), with the previews rendered where ComfyUI would render them:
        on the MODEL's own load device (its GPU), not on the host where ComfyUI's copy of the weights stays."""
        samples = ksample(m, latent, seed, steps, cfg, sampler_name, scheduler, positive, negative, denoise,
                          preview_from)  # latent: KSampler's (sample: ksampler_latent)
        out = latent.copy()
        out["samples"] = samples
        return (out,)

    def _loop_mode(self, m, hp, state, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                   denoise, preview_from):
        """ComfyUI's noise, sigmas and conditioning; the loop runs in the workers (PipeFusion or loop mode)."""
        samples = ksample_with(m, latent, seed, steps, cfg, sampler_name, scheduler, positive, negative, denoise,
                               preview_from, lambda: make_loop_sampler(
                                   self.runtime, hp, state, sampler_name, cfg, m, lambda: state.family))
        out = latent.copy()
        out["samples"] = samples
        return (out,)
