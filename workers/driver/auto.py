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
import time
from dataclasses import replace

from ...parallel.config import ParallelConfig
from ...parallel.costmodel import (CPU_EPYC_2, H100_NVLINK, H100_PCIE, DeviceCost, choose, format_table, probe_cpu,
                                   scaled_to, shape_from_module)
from ..bridge.build import attention_function, picked_attention
from ..bridge.spec import ANY, diffusion_model_of, family_adapter

log = logging.getLogger("comfyui_hybrid_parallel.auto")


def cfg_active(cfg: float, negative) -> bool:
    """Whether ComfyUI runs the unconditional half: a negative prompt and a cfg other than 1 (at 1 ComfyUI skips
    it, comfy/samplers.py cfg1 optimization)."""
    return negative is not None and not math.isclose(float(cfg), 1.0)


def warn_idle_cfg(hp, cfg: float, negative, who: str) -> bool:
    """Say so when CFG parallel has nothing to split: with cfg 1 (or no negative) ComfyUI runs no unconditional
    pass, so the cfg ranks compute the same half twice - correct, but half the devices do no useful work.
    A warning, not a refusal: one PARALLEL_CONFIG often feeds a cfg > 1 pass and a cfg 1 pass (Wan 2.2's experts)."""
    if hp.config.cfg_degree < 2 or cfg_active(cfg, negative):
        return False
    log.warning("%s: cfg_degree %d with cfg %g runs no unconditional pass, so the CFG ranks repeat the same work; "
                "set cfg_degree to 1 and give those devices to ulysses_degree (or use Parallel GPUs / degrees auto)",
                who, hp.config.cfg_degree, float(cfg))
    return True


def text_tokens(*conditionings, default: int = 77) -> int:
    """The longest text context among ComfyUI CONDITIONING lists ([[tensor (B, T, C), {...}], ...])."""
    lengths = [c[0].shape[1] for cond in conditionings if cond for c in cond
               if getattr(c[0], "ndim", 0) == 3]
    return max(lengths) if lengths else default


def device_cost(device: str, n_devices: int, cache: dict | None = None) -> DeviceCost:
    """The cost preset for where the workers run: H100s (NVLink when torch sees peer access, else PCIe) - any
    other GPU uses the H100 figures scaled by nothing better we know - or this machine's CPU cores, the CPU
    preset's throughputs moved to this machine by a probe (once, kept in `cache`): CPU machines differ by 2x and
    more, and a preset that over-rates the compute under-rates what communication costs."""
    import torch
    if device in ("cuda", "auto") and torch.cuda.is_available():
        nvlink = n_devices < 2 or torch.cuda.can_device_access_peer(0, 1)
        return H100_NVLINK if nvlink else H100_PCIE
    cache = {} if cache is None else cache
    if "cpu_rates" not in cache:
        cache["cpu_rates"] = probe_cpu()
    return scaled_to(CPU_EPYC_2, cache["cpu_rates"]).with_cores(os.cpu_count() or 1)


PROBE_FLOPS = 4e9  # a CPU probe's attention work cap: a kernel call of ~0.1 s at most (fewer heads beyond)


def kernel_probe(device: str, head_dim: int, cache: dict | None = None):
    """(speed(batch, heads, length, threads) or None, the kernel's name): how fast the attention kernel ComfyUI
    picked runs relative to torch's SDPA at one rank's attention shape, *measured* on the device kind the workers
    use (here, in the driver; each shape once, kept in `cache`).

    Why measured: the cost model's attention throughput is SDPA's, but degree 1, cfg, dp and Ulysses ranks run
    ComfyUI's kernel (sage / flash on a GPU; sub-quadratic by default on a CPU, 1.1-2.5x slower than SDPA here
    depending on batch, heads and threads), while ring ranks run SDPA. None when ComfyUI's kernel is SDPA itself."""
    import torch

    name = picked_attention()
    if name in (None, "pytorch"):
        return None, name
    kernel = attention_function(name)
    dev = torch.device("cuda") if device in ("cuda", "auto") and torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cache = {} if cache is None else cache

    def speed(batch: int, heads: int, length: int, threads: int) -> float:
        if dev.type == "cpu":  # cap the probe's work: fewer heads (the speed is per head)
            heads = max(1, min(heads, int(PROBE_FLOPS // max(1, 4 * batch * length * length * head_dim))))
        key = (name, str(dev), batch, heads, length, head_dim, threads if dev.type == "cpu" else 0)
        if key not in cache:
            cache[key] = _measure(kernel, dev, dtype, key[2:6], threads)
        return cache[key]
    return speed, name


def _measure(kernel, dev, dtype, shape, threads: int, reps: int = 3) -> float:
    """SDPA's time / the kernel's, min of `reps` alternating calls after a warm-up; 1.0 if the kernel fails."""
    import torch
    old = torch.get_num_threads()
    try:
        if dev.type == "cpu":
            torch.set_num_threads(max(1, threads))
        best = _time_both(kernel, dev, dtype, shape, reps)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape: assume SDPA's speed
        log.warning("Parallel Config degrees auto: could not time ComfyUI's attention kernel (%s); assuming "
                    "torch's speed", e)
        return 1.0
    finally:
        torch.set_num_threads(old)
        if dev.type == "cuda":  # the driver's GPU is rank 0's: give the probe's memory back to it
            torch.cuda.empty_cache()
    return min(20.0, max(0.05, best["sdpa"] / best["kernel"]))


def _time_both(kernel, dev, dtype, shape, reps: int) -> dict:

    import torch
    import torch.nn.functional as F
    b, h, n, d = shape
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, generator=g, device=dev, dtype=dtype) for _ in range(3))
    calls = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v),
             "kernel": lambda: kernel(q, k, v, h, skip_reshape=True, skip_output_reshape=True)}
    best = {}
    for rep in range(reps + 1):
        for which, call in calls.items():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            call()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            if rep:  # the first round warms up
                best[which] = min(best.get(which, float("inf")), time.perf_counter() - t)
    return best


def _batch_split(hp, name: str, latent_shape, active: bool, report: dict | None):
    """Degrees auto for a model no family adapter knows: CFG parallel when ComfyUI batches an unconditional half,
    data parallel over the latent's batch with the devices left. Each rank runs the whole model on its share of the
    batch and the only traffic is one gather of the output per step, so the split is taken whenever there is a batch
    to split (no cost model reads this model's blocks)."""
    n = hp.auto_devices
    cfg_degree = 2 if active and n >= 2 else 1
    dp = max(1, min(int(latent_shape[0]), n // cfg_degree))
    base = hp.config
    config = ParallelConfig(dp_degree=dp, cfg_degree=cfg_degree, warmup_steps=base.warmup_steps,
                            devices=tuple(hp.device_list[:dp * cfg_degree]))
    log.info("Parallel Config degrees auto: %s for %s (no family adapter: its batch splits, cfg %s, batch %d) on up to "
             "%d %s device(s)", config.describe(), name, "on" if active else "off", int(latent_shape[0]), n, hp.device)
    if report is not None:
        report.update(model=name, batch=int(latent_shape[0]) * (2 if active else 1), cfg=active, devices=n,
                      chosen=config.describe(), candidates=[], batch_only=True)
    return replace(hp, config=config, auto_devices=0, device_list=())


def resolve_auto(hp, model_patcher, latent_shape, cfg: float, negative, positive=None, report: dict | None = None,
                 probes: dict | None = None):
    """`hp` unchanged unless its degrees are "auto"; else a HybridParallelConfig with the degrees the cost model
    picks for this model, latent and cfg on hp.auto_devices devices (degree 1 unless more is predicted faster).
    `report` receives what the mesh picture shows: the predicted time per step of every candidate.
    `probes`: what was measured for the cost (this CPU's throughput, ComfyUI's attention kernel per shape), kept
    across prompts (the Runtime's)."""
    if not getattr(hp, "auto_devices", 0):
        return hp
    active = cfg_active(cfg, negative)
    try:
        shape = shape_from_module(diffusion_model_of(model_patcher))
    except ValueError as e:
        dm = diffusion_model_of(model_patcher)
        if family_adapter(dm) is ANY:  # a model no family adapter knows: only its batch splits (any_model.py)
            return _batch_split(hp, type(dm).__name__, latent_shape, active, report)
        log.warning("Parallel Config degrees auto: %s; running on one rank", e)
        return replace(hp, auto_devices=0, device_list=())
    batch = int(latent_shape[0]) * (2 if active else 1)
    tokens = shape.tokens(latent_shape)
    text = text_tokens(positive, negative if active else None)
    cost = device_cost(hp.device, hp.auto_devices, probes)
    kernel_speed, kernel = kernel_probe(hp.device, shape.head_dim, probes)
    chosen, table = choose(shape, tokens, batch, active, hp.auto_devices, cost, text=text, kernel_speed=kernel_speed)
    base = hp.config
    config = ParallelConfig(dp_degree=chosen.dp_degree, cfg_degree=chosen.cfg_degree,
                            ulysses_degree=chosen.ulysses_degree, ring_degree=chosen.ring_degree,
                            warmup_steps=base.warmup_steps, method=base.method,
                            devices=tuple(hp.device_list[:chosen.world_size]))
    log.info("Parallel Config degrees auto: %s for %s (%d image + %d text tokens, batch %d, cfg %s) on up to %d "
             "%s device(s) [%s; ComfyUI's attention: %s]\n%s", config.describe(), shape.family, tokens, text, batch,
             "on" if active else "off", hp.auto_devices, hp.device, cost.name, kernel, format_table(table))
    if report is not None:
        report.update(model=shape.family, tokens=tokens, text_tokens=text, batch=batch, cfg=active,
                      devices=hp.auto_devices, cost=cost.name, kernel=kernel, chosen=config.describe(),
                      candidates=[{"config": r["config"], "ms": round(1e3 * r["total_s"], 2),
                                   "speedup": round(r["speedup"], 3), "chosen": bool(r["chosen"])}
                                  for i, r in enumerate(table) if i < 12 or r["chosen"]])
    return replace(hp, config=config, auto_devices=0, device_list=())
