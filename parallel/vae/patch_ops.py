"""Row-patch versions of the decoder ops that mix rows: convolutions, GroupNorm, attention K/V.

Every activation of a patch decode is split along its height (dim -2) over the
ranks of one axis, rank 0 on top. Ops that look at one row at a time (SiLU,
RMS norm over channels, nearest upsampling by an integer factor, clamps) run
unchanged on the local rows. The wrappers here cover the ops that do not:

- `PatchConv`: a stride-1 (in H) convolution needs `pad` rows from the rank
  above and `dilation*(k-1)-pad` rows from the rank below. They are exchanged
  with non-blocking sends/receives; zero rows are added only at the true image
  border (rank 0's top, the last rank's bottom). Every output row belongs to
  exactly one rank (no overlapping patches) and equals the serial conv's row.
  For the usual "same" conv the local rows are convolved while the halos are
  in flight, and only the `pad` rows at each inner border are redone once the
  halos arrive: no padded copy of the patch is made. `block_size` instead
  computes the output in chunks of that many rows, each from a chunk-sized
  slab of (halo + local rows), which caps the conv's input copy and workspace.
- `PatchGroupNorm`: exact global statistics. Each rank's (count, mean, M2) are
  gathered and combined around the *global* mean (M2 = sum M2_r + n_r (mean_r -
  mean)^2, the biased variance); adding per-rank variances around their own
  means drops the between-patch term (the old DistVAE bug).

The wrappers keep a reference to the original module (weights are shared, not
copied) and are installed only for the duration of a patch decode (native.py).
"""
from __future__ import annotations

import functools
import inspect
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..comm import all_gather_uneven, complete
from ..config import ConfigError


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class HaloExchange:
    """Post the halo sends/receives of `x` along `dim` now; `wait()` returns (rows from above, rows from below).

    The rank above sends its last `top` rows, the rank below its first `bottom`
    rows; the first rank gets None for the top, the last rank None for the
    bottom. The operations are non-blocking, so the caller computes the rows
    that need no halo while they are in flight; `wait` uses `timeout_s`, so a
    missing peer raises instead of hanging.
    """

    def __init__(self, x: torch.Tensor, ax, top: int, bottom: int, dim: int = -2,
                 timeout_s: Optional[float] = None):
        self.top_rows = self.bottom_rows = None
        self._works, self.timeout_s, self.device = [], timeout_s, x.device
        if ax.size == 1 or (top == 0 and bottom == 0):
            return
        dim = dim % x.dim()
        rows = x.shape[dim]
        if rows < max(top, bottom):
            raise ConfigError(
                f"rank {ax.rank} holds {rows} row(s) but a convolution needs {max(top, bottom)} halo row(s) "
                f"from it; use fewer ranks or a taller input")
        first, last = ax.rank == 0, ax.rank == ax.size - 1
        shape = list(x.shape)
        ops, sent = [], 0
        if not first:
            if top:
                shape[dim] = top
                self.top_rows = x.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, self.top_rows, ax.prev_rank, group=ax.group))
            if bottom:
                piece = x.narrow(dim, 0, bottom).contiguous()
                ops.append(dist.P2POp(dist.isend, piece, ax.prev_rank, group=ax.group))
                sent += _nbytes(piece)
        if not last:
            if bottom:
                shape[dim] = bottom
                self.bottom_rows = x.new_empty(shape)
                ops.append(dist.P2POp(dist.irecv, self.bottom_rows, ax.next_rank, group=ax.group))
            if top:
                piece = x.narrow(dim, rows - top, top).contiguous()
                ops.append(dist.P2POp(dist.isend, piece, ax.next_rank, group=ax.group))
                sent += _nbytes(piece)
        if ops:
            self._works = dist.batch_isend_irecv(ops)
            ax.stats.record("halo", sent)

    def wait(self):
        for w in self._works:
            complete(w, self.device, self.timeout_s)
        self._works = []
        return self.top_rows, self.bottom_rows


def exchange_halo(x: torch.Tensor, ax, top: int, bottom: int, dim: int = -2,
                  timeout_s: Optional[float] = None):
    """Blocking form of `HaloExchange`: (rows from the rank above, rows from the rank below)."""
    return HaloExchange(x, ax, top, bottom, dim, timeout_s).wait()


def _causal_padding(conv: nn.Module, name: str) -> tuple:
    """(frames in front, rows, columns) a Wan causal conv pads its input with, from either of ComfyUI's layouts:
    `_padding` the F.pad 6-tuple (w, w, h, h, 2*t, 0) with the conv's own padding zero, or `_padding` the number
    of frames in front with the conv padding space itself (`padding` (0, h, w))."""
    p, own = conv._padding, tuple(int(v) for v in conv.padding) if not isinstance(conv.padding, str) else None
    if isinstance(p, int) and own is not None and own[0] == 0:
        return (p, own[1], own[2])
    if (isinstance(p, (tuple, list)) and len(p) == 6 and p[0] == p[1] and p[2] == p[3] and p[5] == 0
            and own is not None and not any(own)):
        return (p[4], p[2], p[0])
    raise ConfigError(f"{name}: a causal conv padding _padding={p!r} with padding={conv.padding!r} is not a layout "
                      f"patch decode has read; decode this VAE with VAE Decode")


def _takes_autopad(conv: nn.Module) -> bool:
    """Whether the conv's op takes ComfyUI's `autopad` (its "causal_zero" truncates the temporal taps)."""
    fn = getattr(type(conv), "_conv_forward", None)
    try:
        return fn is not None and "autopad" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _rows(pieces, start: int, stop: int, dim: int) -> torch.Tensor:
    """Rows [start, stop) of the virtual concatenation of `pieces` along `dim` (copying only that range)."""
    out, offset = [], 0
    for p in pieces:
        n = p.shape[dim]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            out.append(p.narrow(dim, lo - offset, hi - lo))
        offset += n
    return out[0] if len(out) == 1 else torch.cat(out, dim=dim)


class PatchConv(nn.Module):
    """A Conv2d / Conv3d / WanCausalConv3d run on this rank's rows with halos from its neighbours.

    For WanCausalConv3d the temporal handling of its forward is kept as it is
    (the cached frames of the previous chunk are concatenated in front, the
    rest of the causal padding is zeros); the cached frames hold local rows
    only, so they get their halo rows in the same exchange as the new frames.
    """

    def __init__(self, conv: nn.Module, ax, block_size: Optional[int] = None,
                 timeout_s: Optional[float] = None, name: str = "conv"):
        super().__init__()
        self.conv, self.ax, self.block_size, self.timeout_s = conv, ax, block_size, timeout_s
        nd = conv.weight.dim() - 2
        self.causal = hasattr(conv, "_padding")  # Wan's causal conv keeps its padding in front of time in _padding
        self.one_frame_taps = False
        if self.causal:
            self.pad = _causal_padding(conv, name)  # (t_front, h, w); t is front-only
            # ComfyUI's causal conv whose `_padding` counts frames only takes a fast path for a lone frame with no
            # cached frames: the conv's last temporal tap alone (the ops' autopad="causal_zero"), the same sum as
            # over the zero frames, and mirrored here so that the rounding is ComfyUI's too.
            self.one_frame_taps = isinstance(conv._padding, int) and _takes_autopad(conv)
        else:
            if isinstance(conv.padding, str):
                raise ConfigError(f"{name}: padding={conv.padding!r} is not supported by patch decode; "
                                  f"use explicit integer padding")
            self.pad = tuple(conv.padding)
        if conv.padding_mode != "zeros":
            raise ConfigError(f"{name}: padding_mode={conv.padding_mode!r} is not supported by patch decode "
                              f"(only zero padding can be split at patch borders)")
        kh, sh, dh = conv.kernel_size[-2], conv.stride[-2], conv.dilation[-2]
        if sh != 1:
            raise ConfigError(f"{name}: stride {sh} along the height is not supported by patch decode "
                              f"(decoders only use stride 1; split encoders another way)")
        self.nd = nd
        self.top = self.pad[-2]
        self.bottom = dh * (kh - 1) - self.top
        if self.bottom < 0:
            raise ConfigError(f"{name}: padding {self.top} exceeds the kernel's reach along the height")
        self.reach = dh * (kh - 1)

    @property
    def halo(self) -> int:
        return max(self.top, self.bottom)

    def _conv(self, x: torch.Tensor, pad_h: int = 0, taps: Optional[int] = None) -> torch.Tensor:
        c = self.conv
        weight, bias = c.weight, c.bias
        if weight.dtype != x.dtype:  # ComfyUI's manual-cast ops compute in the input's dtype
            weight, bias = weight.to(x.dtype), None if bias is None else bias.to(x.dtype)
        if self.nd == 2:
            return F.conv2d(x, weight, bias, c.stride, (pad_h, self.pad[1]), c.dilation, c.groups)
        if taps is not None:  # the causal fast path: the last `taps` temporal taps over unpadded frames
            weight = weight[:, :, -taps:]
        pad_t = 0 if self.causal else self.pad[0]
        return F.conv3d(x, weight, bias, c.stride, (pad_t, pad_h, self.pad[2]), c.dilation, c.groups)

    def forward(self, x: torch.Tensor, cache_x: Optional[torch.Tensor] = None, cache_list=None,
                cache_idx=None) -> torch.Tensor:
        if cache_list is not None:  # ComfyUI's CausalConv3d: the cached frames handed over in a list, taken out
            cache_x = cache_list[cache_idx]
            cache_list[cache_idx] = None
        taps = None
        if self.causal:
            t_pad = self.pad[0]
            if self.one_frame_taps and cache_x is None and x.shape[2] == 1:
                taps = 1
            else:
                if cache_x is not None and t_pad > 0:
                    x = torch.cat([cache_x.to(x.device), x], dim=2)
                    t_pad -= cache_x.shape[2]
                if t_pad > 0:
                    x = F.pad(x, (0, 0, 0, 0, t_pad, 0))
        conv = self._conv if taps is None else functools.partial(self._conv, taps=taps)
        exchange = HaloExchange(x, self.ax, self.top, self.bottom, timeout_s=self.timeout_s)
        rows = x.shape[-2]
        if self.block_size is None and self.top == self.bottom and rows >= self.reach:
            # "Same" conv: convolve the local rows with the conv's own zero padding while the halos are in
            # flight (no padded copy of the input), then redo the `top` first / `bottom` last output rows,
            # the only ones that depend on a neighbour's rows, from the received halos.
            out = conv(x, pad_h=self.top)
            got_top, got_bottom = exchange.wait()
            if got_top is not None:
                out.narrow(-2, 0, self.top).copy_(conv(torch.cat([got_top, x.narrow(-2, 0, self.reach)], -2)))
            if got_bottom is not None:
                slab = torch.cat([x.narrow(-2, rows - self.reach, self.reach), got_bottom], -2)
                out.narrow(-2, rows - self.bottom, self.bottom).copy_(conv(slab))
            return out
        got_top, got_bottom = exchange.wait()
        shape = list(x.shape)
        if got_top is None and self.top:
            shape[-2] = self.top
            got_top = x.new_zeros(shape)  # true image border
        if got_bottom is None and self.top:
            # the true bottom border gets the conv's own zero padding (`top` rows, as in the serial conv);
            # interior ranks got `bottom` = reach - top real rows from below instead.
            shape[-2] = self.top
            got_bottom = x.new_zeros(shape)
        pieces = [p for p in (got_top, x, got_bottom) if p is not None]
        out_rows = sum(p.shape[-2] for p in pieces) - self.reach
        if out_rows < 1:
            raise ConfigError(f"a patch of {x.shape[-2]} rows is too short for this convolution's reach "
                              f"({self.reach + 1} rows); use fewer ranks")
        step = self.block_size or out_rows
        if step >= out_rows:
            return conv(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2))
        out = None
        for start in range(0, out_rows, step):
            stop = min(start + step, out_rows)
            y = conv(_rows(pieces, start, stop + self.reach, dim=x.dim() - 2))
            if out is None:
                shape = list(y.shape)
                shape[-2] = out_rows
                out = y.new_empty(shape)
            out.narrow(-2, start, stop - start).copy_(y)
            del y
        return out


class PaddedConv:
    """A conv module that pads its own input (`F.pad(x, padding, mode)`, then its child conv with no padding:
    ComfyUI's VideoConv3d, replicate by default) run on this rank's rows.

    The rows it pads along the height come from the neighbours (halo exchange) at inner borders and are made as
    `mode` makes them only at the true top and bottom (replicate: the edge row repeated; reflect: the rows next to
    it mirrored); the other dimensions are padded locally as the module does (replicate / reflect pad each
    dimension independently, so padding the height first gives the same tensor). `block_size` convolves that many
    output rows at a time. The module's own child conv runs (ComfyUI's ops cast its weight)."""

    MODES = ("replicate", "reflect", "constant")

    def __init__(self, module: nn.Module, ax, padding, mode: str, block_size: Optional[int] = None,
                 timeout_s: Optional[float] = None, name: str = "conv"):
        conv = module.conv
        if mode not in self.MODES:
            raise ConfigError(f"{name}: padding mode {mode!r} cannot be split by rows (a band would need rows from "
                              f"the other end of the image); decode this VAE with VAE Decode")
        if any(int(v) for v in conv.padding) or conv.stride[-2] != 1:
            raise ConfigError(f"{name}: its conv pads ({conv.padding}) or strides ({conv.stride}) on its own as well; "
                              f"not split by rows")
        self.padding = tuple(int(v) for v in padding)
        self.top, self.bottom = self.padding[2], self.padding[3]
        self.reach = conv.dilation[-2] * (conv.kernel_size[-2] - 1)
        if self.top + self.bottom != self.reach:
            raise ConfigError(f"{name}: padding {self.padding} does not keep the height (kernel reach {self.reach})")
        self.module, self.conv, self.ax, self.mode = module, conv, ax, mode
        self.block_size, self.timeout_s = block_size, timeout_s
        self.rest = self.padding[:2] + (0, 0) + self.padding[4:]

    @property
    def halo(self) -> int:
        return max(self.top, self.bottom) + (1 if self.mode == "reflect" else 0)

    def _border(self, x: torch.Tensor, n: int, top: bool) -> torch.Tensor:
        rows = x.shape[-2]
        if self.mode == "constant":
            shape = list(x.shape)
            shape[-2] = n
            return x.new_zeros(shape)
        if self.mode == "replicate":
            edge = x.narrow(-2, 0 if top else rows - 1, 1)
            shape = list(x.shape)
            shape[-2] = n
            return edge.expand(shape)
        return x.narrow(-2, 1 if top else rows - 1 - n, n).flip(-2)  # reflect: the rows beside the edge, mirrored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        got_top, got_bottom = exchange_halo(x, self.ax, self.top, self.bottom, timeout_s=self.timeout_s)
        if got_top is None and self.top:
            got_top = self._border(x, self.top, top=True)
        if got_bottom is None and self.bottom:
            got_bottom = self._border(x, self.bottom, top=False)
        x = torch.cat([p for p in (got_top, x, got_bottom) if p is not None], dim=-2)
        if any(self.rest):
            x = F.pad(x, self.rest, mode=self.mode)
        out_rows = x.shape[-2] - self.reach
        step = self.block_size or out_rows
        if step >= out_rows:
            return self.conv(x)
        parts = [self.conv(x.narrow(-2, start, min(step, out_rows - start) + self.reach))
                 for start in range(0, out_rows, step)]
        return torch.cat(parts, dim=-2)


class PrepaddedConv:
    """A conv without padding whose caller pads its input (HunyuanVideo 1.5's NoPadConv3d, later ComfyUIs'
    CarriedConv3d - HunyuanVideo 1.0 and 1.5 -, fed by `conv_carry_causal_3d`: `F.pad(x, (1, 1, 1, 1, t, 0),
    "replicate")` on the whole tensor, the previous chunk's carried frames in front) run on this rank's rows. The
    caller pads this rank's band by repeating its own edge rows (the carried frames too: padded when they were
    carried, or after); at an inner border the rows it made are replaced by the neighbour's real rows (which the
    neighbour's caller padded in width and time alike), and only at the image's true top and bottom do the repeated
    rows stay, as in the serial decode."""

    def __init__(self, module: nn.Module, ax, timeout_s: Optional[float] = None, name: str = "conv"):
        conv = module.conv
        if any(int(v) for v in conv.padding) or conv.stride[-2] != 1:
            raise ConfigError(f"{name}: its conv pads ({conv.padding}) or strides ({conv.stride}) itself; not split "
                              f"by rows")
        self.reach = conv.dilation[-2] * (conv.kernel_size[-2] - 1)
        self.top = self.reach // 2
        self.bottom = self.reach - self.top
        self.module, self.ax, self.timeout_s = module, ax, timeout_s

    @property
    def halo(self) -> int:
        return max(self.top, self.bottom, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[-2]
        inner = x.narrow(-2, self.top, rows - self.reach)
        got_top, got_bottom = exchange_halo(inner, self.ax, self.top, self.bottom, timeout_s=self.timeout_s)
        if got_top is not None or got_bottom is not None:
            x = torch.cat([got_top if got_top is not None else x.narrow(-2, 0, self.top), inner,
                           got_bottom if got_bottom is not None else x.narrow(-2, rows - self.bottom, self.bottom)],
                          dim=-2)
        return self.module.conv(x)


class PatchGroupNorm(nn.Module):
    """nn.GroupNorm over all ranks' rows: the statistics are those of the whole (unsplit) tensor."""

    def __init__(self, norm: nn.GroupNorm, ax):
        super().__init__()
        self.norm, self.ax = norm, ax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, eps = self.norm.num_groups, self.norm.eps
        b, c = x.shape[0], x.shape[1]
        grouped = x.reshape(b, g, -1)
        n_local = grouped.shape[-1]
        pdt = torch.float64 if x.dtype == torch.float64 else torch.float32
        var, mean = torch.var_mean(grouped.to(pdt), dim=-1, correction=0)
        # (count, mean, M2) per rank, combined in float64 around the global mean.
        stats = torch.stack([torch.full_like(mean, float(n_local)), mean, var * n_local]).double()
        every = all_gather_uneven(stats.unsqueeze(0), dim=0, ax=self.ax, sizes=[1] * self.ax.size)
        counts, means, m2s = every[:, 0], every[:, 1], every[:, 2]
        total = counts.sum(0)
        g_mean = (counts * means).sum(0) / total
        g_var = (m2s + counts * (means - g_mean) ** 2).sum(0) / total
        # Normalise with the global statistics in one fused op: batch_norm in eval mode over (1, B*C, rest).
        # Statistics and affine parameters stay fp32 for half/bf16 inputs (batch_norm accepts that mix),
        # as native group_norm computes in fp32; rounding them to bf16 would cost ~1e-3 relative.
        per = c // g
        ch_mean = g_mean.repeat_interleave(per, dim=1).reshape(-1).to(pdt)
        ch_var = g_var.repeat_interleave(per, dim=1).reshape(-1).to(pdt)
        w = self.norm.weight.to(pdt).repeat(b) if self.norm.weight is not None else None
        bias = self.norm.bias.to(pdt).repeat(b) if self.norm.bias is not None else None
        y = F.batch_norm(x.reshape(1, b * c, -1), ch_mean, ch_var, w, bias, False, 0.0, eps)
        return y.reshape(x.shape)
