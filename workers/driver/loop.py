"""Loop mode's sequence (Hybrid Sampler's loop mode and PipeFusion): ComfyUI's conditioning for one captured model
call (workers/bridge/loop_mode.read_loop_call), then one typed `loop` job (workers/messages.LoopJob) with the noise,
sigmas and those inputs, run on the pool under ComfyUI's progress bar, previews and interrupt.

Why here: the bridge reads ComfyUI (the capture, the conventions, EasyCache's options); reaching the pool and the
order of a loop run is the driver room's, as step mode's is (workers/driver/step.py).
"""
from __future__ import annotations

import uuid

from ..bridge.carry import bypass_call
from ..bridge.loop_mode import read_loop_call
from ..bridge.proxy import loop_structure, loop_tensors
from ..bridge.sampling import previews_enabled, progress_bar, raise_if_interrupted, sampler_object
from ..messages import LoopJob
from .step import submit_interruptible


def make_loop_sampler(runtime, hp, state, sampler_name: str, cfg: float, patcher, family_of_state):
    """A ComfyUI KSAMPLER whose function runs the loop (PipeFusion, or one parallel forward per step) on the workers:
    ComfyUI's conditioning pipeline runs once for a captured model call, then noise, sigmas and those inputs travel in
    one `loop` job. `patcher`: the MODEL sampled; `state`: the run's record (its plan)."""
    def sample(model_k, x, sigmas, extra_args=None, callback=None, disable=None):
        call = read_loop_call(patcher, hp, model_k, x, sigmas, dict(extra_args or {}), state, family_of_state)
        plan = state.plan
        tensors = {**loop_tensors(call.inputs), "noise": x.float().contiguous(), "sigmas": sigmas.float().cpu()}
        bypass = run = None
        if plan.bypass:  # a LoRA in bypass mode: injected around the loop's model calls
            run = uuid.uuid4().hex
            bypass, parts = bypass_call(plan.bypass, set())
            tensors.update(parts)
        job = LoopJob(key=plan.key, structure=loop_structure(call.inputs), sampler=sampler_name,
                      convention=call.convention, cfg_scale=float(cfg) if call.has_uncond else None,
                      step_cache=call.step_cache, run=run, bypass=bypass,
                      object_values=plan.object_values or None)  # plain object patches (Flux Kontext's references)
        res = submit_loop(runtime, hp, job, tensors, x, sigmas, callback)
        report = next((v["step_cache"] for v in res.per_rank if v.get("step_cache")), None)
        if job.step_cache is not None and report:
            call.report_skipped(hp, report)
        return res.tensors["out"].to(x.device, x.dtype)

    return sampler_object(sample)


def submit_loop(runtime, hp, job: LoopJob, tensors: dict, x, sigmas, callback):
    """The `loop` job, with ComfyUI's progress bar, previews (where ComfyUI renders them) and interrupt."""
    pbar = progress_bar(len(sigmas) - 1)
    preview = None
    if callback is not None and hp.config.pp_degree == 1 and previews_enabled():  # only then do the workers send them
        def preview(step, total, denoised):  # ComfyUI's k-diffusion callback: its previewer and progress bar
            i = step - 1
            d = denoised.to(x.device, x.dtype)
            callback({"i": i, "denoised": d, "x": d, "sigma": sigmas[i], "sigma_hat": sigmas[i]})

    def progress(step, total):
        raise_if_interrupted()
        if preview is None:  # otherwise ComfyUI's callback (with the preview) already moved the bar
            pbar.update_absolute(step, total)
        runtime.progress(step, total)

    return submit_interruptible(runtime.pool(hp), hp.config, "loop", job.message(), tensors, progress=progress,
                                preview=preview)
