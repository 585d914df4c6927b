"""A step cache for the loops that run in the workers (loop mode, PipeFusion): ComfyUI's EasyCache rule.

Why here and not in ComfyUI: EasyCache is a wrapper around the diffusion model's forward in ComfyUI's process.
In step mode the driver runs it around the pool call (one decision, every rank follows). In loop mode and
PipeFusion the denoising loop runs in the workers, so the rule runs there - and every rank that takes part in a
forward must make the same decision, or one rank would wait in a collective the others skipped. The caller
agrees on it (`agree`: one small all-reduce) before acting.

The rule (EasyCache, Zhou et al. 2025, as ComfyUI 0.3.75 implements it): within [start_sigma, end_sigma), the
output change of a step is predicted as k * mean|x - x_prev| / mean|out_prev|, where k (the "transformation
rate") is the ratio of output change to input change measured between the last two computed steps and x_prev
the input of the last computed step; the predictions accumulate, and while the sum stays below the threshold
the step is skipped: its output is its input plus the last computed (output - input). Statistics are taken on
one batch slice (ComfyUI's first conditioning in the batch) subsampled every `subsample` rows and columns.

PipeFusion keeps one cache per patch (the rule on the patch's rows): a skipped patch computes nothing on any
stage and its K/V buffers keep the older values, a stale method on top of a stale method, whose error is
measured (bench). In full (synchronous) steps one cache covers the whole latent, which is EasyCache itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class StepCacheSpec:
    """What a cache needs from ComfyUI's EasyCache node: its threshold and sigma window (ComfyUI's percent_to_sigma
    of start/end percent), subsampling and the latent channels; `first` / `chunks`: which batch slice of the
    model's batch (cond/uncond chunks, in ComfyUI's call order) the statistics are taken on."""
    threshold: float
    start_sigma: float
    end_sigma: float
    subsample: int = 8
    channels: Optional[int] = None
    first: int = 0
    chunks: int = 1
    # ComfyUI's EasyCache adds the cached difference to the model input *in place*; where that input is the
    # sampler's own batch (flow models computing in the latent's float32, no concat channels) the skipped step's
    # denoised is then computed from the shifted input too. True reproduces that (KSampler's result, bit for bit).
    shift_input: bool = False

    def __post_init__(self):
        if self.threshold < 0 or self.subsample < 1 or not 0 <= self.first < self.chunks:
            raise ValueError(f"step cache: threshold >= 0, subsample >= 1 and 0 <= first < chunks; got {self}")

    @classmethod
    def from_json(cls, d: Optional[dict]) -> Optional["StepCacheSpec"]:
        return None if not d else cls(**d)


class StepCache:
    """The state of one cache (one latent, or one PipeFusion patch)."""

    def __init__(self, spec: StepCacheSpec):
        self.spec = spec
        self.k = None            # output change / input change between the last two computed steps
        self.cumulative = 0.0
        self.x_prev = None       # subsampled input of the last computed step
        self.out_prev = None     # subsampled output of the last computed step
        self.out_norm = None     # mean |output| of the last computed step (whole batch)
        self.diff = None         # output - input of the last computed step (whole batch)
        self.input_change = None
        self.started = False     # statistics are kept from the first step inside the window on (as ComfyUI's)
        self.skipped = 0
        self.last_skipped = False

    def _sub(self, t: torch.Tensor) -> torch.Tensor:
        n = t.shape[0] // self.spec.chunks
        t = t[self.spec.first * n:(self.spec.first + 1) * n]
        s = self.spec.subsample
        return t[..., ::s, ::s] if s > 1 else t

    def _x(self, h: torch.Tensor) -> torch.Tensor:
        c = self.spec.channels
        return h if c is None else h[:, :c]

    def _in_window(self, sigma) -> tuple:
        """(before the end, at or after the start) of the window, compared as ComfyUI does: a float32 sigma tensor
        against the Python float bounds, i.e. in float32 (a sigma equal to the bound in float32 is inside)."""
        s = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1)[0]
        return bool(s > self.spec.end_sigma), bool(s <= self.spec.start_sigma)

    def wants_compute(self, sigma, h: torch.Tensor) -> bool:
        """Decide for a step at `sigma` with model input `h`: False = skip it (then call `reuse`)."""
        self.input_change = None
        before_end, started = self._in_window(sigma)
        if not before_end or not started:
            return True  # outside the window: computed (past the end, not even remembered: see remember)
        self.started = True
        x = self._x(h)
        if self.x_prev is not None:
            self.input_change = (self._sub(x) - self.x_prev).flatten().abs().mean()
        if self.out_norm is not None and self.k is not None and self.diff is not None:
            # a 0-dim tensor sum, as ComfyUI's: the same rounding, hence the same decision at the threshold
            self.cumulative = self.cumulative + self.k * self.input_change / self.out_norm
            if bool(self.cumulative < self.spec.threshold):
                return False
            self.cumulative = 0.0
        return True

    def reuse(self, h: torch.Tensor) -> torch.Tensor:
        """The skipped step's output: its input plus the last computed (output - input)."""
        self.skipped += 1
        return self._x(h) + self.diff.to(h.device)

    def remember(self, sigma, h: torch.Tensor, out: torch.Tensor) -> None:
        """After a computed step: the transformation rate, and the input / output / difference to compare with."""
        if not self._in_window(sigma)[0]:
            return  # past the window: EasyCache runs the model without touching its state
        x = self._x(h)
        self.diff = out - x
        if not self.started:
            return
        if self.out_norm is not None:
            change = (self._sub(out) - self.out_prev).flatten().abs().mean()
            if self.input_change is not None:
                self.k = change / self.input_change
        self.x_prev, self.out_prev = self._sub(x).clone(), self._sub(out).clone()
        self.out_norm = out.flatten().abs().mean()


def cached_step(cache: Optional[StepCache], sigma, h: torch.Tensor, compute, agree=None) -> torch.Tensor:
    """One model call through `cache` (None: just compute). `agree(wants_compute) -> bool` makes the decision
    common to every rank that takes part in the forward (compute when any of them wants to)."""
    if cache is None:
        return compute()
    want = cache.wants_compute(sigma, h)
    if agree is not None:
        want = agree(want)
    cache.last_skipped = not want
    if not want:
        return cache.reuse(h)
    out = compute()
    cache.remember(sigma, h, out)
    return out
