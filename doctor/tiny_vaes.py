"""Tiny random-init VAEs in ComfyUI's own format (models/vae), built from ComfyUI's own classes on the meta device and
filled from a seeded generator like the diffusion models of tiny_checkpoints.py (whose helpers they share):

- KL VAE: architecture fixed by ComfyUI (ch 128, mult 1,2,4,4); only latent channels are read.
  "sd" style has quant convs (4 channels), "flux" style has none (16 channels).
- Wan 2.1 VAE: base width read from the weights; Wan 2.2's widths are fixed by comfy/sd.py.
- HunyuanVideo 1.0's 3-D KL VAE: decoder side only.
- LTX-2's video VAE: LTX's VideoVAE with LTX-2's stage list at tiny widths, its configuration in the file's header
  (as in an LTX-2 checkpoint: ComfyUI reads it from there).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from .tiny_weights import _random_state_dict, _save


def write_kl_vae(path: Path, *, style: str = "sd", seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The SD ("sd": 4 latent channels, quant convs) or Flux ("flux": 16 channels, none) KL VAE."""
    from comfy.ldm.models.autoencoder import AutoencoderKL, AutoencodingEngine

    if style not in ("sd", "flux"):
        raise ValueError(f"style must be 'sd' or 'flux', got {style!r}")
    z = 4 if style == "sd" else 16
    ddconfig = {"double_z": True, "z_channels": z, "resolution": 256, "in_channels": 3, "out_ch": 3,
                "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [],
                "dropout": 0.0}

    def make():
        if style == "sd":
            return AutoencoderKL(ddconfig=ddconfig, embed_dim=z)
        reg = {"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"}
        enc = {"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": ddconfig}
        dec = {"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": ddconfig}
        return AutoencodingEngine(regularizer_config=reg, encoder_config=enc, decoder_config=dec)

    return _save(make, path, seed, dtype, meta_context=True)


def write_wan_vae(path: Path, *, dim: int = 8, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Wan 2.1 VAE (16 latent channels, 4x temporal / 8x spatial) with base width `dim`."""
    from comfy.ldm.wan.vae import WanVAE

    def make():
        return WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)

    return _save(make, path, seed, dtype, meta_context=True)


# what comfy/sd.py builds for any HunyuanVideo 1.0 VAE it detects ("decoder.conv_in.conv.weight", 16 channels)
HUNYUAN_VIDEO_VAE_DDCONFIG = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3,
                              "ch": 128, "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [],
                              "dropout": 0.0, "conv3d": True, "time_compress": 4}


def write_hunyuan_video_vae(path: Path, *, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """HunyuanVideo 1.0's 3-D KL VAE, decoder side (post_quant_conv + decoder: what a decode reads; VAELoader loads
    with strict=False). Detection fixes the 128-wide, 4-level layout: 146M decoder parameters."""
    from comfy.ldm.models.autoencoder import AutoencoderKL

    with torch.device("meta"):
        model = AutoencoderKL(ddconfig=HUNYUAN_VIDEO_VAE_DDCONFIG, embed_dim=16)
    sd = {k: v for k, v in _random_state_dict(model, seed, dtype).items() if not k.startswith(("encoder.", "quant_"))}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": "pt"})
    return sd


WAN22_VAE_DIM, WAN22_VAE_DEC_DIM = 160, 256  # what comfy/sd.py builds for any Wan 2.2 VAE it detects


def wan22_vae(dim: int = WAN22_VAE_DIM, dec_dim: int = WAN22_VAE_DEC_DIM, device: str = "meta") -> torch.nn.Module:
    """ComfyUI's own Wan 2.2 VAE class (comfy/ldm/wan/vae2_2.py: 48 latent channels, residual blocks with
    averaging / duplicating shortcuts, 2x2 pixels folded into 12 channels) with these widths; the fixed parts
    (dim_mult 1,2,4,4, two res blocks, temporal down [F, T, T]) as comfy/sd.py sets them."""
    from comfy.ldm.wan.vae2_2 import WanVAE

    with torch.device(device):
        return WanVAE(dim=dim, dec_dim=dec_dim, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                      temperal_downsample=[False, True, True], dropout=0.0)


def write_wan22_vae(path: Path, *, dim: int = WAN22_VAE_DIM, dec_dim: int = WAN22_VAE_DEC_DIM, seed: int = 0,
                    dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The Wan 2.2 VAE. comfy.sd.VAE detects it by its nested up-block keys and then builds dim 160 / decoder width
    256 whatever the file holds, loading with strict=False (a missing weight would stay uninitialised memory): the
    smallest file VAELoader takes and decodes deterministically is the full 705M-parameter model (bf16 by default:
    1.4 GB; ComfyUI casts it to its VAE dtype, float32 on CPU). Other widths are for tests that build ComfyUI's
    class directly (`wan22_vae`) and convert it; VAELoader would reject their shapes."""
    return _save(lambda: wan22_vae(dim, dec_dim), path, seed, dtype)  # built on the meta device: no memory


# LTX-2's video VAE configuration (an LTX-2 / 2.3 checkpoint's header "config" -> "vae": no timestep conditioning, no
# noise, zero padding in space, non-causal decoder, pixel norm, 4x4 patches; the decoder's stage list, listed pixel
# side first) with one layer per residual group and 8 base channels; ComfyUI's LTX VAE always has 128 latent channels
LTX2_VAE_CONFIG = {
    "_class_name": "CausalVideoAutoencoder", "dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128,
    "encoder_blocks": [["res_x", {"num_layers": 1}]],
    "decoder_blocks": [["res_x", {"num_layers": 1}], ["compress_space", {"multiplier": 2}],
                       ["res_x", {"num_layers": 1}], ["compress_time", {"multiplier": 2}], ["res_x", {"num_layers": 1}],
                       ["compress_all", {"multiplier": 1}], ["res_x", {"num_layers": 1}],
                       ["compress_all", {"multiplier": 2}], ["res_x", {"num_layers": 1}]],
    "scaling_factor": 1.0, "norm_layer": "pixel_norm", "patch_size": 4, "latent_log_var": "uniform",
    "use_quant_conv": False, "causal_decoder": False, "timestep_conditioning": False,
    "normalize_latent_channels": False, "encoder_base_channels": 8, "decoder_base_channels": 8,
    "spatial_padding_mode": "zeros",
}


def write_ltx2_vae(path: Path, *, seed: int = 0, config: dict | None = None,
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """LTX-2's video VAE (comfy.ldm.lightricks.vae.causal_video_autoencoder.VideoVAE) built from `config` (default
    LTX2_VAE_CONFIG), written with that configuration in the header as {"config": {"vae": ...}}: VAELoader passes the
    header to comfy.sd.VAE, which builds the VAE from it (the file's names alone give ComfyUI's default, timestep
    conditioned configurations)."""
    import json

    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE

    config = dict(LTX2_VAE_CONFIG if config is None else config)
    with torch.device("meta"):
        model = VideoVAE(config=config)
    sd = _random_state_dict(model, seed, dtype)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata={"format": "pt", "config": json.dumps({"vae": config})})
    return sd
