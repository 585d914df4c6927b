"""Tiny random-init checkpoints in ComfyUI's own format, built from ComfyUI's own model classes.

Each builder instantiates the ComfyUI class on the meta device (no memory, no init cost) to get
the exact key set and shapes ComfyUI expects, fills every tensor from a seeded generator, and
saves the state dict with safetensors, with no key prefix — the layout of a file in
models/diffusion_models (or models/vae). `comfy.sd.load_diffusion_model(path)` / `comfy.sd.VAE`
then detect the model type from these shapes, so the configs below are the smallest that
ComfyUI's detection (comfy.model_detection, comfy.sd.VAE) still maps to the intended family:

- Flux.1: detection fixes 24 heads and RoPE axes (16, 56, 56), hence hidden 3072: even one double
  and one single block is 531M parameters. Saved as bf16 (1 GB) by default.
- SD3 (MMDiT): hidden = 64 * depth and heads = depth; depth 2.
- PixArt-Σ: hidden 1152 / 16 heads fixed; caption_channels 4096 is not read by detection, so it
  must stay 4096; depth 1.
- Wan 2.1 T2V: heads = dim / 128, text_dim 4096 is not read by detection; dim 128, 1 layer.
- Qwen-Image: 24 heads x 128 and a 3584-wide text input are fixed: one block is ~0.36B parameters.
- The VAEs: tiny_vaes.py (re-exported here).

The embedded default model of the pack (README main job, the doctor, the tests). Requires ComfyUI
importable (the doctor and tests/comfy_env.setup_comfy() put it on sys.path first).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

# Shared text/pooled widths for the tiny models: small where detection reads them from the weights.
TINY_CONTEXT_DIM = 32
TINY_POOLED_DIM = 24


from .tiny_weights import _random_state_dict, _save  # noqa: E402,F401 (shared with tiny_vaes / tiny_controlnets)


def _ops():
    import comfy.ops

    return comfy.ops.disable_weight_init


def detected(params_cls, **fields) -> dict:
    """The `fields` (values ComfyUI's detection sets for a family) that this ComfyUI's params dataclass declares:
    later ComfyUIs added required fields (FluxParams.txt_ids_dims, ChromaParams.vec_in_dim, ...), earlier ones
    reject them, and a tiny model built from the class must get what a checkpoint's detection would give it."""
    import dataclasses
    names = {f.name for f in dataclasses.fields(params_cls)}
    return {k: v for k, v in fields.items() if k in names}


def write_flux(path: Path, *, guidance: bool = True, depth: int = 1, depth_single: int = 1,
               seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Flux.1 dev (guidance=True) or schnell (guidance=False) with hidden 3072 (forced, see module doc).
    device: where the random values are drawn (the GPU suite's 12B model: "cuda")."""
    from comfy.ldm.flux.model import Flux, FluxParams

    def make():
        return Flux(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=TINY_POOLED_DIM,
                    context_in_dim=TINY_CONTEXT_DIM, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
                    depth=depth, depth_single_blocks=depth_single, axes_dim=[16, 56, 56], theta=10000,
                    patch_size=2, qkv_bias=True, guidance_embed=guidance, operations=_ops(), device="meta",
                    **detected(FluxParams, txt_ids_dims=[]))

    return _save(make, path, seed, dtype, device=device)


def write_flux2(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, torch.Tensor]:
    """Flux.2: detection fixes 48 heads x 128 (hidden 6144), mlp ratio 3, gated SiLU MLPs and global modulation;
    one double and one single block are 2.2B parameters (saved fp8 by default: 2.2 GB)."""
    from comfy.ldm.flux.model import Flux, FluxParams

    def make():
        return Flux(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None,
                    context_in_dim=TINY_CONTEXT_DIM, hidden_size=6144, mlp_ratio=3.0, num_heads=48, depth=1,
                    depth_single_blocks=1, axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1, qkv_bias=False,
                    guidance_embed=True, global_modulation=True, mlp_silu_act=True, ops_bias=False,
                    default_ref_method="index", ref_index_scale=10.0, operations=_ops(), device="meta",
                    **detected(FluxParams, txt_ids_dims=[3]))

    return _save(make, path, seed, dtype)


def write_flux2_klein(path: Path, *, hidden: int = 256, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Flux.2 Klein (4B / 9B): ComfyUI's Flux2 class at Klein's sizes - ComfyUI 0.33 reads the width from the
    weights (heads of 128; Klein 4B is 3072 wide, 9B 4096), the distilled models carry no guidance embedder, and
    the text is Qwen3's (its width read from txt_in). Width 256 (2 heads), one block of each kind, 32-wide text."""
    from comfy.ldm.flux.model import Flux, FluxParams

    def make():
        return Flux(image_model="flux2", in_channels=128, out_channels=128, vec_in_dim=None,
                    context_in_dim=TINY_CONTEXT_DIM, hidden_size=hidden, mlp_ratio=3.0, num_heads=hidden // 128,
                    depth=1, depth_single_blocks=1, axes_dim=[32, 32, 32, 32], theta=2000, patch_size=1,
                    qkv_bias=False, guidance_embed=False, global_modulation=True, mlp_silu_act=True, ops_bias=False,
                    default_ref_method="index", ref_index_scale=10.0, operations=_ops(), device="meta",
                    **detected(FluxParams, txt_ids_dims=[3]))

    return _save(make, path, seed, dtype)


def write_flux_variant(path: Path, *, variant: str, seed: int = 0,
                       dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Models ComfyUI 0.33 runs in its own Flux class with other settings, told apart by detection only: LongCat-Image
    (3584-wide Qwen2.5 text, no pooled vector, no guidance: text ids on two axes, RoPE shifts set per call) and
    Ovis-Image ("yak" gated MLPs and a text RMSNorm: text ids on two axes). Width 256 (2 heads of 128: ComfyUI 0.33
    reads the width), one block of each kind."""
    from comfy.ldm.flux.model import Flux, FluxParams

    if variant not in ("longcat", "ovis"):
        raise ValueError(f"variant must be 'longcat' or 'ovis', got {variant!r}")
    longcat = variant == "longcat"

    def make():
        return Flux(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=None if longcat else TINY_POOLED_DIM,
                    context_in_dim=3584 if longcat else TINY_CONTEXT_DIM, hidden_size=256, mlp_ratio=4.0,
                    num_heads=2, depth=1, depth_single_blocks=1, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
                    qkv_bias=True, guidance_embed=False, operations=_ops(), device="meta",
                    **detected(FluxParams, txt_ids_dims=[1, 2], yak_mlp=not longcat, txt_norm=not longcat))

    return _save(make, path, seed, dtype)


def write_chroma(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float8_e4m3fn) -> dict[str, torch.Tensor]:
    """Chroma: Flux's blocks without per-block modulation plus a distilled guidance network; detection fixes 24
    heads x 128 (hidden 3072) and the 5120-wide, 5-layer approximator: ~0.8B parameters with one block of each
    kind (saved fp8 by default)."""
    from comfy.ldm.chroma.model import Chroma, ChromaParams

    def make():
        return Chroma(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=TINY_CONTEXT_DIM,
                      hidden_size=3072, mlp_ratio=4.0, num_heads=24, depth=1, depth_single_blocks=1,
                      axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, in_dim=64, out_dim=3072,
                      hidden_dim=5120, n_layers=5, operations=_ops(), device="meta",
                      **detected(ChromaParams, txt_ids_dims=[], vec_in_dim=None))

    return _save(make, path, seed, dtype)


def write_sd3(path: Path, *, depth: int = 2, pos_embed_max_size: int = 16, seed: int = 0,
              dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """SD3-medium-style MMDiT (no qk norm, no dual attention): hidden = 64 * depth."""
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    hidden = 64 * depth

    def make():
        return MMDiT(in_channels=16, patch_size=2, out_channels=16, depth=depth, input_size=None,
                     adm_in_channels=TINY_POOLED_DIM,
                     context_embedder_config={"target": "torch.nn.Linear",
                                              "params": {"in_features": TINY_CONTEXT_DIM, "out_features": hidden}},
                     num_patches=pos_embed_max_size ** 2, pos_embed_max_size=pos_embed_max_size,
                     operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_unet(path: Path, *, xl: bool = False, seed: int = 0, dtype: torch.dtype = torch.float16,
               levels: int | None = None) -> dict[str, torch.Tensor]:
    """SD1.5 (xl=False) or SDXL-class (xl=True) UNet, the models without a family adapter (CFG / data parallel only).

    Detection fixes model_channels 320 and the text width (768; SDXL 2048 with its 2816-wide class embedding) but
    reads the number of levels and their widths from the weights: SD1.5 with one level of one ResBlock + one
    transformer is 26M parameters. SDXL's own depth list [0,0,2,2,10,10] is matched exactly; KOALA-700M's
    [0,2,5] (an SDXL model class: same conditioning, size embeddings included) at width 320 on every level is 126M.
    `levels` (SD1.5): 2 gives a second level twice as wide (640, no transformer) - what FreeU's patch acts on."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    wide = not xl and levels == 2
    levels = 3 if xl else (levels or 1)
    depth = [0, 2, 5] if xl else [1] + [0] * (levels - 1)
    mult = [1, 2] if wide else [1] * levels

    def make():
        return UNetModel(image_size=32, in_channels=4, model_channels=320, out_channels=4,
                         num_res_blocks=[1] * levels, channel_mult=mult, use_spatial_transformer=True,
                         transformer_depth=depth, transformer_depth_output=[d for d in depth for _ in range(2)],
                         transformer_depth_middle=depth[-1], context_dim=2048 if xl else 768,
                         num_heads=-1 if xl else 8, num_head_channels=64 if xl else -1, use_linear_in_transformer=xl,
                         adm_in_channels=2816 if xl else None, num_classes="sequential" if xl else None,
                         legacy=False, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_pixart(path: Path, *, depth: int = 1, model_max_length: int = 8, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """PixArt-Σ (no micro-conditioning): hidden 1152 and 16 heads are fixed by detection."""
    from comfy.ldm.pixart.pixartms import PixArtMS

    def make():
        return PixArtMS(input_size=None, patch_size=2, in_channels=4, hidden_size=1152, depth=depth,
                        num_heads=16, caption_channels=4096, model_max_length=model_max_length,
                        pe_interpolation=None, micro_condition=False, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_wan(path: Path, *, dim: int = 128, ffn_dim: int = 256, num_layers: int = 1, seed: int = 0,
              dtype: torch.dtype = torch.float32, in_dim: int = 16, out_dim: int = 16,
              model_type: str = "t2v", device: str = "cpu") -> dict[str, torch.Tensor]:
    """Wan 2.1 T2V: heads = dim / 128 (detection), text_dim 4096 (not read by detection). in_dim 36 is the
    Wan 2.2 14B image-to-video layout (latent + 4 mask channels + the start image's latent, no CLIP vision):
    ComfyUI detects it as a t2v-type model and joins WanImageToVideo's concat latent to x itself.
    in_dim = out_dim = 48 is Wan 2.2 TI2V 5B's layout (48-channel latents; ComfyUI's WAN22 model class, whose
    noise mask becomes per-frame timesteps). model_type "i2v" with in_dim 36 is Wan 2.1 image-to-video: the
    CLIP-vision projection (img_emb) and the image key/value projections of every cross-attention.
    model_type "vace" is Wan 2.1 VACE (ComfyUI's VaceWanModel, detected by its vace_patch_embedding): one VACE
    block beside the first block, taking WanVaceToVideo's 96-channel control latent (inactive + reactive + mask).
    model_type "camera_2.2" is Wan 2.2 Fun Camera (ComfyUI's CameraWanModel, detected by its control adapter): the
    camera embedding (24-channel Plücker maps at pixel resolution) is added to the patch embedding."""
    from comfy.ldm.wan.model import VaceWanModel, WanModel

    if dim % 128:
        raise ValueError(f"Wan dim must be a multiple of 128 (ComfyUI uses heads = dim/128), got {dim}")
    from comfy.ldm.wan.model import CameraWanModel
    cls, extra = {"vace": (VaceWanModel, dict(vace_layers=1, vace_in_dim=96)),
                  "camera_2.2": (CameraWanModel, {})}.get(model_type, (WanModel, {}))

    def make():
        return cls(model_type=model_type, patch_size=(1, 2, 2), text_len=512, in_dim=in_dim, dim=dim,
                   ffn_dim=ffn_dim, freq_dim=256, text_dim=4096, out_dim=out_dim, num_heads=dim // 128,
                   num_layers=num_layers, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True,
                   eps=1e-6, operations=_ops(), device="meta", **extra)

    return _save(make, path, seed, dtype, device=device)


def write_ltxv(path: Path, *, head_dim: int = 8, num_layers: int = 1, seed: int = 0,
               dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """LTX-Video: detection fixes 32 heads (head dim = attn2's width / 32), 128 latent channels and the 4096-wide
    caption projection (not read); the width is 32 x head_dim and the text width equals it. head_dim 8: 1.9M
    parameters for one block."""
    from comfy.ldm.lightricks.model import LTXVModel

    inner = 32 * head_dim

    def make():
        return LTXVModel(in_channels=128, cross_attention_dim=inner, attention_head_dim=head_dim,
                         num_attention_heads=32, caption_channels=4096, num_layers=num_layers,
                         operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_ltxav(path: Path, *, head_dim: int = 8, num_layers: int = 1, v23: bool = False, seed: int = 0,
                dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """LTX-2 (ComfyUI's LTXAVModel: video + audio streams; `v23`: LTX-2.3's layout - text projected before the
    connectors, cross-attention AdaLN, gated attention). Detection reads LTX-Video's keys (32 video heads, head dim
    = attn2's width / 32) plus `audio_adaln_single` for LTXAV; everything else is the class's defaults (an audio
    stream 2048 wide, two 3840-wide text connectors: ~1B parameters) unless the file's metadata carries a
    "config" {"transformer": {...}}, as the real checkpoints do. Here it shrinks the audio stream to 2 heads x 16,
    the caption width to 32 and the connectors to one 2 x 16 layer: 2.4M parameters with one block (head_dim 8).
    The text the model takes is [video, audio] captions side by side: 64 wide (2 x caption width; 288 for v23)."""
    import json

    from comfy.ldm.lightricks.av_model import LTXAVModel

    inner = 32 * head_dim
    config = dict(audio_num_attention_heads=2, audio_attention_head_dim=16, audio_cross_attention_dim=32,
                  caption_channels=32, connector_num_layers=1, connector_num_attention_heads=2,
                  connector_attention_head_dim=16)
    if v23:
        config.update(caption_proj_before_connector=True, cross_attention_adaln=True, apply_gated_attention=True)

    def make():
        return LTXAVModel(in_channels=128, audio_in_channels=128, cross_attention_dim=inner,
                          attention_head_dim=head_dim, num_attention_heads=32, num_layers=num_layers,
                          operations=_ops(), device="meta", **config)

    sd = _save(make, path, seed, dtype)
    save_file(sd, str(path), metadata={"format": "pt", "config": json.dumps({"transformer": config})})
    return sd

def write_auraflow(path: Path, *, max_seq: int = 64, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """AuraFlow: detection reads the position table's length, the text width (2048, matched) and the layer counts;
    the width (3072), 12 heads and the 3072-wide timestep conditioning are fixed, so one double (joint) layer and one
    single layer - the structure of the real model, whose last layer is single - are 0.5B parameters (bf16: 1 GB).
    max_seq 64: an 8 x 8 position grid (larger latents interpolate it, as ComfyUI does)."""
    from comfy.ldm.aura.mmdit import MMDiT

    def make():
        return MMDiT(in_channels=4, out_channels=4, patch_size=2, dim=3072, n_layers=2, n_double_layers=1, n_heads=12,
                     global_conddim=3072, cond_seq_dim=2048, max_seq=max_seq, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_qwen_image(path: Path, *, num_layers: int = 1, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16, ref_method: str | None = None) -> dict[str, torch.Tensor]:
    """Qwen-Image: detection reads only the input channels and the block count; 24 heads x 128, the 3584-wide
    text input and the rest are fixed, so one block is ~0.36B parameters (saved bf16 by default).
    `ref_method="index_timestep_zero"`: Qwen-Image-Edit-2511 (ComfyUI >= 0.33 detects it by the empty
    `__index_timestep_zero__` buffer the model then holds)."""
    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel

    def make():
        return QwenImageTransformer2DModel(patch_size=2, in_channels=64, out_channels=16, num_layers=num_layers,
                                           operations=_ops(), device="meta",
                                           **({"default_ref_method": ref_method} if ref_method else {}))

    return _save(make, path, seed, dtype)


def write_kandinsky5(path: Path, *, image: bool = False, num_visual_blocks: int = 2, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Kandinsky 5: detection reads the width, the time and feed-forward widths, the patch-embedding width and the
    block counts. Video (Lite / Pro layout): width 256, 4 heads of 64 (the class's RoPE axes), 132-wide patch
    embedding (16 latent + 16 image + 1 mask channels, 2 x 2 patches). Image (`image=True`): ComfyUI tells
    Kandinsky 5 Image Lite by its width 2560 and 64-wide patch embedding (16 channels, 2 x 2), 20 heads of 128;
    a narrow feed-forward keeps it ~0.13B parameters. The text (3584) and pooled (768) widths are the class's."""
    from comfy.ldm.kandinsky5.model import Kandinsky5

    def make():
        if image:
            dims = dict(model_dim=2560, visual_embed_dim=64, axes_dims=(32, 48, 48), rope_scale_factor=(1.0, 1.0, 1.0))
        else:
            dims = dict(model_dim=256, visual_embed_dim=132)
        return Kandinsky5(time_dim=64, ff_dim=256, num_text_blocks=1, num_visual_blocks=num_visual_blocks,
                          operations=_ops(), device="meta", **dims)

    return _save(make, path, seed, dtype)


def write_krea2(path: Path, *, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                ref_method: str | None = None) -> dict[str, torch.Tensor]:
    """Krea 2: detection fixes the head width at 128 and reads the width, heads, K/V heads, blocks, text layers and
    text width. Width 256 (2 heads, 1 K/V head: grouped), two blocks, a 2-layer x 320-wide caption (the text
    fusion's 20 heads are the class's): conditioning is 640 wide."""
    from comfy.ldm.krea2.model import SingleStreamDiT

    def make():
        return SingleStreamDiT(features=256, heads=2, kvheads=1, layers=layers, txtdim=320, txtlayers=2,
                               operations=_ops(), device="meta", default_ref_method=ref_method)

    return _save(make, path, seed, dtype)


def write_minimax_h3(path: Path, *, layers: int = 2, seed: int = 0,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """MiniMax H3 (video + audio in one packed stream): detection reads the width, blocks, refiner blocks, head
    width (q_norm), heads (qkv rows), feed-forward, text width, time embedder and RoPE table sizes. Width 256 (4 heads
    of 64), two blocks, one refiner block, 32-wide text, RoPE over 3 x 8 frequencies (48 of each head's 64 rotated)."""
    from comfy.ldm.minimax.model import MiniMaxH3Model

    def make():
        return MiniMaxH3Model(hidden_size=256, num_layers=layers, token_refiner_num_layers=1, num_attention_heads=4,
                              attention_head_dim=64, ffn_hidden_size=256, text_dim=TINY_CONTEXT_DIM,
                              timestep_input_dim=32, time_embed_hidden_size=64, time_embed_dim=64,
                              rope_inv_freq_len=8, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


def write_cogvideox(path: Path, *, v15: bool = False, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """CogVideoX: detection reads the width (heads of 64), the time and text widths, the blocks and the patch embedding
    (a Conv2d: 1.0; a Linear over 2-frame patches: 1.5); no `pos_embedding` means rotary embeddings (the 5B
    models'). Width 128 (2 heads), two blocks, 32-wide text."""
    from comfy.ldm.cogvideo.model import CogVideoXTransformer3DModel

    def make():
        return CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=64, in_channels=16,
                                           time_embed_dim=64, text_embed_dim=32, num_layers=2,
                                           use_rotary_positional_embeddings=True,
                                           **({"patch_size_t": 2} if v15 else {}), operations=_ops(), device="meta")

    return _save(make, path, seed, dtype)


# ERNIE-Image's sizes: ComfyUI 0.33's detection reads none (it returns {"image_model": "ernie"}, so the class's
# defaults - width 4096, 36 layers, ~8B parameters - are built, and the layers a smaller file lacks stay uninitialised);
# the tiny checkpoint carries them in its metadata under this key, which the tests' size shim (tests/hp_tiny_sizes)
# hands to the class
ERNIE_META = "hp_ernie_config"


def write_ernie(path: Path, *, num_layers: int = 2, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """ERNIE-Image: width 256 in 2 heads of 128 (the class's head width: its RoPE axes are 32 + 48 + 48), a 512-wide
    feed-forward, `num_layers` shared-AdaLN layers; the class's 3072-wide text input and 128-channel Flux.2 latents.
    The sizes go in the metadata (ERNIE_META), which detection does not read."""
    import json

    from comfy.ldm.ernie.model import ErnieImageModel
    sizes = dict(hidden_size=256, num_attention_heads=2, num_layers=num_layers, ffn_hidden_size=512)

    def make():
        return ErnieImageModel(**sizes, operations=_ops(), device="meta")

    return _save(make, path, seed, dtype, metadata={ERNIE_META: json.dumps(sizes)})


def write_lumina2(path: Path, *, z_image: bool = False, num_layers: int = 1, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Lumina 2 (NextDiT): detection reads the width and caption width from `cap_embedder.1` and maps only two
    widths to a consistent head layout: 2304 (Lumina 2: 24 heads x 96, 8 KV heads) and 3840 (Z-Image: 30 heads
    x 128, padding tokens to a multiple of 32). Two refiner blocks of each kind are fixed, so one main layer gives
    0.42B (Lumina 2) or 0.90B (Z-Image) parameters. The caption width is ours (TINY_CONTEXT_DIM)."""
    from comfy.ldm.lumina.model import NextDiT

    if z_image:
        kw = dict(dim=3840, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512],
                  rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True, time_scale=1000.0,
                  pad_tokens_multiple=32)
    else:
        kw = dict(dim=2304, n_heads=24, n_kv_heads=8, axes_dims=[32, 32, 32], axes_lens=[300, 512, 512],
                  rope_theta=10000.0, ffn_dim_multiplier=4.0)

    def make():
        return NextDiT(patch_size=2, in_channels=16, n_layers=num_layers, qk_norm=True,
                       cap_feat_dim=TINY_CONTEXT_DIM, operations=_ops(), device="meta", **kw)

    return _save(make, path, seed, dtype)


def write_hunyuan_video(path: Path, *, version: str = "1.5", hidden: int = 256, depth: int = 1,
                        depth_single: int = 1, seed: int = 0,
                        dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """HunyuanVideo: detection reads heads = hidden / 128 and the text width from the weights, so the model can be
    small. "1.5": 65 input channels (32 latent + 32 start-image latent + 1 mask, ComfyUI's HunyuanVideo15 concat),
    32 out, 1x1x1 patches, the 1152-wide CLIP-vision input that selects the 1.5 class, the ByT5 glyph mapper and
    the condition-type embedding. "1.0": 16 channels, 1x2x2 patches, the 768-wide pooled CLIP input, guidance.
    "image2.1": HunyuanImage 2.1 on the same class - 64-channel image latents, 2-D 1x1 patches (2-D RoPE ids),
    the ByT5 glyph mapper, no pooled or vision input (ComfyUI's HunyuanImage21 model class)."""
    from comfy.ldm.hunyuan_video.model import HunyuanVideo, HunyuanVideoParams

    if version not in ("1.0", "1.5", "image2.1"):
        raise ValueError(f"HunyuanVideo version must be '1.0', '1.5' or 'image2.1', got {version!r}")
    v15, image = version == "1.5", version == "image2.1"
    channels = (65, 32) if v15 else (64, 64) if image else (16, 16)
    patch = [1, 1, 1] if v15 else [1, 1] if image else [1, 2, 2]

    def make():
        return HunyuanVideo(image_model="hunyuan_video", in_channels=channels[0], out_channels=channels[1],
                            vec_in_dim=768 if version == "1.0" else None, context_in_dim=TINY_CONTEXT_DIM,
                            hidden_size=hidden, mlp_ratio=4.0, num_heads=hidden // 128, depth=depth,
                            depth_single_blocks=depth_single, axes_dim=[64, 64] if image else [16, 56, 56], theta=256,
                            patch_size=patch, qkv_bias=True, guidance_embed=version == "1.0", byt5=not version == "1.0",
                            meanflow=False, use_cond_type_embedding=v15, vision_in_dim=1152 if v15 else None,
                            operations=_ops(), device="meta",
                            **detected(HunyuanVideoParams, meanflow_sum=v15))  # detection: True with 1.5's vision input

    return _save(make, path, seed, dtype)


# HiDream-O1's sizes: ComfyUI 0.33's detection reads none (it returns {"image_model": "hidream_o1"}, so the class's
# defaults - the Qwen3-VL-8B decoder and its vision tower, ~8.7B parameters - are built); the tiny checkpoint carries
# the overrides in its metadata under this key, which the tests' size shim (tests/hp_tiny_sizes) hands
# to the class as `text_config_overrides` / `vision_config_overrides`
HIDREAM_O1_META = "hp_hidream_o1_config"


def write_hidream_o1(path: Path, *, layers: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
                     prefix: str = "model.diffusion_model.") -> dict[str, torch.Tensor]:
    """HiDream-O1 (Qwen3-VL decoder over [text, tms, image patches]): width 32, 4 heads of 16 over 2 K/V heads
    (grouped, as the real 32 / 8), interleaved MRoPE over 4 + 2 + 2 frequencies, `layers` decoder layers, the real
    vocabulary (the tokenizer's ids reach 151673: 4.9M of the ~5M parameters), a one-block 16-wide vision tower.
    Written as a checkpoint (`prefix`) so CheckpointLoaderSimple also gives the tokenizer-only text encoder and the
    pixel-space VAE; the sizes go in the metadata (HIDREAM_O1_META), which detection does not read."""
    import json

    from comfy.ldm.hidream_o1.model import HiDreamO1Transformer
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_dims=[4, 2, 2])
    vision = dict(hidden_size=16, num_heads=2, intermediate_size=32, depth=1, num_position_embeddings=16)

    def make():
        return HiDreamO1Transformer(text_config_overrides=text, vision_config_overrides=vision,
                                    operations=_ops(), device="meta")

    return _save(make, path, seed, dtype, metadata={HIDREAM_O1_META: json.dumps({"text": text, "vision": vision})},
                 file_key=lambda k: prefix + k)


# Cosmos Predict2 and Anima share one DiT builder: tiny_cosmos.py (re-exported here, like the VAE writers)
from .tiny_cosmos import write_anima, write_cosmos_predict2  # noqa: E402,F401

# the VAE writers live in tiny_vaes.py; imported here so `tiny_checkpoints.write_*_vae` stays one namespace
from .tiny_vaes import (HUNYUAN_VIDEO_VAE_DDCONFIG, WAN22_VAE_DEC_DIM, WAN22_VAE_DIM, wan22_vae,  # noqa: E402,F401
                        write_hunyuan_video_vae, write_kl_vae, write_wan22_vae, write_wan_vae)
