"""Parallel VAE Decode: ComfyUI's VAEDecode with the decode split into row patches across the workers.

The workers rebuild ComfyUI's VAE as the diffusers class that computes the same decode (diffusers
AutoencoderKL for the KL image VAE, AutoencoderKLWan for the Wan 2.1 and 2.2 video VAEs,
AutoencoderTiny for TAESD) and split it with parallel/vae. Any other VAE ComfyUI loads (HunyuanVideo
1.5's, TAEHV, LTXV, Mochi, Cosmos, audio VAEs...) has no such twin: `check_vae` refuses it by class,
naming the workaround, before the VAE travels or a worker starts.
"""
from __future__ import annotations

import torch

from ..parallel.checkpoints import CheckpointError, detect_family, family_module
from ..parallel.checkpoints.vae import (kl_config_from_state_dict, taesd_config_from_state_dict, taesd_latent_in,
                                        wan_config_from_state_dict)
from .runtime import to_diffusers, weights_key
from .sampler_node import submit_interruptible


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
            "vae": ("VAE", {"tooltip": "A KL image VAE (SD, SDXL, SD3, Flux.1, PixArt, Lumina 2, Z-Image), a TAESD "
                                       "(taesd, taesdxl, taesd3, taef1) or the Wan 2.1 / Wan 2.2 video VAE; other "
                                       "VAEs: use VAE Decode."}),
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
        first = vae.first_stage_model
        if samples["samples"].is_nested:
            raise ValueError("Parallel VAE Decode does not take nested (multi-part) latents; use VAE Decode")
        check_rows(samples["samples"], first, hp.config.world_size)  # before the VAE travels or a world starts
        family = check_vae(first, samples["samples"])
        key = weights_key(first, "vae")
        self.runtime.ensure_resident(hp, key, lambda: to_diffusers(first, family))
        pool = self.runtime.pool(hp)
        latent = samples["samples"].float()
        if family == "vae_taesd":  # ComfyUI's TAESD.decode shifts and scales the latent before its decoder
            latent = taesd_latent_in(latent, first.vae_scale, first.vae_shift)
        values = {"key": key}
        if block_size:
            values["block_size"] = int(block_size)
        res = submit_interruptible(pool, hp.config, "vae_decode", values, {"latent": latent})
        images = family_module(family).diffusers_to_comfy_images(res.tensors["image"])
        if images.ndim == 5:  # video: (B, T, H, W, C) -> frames in the batch, as VAEDecode does
            images = images.reshape(-1, *images.shape[-3:])
        return (images.to(torch.float32),)


def check_rows(latent, first_stage_model, ranks: int) -> None:
    """Every rank decodes a band of latent rows and needs at least a convolution's halo of them: refuse a latent
    too short for `ranks` from ComfyUI's own VAE (its largest kernel), naming the degree that fits."""
    if ranks <= 1 or latent.is_nested:
        return
    halo = 1
    for m in first_stage_model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)):
            halo = max(halo, int(m.kernel_size[-2]) // 2)
    rows = int(latent.shape[-2])
    if rows // halo < ranks:
        raise ValueError(f"Parallel VAE Decode: a latent {rows} rows tall cannot be split over {ranks} ranks (each needs "
                         f"at least {halo} row(s)); use a Parallel Config with at most {max(1, rows // halo)} ranks "
                         f"for the decode, or ComfyUI's VAE Decode")


# ComfyUI's VAE classes (module.qualname) whose decode the workers reproduce with a diffusers class.
_WAN_VAES = ("comfy.ldm.wan.vae.WanVAE", "comfy.ldm.wan.vae2_2.WanVAE")
_KL_VAE = "comfy.ldm.models.autoencoder.AutoencodingEngine"  # AutoencoderKL derives from it
_KL_DECODER = "comfy.ldm.modules.diffusionmodules.model.Decoder"
_TAESD = "comfy.taesd.taesd.TAESD"  # taesd, taesdxl (4 channels), taesd3, taef1 (16); not TAEHV (video)
SUPPORTED_VAES = ("the KL image VAE (SD 1.x, SDXL, SD3, Flux.1, PixArt, Lumina 2, Z-Image), TAESD (taesd, taesdxl, "
                  "taesd3, taef1) and the Wan 2.1 and Wan 2.2 video VAEs")
_CONFIG = {"vae_kl": kl_config_from_state_dict, "vae_wan": wan_config_from_state_dict,
           "vae_taesd": taesd_config_from_state_dict}


def _qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def check_vae(first_stage_model, latent=None) -> str:
    """'vae_kl', 'vae_wan' (the Wan 2.2 VAE included) or 'vae_taesd' for a ComfyUI VAE the workers can split and a
    latent it takes, else a ValueError naming the VAE's class and the workaround. Why: no other VAE has a diffusers
    twin here whose decoder was checked to split by rows (HunyuanVideo 1.5's, for one, attends over every frame's
    tokens at once in its mid block and its detected size is fixed at ~1B parameters), and the refusal must come
    before the VAE travels or a worker starts. The converter's own shape checks (a Flux.2 batch-norm latent, an SVD
    temporal decoder, a TAESD whose layer layout is not AutoencoderTiny's) run here too, on the state dict's names
    and shapes only."""
    names = {f"{c.__module__}.{c.__qualname__}" for c in type(first_stage_model).__mro__}
    decoder = getattr(first_stage_model, "decoder", None)
    what = _qualname(first_stage_model)
    if names & set(_WAN_VAES):
        family = "vae_wan"
    elif _TAESD in names:
        family = "vae_taesd"
    elif _KL_VAE in names and _qualname(decoder) == _KL_DECODER and isinstance(decoder.conv_in, torch.nn.Conv2d):
        family = "vae_kl"  # not the 3-D variant of the same Decoder (conv3d=True: VideoConv3d convs)
    else:
        if decoder is not None:
            what += f" with decoder {_qualname(decoder)}"
        raise ValueError(f"Parallel VAE Decode does not split this VAE ({what}): it covers {SUPPORTED_VAES}. "
                         f"Decode it with ComfyUI's VAE Decode, or VAE Decode (Tiled) when it does not fit in memory")
    sd = first_stage_model.state_dict()  # references, not copies: only names and shapes are read
    try:
        found = detect_family(sd)
        if found != family:
            raise CheckpointError(f"its weights look like {found}, its class like {family}")
        config = _CONFIG[family](sd)
    except CheckpointError as e:
        raise ValueError(f"Parallel VAE Decode cannot split this VAE ({what}): {e}. Decode it with ComfyUI's VAE "
                         f"Decode, or VAE Decode (Tiled) when it does not fit in memory") from None
    if latent is not None:
        dims, channels = (5, config["z_dim"]) if family == "vae_wan" else (4, config["latent_channels"])
        if latent.dim() != dims or latent.shape[1] != channels:
            kind = "image (B, C, H, W)" if dims == 4 else "video (B, C, T, H, W)"
            raise ValueError(f"Parallel VAE Decode: this VAE ({what}) decodes {kind} latents with {channels} channels, "
                             f"got shape {tuple(latent.shape)}; connect the VAE that belongs to the model that "
                             f"made this latent")
    return family
