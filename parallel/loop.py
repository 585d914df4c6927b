"""Loop mode without a pipeline: the whole denoising loop in the workers, one parallel forward per step.

Why a loop in the workers when step mode already works: DistriFusion's stale
buffers and their asynchronous refresh overlap the sampler step and the start
of the next forward only when the next forward follows without a round trip to
the driver; the driver also pays its per-step transport once per run instead of
once per step. Any parallelized model works here (USP, CFG/DP, TP,
DistriFusion): it takes the full inputs on every rank and returns the full
output on every rank, so every rank applies the same (elementwise) sampler step
to the same latent and the ranks stay identical without further communication.

The latent lives in the sampler's layout (ComfyUI's (B, C, ...)) and ComfyUI's model takes it as it is: the model
patchifies (and pads an odd size circularly) on every call, exactly as in ComfyUI, so odd latent sizes stay
bit-compatible - the padding is recomputed from the cropped latent on every step, never carried.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from .config import ConfigError
from .sampling import Convention, check_cfg_batch, check_sigmas, denoise, get_sampler, model_latent
from .stepcache import StepCache, StepCacheSpec, cached_step


def run_loop(model, inputs: dict, sigmas, noise: torch.Tensor, *, convention: Convention, sampler: str = "euler",
             forward: Callable, cfg_scale: Optional[float] = None, before_step: Optional[Callable] = None,
             callback: Optional[Callable] = None, dtype: Optional[torch.dtype] = None,
             timestep_dtype: Optional[torch.dtype] = None,
             step_cache: Optional[StepCacheSpec] = None, agree: Optional[Callable] = None,
             cache_report: Optional[dict] = None) -> torch.Tensor:
    """Sample `noise` (the latent at sigmas[0]) down the sigmas; returns the final latent.

    inputs: the model's conditioning kwargs (not the latent x / timestep); with cfg_scale they hold
    [cond, uncond] (twice the latent batch) and the output is mixed as ComfyUI's CFG does.
    before_step(i, n) runs before each forward (cancel agreement, DistriFusion's step index);
    callback(i, n, denoised) after step i is applied (denoised: what ComfyUI's previews show).
    forward(x, timestep, inputs) calls ComfyUI's model (its forward(x, timestep, context=...)); `dtype` is the dtype
    the model takes its latent in (ComfyUI's manual-cast dtype for fp8 weights) and `timestep_dtype` its timestep's
    (ComfyUI passes float32); both default to the model's parameter dtype.
    step_cache: ComfyUI's EasyCache rule around each model call (parallel/stepcache.py); `agree(wants_compute)`
    makes its decision common to every rank; cache_report gets {"skipped": steps skipped, "steps": n}.
    """
    sigmas = check_sigmas(sigmas)
    samp = get_sampler(sampler)
    bad = {"x", "timestep"} & set(inputs)
    if bad:
        raise ConfigError(f"inputs must not contain {sorted(bad)}: the loop supplies the latent and timestep")
    check_cfg_batch(inputs, noise.shape[0], cfg_scale)
    x = noise.detach().clone().float()
    state = {k: torch.zeros_like(x) for k in samp.state_keys}
    dtype = dtype or next(model.parameters()).dtype
    timestep_dtype = timestep_dtype or dtype
    channel_dim = 1  # ComfyUI's latents: (B, C, ...)
    n = len(sigmas) - 1
    cache = None if step_cache is None else StepCache(step_cache)
    for i in range(n):
        if before_step is not None:
            before_step(i, n)
        h = model_latent(convention, x, sigmas[i], dtype, cfg_scale)
        t = convention.timestep(sigmas[i], h.shape[0], timestep_dtype, h.device)

        def compute():
            with torch.no_grad():
                return forward(h, t, inputs)
        out = cached_step(cache, sigmas[i], h, compute, agree)
        if cache is not None and cache.last_skipped and cache.spec.shift_input:
            # ComfyUI's EasyCache shifted its model input in place by the cached difference: that input (= out)
            # is what the denoised is computed from, per cond/uncond half
            d = convention.denoised(out.float(), sigmas[i], out, channel_dim)
            cond, uncond = (d, None) if cfg_scale is None else d.chunk(2)
            den = cond if cfg_scale is None else uncond + (cond - uncond) * cfg_scale
        else:
            den = denoise(convention, x, sigmas[i], out, channel_dim, cfg_scale)
        x = samp.step(i, sigmas, x, den, state)
        if callback is not None:
            callback(i, n, den)
    if cache_report is not None and cache is not None:
        cache_report.update(skipped=cache.skipped, steps=n)
    return x
