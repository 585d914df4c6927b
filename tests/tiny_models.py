"""Tiny models of ComfyUI's own diffusion-model classes (the ones the workers run), and fresh random inputs for them.

Why these and not checkpoints: the engine tests need many small worlds and a free number of heads (3 heads over
4 Ulysses ranks, 6 over tp 4), which detection of a saved checkpoint does not allow (it fixes SD3's heads to its
depth, PixArt's to 16, Flux's to 24). Each model is built on "meta" from the class itself and given the tiny
checkpoints' seeded values (doctor/tiny_weights.py: nothing left at zero), so every rank of a test world builds
the same weights, and the inputs come from a generator seeded by the test: fresh, and the same on every rank.

SD3's MMDiT ties its width to its heads (64 per head, `depth` in ComfyUI's terms; its block count is apart). The
others keep 16 per head.
"""
from __future__ import annotations

import torch

HEADS = 4
CONTEXT = 24  # the text width of every tiny model
POOLED = 12
FAMILIES = ("flux", "sd3", "pixart", "wan")


def _classes():
    from comfy_env import setup_comfy
    setup_comfy()  # ComfyUI on sys.path (a test world's rank imports it as a worker does)
    import comfy.ops
    return comfy.ops.disable_weight_init


def _make(family: str, heads: int, ops, dtype, blocks: int):
    if family == "flux":
        from comfy.ldm.flux.model import Flux, FluxParams
        from comfyui_hybrid_parallel.doctor.tiny_checkpoints import detected
        return Flux(image_model="flux", in_channels=4, out_channels=4, vec_in_dim=POOLED, context_in_dim=CONTEXT,
                    hidden_size=16 * heads, mlp_ratio=2.0, num_heads=heads, depth=blocks // 2,
                    depth_single_blocks=blocks - blocks // 2,
                    axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True,
                    operations=ops, device="meta", dtype=dtype, **detected(FluxParams, txt_ids_dims=[]))
    if family == "sd3":  # SD3.5-style: qk norm and the image-only attn2 of every other block
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
        return OpenAISignatureMMDITWrapper(  # `depth` sets its heads and width (64 a head), num_blocks its blocks
            in_channels=4, patch_size=2, out_channels=4, depth=heads, num_blocks=blocks, input_size=None,
            adm_in_channels=POOLED,
            context_embedder_config={"target": "torch.nn.Linear",
                                     "params": {"in_features": CONTEXT, "out_features": 64 * heads}},
            num_patches=24 ** 2, pos_embed_max_size=24, qk_norm="rms",
            x_block_self_attn_layers=list(range(0, blocks, 2)), operations=ops, device="meta", dtype=dtype)
    if family == "pixart":
        from comfy.ldm.pixart.pixartms import PixArtMS
        return PixArtMS(input_size=None, patch_size=2, in_channels=4, hidden_size=16 * heads, depth=blocks,
                        num_heads=heads, caption_channels=CONTEXT, model_max_length=8, pe_interpolation=None,
                        micro_condition=False, operations=ops, device="meta", dtype=dtype)
    if family == "wan":
        from comfy.ldm.wan.model import WanModel
        return WanModel(model_type="t2v", patch_size=(1, 2, 2), text_len=32, in_dim=4, dim=16 * heads,
                        ffn_dim=32, freq_dim=32, text_dim=CONTEXT, out_dim=4, num_heads=heads, num_layers=blocks,
                        window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, operations=ops,
                        device="meta", dtype=dtype)
    raise ValueError(family)


def seeded(make, seed: int = 0):
    """`make(ops)` - ComfyUI's class built on "meta" with ComfyUI's ops - given the tiny checkpoints' seeded values,
    each entry in the dtype the class gives it (Wan keeps its patch embedding fp32); in eval mode. The benches build
    their bigger models through it too (bench/_worlds.py)."""
    from comfyui_hybrid_parallel.doctor.tiny_weights import _random_state_dict
    model = make(_classes())
    kept = model.state_dict()
    values = _random_state_dict(model, seed, torch.float32)
    model.load_state_dict({k: v.to(kept[k].dtype) for k, v in values.items()}, assign=True)
    return model.eval()


def build(family: str, heads: int = HEADS, seed: int = 0, dtype=torch.float32, blocks: int | None = None):
    """blocks: transformer blocks (Flux: half double, half single stream), 2 by default."""
    return seeded(lambda ops: _make(family, heads, ops, dtype, blocks or 2), seed)


def inputs(family: str, seed: int, batch: int = 1, h: int = 6, w: int = 5, text: int = 7, frames: int = 3,
           dtype=torch.float32) -> dict:
    """The inputs of one forward of ComfyUI's class (x, timestep, the rest by its keyword). h, w: the latent's size
    (Flux: its token grid, the latent being twice as tall and wide - Flux patches 2 x 2 inside the model; PixArt: even sides, their mean at
    least 33); frames: Wan's latent frames."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    t = torch.rand(batch, generator=g)
    context = r(batch, text, CONTEXT)
    if family == "flux":
        return dict(x=r(batch, 4, 2 * h, 2 * w), timestep=t.to(dtype), context=context, y=r(batch, POOLED),
                    guidance=(1 + 3 * t).to(dtype))
    if family == "sd3":
        return dict(x=r(batch, 4, h, w), timestep=(t * 1000).to(dtype), context=context, y=r(batch, POOLED))
    if family == "pixart":
        if h % 2 or w % 2 or (h + w) // 2 < 33:  # ComfyUI's PixArt sizes its position table by (H + W) // 64
            raise ValueError(f"PixArt takes even latent sides with (h + w) // 2 >= 33, got {h} x {w}")
        return dict(x=r(batch, 4, h, w), timestep=(t * 1000).to(dtype), context=context)
    if family == "wan":
        return dict(x=r(batch, 4, frames, h, w), timestep=(t * 1000).to(dtype), context=context)
    raise ValueError(family)


def call(model, kw: dict) -> torch.Tensor:
    """The model called as the workers call it (workers/bridge/build.call_native: the latent and the timestep by
    position, the rest by name), with ComfyUI's empty transformer_options. The loops' `native_call`."""
    from comfyui_hybrid_parallel.workers.bridge.build import call_native
    return call_native(model, {"transformer_options": {}, **kw})


def forward(model, kw: dict) -> torch.Tensor:
    with torch.no_grad():
        return call(model, kw)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
