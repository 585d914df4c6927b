"""Patch VAE Decode: ComfyUI's VAEDecode with the decode split into row patches across the workers."""
from __future__ import annotations

import torch

from ..parallel.checkpoints import family_module
from .runtime import to_diffusers, weights_key
from .sampler_node import submit_interruptible


class PatchVAEDecode:
    DESCRIPTION = ("Decodes latents like VAE Decode, with the image split into row patches across the devices of "
                   "a Parallel Config (every worker decodes its rows; borders exchanged exactly), so large images "
                   "and long videos decode without one device holding all activations. Same output as VAE Decode.")
    CATEGORY = "latent/hybrid parallel"
    RETURN_TYPES = ("IMAGE",)
    OUTPUT_TOOLTIPS = ("The decoded image.",)
    FUNCTION = "decode"
    runtime = None  # set by the pack's entry point

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "samples": ("LATENT", {"tooltip": "The latent to decode."}),
            "vae": ("VAE", {"tooltip": "An SD3/Flux/PixArt-style KL VAE or the Wan 2.1 video VAE."}),
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
        family = "vae_wan" if type(first).__name__ == "WanVAE" else "vae_kl"
        check_rows(samples["samples"], first, hp.config.world_size)  # before the VAE travels or a world starts
        key = weights_key(first, "vae")
        self.runtime.ensure_resident(hp, key, lambda: to_diffusers(first, family))
        pool = self.runtime.pool(hp)
        latent = samples["samples"].float()
        if latent.is_nested:
            raise ValueError("Patch VAE Decode does not take nested (multi-part) latents")
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
        raise ValueError(f"Patch VAE Decode: a latent {rows} rows tall cannot be split over {ranks} ranks (each needs "
                         f"at least {halo} row(s)); use a Parallel Config with at most {max(1, rows // halo)} ranks "
                         f"for the decode, or ComfyUI's VAE Decode")
