"""Tiny random-init ControlNet checkpoints that ComfyUI 0.3.75's `comfy.controlnet.load_controlnet` detects.

Why: the pack carries ControlNet residuals to the workers (ComfyUI computes them in the driver), and the only
honest end-to-end check is a ControlNet file loaded by ComfyUI's own ControlNetLoader. Real ControlNets are
gigabytes; these are the smallest files ComfyUI's detection still maps to the intended loader, sized to pair
with the tiny diffusion models of doctor/tiny_checkpoints.py. Built like those: ComfyUI's own control-model
class on the meta device gives the exact key set and shapes, every tensor comes from a seeded generator
(`_random_state_dict`, nothing left at zero, so an ignored or misplaced residual shows), no ComfyUI module is
ever randomly initialised.

- SD3 (`write_sd3_controlnet`): the diffusers SD3ControlNetModel layout that `load_controlnet_mmdit` reads
  (detected by `controlnet_blocks.0.weight` + `pos_embed_input.proj.weight`, without SD3.5's
  `transformer_blocks.0.adaLN_modulation.1.bias`). ComfyUI converts its transformer keys back with
  `comfy.utils.mmdit_to_diffusers`; we write the file through the inverse of that very map (fused qkv rows cut
  into to_q/to_k/to_v), so what ComfyUI loads is bit for bit the state dict we drew. Its width is the main
  model's (64 * depth); it may have fewer joint blocks than the main model (ComfyUI repeats their outputs).
  The hint is VAE-encoded by ComfyUI (latent format SD3): apply it with a VAE.
- Flux (`write_flux_controlnet`): the XLabs format, the one ComfyUI reads with no VAE (detected by
  `controlnet_blocks.0.weight` + `double_blocks.0.img_attn.norm.key_norm.scale`): ComfyUI's ControlNetFlux state
  dict with the q / k norms under the file's `scale` (ComfyUI 0.33's module calls them `weight`, and renames them
  back as it loads). Flux detection forces hidden 3072 (24 heads, RoPE axes 16/56/56), so even
  one double block is ~0.37B parameters (bf16 by default). Its pixel-space hint goes through three stride-2
  convs and the 2x2 patchify, so it needs an even latent (the InstantX format pads, but needs VAE encoding).

Requires ComfyUI importable (tests/comfy_env.setup_comfy() or the doctor put it on sys.path first).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from .tiny_checkpoints import TINY_CONTEXT_DIM, TINY_POOLED_DIM, _ops, detected
from .tiny_weights import _random_state_dict, _save


def _comfy_to_diffusers_mmdit(sd: dict, depth: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """ComfyUI MMDiT keys -> the diffusers keys `comfy.model_detection.convert_diffusers_mmdit` maps back: the
    inverse of `comfy.utils.mmdit_to_diffusers` (a slice of a fused tensor for offset entries; the map's
    conversion functions, swap_scale_shift, are their own inverse). Keys the map does not name (the
    ControlNet's own controlnet_blocks / pos_embed_input, same name in both layouts) are kept."""
    import comfy.utils

    out, used = {}, set()
    for diffusers_key, target in comfy.utils.mmdit_to_diffusers({"depth": depth, "num_blocks": num_blocks}).items():
        if isinstance(target, str):
            comfy_key, offset, fun = target, None, None
        else:
            comfy_key, offset = target[0], target[1]
            fun = target[2] if len(target) > 2 else None
        if comfy_key not in sd:
            continue
        t = sd[comfy_key]
        if offset is not None:
            t = t.narrow(offset[0], offset[1], offset[2])
        if fun is not None:
            t = fun(t)
        out[diffusers_key] = t.contiguous()
        used.add(comfy_key)
    for k, v in sd.items():
        if k not in used:
            if k.startswith("joint_blocks.") or k in ("pos_embed", "x_embedder.proj.weight"):
                raise RuntimeError(f"ComfyUI's mmdit_to_diffusers map does not cover {k}: the SD3 ControlNet file "
                                   f"would not load as written")
            out[k] = v
    return out


def write_sd3_controlnet(path: Path, *, depth: int = 4, num_blocks: int = 2, pos_embed_max_size: int = 48,
                         seed: int = 0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """An SD3 (MMDiT) ControlNet in diffusers' layout for a tiny SD3 of this `depth` (hidden 64 * depth,
    heads = depth) and `pos_embed_max_size` (tests use depth 4 / 48: tests/comfy_server.write_checkpoints).
    Returns the state dict in ComfyUI's own key layout, which is what `load_controlnet` rebuilds."""
    from comfy.cldm.mmdit import ControlNet

    hidden = 64 * depth
    module = ControlNet(num_blocks=num_blocks, control_latent_channels=16, in_channels=16, patch_size=2,
                        depth=depth, input_size=None, adm_in_channels=TINY_POOLED_DIM,
                        context_embedder_config={"target": "torch.nn.Linear",
                                                 "params": {"in_features": TINY_CONTEXT_DIM, "out_features": hidden}},
                        num_patches=pos_embed_max_size ** 2, pos_embed_max_size=pos_embed_max_size,
                        operations=_ops(), device="meta")
    sd = _random_state_dict(module, seed, dtype)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(_comfy_to_diffusers_mmdit(sd, depth, num_blocks), str(path), metadata={"format": "pt"})
    return sd


def write_flux_controlnet(path: Path, *, guidance: bool = True, depth: int = 1, depth_single: int = 0,
                          seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """An XLabs-format Flux.1 ControlNet (ComfyUI's ControlNetFlux keys) for the tiny Flux of
    tiny_checkpoints.write_flux (same text / pooled widths; `guidance` as the main model's dev/schnell).
    At least one double block: ComfyUI repeats the double-block outputs over Flux's 19 and divides by their
    count. The q / k norms are written as XLabs' files hold them (`*_norm.scale`): ComfyUI detects the format by
    that key and renames it to the module's `weight` as it loads (its Flux config's process_unet_state_dict);
    returns the state dict as the module holds it."""
    from comfy.ldm.flux.controlnet import ControlNetFlux
    from comfy.ldm.flux.model import FluxParams

    if depth < 1:
        raise ValueError("a Flux ControlNet needs at least one double block (ComfyUI divides by their count)")

    def make():
        return ControlNetFlux(mistoline=False, image_model="flux", in_channels=16, out_channels=16,
                              vec_in_dim=TINY_POOLED_DIM, context_in_dim=TINY_CONTEXT_DIM, hidden_size=3072,
                              mlp_ratio=4.0, num_heads=24, depth=depth, depth_single_blocks=depth_single,
                              axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
                              guidance_embed=guidance, operations=_ops(), device="meta",
                              **detected(FluxParams, txt_ids_dims=[]))

    return _save(make, path, seed, dtype,
                 file_key=lambda k: k[:-len(".weight")] + ".scale" if k.endswith("_norm.weight") else k)


def write_sd15_controlnet(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """An SD1.5 ControlNet (ComfyUI's cldm layout, no key prefix: `zero_convs.0.0.weight` marks it) for the tiny
    SD1.5 UNet of tiny_checkpoints.write_unet: ComfyUI reads its UNet config from the same weights' shapes.
    Returns the state dict written."""
    from comfy.cldm.cldm import ControlNet

    def make():
        return ControlNet(image_size=32, in_channels=4, model_channels=320, hint_channels=3, num_res_blocks=[1],
                          channel_mult=[1], use_spatial_transformer=True, transformer_depth=[1],
                          transformer_depth_middle=1, context_dim=768, num_heads=8, num_head_channels=-1,
                          use_linear_in_transformer=False, legacy=False, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)
