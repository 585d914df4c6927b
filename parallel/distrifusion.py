"""DistriFusion (displaced patch parallelism) for the DiT families, on top of the family plans.

Each sequence-parallel rank owns one patch of the image tokens: the split and
gather points are the family plan's (parallel/models/*.py), applied by
parallel/plan.py, so uneven token counts follow `split_sizes` exactly as USP
does. Only what happens *inside* self-attention differs from USP:

* Synchronous steps - the first `warmup_steps` forwards of a run, and always
  the first one (``step < max(1, warmup_steps)``; the same meaning as
  PipeFusion's warmup_steps and the node's tooltip; DistriFusion's own counter
  would give one more) - all-gather every layer's fresh image K/V before
  attention, so they equal the serial model (up to float reordering).
* Stale steps: a rank computes only its own patch. Its queries attend to the
  full image K/V in which its own patch is fresh and every other patch comes
  from the previous forward; the all-gather that refreshes those buffers for
  the *next* forward is issued asynchronously right after the layer's fresh
  K/V exist and is waited on only when the next forward reaches that layer,
  so it overlaps the rest of this forward, the sampler step and the start of
  the next forward. Layers are packed into one flat send buffer and gathered
  in groups of `layers_per_comm` layers (DistriFusion's comm-manager idea:
  fewer, larger collectives); two exchanges alternate so the buffer being
  read is never the one being filled.

MMDiT joint attention (Flux, SD3): the text tokens are replicated on every rank
as in usp.py, so text K/V are always fresh and local; only image K/V are stale.
Image queries see [text, image with own patch fresh]. Text queries see all image
keys *from the stale buffer*, own patch included: that buffer is the same on
every rank (it is one all-gather), so the text stream stays identical on all
ranks - the replicated-text invariant holds in stale steps too, and no rank's
text depends on which patch it happens to own. (Using the own fresh patch for
text queries would make each rank carry a slightly different text stream.)

GroupNorm does not occur in these DiT transformers (their norms are LayerNorm /
RMSNorm / AdaLN per token, which a patch computes exactly); the corrected async
GroupNorm (statistics around the global mean) matters for conv UNets only.
`apply_distrifusion` refuses a transformer that contains a GroupNorm rather than
normalise each patch on its own.

Per-run state lives in a `DistriFusionState` per model (no globals). The step
index of a forward decides warmup vs stale: by default it is the number of
forwards since the last reset; a caller that knows the sampler step calls
`state.set_step(i)` before the forward (`set_step(0)` starts a new run). The
pool in step mode calls `start_call(call_index, lane)`: call 0 starts a new
run, and the calls of each conditioning set are a lane of steps with their own
stale K/V (ComfyUI calls the model once per conditioning where it cannot batch
them; a cond call must never read an uncond call's K/V). A new run also starts on `reset()` and whenever the full
input shape (batch or token count), dtype or device changes; in-flight gathers
are drained first. Optionally `total_steps` skips the useless gather of the
last step. Memory: every rank holds the full image K/V of every self-attention
layer (twice while an exchange is in flight), which is DistriFusion's price.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .comm import complete
from .models import plan_for
from .plan import apply_plan, wrap_forward

_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def is_sync_step(step: int, warmup_steps: int) -> bool:
    """The first `warmup_steps` steps (at least step 0, which fills the buffers) gather fresh K/V synchronously."""
    return step < max(1, warmup_steps)


def _wait(work, timeout_s: float, what: str, device: torch.device) -> None:
    try:
        ok = complete(work, device, timeout_s)
    except Exception as e:  # noqa: BLE001 - re-raised with what was waited on
        raise RuntimeError(f"DistriFusion: waiting for {what} failed after up to {timeout_s:.0f} s: {e}") from e
    if ok is False:
        raise RuntimeError(f"DistriFusion: {what} did not complete within {timeout_s:.0f} s")


class _SyncStore:
    """The K/V blocks gathered synchronously during one forward, per layer."""

    def __init__(self):
        self.layers = []

    def blocks(self, layer: int) -> list:
        return self.layers[layer]

    def drain(self) -> None:
        pass


class _Exchange:
    """One forward's asynchronous all-gather of every layer's fresh local K/V, issued in groups of layers.

    layout[l] is the padded local K/V shape (2, B, H, P, D) of layer l; P is the
    largest patch so every rank sends the same number of elements (gloo and NCCL
    all-gather need equal sizes); padding rows stay zero and are cut off on read.
    """

    def __init__(self, layout, dtype, device, layers_per_comm: int, ax, sizes, timeout_s: float):
        self.layout, self.ax, self.sizes, self.timeout_s = layout, ax, sizes, timeout_s
        numels = [int(torch.Size(s).numel()) for s in layout]
        self.offsets = [sum(numels[:l]) for l in range(len(layout))]
        self.numels = numels
        self.send = torch.zeros(sum(numels), dtype=dtype, device=device)
        self.groups = [list(range(i, min(i + layers_per_comm, len(layout))))
                       for i in range(0, len(layout), layers_per_comm)]
        self.group_of = {l: g for g, ls in enumerate(self.groups) for l in ls}
        self.recv = [torch.empty(ax.size * sum(numels[l] for l in ls), dtype=dtype, device=device)
                     for ls in self.groups]
        self.works = [None] * len(self.groups)
        self.wait_s = 0.0

    def key(self):
        return (tuple(self.layout), self.send.dtype, self.send.device, len(self.groups[0]), tuple(self.sizes))

    def put(self, layer: int, k: torch.Tensor, v: torch.Tensor, stats) -> None:
        n = k.shape[2]
        slot = self.send[self.offsets[layer]: self.offsets[layer] + self.numels[layer]].view(self.layout[layer])
        slot[0, :, :, :n].copy_(k)
        slot[1, :, :, :n].copy_(v)
        g = self.group_of[layer]
        if layer == self.groups[g][-1]:  # the group is complete: send it while later layers compute
            ls = self.groups[g]
            chunk = self.send[self.offsets[ls[0]]: self.offsets[ls[-1]] + self.numels[ls[-1]]]
            self.works[g] = _gather_single(self.recv[g], chunk, group=self.ax.group, async_op=True)
            stats.record("distrifusion_async_kv", chunk.numel() * chunk.element_size() * (self.ax.size - 1))

    def blocks(self, layer: int) -> list:
        g = self.group_of[layer]
        if self.works[g] is not None:
            t0 = time.perf_counter()
            _wait(self.works[g], self.timeout_s, f"the K/V all-gather of layers {self.groups[g]}", self.send.device)
            self.wait_s += time.perf_counter() - t0
            self.works[g] = None
        ls = self.groups[g]
        per_rank = self.recv[g].view(self.ax.size, -1)
        off = self.offsets[layer] - self.offsets[ls[0]]
        order = self.ax.group_order
        return [per_rank[order[r], off: off + self.numels[layer]].view(self.layout[layer])[:, :, :, : self.sizes[r]]
                for r in range(self.ax.size)]

    def drain(self) -> None:
        for g, w in enumerate(self.works):
            if w is not None:
                _wait(w, self.timeout_s, f"the K/V all-gather of layers {self.groups[g]}", self.send.device)
                self.works[g] = None


# what one lane of calls keeps between its steps (DistriFusionState.start_call)
_LANE_FIELDS = ("_prev", "_cur", "_signature", "_calls", "_layout", "_prev_layout", "_exchanges", "_seq_sizes",
                "_kv_dtype", "_kv_device")


class DistriFusionState:
    """Stale K/V buffers and the step counter of one parallelized model; see the module docstring."""

    def __init__(self, ctx, warmup_steps: int, layers_per_comm: Optional[int] = None):
        if layers_per_comm is not None and (isinstance(layers_per_comm, bool) or not isinstance(layers_per_comm, int)
                                            or layers_per_comm < 1):
            raise ValueError(f"layers_per_comm must be a positive integer or None (auto), got {layers_per_comm!r}")
        self.ctx, self.ax = ctx, ctx.sp
        self.warmup_steps = warmup_steps
        self.layers_per_comm = layers_per_comm
        self.run_id = 0
        self.history = []       # one dict per forward of the current run (benchmarks, tests)
        self._explicit_step = None
        self.total_steps = None
        self._lane, self._lanes = (), {}  # the current lane, and the others' parked state (start_call)
        self._forget()

    # ---- public API -------------------------------------------------------
    def reset(self, total_steps: Optional[int] = None) -> int:
        """Start a new run: finish in-flight gathers, drop all buffers (every lane's); returns the new run id."""
        self._drain()
        for parked in self._lanes.values():
            for ex in parked["_exchanges"]:
                if ex is not None:
                    ex.drain()
        self._lane, self._lanes = (), {}
        self._forget()
        self.history = []
        self.total_steps = total_steps
        self.run_id += 1
        return self.run_id

    def set_step(self, step: int, total_steps: Optional[int] = None) -> None:
        """Declare the step index of the next forward (0 starts a new run)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative integer (the sampler step index), got {step!r}")
        if step == 0 and self._calls:
            self.reset(total_steps)
        if total_steps is not None:
            self.total_steps = total_steps
        self._explicit_step = step

    def start_call(self, call_index: int, lane: tuple = ()) -> None:
        """Step mode: before the sampler's model call `call_index` (0 starts a new run), holding the conditionings
        `lane` (ComfyUI's cond_or_uncond). Each lane is its own sequence of steps with its own stale K/V: where
        ComfyUI calls the model once per conditioning (it cannot batch them: MiniMax H3's per-run payload, prompts of
        different shapes) a step's cond call must read the cond call's K/V of the step before, never the uncond's,
        and its step is its own count of calls, not the call index (two calls per step)."""
        if call_index == 0:
            self.reset(self.total_steps)
        lane = tuple(lane)
        if lane == self._lane:
            return
        self._lanes[self._lane] = {f: getattr(self, f, None) for f in _LANE_FIELDS}
        parked = self._lanes.pop(lane, None)
        if parked is None:
            self._forget()
        else:
            for f, v in parked.items():
                setattr(self, f, v)
        self._lane = lane

    @property
    def step(self) -> int:
        """The step index the next forward will run as."""
        return self._calls if self._explicit_step is None else self._explicit_step

    def close(self) -> None:
        self._drain()
        self._forget()

    # ---- internals ---------------------------------------------------------
    def _forget(self) -> None:
        self._prev = None           # where the previous forward's gathered K/V live (_SyncStore/_Exchange)
        self._cur = None            # where this forward's go
        self._signature = None
        self._calls = 0
        self._layer = 0
        self._layout = []
        self._prev_layout = None
        self._exchanges = [None, None]  # (draining them first is the caller's: _drain)

    def _drain(self) -> None:
        for ex in self._exchanges:
            if ex is not None:
                ex.drain()

    def _begin(self, signature) -> None:
        if self._signature is not None and signature != self._signature:
            self._drain()  # resolution / batch changed: this lane starts again
            self._forget()
        self._signature = signature
        step = self.step
        self._explicit_step = None
        self.sync = is_sync_step(step, self.warmup_steps) or self._prev is None
        last = self.total_steps is not None and step >= self.total_steps - 1
        self.issue = not self.sync and not last
        self._step_now, self._layer, self._layout = step, 0, []
        self._comm_s = 0.0
        self._cur = _SyncStore() if self.sync else (self._next_exchange() if self.issue else None)
        self._t0 = time.perf_counter()

    def _next_exchange(self):
        """The exchange this forward fills: not the one being read (double buffering), layout known then."""
        prev_layout = self._prev_layout
        sizes = self._seq_sizes
        lpc = self.layers_per_comm or max(1, -(-len(prev_layout) // 4))
        dtype, device = self._kv_dtype, self._kv_device
        idx = 0 if self._exchanges[0] is not self._prev else 1
        ex = self._exchanges[idx]
        want = (tuple(prev_layout), dtype, device, min(lpc, len(prev_layout)), tuple(sizes))
        if ex is None or ex.key() != want:
            ex = _Exchange(prev_layout, dtype, device, lpc, self.ax, sizes, self.ctx.timeout_s)
            self._exchanges[idx] = ex
        ex.drain()
        ex.wait_s = 0.0
        return ex

    def _end(self) -> None:
        if self._prev_layout is not None and not self.sync and self._layout != self._prev_layout:
            raise RuntimeError("DistriFusion: the self-attention layers of this forward differ from the previous "
                               "one's; call state.reset() when the model or its inputs change structure")
        wait_s = self._prev.wait_s if isinstance(self._prev, _Exchange) else 0.0
        self.history.append(dict(run_id=self.run_id, lane=list(self._lane), step=self._step_now,
                                 mode="sync" if self.sync else "stale",
                                 layers=self._layer, forward_s=time.perf_counter() - self._t0,
                                 wait_s=wait_s, sync_comm_s=self._comm_s, issued=self.issue))
        self._prev = self._cur
        self._prev_layout = self._layout if self._cur is not None else None
        self._cur = None
        self._calls += 1

    def forward_wrapper(self, old):
        """Wraps the plan's root forward: one call = one step of the run."""
        @functools.wraps(old)
        def forward(*args, **kwargs):
            hs = args[0] if args else kwargs.get("x")  # ComfyUI's model: forward(x, timestep, ...)
            if isinstance(hs, (list, tuple)) and hs and all(isinstance(t, torch.Tensor) for t in hs):
                # a multi-stream latent (MiniMax H3: [video, audio] packed into one sequence by the model)
                self._begin((tuple(tuple(t.shape) for t in hs), hs[0].dtype, hs[0].device))
            elif isinstance(hs, torch.Tensor):
                self._begin((tuple(hs.shape), hs.dtype, hs.device))
            else:
                raise TypeError("DistriFusion needs the latent x as a tensor or a list of stream tensors "
                                "(first argument or keyword)")
            try:
                out = old(*args, **kwargs)
                self._end()
            except BaseException:
                # half a forward leaves inconsistent buffers: the next call starts a new run (in-flight
                # gathers keep their own tensors alive and finish on their own)
                self._forget()
                raise
            return out
        return forward

    def attention(self, q, k, v, *, ctx, seq_sizes, text_len=0, text_first=True, scale=None, backend="auto"):
        """Replaces self-attention (usp_attention's signature) on this rank's patch."""
        layer = self._layer
        self._layer += 1
        ax = self.ax
        me, n = ax.rank, seq_sizes[ax.rank]

        def split(x):
            if text_len == 0:
                return None, x
            return (x[:, :, :text_len], x[:, :, text_len:]) if text_first else \
                (x[:, :, -text_len:], x[:, :, :-text_len])

        def with_text(t, x):
            return x if t is None else (torch.cat([t, x], 2) if text_first else torch.cat([x, t], 2))

        (qt, qi), (kt, ki), (vt, vi) = split(q), split(k), split(v)
        if ki.shape[2] != n:
            raise RuntimeError(f"DistriFusion: layer {layer} holds {ki.shape[2]} image tokens, the split gave {n}")
        B, H, _, D = ki.shape
        self._layout.append((2, B, H, max(seq_sizes), D))
        self._seq_sizes, self._kv_dtype, self._kv_device = list(seq_sizes), ki.dtype, ki.device

        if self.sync:
            blocks = self._gather_now(ki, vi, seq_sizes)
            self._cur.layers.append(blocks)
            K = with_text(kt, torch.cat([b[0] for b in blocks], 2))
            V = with_text(vt, torch.cat([b[1] for b in blocks], 2))
            return F.scaled_dot_product_attention(q, K, V, scale=scale)

        if self._prev_layout is None or layer >= len(self._prev_layout) or \
                self._prev_layout[layer] != self._layout[layer]:
            raise RuntimeError(f"DistriFusion: layer {layer}'s K/V shape {self._layout[layer]} has no stale buffer "
                               f"from the previous step; call state.reset() when the model's structure changes")
        stale = self._prev.blocks(layer)
        if self.issue:
            self._cur.put(layer, ki, vi, ax.stats)
        Ki = torch.cat([ki if r == me else b[0] for r, b in enumerate(stale)], 2)
        Vi = torch.cat([vi if r == me else b[1] for r, b in enumerate(stale)], 2)
        out_i = F.scaled_dot_product_attention(qi, with_text(kt, Ki), with_text(vt, Vi), scale=scale)
        if text_len == 0:
            return out_i
        Ks = torch.cat([b[0] for b in stale], 2)
        Vs = torch.cat([b[1] for b in stale], 2)
        out_t = F.scaled_dot_product_attention(qt, with_text(kt, Ks), with_text(vt, Vs), scale=scale)
        return with_text(out_t, out_i)

    def _gather_now(self, k, v, sizes) -> list:
        """Blocking all-gather of this layer's fresh image K/V: per-rank blocks (2, B, H, n_r, D)."""
        ax = self.ax
        B, H, n, D = k.shape
        P = max(sizes)
        send = k.new_zeros((2, B, H, P, D))
        send[0, :, :, :n].copy_(k)
        send[1, :, :, :n].copy_(v)
        recv = k.new_empty(ax.size * send.numel())   # flat: gloo wants the concatenation, not a stack
        t0 = time.perf_counter()
        work = _gather_single(recv, send.reshape(-1), group=ax.group, async_op=True)
        recv = recv.view((ax.size,) + tuple(send.shape))
        _wait(work, self.ctx.timeout_s, f"the synchronous K/V all-gather of layer {self._layer - 1}", recv.device)
        self._comm_s += time.perf_counter() - t0
        ax.stats.record("distrifusion_sync_kv", send.numel() * send.element_size() * (ax.size - 1))
        order = ax.group_order
        return [recv[order[r], :, :, :, : sizes[r]] for r in range(ax.size)]


def apply_distrifusion(transformer: torch.nn.Module, ctx, plan=None,
                       layers_per_comm: Optional[int] = None) -> torch.nn.Module:
    """Make `transformer` run DistriFusion over ctx's sequence ranks, in place; undo with `unparallelize`.

    Full inputs in, full output out on every rank. The run state is
    `distrifusion_state(transformer)`. `layers_per_comm` layers share one
    asynchronous all-gather (default: about 4 gathers per step).
    """
    cfg = ctx.config
    if cfg.method != "distrifusion":
        raise ValueError(f"apply_distrifusion needs ParallelConfig(method='distrifusion'), got method={cfg.method!r}")
    if cfg.ring_degree > 1 or cfg.pp_degree > 1 or cfg.tp_degree > 1:
        raise ValueError("DistriFusion uses ulysses_degree as the patch count; set ring_degree, pp_degree and "
                         "tp_degree to 1")
    norms = [name for name, m in transformer.named_modules() if isinstance(m, torch.nn.GroupNorm)]
    if norms:
        raise NotImplementedError(f"{type(transformer).__name__} has GroupNorm ({norms[0]}), which a patch cannot "
                                  f"normalise on its own; DistriFusion here covers GroupNorm-free DiTs")
    plan = plan or plan_for(transformer)
    state = DistriFusionState(ctx, cfg.warmup_steps, layers_per_comm)
    apply_plan(transformer, plan, ctx, attention_fn=state.attention)
    applied = transformer._hp_applied
    if ctx.sp.size > 1:  # one patch per rank; with sp 1 (cfg/dp only) there is nothing stale to keep
        wrap_forward(transformer, applied.forwards, state.forward_wrapper)

    def cleanup():
        state.close()
        transformer._hp_distrifusion = None

    applied.cleanups.append(cleanup)
    transformer._hp_distrifusion = state
    return transformer


def distrifusion_state(transformer: torch.nn.Module) -> DistriFusionState:
    """The run state of a model prepared by `apply_distrifusion` (reset(), set_step(), history)."""
    state = getattr(transformer, "_hp_distrifusion", None)
    if state is None:
        raise ValueError("this model is not running DistriFusion: call parallelize() with "
                         "ParallelConfig(method='distrifusion', ...) first")
    return state
