"""Worker-side samplers and model conventions for loop mode (the plain loop, parallel/loop.py, and PipeFusion's).

In loop mode the last pipeline stage applies the sampler step to each patch as
soon as its prediction is ready, so a sampler here must be *elementwise* in the
latent: every update below (ComfyUI's `euler` and `dpmpp_2m`) touches each
element only through its own x / denoised / history, which is why updating a
band of rows at a time gives the same bits as updating the whole latent.
The arithmetic is written in the same order and on the same 0-dim fp32 sigma
tensors as ComfyUI's k_diffusion/sampling.py, so the results are bit-identical
for the same sigmas (tested against ComfyUI itself).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .config import ConfigError


@dataclass(frozen=True)
class Convention:
    """How a model's output becomes the sampler's `denoised` (ComfyUI's model_sampling).

    kind "flow" (ComfyUI CONST: SD3, Flux): input x, timestep = sigma * timestep_scale
    (1000 for SD3, 1 for Flux), denoised = x - out * sigma.
    kind "eps" (ComfyUI EPS: PixArt): input x / sqrt(sigma^2 + sigma_data^2),
    timestep = timestep_fn(sigma) (the discrete schedule's sigma->t), denoised = x - out * sigma.
    Extra output channels (PixArt's learned variance) are dropped, as ComfyUI does.
    """
    kind: str = "flow"
    timestep_scale: float = 1.0
    timestep_fn: Optional[Callable] = None
    sigma_data: float = 1.0

    def __post_init__(self):
        if self.kind not in ("flow", "eps"):
            raise ConfigError(f"convention kind must be 'flow' or 'eps', got {self.kind!r}")
        if self.kind == "eps" and self.timestep_fn is None:
            raise ConfigError("an 'eps' convention needs timestep_fn (sigma -> model timestep)")

    def model_input(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        if self.kind == "flow":
            return x
        return x / (sigma ** 2 + self.sigma_data ** 2) ** 0.5

    def timestep(self, sigma: torch.Tensor, batch: int, dtype, device=None) -> torch.Tensor:
        """The model's timestep for `sigma`, one per batch row, on `device` (the latent's): the sigmas stay on the
        host for the sampler's arithmetic, and a host timestep would meet the model's CUDA weights."""
        t = sigma * self.timestep_scale if self.kind == "flow" else torch.as_tensor(self.timestep_fn(sigma))
        return t.reshape(-1).expand(batch).to(device=device, dtype=dtype)

    def denoised(self, x: torch.Tensor, sigma: torch.Tensor, out: torch.Tensor, channel_dim: int) -> torch.Tensor:
        if out.shape[channel_dim] != x.shape[channel_dim]:
            out = out.narrow(channel_dim, 0, x.shape[channel_dim])
        return x - out.float() * sigma


def flow(timestep_scale: float) -> Convention:
    return Convention("flow", timestep_scale=timestep_scale)


def eps(timestep_fn: Callable, sigma_data: float = 1.0) -> Convention:
    return Convention("eps", timestep_fn=timestep_fn, sigma_data=sigma_data)


class Euler:
    """ComfyUI `euler` without churn: x + (x - denoised) / sigma_i * (sigma_{i+1} - sigma_i)."""
    name = "euler"
    state_keys = ()

    def step(self, i: int, sigmas: torch.Tensor, x, denoised, state: dict):
        d = (x - denoised) / sigmas[i]
        dt = sigmas[i + 1] - sigmas[i]
        return x + d * dt


class DPMpp2M:
    """ComfyUI `dpmpp_2m` (DPM-Solver++(2M)); its only history is the previous `denoised`, kept per element."""
    name = "dpmpp_2m"
    state_keys = ("old_denoised",)

    def step(self, i: int, sigmas: torch.Tensor, x, denoised, state: dict):
        sigma_fn = lambda t: t.neg().exp()  # noqa: E731 - the same lambdas as ComfyUI, for the same bits
        t_fn = lambda sigma: sigma.log().neg()  # noqa: E731
        t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
        h = t_next - t
        old = state["old_denoised"]
        if i == 0 or sigmas[i + 1] == 0:
            x = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised
        else:
            h_last = t - t_fn(sigmas[i - 1])
            r = h_last / h
            denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old
            x = (sigma_fn(t_next) / sigma_fn(t)) * x - (-h).expm1() * denoised_d
        old.copy_(denoised)
        return x


SAMPLERS = {"euler": Euler, "dpmpp_2m": DPMpp2M}


def get_sampler(name: str):
    if name not in SAMPLERS:
        raise ConfigError(f"loop mode supports the samplers {sorted(SAMPLERS)}, not {name!r}; pick one of them "
                          f"or use step mode (every ComfyUI sampler)")
    return SAMPLERS[name]()


def check_sigmas(sigmas) -> torch.Tensor:
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32).reshape(-1)
    if sigmas.numel() < 2:
        raise ConfigError(f"sigmas must hold at least 2 values (one step), got {sigmas.numel()}")
    if bool((sigmas[:-1] <= 0).any()):
        raise ConfigError("every sigma but the last must be > 0 (the samplers divide by it)")
    return sigmas


def check_cfg_batch(inputs: dict, batch: int, cfg_scale) -> None:
    if cfg_scale is None:
        return
    for k, v in inputs.items():
        text = k == "context"  # ComfyUI's name for the text conditioning
        if isinstance(v, torch.Tensor) and text and v.shape[0] != 2 * batch:
            raise ConfigError(f"with cfg_scale the conditioning batch must be [cond, uncond] = 2 x the latent "
                              f"batch ({2 * batch}); {k} has batch {v.shape[0]}")


def denoise(convention: Convention, x, sigma, out, channel_dim: int, cfg_scale):
    """ComfyUI's denoised, with its CFG mix (uncond + (cond - uncond) * scale) when cfg_scale is set."""
    if cfg_scale is None:
        return convention.denoised(x, sigma, out, channel_dim)
    cond, uncond = convention.denoised(torch.cat([x, x]), sigma, out, channel_dim).chunk(2)
    return uncond + (cond - uncond) * cfg_scale


def model_latent(convention: Convention, x, sigma, dtype, cfg_scale):
    h = convention.model_input(x, sigma).to(dtype)
    return h if cfg_scale is None else torch.cat([h, h])
