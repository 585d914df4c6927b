"""The one Wan VAE decoder op whose forward has to be restated: the mid-block attention.

`WanAttentionBlock` projects q, k and v with a single 1x1 conv and chunks the
result, so its K/V cannot be gathered by wrapping a projection (as the KL
decoder's `Attention.to_k/to_v` can). `PatchWanAttention` follows the block's
forward step for step (per-frame single-head attention over the h*w tokens,
RMS norm over channels, residual) with one change: keys and values of every
rank's rows are gathered, queries stay local. Everything else in the Wan
decoder either runs per row (RMS norm, SiLU, nearest-exact x2 upsampling,
DupUp3D, clamp, unpatchify) or is a WanCausalConv3d/Conv2d that `PatchConv`
handles, including its temporal feature cache.
"""
from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather_uneven


class PatchWanAttention(nn.Module):
    def __init__(self, block: nn.Module, ax):
        super().__init__()
        self.block, self.ax = block, ax

    def forward(self, x):
        blk = self.block
        identity = x
        b, c, t, h, w = x.size()
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = blk.norm(x)
        qkv = blk.to_qkv(x).reshape(b * t, 1, c * 3, -1).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        k = all_gather_uneven(k.contiguous(), dim=2, ax=self.ax)
        v = all_gather_uneven(v.contiguous(), dim=2, ax=self.ax)
        x = F.scaled_dot_product_attention(q, k, v)
        x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        x = blk.proj(x)
        x = x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4)
        return x + identity
