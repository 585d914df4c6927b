"""Parallel VAE Decode: ComfyUI's VAEDecode with the decode split into row patches across the workers.

The workers run ComfyUI's own VAE model - the class its detection builds from the weights, its decode loop - with
the ops that mix rows swapped for patch-aware ones for the duration of the decode (parallel/vae/native.py); which
VAE classes were read for that, and which are refused with the reason, is parallel/vae/comfy_vaes.py. Everything
is checked here, on ComfyUI's copy, before the VAE travels or a worker starts.
"""
from __future__ import annotations

import torch

from ..parallel.config import ConfigError
from ..parallel.vae.comfy_vaes import comfy_vae_for, refusal, supported_titles
from ..parallel.vae.native import plan_native
from ..workers.driver.step import submit_interruptible
from ..workers.bridge.residency import stamp
from ..workers.bridge.vae import native_vae_spec, qualname, vae_input, vae_module, vae_output


class PatchVAEDecode:
    DESCRIPTION = ("Decodes latents like VAE Decode, with the image split into row patches across the devices of "
                   "a Parallel Config (every worker decodes its rows; borders exchanged exactly), so large images "
                   "and long videos decode without one device holding all activations. Same output as VAE Decode.")
    CATEGORY = "Hybrid Parallel"
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image.",)
    FUNCTION = "decode"
    runtime = None  # set by the pack's entry point

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "samples": ("LATENT", {"tooltip": "The latent to decode."}),
            "vae": ("VAE", {"tooltip": "A KL image VAE (SD, SDXL, SD3, Flux.1 / Flux.2, PixArt, Lumina 2, Z-Image), "
                                       "a TAESD (taesd, taesdxl, taesd3, taef1), the Wan 2.1 / Wan 2.2 video VAE, "
                                       "TAEHV, HunyuanVideo 1.0 / 1.5's VAE (Kandinsky 5's too) or LTX-2's video "
                                       "VAE; other VAEs (timestep-conditioned LTX-Video, MiniMax H3, CogVideoX, "
                                       "Mochi, Cosmos...): use VAE Decode."}),
            "parallel_config": ("PARALLEL_CONFIG", {"tooltip": "From the Parallel Config node; every rank of its "
                                                    "world decodes a band of rows."}),
        }, "optional": {
            "block_size": ("INT", {"default": 0, "min": 0, "max": 4096, "tooltip": "Rows per chunk inside each "
                                   "worker to cap peak memory (0 = whole patch at once). Exact either way."}),
        }}

    def decode(self, samples, vae, parallel_config, block_size=0):
        with self.runtime.track("vae_decode"):  # the worker panel's busy state
            return self._decode(samples, vae, parallel_config, block_size)

    def _decode(self, samples, vae, hp, block_size):
        first = vae_module(vae)
        latent = samples["samples"]
        if latent.is_nested:
            raise ValueError("Parallel VAE Decode does not take nested (multi-part) latents; use VAE Decode")
        declared = _check_vae(first, latent, hp.config.world_size, block_size or None)  # before anything travels
        key = f"{stamp(first)}:vae"
        self.runtime.ensure_native(hp, key, native_vae_spec(vae), first, family="vae_comfy")
        pool = self.runtime.pool(hp)
        values = {"key": key}
        if block_size:
            values["block_size"] = int(block_size)
        # as ComfyUI's VAE.decode: the latent in the VAE's dtype into first_stage_model.decode, the output as float
        # through the VAE's process_output, channels last
        res = submit_interruptible(pool, hp.config, "vae_decode", values, {"latent": vae_input(vae, latent)})
        images = vae_output(vae, res.tensors["image"])
        if images.ndim == 5:  # video: (B, T, H, W, C) -> frames in the batch, as VAEDecode does
            images = images.reshape(-1, *images.shape[-3:])
        del declared
        return (images.to(torch.float32),)


class _Axis:
    """The axis a plan is checked against on the driver (sizes only; nothing is communicated)."""

    def __init__(self, size: int):
        self.size, self.rank = size, 0


def _check_vae(first_stage_model, latent=None, ranks: int = 1, block_size=None):
    """The declaration (parallel/vae/comfy_vaes.py) of a ComfyUI VAE model Patch VAE Decode splits, with its plan
    checked on ComfyUI's copy (every module of its decode path read, a latent of the right rank, tall enough for
    `ranks`); a ValueError naming the VAE, why and the workaround otherwise - before the VAE travels or a worker
    starts."""
    what = qualname(first_stage_model)
    workaround = "Decode it with ComfyUI's VAE Decode, or VAE Decode (Tiled) when it does not fit in memory"
    declared = comfy_vae_for(first_stage_model)
    why = refusal(first_stage_model)
    if declared is None or (why and declared.check is not None and declared.check(first_stage_model)):
        raise ValueError(f"Parallel VAE Decode does not split this VAE ({what})"
                         + (f": {why}" if why else f"; it splits {supported_titles()}") + f". {workaround}")
    try:
        plan = plan_native(first_stage_model, declared, _Axis(max(1, ranks)), block_size=block_size)
    except ConfigError as e:
        raise ValueError(f"Parallel VAE Decode cannot split this VAE ({what}): {e}. {workaround}") from None
    if latent is not None:
        if latent.dim() != declared.dims:
            kind = "image (B, C, H, W)" if declared.dims == 4 else "video (B, C, T, H, W)"
            raise ValueError(f"Parallel VAE Decode: {declared.title} ({what}) decodes {kind} latents, got shape "
                             f"{tuple(latent.shape)}; connect the VAE that belongs to the model that made this latent")
        rows = int(latent.shape[-2])
        if ranks > 1 and rows // plan.min_rows < ranks:
            raise ValueError(f"Parallel VAE Decode: a latent {rows} rows tall cannot be split over {ranks} ranks "
                             f"(each needs at least {plan.min_rows} row(s)); use a Parallel Config with at most "
                             f"{max(1, rows // plan.min_rows)} ranks for the decode, or ComfyUI's VAE Decode")
    return declared
