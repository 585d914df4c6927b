"""Loop mode: the whole denoising loop of PipeFusion inside the workers.

Schedule of stage s (of S) for N steps, P patches, W warmup steps:

* steps 0..W-1 (synchronous): the full latent goes through the stages; every
  layer stores fresh K/V of the whole image; the last stage applies the
  sampler step and returns the full latent to stage 0.
* steps W..N-1 (asynchronous): stage 0 feeds patch p of step i as soon as its
  rows are back from the last stage (from step W+1 on), sends its activations
  on with a non-blocking send and goes straight to the next patch; the last
  stage applies the sampler step to each patch as it finishes and sends those
  rows back to stage 0. There is no barrier between steps: while the last
  stage finishes step i, stage 0 already works on step i+1.
* at the end the last stage broadcasts the final latent to the pp group.

Cancel: stage 0 checks `cancel()` before every step and, if set, sends a
cancel message down the pipeline in place of the next activations; every
stage stops at the same step and raises PipelineCancelled (no rank is left
waiting); with cfg/dp replicas the stage 0s first agree on the decision
(a one-element all-reduce per step). Every receive waits at most ctx.timeout_s.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from ..comm import any_rank, broadcast
from ..config import ConfigError
from ..models import plan_for
from ..stepcache import StepCache, StepCacheSpec
from .batch import gather_cfg, gather_dp, share_batch
from .plans import latent_layout, pipeline_plan_for, stage_ranges
from ..sampling import Convention, check_cfg_batch, check_sigmas, denoise, get_sampler, model_latent
from .stage import SKIPPED, TAG_LATENT, Channel, PipelineCancelled, Run, Stage


def _any_in_stage(flag: bool, ctx) -> bool:
    """True when `flag` is set on any rank that meets this one in a stage's collectives: the sp ranks of the stage
    (their pieces meet in every attention) and the same stage of the other (cfg, dp) replicas (their last stages
    meet in per-patch collectives)."""
    return flag if ctx is None else any_rank(flag, (ctx.sp, ctx.axis("batch")), ctx.device)


def _poll_cancel(cancel, ctx) -> bool:
    """Stage 0's cancel decision, agreed by all stage-0 ranks, so every rank stops at the same step."""
    return _any_in_stage(cancel is not None and bool(cancel()), ctx)


def _agree_last(want: bool, ctx) -> bool:
    """A step-cache decision common to the last stages (compute when any of them wants to)."""
    return _any_in_stage(want, ctx)


def run_pipefusion_loop(transformer, ctx, inputs: dict, sigmas, noise: torch.Tensor, *,
                        convention: Convention, native_call: Callable, sampler: str = "euler",
                        cfg_scale: Optional[float] = None,
                        callback: Optional[Callable] = None,
                        cancel: Optional[Callable] = None, num_patches: Optional[int] = None,
                        warmup_steps: Optional[int] = None, timeout_s: Optional[float] = None,
                        dtype: Optional[torch.dtype] = None,
                        timestep_dtype: Optional[torch.dtype] = None, step_cache: Optional[StepCacheSpec] = None,
                        cache_report: Optional[dict] = None) -> torch.Tensor:
    """Sample with PipeFusion and return the final latent (whole batch) on every rank.

    inputs: the model's conditioning kwargs (everything except the latent x and the timestep),
    identical on every rank. noise: the sample at sigmas[0] (ComfyUI's noise_scaling already applied).
    convention: how sigma and the model output map to ComfyUI's denoised (sampling.flow / sampling.eps).
    cfg_scale: classifier-free guidance inside the pipeline: `inputs` hold [cond, uncond] (twice the
    latent batch), both halves travel through the stages together and the last stage mixes them;
    with cfg_degree=2 the halves run on two pipelines instead, and dp_degree splits the batch (batch.py).
    callback(i, n_steps) runs on every rank when it has finished its share of step i (on the last
    stage: step i is done). cancel() is polled by stage 0 before every step.
    `ctx=None` runs all stages in this process: with num_patches > 1 that is the exact single-device
    emulation of the stale-KV schedule (a reference for tests); with 1 patch it is the serial loop.
    num_patches / warmup_steps / timeout_s default to ctx.config / ctx.timeout_s.
    native_call(model, inputs): ComfyUI's own model, called with its signature (x, timestep, context, ...);
    dtype: the dtype its latent goes in (ComfyUI's compute dtype: fp8 weights compute in another),
    timestep_dtype: the timestep's (ComfyUI passes fp32); both default to the weights' dtype.
    step_cache: ComfyUI's EasyCache rule (parallel/stepcache.py): one cache over the latent in full steps (EasyCache
    itself), one per patch in patch steps. The last stage decides for the next step (or the same patch of the next
    step) as soon as it has updated those rows, agrees with the other last stages, and sends the decision back with
    the rows; stage 0 then starts a skipped forward that stops at each stage's first block (no block runs, the K/V
    buffers keep older values) and the last stage applies the sampler step to the cached output. cache_report (on
    the last stage) gets {"skipped": patch steps skipped (a skipped full step counts P), "patches": P, "steps": N}.
    """
    run = _setup(transformer, ctx, inputs, sigmas, noise, sampler=sampler, cfg_scale=cfg_scale,
                 num_patches=num_patches, warmup_steps=warmup_steps, timeout_s=timeout_s,
                 dtype=dtype, timestep_dtype=timestep_dtype, step_cache=step_cache)  # everything checked first
    loop = _Loop(run, ctx, convention, cfg_scale, step_cache)
    stage = Stage(transformer, run.fplan, run.pplan, run.stage_i, run.S, run.start, run.stop, run.channel,
                  sp=None if ctx is None else ctx.sp, call=native_call)
    try:
        for i in range(run.N):
            cancelled = run.first and _poll_cancel(cancel, ctx)
            if run.P > 1 and i >= run.W:
                loop.patch_step(stage, i, cancelled)
            else:
                loop.full_step(stage, i, cancelled)
            if callback is not None:
                callback(i, run.N)
        if run.channel is not None:
            run.channel.flush()
    except PipelineCancelled:
        if run.channel is not None:  # the cancel message must reach the next stage before this rank moves on
            run.channel.flush()
        raise
    finally:
        stage.remove()
    if cache_report is not None and run.last and loop.full_cache is not None:
        cache_report.update(skipped=loop.full_cache.skipped * run.P + sum(c.skipped for c in loop.patch_caches),
                            patches=run.P, steps=run.N)
    if run.S > 1:
        broadcast(loop.x, ctx.pp, src_axis_rank=run.S - 1)
    return gather_dp(loop.x, ctx, run.share)


@dataclasses.dataclass
class _Run:
    """One rank's PipeFusion run, checked: its stage, the schedule, the batch share and the latent's layout."""
    S: int                 # stages
    stage_i: int           # this rank's stage
    P: int                 # patches
    W: int                 # warmup (synchronous, full) steps
    N: int                 # steps
    sigmas: torch.Tensor
    samp: object           # the sampler (sampling.get_sampler)
    share: object          # this rank's part of the batch (batch.share_batch)
    inputs: dict           # the conditioning kwargs of this rank's part
    noise: torch.Tensor
    in_pipeline_cfg: Optional[float]  # CFG halves batched inside this pipeline (None: not, or split over cfg ranks)
    layout: object         # the latent's rows and tokens (plans.latent_layout)
    bands: list            # each patch's latent rows
    fplan: object
    pplan: object
    start: int             # this stage's blocks [start, stop)
    stop: int
    channel: Optional[Channel]
    dtype: torch.dtype
    timestep_dtype: torch.dtype
    step_cache: Optional[StepCacheSpec]

    @property
    def first(self) -> bool:
        return self.stage_i == 0

    @property
    def last(self) -> bool:
        return self.stage_i == self.S - 1

    @property
    def n_tokens(self) -> int:
        return self.layout.rows * self.layout.cols


def _setup(transformer, ctx, inputs, sigmas, noise, *, sampler, cfg_scale, num_patches, warmup_steps, timeout_s,
           dtype, timestep_dtype, step_cache) -> _Run:
    """Validate everything before any work; the run's plan for this rank."""
    S = 1 if ctx is None else ctx.pp.size
    stage_i = 0 if ctx is None else ctx.pp.rank
    P = num_patches if num_patches is not None else (1 if ctx is None else ctx.config.num_pipeline_patch)
    W = warmup_steps if warmup_steps is not None else (0 if ctx is None else ctx.config.warmup_steps)
    if P < S:
        raise ConfigError(f"num_pipeline_patch={P} must be >= pp_degree={S}")
    fplan = plan_for(transformer)
    pplan = pipeline_plan_for(fplan)
    sigmas = check_sigmas(sigmas)
    if P > 1 and W < 1:
        raise ConfigError("PipeFusion needs warmup_steps >= 1: the first step fills the stale KV buffers "
                          "with the whole image; set warmup_steps to 1 or more")
    samp = get_sampler(sampler)
    check_cfg_batch(inputs, noise.shape[0], cfg_scale)
    # c_concat: ComfyUI's concat conditioning, one batch entry per latent (joined to it before each model call)
    share, inputs, noise = share_batch(ctx, tuple(fplan.batch_inputs) + ("c_concat",), inputs, noise, cfg_scale)
    if step_cache is not None and share.cfg_split:  # each pipeline holds one half: its own statistics
        step_cache = dataclasses.replace(step_cache, first=0, chunks=1)
    layout = latent_layout(transformer, pplan, noise, P)
    bands = layout.patch_rows(P)
    layer_counts = None if ctx is None else ctx.config.attn_layer_num_for_pp
    n_blocks = sum(len(dict(transformer.named_modules())[b.path]) for b in pplan.blocks)
    start, stop = stage_ranges(n_blocks, S, layer_counts)[stage_i]
    kept = getattr(transformer, "_hp_pp_stage_blocks", None)
    if kept is not None and kept != (start, stop, n_blocks):
        raise ConfigError(f"this model keeps only the weights of blocks [{kept[0]}, {kept[1]}) (loaded for another "
                          f"pipeline split) but this stage runs blocks [{start}, {stop}); load it again for this "
                          f"config")
    bad = {"x", "timestep"} & set(inputs)
    if bad:
        raise ConfigError(f"inputs must not contain {sorted(bad)}: the loop supplies the latent and timestep")
    sp = None if ctx is None else ctx.sp
    if sp is not None and sp.size > 1:
        small = min(t1 - t0 for t0, t1 in (layout.tokens(r0, r1)
                                           for r0, r1 in (bands if P > 1 else [(0, layout.rows)])))
        if small < sp.size:
            raise ConfigError(f"a PipeFusion patch of {small} tokens cannot be split over sp_degree={sp.size} "
                              f"ranks; use fewer patches (num_pipeline_patch), a smaller ulysses/ring degree or "
                              f"a larger image")
    dtype = dtype or next(transformer.parameters()).dtype
    return _Run(S=S, stage_i=stage_i, P=P, W=W, N=len(sigmas) - 1, sigmas=sigmas, samp=samp, share=share,
                inputs=inputs, noise=noise, in_pipeline_cfg=None if share.cfg_split else cfg_scale, layout=layout,
                bands=bands, fplan=fplan, pplan=pplan, start=start, stop=stop,
                channel=None if S == 1 else Channel(ctx.pp, timeout_s or ctx.timeout_s), dtype=dtype,
                timestep_dtype=timestep_dtype or dtype, step_cache=step_cache)


class _Loop:
    """What one rank does at each step: its latent `x` (the last stage's is the truth; stage 0 gets rows back from
    it), the sampler's state, the step caches and their decisions, and the rows messages between last and first
    stage (with a step cache each carries the next decision in one extra element)."""

    def __init__(self, run: _Run, ctx, convention: Convention, cfg_scale, step_cache):
        self.run, self.ctx, self.convention, self.cfg_scale = run, ctx, convention, cfg_scale
        self.x = run.noise.detach().clone().float()
        self.state = {k: torch.zeros_like(self.x) for k in run.samp.state_keys}
        cache = run.step_cache
        self.full_cache = None if cache is None else StepCache(cache)
        self.patch_caches = [] if cache is None else [StepCache(cache) for _ in range(run.P)]
        self.skip_next = {}  # (step, patch or None) -> the last stage's agreed decision (this process, S 1 or last)
        self.skip_now = {}  # stage 0: (step, patch or None) -> skip, from the last stage's messages
        self.pending_rows = {}  # stage 0: patch -> the posted receive of its next rows
        self.flag = 0 if cache is None else 1
        self.channel_dim = 1  # ComfyUI's latents: (B, C, ...)

    # ---- the last stage's view of the latent ----
    def h_of(self, i, rows=None):
        """The model input of step i (rows [r0, r1) of it) as the last stage computes it from its x."""
        r = self.run
        xr = self.x if rows is None else r.layout.latent_rows(self.x, *rows)
        return model_latent(self.convention, xr, r.sigmas[i], r.dtype, r.in_pipeline_cfg)

    def decide(self, i, p, rows):
        """Last stage, after updating these rows of x: does step i (patch p, or the full step) skip?"""
        r = self.run
        if r.step_cache is None or i >= r.N:
            return False
        cache = self.full_cache if p is None else self.patch_caches[p]
        if p is not None and i == r.W:
            return False  # patch caches start at the first patch step
        skip = not _agree_last(cache.wants_compute(r.sigmas[i], self.h_of(i, rows)), self.ctx)
        self.skip_next[(i, p)] = skip
        return skip

    def model_out(self, i, out, p, r0, r1):
        """Last stage: this forward's output rows, from the cache when it was skipped; the cache learns otherwise."""
        cache = None if self.run.step_cache is None else self.full_cache if p is None else self.patch_caches[p]
        rows = None if p is None else (r0, r1)
        if out is SKIPPED or (cache is not None and self.skip_next.get((i, p))):
            return cache.reuse(self.h_of(i, rows))
        out_rows = self.run.layout.latent_rows(out, r0, r1)
        if cache is not None:
            h = self.h_of(i, rows)
            cache.remember(self.run.sigmas[i], h,
                           out_rows if out_rows.shape[1] == h.shape[1] else out_rows[:, :h.shape[1]])
        return out_rows

    def model_kwargs(self, i):
        r = self.run
        h = model_latent(self.convention, self.x, r.sigmas[i], r.dtype, r.in_pipeline_cfg)
        return {**r.inputs, "x": h,
                "timestep": self.convention.timestep(r.sigmas[i], h.shape[0], r.timestep_dtype, h.device)}

    def finish(self, i, out_rows, r0, r1):
        """Last stage: sampler step on rows [r0, r1) of x (all rows in full mode), given the output's rows."""
        r = self.run
        rows = lambda t: r.layout.latent_rows(t, r0, r1)  # noqa: E731
        xr = rows(self.x)
        den = denoise(self.convention, xr, r.sigmas[i], gather_cfg(out_rows, self.ctx, r.share), self.channel_dim,
                      self.cfg_scale)
        xr.copy_(r.samp.step(i, r.sigmas, xr, den, {k: rows(v) for k, v in self.state.items()}))

    # ---- the rows messages from the last stage back to stage 0 ----
    def send_rows(self, rows_t, skip):
        msg = rows_t.reshape(-1)
        if self.flag:
            msg = torch.cat([msg, msg.new_full((1,), 1.0 if skip else 0.0)])
        self.run.channel.send(msg, 0, TAG_LATENT, "pp_latent")

    def recv_rows(self, shape):
        return self.run.channel.recv(torch.empty(math.prod(shape) + self.flag, device=self.x.device), self.run.S - 1,
                                     TAG_LATENT)

    def take_rows(self, buf, into):
        """Copy a received rows message into `into`; the decision it carries (False without a cache)."""
        into.copy_(buf[:buf.numel() - self.flag].view(into.shape))
        return bool(self.flag and buf[-1] != 0)

    # ---- one step ----
    def full_step(self, stage, i, cancelled):
        """A synchronous step: the whole latent through the stages, the last stage's result back to stage 0."""
        r = self.run
        skip = bool(self.skip_now.pop((i, None), False) if r.S > 1 else self.skip_next.get((i, None)))
        out = None
        if not (skip and r.S == 1):
            out = stage.forward(self.model_kwargs(i), Run("full", 0, r.n_tokens, r.n_tokens, cancelled,
                                                          skip=skip and r.first and not cancelled))
        if r.last:
            self.finish(i, self.model_out(i, SKIPPED if skip and r.S == 1 else out, None, 0, r.layout.rows), 0,
                        r.layout.rows)
            # the next full step is decided now; the first patch step computes (fresh patch caches)
            nxt = False if r.P > 1 and i + 1 >= r.W else self.decide(i + 1, None, None)
            if r.S > 1 and i + 1 < r.N:
                self.send_rows(self.x.clone(), nxt)
        if r.first and r.S > 1 and i + 1 < r.N:
            buf = r.channel.wait(self.recv_rows(self.x.shape), "the latent from the last stage")
            self.skip_now[(i + 1, None)] = self.take_rows(buf, self.x)

    def patch_step(self, stage, i, cancelled):
        """An asynchronous step: patch by patch, stage 0 starting each as soon as its rows are back."""
        r = self.run
        if cancelled and i > r.W and r.S > 1:
            for p in range(r.P):  # drain the rows the last stage already sent for this step
                r.channel.wait(self.pending_rows.pop(p), "latent rows from the last stage")
        for p, (r0, r1) in enumerate(r.bands):
            if r.first and r.S > 1 and i > r.W and not cancelled:
                buf = r.channel.wait(self.pending_rows.pop(p), "latent rows from the last stage")
                self.skip_now[(i, p)] = self.take_rows(buf, r.layout.latent_rows(self.x, r0, r1))
            skip = bool(self.skip_now.pop((i, p), False) if r.S > 1 else self.skip_next.get((i, p)))
            t0, t1 = r.layout.tokens(r0, r1)
            out = None
            if not (skip and r.S == 1):
                out = stage.forward(self.model_kwargs(i), Run("patch", t0, t1, r.n_tokens, cancelled and p == 0,
                                                              skip=skip and r.first and not cancelled))
            if r.last:
                self.finish(i, self.model_out(i, SKIPPED if skip and r.S == 1 else out, p, r0, r1), r0, r1)
                nxt = self.decide(i + 1, p, (r0, r1))
                if r.S > 1 and i + 1 < r.N:
                    self.send_rows(r.layout.latent_rows(self.x, r0, r1).clone(), nxt)
            if r.first and r.S > 1 and i + 1 < r.N:  # post the receive of this patch's next rows early
                self.pending_rows[p] = self.recv_rows(r.layout.latent_rows(self.x, r0, r1).shape)
