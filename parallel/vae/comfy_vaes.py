"""The ComfyUI VAEs Patch VAE Decode splits, each declared after reading its decode path (ComfyUI 0.3.75 and 0.33),
and the ones it refuses with the reason. The mechanism is native.py; a new VAE is an entry here plus a test against
ComfyUI's VAE Decode.

Row-local, read: a module listed under `row_local` does nothing across rows itself (its children are walked and
checked on their own): residual sums, per-pixel activations and norms over channels (Wan's RMS_norm), nearest
upsampling by integer factors, rearranges that move channels into blocks of rows in order (Wan 2.2's DupUp3D and
unpatchify, Flux.2's latent un-shuffle), the frame caches of causal decoders (they hold this rank's rows).

Where ComfyUI releases differ, an entry names the classes of each (a name a release lacks never matches; the
renames are listed in RENAMED, so the tests can tell them from typos) and `native.py` / `patch_ops.py`
read the layout from the modules themselves (attributes and signatures, never a version number).
"""
from __future__ import annotations

import json

from .native import ComfyVae, qualname

_MODEL = "comfy.ldm.modules.diffusionmodules.model"
_WAN = "comfy.ldm.wan.vae"
_WAN22 = "comfy.ldm.wan.vae2_2"


# The 3-D KL decoder's convs: VideoConv3d pads its own input (ComfyUI 0.3.75, and later where the decoder has
# attention levels); CarriedConv3d is padded by its caller, conv_carry_causal_3d (later ComfyUIs, no attention levels:
# HunyuanVideo 1.0), which carries each conv's last 2 input frames into the next 2-frame chunk
_KL3D_CONVS = (f"{_MODEL}.VideoConv3d", f"{_MODEL}.CarriedConv3d")


def _is_3d(decoder) -> bool:
    return qualname(getattr(decoder, "conv_in", None)) in _KL3D_CONVS


def _kl_problems(model) -> list:
    """The KL decoder's 3-D variant (conv3d=True: VideoConv3d, replicate padding before each conv) is KL3D's; a
    decoder returning its pre-output features or batching inside decode is not ComfyUI's VAE Decode."""
    decoder = getattr(model, "decoder", None)
    out = []
    if qualname(decoder) != f"{_MODEL}.Decoder":
        out.append(f"its decoder is {qualname(decoder)}, not the KL Decoder")
    elif _is_3d(decoder):
        out.append("its decoder is the 3-D KL decoder (VideoConv3d / CarriedConv3d)")
    if getattr(model, "max_batch_size", None) is not None:
        out.append("it decodes in sub-batches (max_batch_size)")
    return out


KL = ComfyVae(
    title="the KL image VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL", "comfy.ldm.models.autoencoder.AutoencodingEngineLegacy",
             "comfy.ldm.models.autoencoder.AutoencodingEngine"),  # SD / SDXL / SD3 / Flux.2 (batch-norm latent:
    # decode un-shuffles channels into 2x2 pixel blocks first, rows in order), Flux.1 / Lumina 2 (no quant convs)
    parts=("post_quant_conv", "decoder"),
    # Decoder: conv_in, mid (ResnetBlock, AttnBlock, ResnetBlock), up levels (ResnetBlocks, AttnBlocks, Upsample:
    # nearest x2 then a 3x3 conv), GroupNorm, SiLU, conv_out (tanh_out per pixel). ResnetBlock: GroupNorm, SiLU,
    # 3x3 convs, 1x1 shortcut, sum.
    row_local=(f"{_MODEL}.Decoder", f"{_MODEL}.ResnetBlock", f"{_MODEL}.Upsample"),
    attention=(f"{_MODEL}.AttnBlock",),  # GroupNorm, 1x1 q/k/v, optimized_attention over the frame's h*w tokens
    check=_kl_problems,
    decoder=f"{_MODEL}.Decoder",
)

def _kl3d_problems(model) -> list:
    decoder = getattr(model, "decoder", None)
    if qualname(decoder) != f"{_MODEL}.Decoder" or not _is_3d(decoder):
        return ["its decoder is not the 3-D KL decoder"]
    return [] if getattr(model, "max_batch_size", None) is None else ["it decodes in sub-batches (max_batch_size)"]


KL3D = ComfyVae(
    title="HunyuanVideo 1.0's 3-D KL video VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencoderKL",),
    parts=("post_quant_conv", "decoder"),
    # the KL Decoder with conv3d=True: every 3x3x3 conv is a VideoConv3d (replicate F.pad in space, replicate in
    # front in time, then a Conv3d without padding); 1x1x1 convs (shortcuts, the mid attention's q/k/v) pad nothing;
    # Upsample: nearest x2 in space (and in time after the first frame on the time-compressed levels) then a
    # VideoConv3d; the mid AttnBlock attends over every frame's pixels at once (gathered K/V over all rows).
    # Later ComfyUIs build it (no attention levels) with CarriedConv3d: the same pads, made by conv_carry_causal_3d
    # on the band it is given (replicated rows; in front the previous 2-frame chunk's last 2 padded input frames of
    # this rank's band, or replicated frames), the up levels run 2-frame chunks: PrepaddedConv swaps the padded rows
    # at inner borders, as for HunyuanVideo 1.5
    row_local=(f"{_MODEL}.Decoder", f"{_MODEL}.ResnetBlock", f"{_MODEL}.Upsample"),
    attention=(f"{_MODEL}.AttnBlock",),
    padded=(f"{_MODEL}.VideoConv3d",),
    prepadded=(f"{_MODEL}.CarriedConv3d",),
    dims=5,
    check=_kl3d_problems,
    decoder=f"{_MODEL}.Decoder",
)

_HV15 = "comfy.ldm.hunyuan_video.vae_refiner"


def _hv15_problems(model) -> list:
    decoder = getattr(model, "decoder", None)
    if qualname(decoder) != f"{_HV15}.Decoder":
        return ["its decoder is not HunyuanVideo 1.5's"]
    return [] if getattr(decoder, "refiner_vae", False) else ["its non-refiner variant (GroupNorm, zero-padded Conv3d: "
                                                              "HunyuanImage 2.1's refiner) was not checked against VAE "
                                                              "Decode yet"]


HV15 = ComfyVae(
    title="HunyuanVideo 1.5's video VAE",
    classes=("comfy.ldm.models.autoencoder.AutoencodingEngine",),
    parts=("decoder",),
    # Decoder (refiner_vae): conv_in + channel-repeated z, mid (resnet, AttnBlock over every frame's pixels with
    # RMS_norm and 1x1 Conv3d q/k/v, resnet), then 2-frame chunks through the up stages: HunyuanRefinerResnetBlocks
    # (RMS_norm over channels, SiLU, NoPadConv3d), UpSmpl (NoPadConv3d, channels into 2x2 pixel blocks - rows in
    # order - and frames, the first frame apart), RMS_norm, SiLU, conv_out. Every 3x3x3 NoPadConv3d is called through
    # conv_carry_causal_3d, which pads the band it is given by replicating rows (and prepends the previous chunk's
    # last 2 frames of this rank's rows, or replicated frames): PrepaddedConv swaps the padded rows at inner borders.
    # Later ComfyUIs: the same with model.py's ResnetBlock (its temb_proj, in the mid blocks, never runs: no
    # timestep) and CarriedConv3d, conv_carry_causal_3d moved to model.py (it now carries the padded frames)
    row_local=(f"{_HV15}.Decoder", f"{_HV15}.HunyuanRefinerResnetBlock", f"{_MODEL}.ResnetBlock", f"{_HV15}.UpSmpl",
               f"{_HV15}.RMS_norm"),
    attention=(f"{_MODEL}.AttnBlock",),
    prepadded=(f"{_HV15}.NoPadConv3d", f"{_MODEL}.CarriedConv3d"),
    dims=5,
    check=_hv15_problems,
    decoder=f"{_HV15}.Decoder",
)

_TAESD = "comfy.taesd.taesd"


def _taesd_problems(model) -> list:
    decoder = getattr(model, "taesd_decoder", None)
    if qualname(decoder) == f"{_TAESD}.DecoderFlux2":
        return ["Flux.2's TAE (taef2) is built by ComfyUI only with VAELoader's metadata (tae_latent_channels), which "
                "the workers, rebuilding the VAE from its weights alone, do not get"]
    return []


TAESD = ComfyVae(
    title="TAESD",
    classes=(f"{_TAESD}.TAESD",),
    parts=("taesd_decoder",),  # decode: (x - shift) * scale, the decoder, *2-1: per element
    # Decoder (an nn.Sequential; its own subclass without a forward in later ComfyUIs): Clamp (tanh(x/3)*3), 3x3
    # convs, ReLU, Block (conv stack + 1x1 skip, ReLU; later ComfyUIs: with use_midblock_gn first x + pool(x), 1x1
    # convs around a GroupNorm - the GroupNorm split like any other), nearest x2 Upsample
    row_local=(f"{_TAESD}.Clamp", f"{_TAESD}.Block", f"{_TAESD}.Decoder"),
    check=_taesd_problems,
)


def _wan_problems(model) -> list:
    return [] if qualname(getattr(model, "decoder", None)).endswith(".Decoder3d") else ["an unknown decoder"]


WAN21 = ComfyVae(
    title="the Wan 2.1 video VAE",
    classes=(f"{_WAN}.WanVAE",),
    # decode: conv2 (1x1x1), then the decoder frame by frame with its causal caches (cached frames: this rank's rows)
    parts=("conv2", "decoder"),
    # Decoder3d: CausalConv3d (3x3x3, causal in time, zero padding in space), middle ResidualBlock / AttentionBlock,
    # upsample ResidualBlocks and Resample (nearest-exact x2 in space then a 3x3 Conv2d; time_conv 3x1x1 in time),
    # head RMS_norm (over channels), SiLU, CausalConv3d. Later ComfyUIs: decode runs the first frame then 2-frame
    # chunks, run_up splits a chunk into frame pairs after a time upsample (frames only), the caches are views of
    # this rank's rows, CausalConv3d pads space in its conv and a lone uncached frame takes its last temporal tap
    row_local=(f"{_WAN}.Decoder3d", f"{_WAN}.ResidualBlock", f"{_WAN}.Resample", f"{_WAN}.RMS_norm"),
    attention=(f"{_WAN}.AttentionBlock",),  # per frame: RMS_norm, fused 1x1 qkv, optimized_attention, 1x1 proj
    convs=(f"{_WAN}.CausalConv3d",),  # zero pad in space, cached frames or zeros in front in time: PatchConv's causal
    dims=5,
    check=_wan_problems,
)

WAN22 = ComfyVae(
    title="the Wan 2.2 video VAE",
    classes=(f"{_WAN22}.WanVAE",),
    parts=("conv2", "decoder"),  # then unpatchify (patch 2: channels into 2x2 pixel blocks, rows in order)
    # Decoder3d as Wan 2.1's, with Up_ResidualBlock (ResidualBlocks + Resample, DupUp3D shortcut: channels repeated
    # into 2x time/space blocks, rows in order)
    row_local=(f"{_WAN22}.Decoder3d", f"{_WAN22}.Up_ResidualBlock", f"{_WAN22}.ResidualBlock",
               f"{_WAN22}.Resample", f"{_WAN22}.DupUp3D", f"{_WAN}.RMS_norm"),
    attention=(f"{_WAN}.AttentionBlock",),
    convs=(f"{_WAN}.CausalConv3d",),
    dims=5,
    check=_wan_problems,
)

_TAEHV = "comfy.taesd.taehv"
TAEHV = ComfyVae(
    title="TAEHV (the tiny video VAEs: taehv, lighttaew2_1 / 2_2, lighttae_hv15)",
    classes=(f"{_TAEHV}.TAEHV",),
    # decode: the latent format's process_in (per element), the decoder frame by frame (apply_model_with_memblocks:
    # a MemBlock sees its frame and the previous one - this rank's rows of both), pixel_shuffle for the 32 / 48-channel
    # latents (channels into 2x2 pixel blocks; later ComfyUIs: per frame inside apply_model_with_memblocks, 4x4 for
    # LTX-2's 128 channels, the output moved to ComfyUI's intermediate device), leading frames trimmed (MiniMax H3's
    # 24 channels: clamped, frames trimmed per 17-frame chunk)
    parts=("decoder",),
    # Clamp (tanh), 3x3 convs, ReLU / LeakyReLU, MemBlock (conv stack over [frame, previous frame] + 1x1 skip), TGrow
    # (1x1 conv, channels into frames), nearest Upsample
    row_local=(f"{_TAEHV}.Clamp", f"{_TAEHV}.MemBlock", f"{_TAEHV}.TGrow"),
    dims=5,
)

_LTX = "comfy.ldm.lightricks.vae"
_LTXV = f"{_LTX}.causal_video_autoencoder"


def _ltxv_problems(model) -> list:
    """LTX's VideoVAE as its configuration builds it: LTX-2's (and LTX-2.3's) is neither timestep conditioned nor
    noise injecting; LTX-Video 0.9.1 and later (ComfyUI's version 1 / 2 defaults) are both."""
    out = []
    if not isinstance(getattr(model, "config", None), dict):
        out.append("this ComfyUI's VideoVAE keeps no copy of the configuration it was built from (the file's header), "
                   "which the workers need to build it again (ComfyUI 0.3.75; later ones keep it)")
    if getattr(model, "timestep_conditioning", False):
        out.append("its decode is timestep conditioned: VideoVAE.decode first mixes unseeded torch.randn noise into "
                   "the whole latent (decode_noise_scale), so no two VAE Decodes agree and a split has nothing exact "
                   "to equal (LTX-Video 0.9.1+; LTX-2's VAE is not conditioned)")
    decoder = getattr(model, "decoder", None)
    if qualname(decoder) != f"{_LTXV}.Decoder":
        out.append(f"its decoder is {qualname(decoder)}")
    elif any(getattr(m, "inject_noise", False) for m in decoder.modules()):
        out.append("its resnet blocks inject unseeded noise drawn over each band's own height (inject_noise)")
    elif any(qualname(m) == f"{_LTX}.pixel_norm.PixelNorm" and m.dim != 1 for m in decoder.modules()):
        out.append("a PixelNorm normalizes over another dimension than the channels")
    return out


def _ltxv_metadata(model) -> dict:
    """The header comfy.sd.VAE reads LTX's VAE configuration from (a checkpoint's or VAE file's "config")."""
    return {"config": json.dumps({"vae": model.config})}


LTXV = ComfyVae(
    title="LTX-2's video VAE (LTX's VideoVAE without timestep conditioning)",
    classes=(f"{_LTXV}.VideoVAE",),
    # decode: per_channel_statistics.un_normalize (per channel), then the decoder. Later ComfyUIs: Decoder.run_up
    # runs each up block on the output of the last, in frame chunks by bytes (byte_chunked: the serial decode's
    # chunks on every rank), into an output buffer sized from the band
    parts=("per_channel_statistics", "decoder"),
    # Decoder: conv_in, up blocks - UNetMidBlock3D (ResnetBlock3D: PixelNorm over channels, SiLU, CausalConv3d, 1x1x1
    # shortcut; the residual sum carried across frame chunks), DepthToSpaceUpsample (a CausalConv3d, then channels
    # into (frame, 2x2 pixel) blocks - rows in order -, the first frame dropped; residual: the input rearranged the
    # same way and repeated over channels) -, PixelNorm, SiLU, conv_out, unpatchify (channels into 4x4 pixel blocks).
    # CausalConv3d pads time itself (copies of the first / last frame, or the previous chunk's frames of this band)
    # and runs its child Conv3d, which pads space with its padding_mode: zeros (LTX-2) split by PatchConv; reflect
    # (the configurations without spatial_padding_mode: LTX-Video 0.9.0) is refused by PatchConv
    row_local=(f"{_LTXV}.Decoder", f"{_LTXV}.UNetMidBlock3D", f"{_LTXV}.ResnetBlock3D",
               f"{_LTXV}.DepthToSpaceUpsample", f"{_LTXV}.processor", f"{_LTX}.causal_conv3d.CausalConv3d",
               f"{_LTX}.pixel_norm.PixelNorm"),
    byte_chunked=(f"{_LTXV}.Decoder",),
    dims=5,
    check=_ltxv_problems,
    metadata=_ltxv_metadata,
)

DECLARED = (KL, KL3D, HV15, TAESD, WAN21, WAN22, TAEHV, LTXV)

# Declared names that only some ComfyUI releases define: (the earlier releases' name, the later ones'). Every other
# name in DECLARED and REFUSED must be a class of the ComfyUI in use, and of each pair one side
# (tests/families/test_patch_vae_native.py).
RENAMED = (
    (f"{_HV15}.NoPadConv3d", f"{_MODEL}.CarriedConv3d"),
    (f"{_HV15}.HunyuanRefinerResnetBlock", f"{_MODEL}.ResnetBlock"),
    ("torch.nn.Sequential", f"{_TAESD}.Decoder"),  # earlier: a function returning an nn.Sequential
)

# Classes only later ComfyUIs define (not a rename): the tests check them where their module imports.
ADDED_LATER = ("comfy.ldm.minimax.vae.MiniMaxH3VideoVAE", "comfy.ldm.cogvideo.vae.AutoencoderKLCogVideoX")

# Read and refused, with the reason (what an entry would need). Keys: the first_stage_model class, or
# "class/decoder class" where one class hosts several decoders.
REFUSED = {
    "comfy.ldm.models.autoencoder.AutoencodingEngine/comfy.ldm.hunyuan_video.vae.Decoder": "HunyuanImage 2.1's decoder "
    "(32x, pixel un-shuffle upsampling) was not read for a row split yet",
    "comfy.ldm.models.autoencoder.AutoencodingEngine/comfy.ldm.modules.temporal_ae.VideoDecoder": "SVD's temporal "
    "decoder keeps frames in the batch and normalizes over all of them (GroupNorm over time): not split yet",
    "comfy.ldm.minimax.vae.MiniMaxH3VideoVAE": "MiniMax H3's video VAE: its decoder is a ViT (ViT3DDecoder) whose "
    "every token attends to all tokens of its tile plus 4 register tokens, with RoPE positions counted from the "
    "tile's origin, and the model tiles each frame itself (256-pixel tiles, overlaps blended, the grid placed from the "
    "full height; 17-frame chunks blended in time): a band of rows changes the tiles. An exact split would hand whole "
    "tiles of that same grid to the ranks (tile parallel), which the row mechanism does not do",
    "comfy.ldm.cogvideo.vae.AutoencoderKLCogVideoX": "CogVideoX's VAE: its CausalConv3d convolves a lone uncached "
    "frame (a one-frame latent) with F.conv3d itself, outside its child conv, and its SpatialNorm3D resizes the latent "
    "to each level by size (nearest): a split needs a stand-in for that causal conv's fast path and a check that every "
    "resize keeps an integer row ratio - not declared yet",
    "comfy.ldm.genmo.vae.model.VideoVAE": "Mochi's VAE: its GroupNormSpatial normalizes each frame on its own and its "
    "PConv3d pads time itself before a replicate-padded conv: not declared for a row split yet",
    "comfy.ldm.cosmos.vae.CausalContinuousVideoTokenizer": "Cosmos' tokenizer pads inside its own causal conv module "
    "(a stand-in for that class is not written yet)",
    "comfy.ldm.cascade.stage_a.StageA": "Stable Cascade stage A upsamples with an overlapping transposed convolution "
    "(kernel 4, stride 2): not split by rows",
    "comfy.ldm.cascade.stage_c_coder.StageC_coder": "the Stable Cascade previewer was not read for a row split yet",
    "comfy.ldm.audio.autoencoder.AudioOobleckVAE": "an audio VAE: its latent has no image rows to split",
}


def refusal(model) -> str | None:
    """The written reason this first_stage_model is not split, if it is one of those read and refused."""
    name = qualname(model)
    decoder = getattr(model, "decoder", None)
    return REFUSED.get(f"{name}/{qualname(decoder)}") or REFUSED.get(name)


def comfy_vae_for(model) -> ComfyVae | None:
    """The declaration covering this first_stage_model's exact class and decoder class - the first whose own check
    passes where several do (the 2-D and 3-D KL decoders) - or None."""
    name, decoder = qualname(model), qualname(getattr(model, "decoder", None))
    found = [v for v in DECLARED if name in v.classes and v.decoder in ("", decoder)]
    return next((v for v in found if v.check is None or not v.check(model)), found[0] if found else None)


def supported_titles() -> str:
    return ", ".join(v.title for v in DECLARED)
