"""Loop mode for Hybrid Sampler: the whole denoising loop runs in the workers.

PipeFusion always runs here (patches cross timesteps, so the per-step APPLY_MODEL
routing of step mode cannot express it); any other method runs here when the
Parallel Config asks for loop mode (DistriFusion then overlaps its buffer refresh
with the sampler step, and the driver pays one round trip per run, not per step).
ComfyUI still does everything around the loop: noise,
sigmas (scheduler, denoise), noise scaling, CFG setup and the final latent
format. The loop itself is a ComfyUI *sampler object* (KSAMPLER) whose function
(1) lets ComfyUI run its conditioning pipeline for one model call and captures
ComfyUI's own conditioning at the diffusion model (instead of computing: `read_loop_call`, here), then
(2) ships noise, sigmas and those inputs to the workers' `loop` job (workers/driver/loop.py, the driver room's).
This module is ComfyUI's side of it: the latent KSampler samples, the checks, the capture and the conventions.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...parallel.models import ADAPTERS
from ...parallel.plan import _given  # an input is given: not None, not an empty list / dict (ComfyUI's defaults)
from .sampling import fix_empty_latent
from .seams import accepts
from .spec import loop_step_cache
from .proxy import Captured

SUPPORTED_SAMPLERS = ("euler", "dpmpp_2m")


_LATENT_RATIOS = ("downscale_ratio_spacial", "downscale_ratio_temporal")


def ksampler_latent(model, latent: dict) -> dict:
    """The LATENT as KSampler samples it (nodes.common_ksampler), for both of Hybrid Sampler's modes: an empty latent
    given the model's latent channels and - where this ComfyUI's empty-latent nodes record the compression they
    assumed (`downscale_ratio_spacial` / `_temporal`; ComfyUI 0.33's EmptyHunyuanLatentVideo says 8, which the Wan 2.2
    VAE's 16 halves) and its fix_empty_latent_channels takes it - resized to the model's own, those keys then dropped
    from what the node returns, as KSampler drops them. Feature detection: an older ComfyUI gets the call it knows.
    Hybrid Sampler calls it once, before anything reads the latent's shape (auto degrees, memory, PipeFusion)."""
    taken = [k for k in _LATENT_RATIOS if accepts("comfy.sample:fix_empty_latent_channels", k)]
    out = {k: v for k, v in latent.items() if k not in taken}
    out["samples"] = fix_empty_latent(model, latent, taken)
    return out


def uses_loop_mode(hp) -> bool:
    """PipeFusion always loops in the workers; other methods when the config's sampling_mode says so."""
    if hp.config.pp_degree > 1 and hp.mode == "step":
        raise ValueError(f"PipeFusion (pp_degree={hp.config.pp_degree}) runs the denoising loop in the workers: "
                         "set sampling_mode to auto or loop on the Parallel Config node")
    return hp.config.pp_degree > 1 or hp.mode == "loop"


def check_loop_mode(sampler_name: str) -> None:
    if sampler_name not in SUPPORTED_SAMPLERS:
        raise ValueError(f"loop mode runs its own worker-side sampler, which supports {list(SUPPORTED_SAMPLERS)}; "
                         f"choose one of those instead of {sampler_name!r}, or use step mode (pp_degree=1 and "
                         "sampling_mode auto/step: every ComfyUI sampler)")


def loop_convention(model_sampling, sigmas=None) -> dict:
    """How the workers' own loop (PipeFusion, loop mode) turns sigma into the model's input and timestep and its
    output into `denoised` - the two forms it computes (parallel/sampling.Convention): "flow" (ComfyUI's
    CONST with a timestep linear in sigma: SD3, Flux, Wan, Qwen-Image ...) and "eps" (ComfyUI's EPS with sigma_data 1:
    PixArt; the timestep per sigma of the run's `sigmas`). Which one is read from what ComfyUI's model sampling
    computes on probe values, not from the family's name: a model of a declared family can sample otherwise - Wan 2.1
    FlowRVS is Wan's WanModel on IMG_TO_IMG_FLOW with discrete timesteps (taken for flow, loop mode was 2.1e1 from
    KSampler, no error), Cosmos Predict2 samples as COSMOS_RFLOW. Any other sampling is refused (ValueError), which
    the sampler node asks before any work."""
    g = torch.Generator().manual_seed(0)
    s = torch.tensor([0.9, 0.45, 0.07])
    x, out = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    col = s[:, None]

    def same(a, b) -> bool:
        return tuple(a.shape) == tuple(b.shape) and torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    try:
        inp, den = model_sampling.calculate_input(s, x), model_sampling.calculate_denoised(s, out, x)
        t, t1 = model_sampling.timestep(s), model_sampling.timestep(torch.ones(1))
    except Exception:  # noqa: BLE001 - a sampling object of another shape: not one the loop knows
        inp = den = t = t1 = None
    if den is not None and same(den, x - out * col):
        if same(inp, x) and same(t.reshape(-1), s * t1.float()):
            return {"kind": "flow", "timestep_scale": float(t1.item())}
        if same(inp, x / (col ** 2 + 1) ** 0.5):
            ts = None if sigmas is None else [float(model_sampling.timestep(v.reshape(1)).item())
                                              for v in sigmas.float().cpu()]
            return {"kind": "eps", "timesteps": ts}
    kinds = " x ".join(b.__name__ for b in type(model_sampling).__bases__) or type(model_sampling).__name__
    raise ValueError(f"PipeFusion and loop mode run the sampler in the workers, which compute ComfyUI's flow (CONST) "
                     f"and eps sampling only; this model samples as {kinds}: use step mode (pp_degree 1, "
                     "sampling_mode auto or step - every other method runs ComfyUI's own sampler)")


def _cond_uncond_order(inputs: dict, cond_or_uncond: list, batch: int) -> tuple:
    """Reorder ComfyUI's batch (chunks in `cond_or_uncond` order) to [cond, uncond]; cfg halves or cond only."""
    if sorted(cond_or_uncond) not in ([0], [0, 1]):
        raise ValueError("PipeFusion supports one positive and one negative conditioning (no area/mask conds "
                         f"or conditioning combines); this prompt batches {cond_or_uncond}")
    order = [cond_or_uncond.index(0)] + ([cond_or_uncond.index(1)] if 1 in cond_or_uncond else [])

    def pick(v):
        if isinstance(v, dict):
            return {k: pick(x) for k, x in v.items()}
        if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == batch * len(cond_or_uncond):
            return torch.cat([v[i * batch:(i + 1) * batch] for i in order])
        return v
    return {k: pick(v) for k, v in inputs.items()}, len(order) == 2


def check_loop_sampling(patcher) -> dict:
    """Refuse, before any work, a MODEL whose sampling the workers' loop cannot compute (loop_convention)."""
    return loop_convention(patcher.get_model_object("model_sampling"))


@dataclass
class LoopCall:
    """What ComfyUI's conditioning pipeline gave one captured model call, read for the workers' loop."""
    inputs: dict                 # the call's conditioning, [cond, uncond] order (the loop supplies latent, timestep)
    has_uncond: bool             # the batch holds an uncond half: the loop applies cfg
    convention: dict             # how sigma and the model output map to ComfyUI's denoised (loop_convention)
    step_cache: dict | None      # EasyCache's rule for the workers (ComfyUI's node or Parallel Config's own)
    model_options: dict | None   # the run's model options (EasyCache's skip count is written back there)

    def report_skipped(self, hp, report: dict) -> None:
        """The steps the workers' cache skipped, where ComfyUI would say it."""
        skipped = report["skipped"] / max(1, report.get("patches", 1))  # PipeFusion: patch steps, in steps' worth
        if hp.step_cache:
            logging.info(f"Hybrid Sampler step cache - skipped {skipped:g}/{report['steps']} steps "
                         f"(threshold {hp.step_cache:g})")
        else:  # so ComfyUI's own "EasyCache - skipped k/N steps" line is right
            self.model_options["transformer_options"]["easycache"].total_steps_skipped = skipped


def read_loop_call(patcher, hp, model_k, x, sigmas, extra_args: dict, record, family_of) -> LoopCall:
    """ComfyUI's conditioning for the workers' loop: its own pipeline runs once for a model call at the first sigma,
    captured at the diffusion model (the proxy raises Captured) - refused, before any work, where the loop cannot run
    it (a noise mask, PipeFusion's conditioning limits, an odd latent). `record`: the run's record (its capture
    flag); `family_of()`: the family the workers run. `patcher`: the MODEL sampled (its model_sampling and model)."""
    if extra_args.get("denoise_mask") is not None:
        raise ValueError("loop mode does not support noise masks (inpainting) yet; use step mode (pp_degree=1, "
                         "sampling_mode auto/step)")
    model_sampling = patcher.get_model_object("model_sampling")
    cap = _capture(model_k, x, sigmas, extra_args, record)
    if hp.config.pp_degree > 1:
        _check_pipefusion(hp, family_of(), cap, x)
    inputs = dict(cap.inputs)  # the call's conditioning (the loop supplies the latent and timestep)
    if cap.x_shape[1] > x.shape[1]:  # ComfyUI joined its concat conditioning (Wan image to video) to the latent:
        # the same every step, so it travels once and the workers join it to theirs before each model call
        inputs["c_concat"] = cap.x[:, x.shape[1]:].contiguous()
    inputs, has_uncond = _cond_uncond_order(inputs, cap.cond_or_uncond, x.shape[0])
    convention = loop_convention(model_sampling, sigmas)  # (checked before any work: sampler_node)
    model_options = extra_args.get("model_options")
    step_cache = _step_cache(hp, model_options, patcher.model, cap, has_uncond, x, model_sampling)
    return LoopCall(inputs, has_uncond, convention, step_cache, model_options)


def _capture(model_k, x, sigmas, extra_args: dict, state):
    """ComfyUI's own conditioning pipeline for one model call at the first sigma, handed over at the diffusion model
    (the proxy raises Captured) instead of computed."""
    state.capture = True
    try:
        model_k(x, sigmas[0] * x.new_ones([x.shape[0]]), **extra_args)
        raise RuntimeError("the diffusion model was not reached while capturing conditioning")
    except Captured as c:
        return c
    finally:
        state.capture = False


def _check_pipefusion(hp, family: str, cap, x) -> None:
    """PipeFusion's refusals that need the captured inputs: a family without a pipeline plan, conditioning its
    stages cannot carry, an odd latent."""
    if not ADAPTERS[family].pipefusion_nodes:
        names = [a.title for a in ADAPTERS.values() if a.pipefusion_nodes]
        raise ValueError(f"PipeFusion through Hybrid Sampler supports {names} models; "
                         f"this is {family}: use pp_degree=1 (USP/CFG/DP/TP/DistriFusion work for it)")
    refusals = ADAPTERS[family].comfy_plan.pipeline_refusals
    carried = [refusals[n] for n in sorted(refusals) if _given(cap.inputs.get(n))]  # (plan.py's test)
    if carried:
        raise ValueError(f"PipeFusion (pp_degree={hp.config.pp_degree}) cannot run this {family} "
                         f"conditioning: {'; '.join(carried)}")
    if x.shape[-1] % 2 or x.shape[-2] % 2:
        raise ValueError(f"PipeFusion needs an even latent height and width, got {tuple(x.shape[-2:])}: "
                         "use an image size that is a multiple of 16")


def _step_cache(hp, model_options, base_model, cap, has_uncond: bool, x, model_sampling) -> dict | None:
    """The workers' step cache for this run: ComfyUI's EasyCache on the MODEL, or Parallel Config's own (not both)."""
    step_cache = loop_step_cache(model_options, base_model, cap.cond_or_uncond, has_uncond,
                                 concat=cap.x_shape[1] != x.shape[1])
    if not hp.step_cache:
        return step_cache
    # Parallel Config's own: EasyCache's rule and default window, no ComfyUI quirks to mirror
    if step_cache is not None:
        raise ValueError("this MODEL carries ComfyUI's EasyCache and Parallel Config sets step_cache: use one "
                         "of them (set step_cache to 0, or remove the EasyCache node)")
    return {"threshold": hp.step_cache, "start_sigma": float(model_sampling.percent_to_sigma(0.15)),
            "end_sigma": float(model_sampling.percent_to_sigma(0.95)), "subsample": 8,
            "channels": int(x.shape[1]), "first": 0, "chunks": 2 if has_uncond else 1}
