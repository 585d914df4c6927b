"""Tiny Cosmos Predict2 and Anima checkpoints (one DiT, MiniTrainDIT, under both), in ComfyUI's format: the builder
tiny_checkpoints.py re-exports (its own file to keep that one readable)."""
from __future__ import annotations

from pathlib import Path

import torch

from .tiny_weights import _save


def _ops():
    import comfy.ops

    return comfy.ops.disable_weight_init


def cosmos_predict2_dit(cls, channels: int, blocks: int):
    """ComfyUI's detection of a Cosmos Predict2 / Anima checkpoint (model_detection.py, "Cosmos predict2"): it
    reads the width (x_embedder) and the blocks; heads are 16 below widths 2048 / 5120, the text 1024 wide."""
    return cls(max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16, patch_spatial=2,
               patch_temporal=1, concat_padding_mask=True, model_channels=channels, num_blocks=blocks, num_heads=16,
               crossattn_emb_channels=1024, pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop",
               min_fps=1, max_fps=30, use_adaln_lora=True, adaln_lora_dim=256, extra_per_block_abs_pos_emb=False,
               rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
               rope_enable_fps_modulation=False, operations=_ops(), device="meta")


def write_cosmos_predict2(path: Path, *, blocks: int = 2, seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Cosmos Predict2 text-to-image (MiniTrainDIT): width 256 (16 heads of 16, as detection fixes), two blocks."""
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    return _save(lambda: cosmos_predict2_dit(MiniTrainDIT, 256, blocks), path, seed, dtype)


def write_anima(path: Path, *, blocks: int = 2, seed: int = 0,
                dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Anima: Cosmos Predict2's DiT (width 256, two blocks) with its LLM adapter, whose sizes are fixed (1024 wide,
    six layers, a 32128-entry embedding: 0.13B parameters; detection only asks for its first block)."""
    from comfy.ldm.anima.model import Anima
    return _save(lambda: cosmos_predict2_dit(Anima, 256, blocks), path, seed, dtype)
