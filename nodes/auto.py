"""Parallel Config's degrees "auto", resolved where the model, the latent and the cfg are known: Hybrid Sampler.

Why here and not in the config node: what pays off depends on the model (blocks, width, heads), the tokens of this
latent and whether CFG batches a negative prompt - none of which the config node sees. The choice itself is
parallel/costmodel.py's (`choose`): a config is taken only when it is predicted faster than one rank by a margin,
so auto is never meant to be slower than degree 1. The candidate table goes to the log, so a user can see why.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import replace

from ..parallel.config import ParallelConfig
from ..parallel.costmodel import CPU_EPYC_2, H100_NVLINK, H100_PCIE, DeviceCost, choose, format_table, shape_from_module

log = logging.getLogger("comfyui_hybrid_parallel.auto")


def cfg_active(cfg: float, negative) -> bool:
    """Whether ComfyUI runs the unconditional half: a negative prompt and a cfg other than 1 (at 1 ComfyUI skips
    it, comfy/samplers.py cfg1 optimization)."""
    return negative is not None and not math.isclose(float(cfg), 1.0)


def text_tokens(*conditionings, default: int = 77) -> int:
    """The longest text context among ComfyUI CONDITIONING lists ([[tensor (B, T, C), {...}], ...])."""
    lengths = [c[0].shape[1] for cond in conditionings if cond for c in cond
               if getattr(c[0], "ndim", 0) == 3]
    return max(lengths) if lengths else default


def device_cost(device: str, n_devices: int) -> DeviceCost:
    """The cost preset for where the workers run: H100s (NVLink when torch sees peer access, else PCIe) - any
    other GPU uses the H100 figures scaled by nothing better we know - or this machine's CPU cores."""
    import torch
    if device in ("cuda", "auto") and torch.cuda.is_available():
        nvlink = n_devices < 2 or torch.cuda.can_device_access_peer(0, 1)
        return H100_NVLINK if nvlink else H100_PCIE
    return CPU_EPYC_2.with_cores(os.cpu_count() or 1)


def resolve_auto(hp, model_patcher, latent_shape, cfg: float, negative, positive=None, report: dict | None = None):
    """`hp` unchanged unless its degrees are "auto"; else a HybridParallelConfig with the degrees the cost model
    picks for this model, latent and cfg on hp.auto_devices devices (degree 1 unless more is predicted faster).
    `report` receives what the mesh picture shows: the predicted time per step of every candidate."""
    if not getattr(hp, "auto_devices", 0):
        return hp
    try:
        shape = shape_from_module(model_patcher.model.diffusion_model)
    except ValueError as e:  # a model no family adapter knows: one rank; the sampler's own checks report the rest
        log.warning("Parallel Config degrees auto: %s; running on one rank", e)
        return replace(hp, auto_devices=0, device_list=())
    active = cfg_active(cfg, negative)
    batch = int(latent_shape[0]) * (2 if active else 1)
    tokens = shape.tokens(latent_shape)
    text = text_tokens(positive, negative if active else None)
    cost = device_cost(hp.device, hp.auto_devices)
    chosen, table = choose(shape, tokens, batch, active, hp.auto_devices, cost, text=text)
    base = hp.config
    config = ParallelConfig(dp_degree=chosen.dp_degree, cfg_degree=chosen.cfg_degree,
                            ulysses_degree=chosen.ulysses_degree, ring_degree=chosen.ring_degree,
                            warmup_steps=base.warmup_steps, method=base.method,
                            devices=tuple(hp.device_list[:chosen.world_size]))
    log.info("Parallel Config degrees auto: %s for %s (%d image + %d text tokens, batch %d, cfg %s) on up to %d "
             "%s device(s) [%s]\n%s", config.describe(), shape.family, tokens, text, batch,
             "on" if active else "off", hp.auto_devices, hp.device, cost.name, format_table(table))
    if report is not None:
        report.update(model=shape.family, tokens=tokens, text_tokens=text, batch=batch, cfg=active,
                      devices=hp.auto_devices, cost=cost.name, chosen=config.describe(),
                      candidates=[{"config": r["config"], "ms": round(1e3 * r["total_s"], 2),
                                   "speedup": round(r["speedup"], 3), "chosen": bool(r["chosen"])}
                                  for i, r in enumerate(table) if i < 12 or r["chosen"]])
    return replace(hp, config=config, auto_devices=0, device_list=())
