"""One pipeline stage of PipeFusion: hooks that make ComfyUI's diffusion model run only its own blocks.

Every stage calls the model's *own* forward with the full inputs; hooks driven
by the family plans decide what actually happens:

* the embeddings (patchify, positional / timestep / text embeddings) run on
  every stage: they are a few per cent of a block, and recomputing them is
  cheaper than shipping temb, RoPE tables and text embeddings between stages;
* in patch mode the image sequence is cut to the current band of token rows
  where the sequence-parallel plan splits it (at the first block's input, at Flux's
  `forward_orig`); the
  patch is computed on the full latent and sliced, which is exact because patch embedding is per token;
* blocks before this stage's first block pass their streams through, and the
  one just before it returns what the previous stage's last block computed
  (one message per patch: that block's outputs concatenated plus one control
  element: cancel = 1, skip = 2 - a forward the step cache skips runs no block
  on any stage); this stage's last block sends its outputs on and stops the
  forward (`_StageDone`), so norm_out / proj_out / unpatchify only run on the
  last stage, where the patch output is scattered into a zero full-size
  sequence before unpatchify;
* inside every self-attention module of its blocks, F.scaled_dot_product_attention
  is swapped (TorchFunctionMode, the model's attention code untouched) for attention
  over the layer's KV buffer: full mode stores the fresh image K/V of the whole
  image; patch mode writes the patch's fresh K/V into its rows and attends to
  the buffer, i.e. stale K/V (previous step) for patches not yet recomputed.
  Text tokens of joint attention are always fresh: they are recomputed with
  every patch and travel between stages with it.

With sequence parallelism (seed 002, the pp x sp hybrid) every forward's token
range - the whole image in full mode, the patch in patch mode - is split again
over the sp ranks (uneven pieces allowed), so the image is cut into
num_pipeline_patch x sp_degree pieces. Each rank computes only its piece; in
every self-attention the pieces' fresh K/V are all-gathered over the sp group
and written into the rank's KV buffer, so after one diffusion step every sp rank
holds the whole fresh buffer; queries of the piece attend to that buffer. At the
gather point the pieces are all-gathered again, so every sp rank of the last
stage holds the patch output and applies the same sampler step. Ulysses and
Ring degrees only size the sp group here: the KV-buffer exchange is the same
all-gather for both (plain USP attention cannot serve stale K/V).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..comm import all_gather_uneven, complete, split_sizes
from ..attention_seam import sdpa_arguments
from ..plan import GatherOutput, SplitInput, SplitOutput, path_matches, restore_forwards, wrap_forward
from ..plan_inputs import _arg, _set_arg
from .plans import flat_blocks

TAG_ACT, TAG_LATENT = 11, 12


class _StageDone(Exception):
    """Raised by this stage's last block: the rest of the forward belongs to later stages."""


class _StageSkipped(Exception):
    """Raised by this stage's first block when the step cache skips this forward (passed down the pipeline)."""


SKIPPED = "skipped"  # what Stage.forward returns on the last stage for a forward the step cache skipped
_FLAG_NONE, _FLAG_CANCEL, _FLAG_SKIP = 0.0, 1.0, 2.0


class PipelineCancelled(RuntimeError):
    """The run was cancelled; every rank of the pipeline raises it at the same step."""


@dataclass
class Run:
    """What the current forward computes: the whole image ("full") or one band of token rows ("patch")."""
    mode: str = "full"
    t0: int = 0
    t1: int = 0
    n_tokens: int = 0
    cancel: bool = False
    skip: bool = False  # the step cache skips this forward: no block runs on any stage, the K/V buffers stay
    pieces: tuple = ()  # with sp > 1: the sp ranks' token counts within [t0, t1)
    s0: int = 0         # this rank's piece [s0, s1)
    s1: int = 0


class Channel:
    """Point-to-point messages along the pp axis, each wait bounded by a timeout; counts bytes sent."""

    def __init__(self, ax, timeout_s: float):
        self.ax, self.timeout_s = ax, timeout_s
        self.pending = []

    def send(self, t: torch.Tensor, dst: int, tag: int, op: str) -> None:
        t = t.contiguous()
        self.pending = [(w, b) for w, b in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(t, self.ax.global_rank(dst), group=self.ax.group, tag=tag), t))
        self.ax.stats.record(op, t.numel() * t.element_size())

    def recv(self, buf: torch.Tensor, src: int, tag: int):
        return dist.irecv(buf, self.ax.global_rank(src), group=self.ax.group, tag=tag), buf

    def wait(self, handle, what: str) -> torch.Tensor:
        work, buf = handle
        try:
            complete(work, buf.device, self.timeout_s)
        except RuntimeError as e:
            raise TimeoutError(f"PipeFusion stage {self.ax.rank}: no {what} within "
                               f"{self.timeout_s:.0f} s (did another stage fail?): {e}") from e
        return buf

    def flush(self) -> None:
        for w, b in self.pending:
            complete(w, b.device, self.timeout_s)
        self.pending = []


class _KVAttention(TorchFunctionMode):
    """Self-attention over the layer's KV buffer (see the module docstring)."""

    def __init__(self, stage, key, text_first):
        super().__init__()
        self.stage, self.key, self.text_first = stage, key, text_first

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, a = sdpa_arguments(args, kwargs, "PipeFusion's KV buffer")
        run, bufs = self.stage.run, self.stage.kv
        n = k.shape[2] - (run.s1 - run.s0)  # what k holds beyond this call's image tokens is the (fresh) text
        if n < 0:
            raise RuntimeError(f"{self.key}: attention over {k.shape[2]} keys for {run.s1 - run.s0} image tokens")

        def split(x):  # -> text, image
            if n == 0:
                return None, x
            return (x[:, :, :n], x[:, :, n:]) if self.text_first else (x[:, :, -n:], x[:, :, :-n])

        (kt, ki), (vt, vi) = split(k), split(v)
        sp = self.stage.sp
        if run.pieces:  # the fresh K/V of the whole range, from every sp rank's piece: one gather for both
            ki, vi = all_gather_uneven(torch.stack([ki, vi]), 3, sp, sizes=run.pieces).unbind(0)
        if run.mode == "full":
            bufs[self.key] = (ki.clone(), vi.clone())
            if not run.pieces:
                return func(q, k, v, **a)  # the very call the serial model makes
            if n:
                ki, vi = (torch.cat([kt, ki], 2), torch.cat([vt, vi], 2)) if self.text_first else \
                    (torch.cat([ki, kt], 2), torch.cat([vi, vt], 2))
            return func(q, ki, vi, **a)
        if self.key not in bufs:
            raise RuntimeError(f"no KV buffer for {self.key}: PipeFusion needs warmup_steps >= 1")
        bk, bv = bufs[self.key]
        if ki.shape[2] != run.t1 - run.t0 or bk.shape[2] != run.n_tokens:
            raise RuntimeError(f"{self.key}: patch of {ki.shape[2]} tokens / buffer of {bk.shape[2]} does not "
                               f"match tokens [{run.t0}, {run.t1}) of {run.n_tokens}")
        bk[:, :, run.t0:run.t1] = ki
        bv[:, :, run.t0:run.t1] = vi
        if n:
            bk, bv = (torch.cat([kt, bk], 2), torch.cat([vt, bv], 2)) if self.text_first else \
                (torch.cat([bk, kt], 2), torch.cat([bv, vt], 2))
        return func(q, bk, bv, **a)


def _bind(fn):
    sig = inspect.signature(fn)
    return lambda args, kwargs: sig.bind(*args, **kwargs)


def _locators(fn, streams) -> list:
    """(name, position) of each stream: given, or the name's position in fn's signature."""
    params = [p.name for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    out = []
    for st in streams:
        name, pos = (st, None) if isinstance(st, str) else st
        out.append((name, pos if pos is not None else (params.index(name) if name in params else None)))
    return out


class Stage:
    """Installs the hooks of stage `index` of `count` (blocks [start, stop)) on `model`; `remove()` undoes them."""

    def __init__(self, model, family_plan, pipe_plan, index: int, count: int, start: int, stop: int,
                 channel: Optional[Channel], call, sp=None):
        self.model, self.fplan, self.pplan, self.call = model, family_plan, pipe_plan, call
        self.sp = sp if sp is not None and sp.size > 1 else None
        self.index, self.count, self.start, self.stop = index, count, start, stop
        self.first, self.last = index == 0, index == count - 1
        self.channel = channel
        self.run = Run()
        self.kv = {}
        self._handles, self._forwards = [], []
        self.blocks = flat_blocks(model, pipe_plan)
        try:
            self._install()
        except BaseException:
            self.remove()
            raise

    # ---- install / remove ----
    def _wrap(self, module, make):
        wrap_forward(module, self._forwards, make)

    def _wrap_method(self, module, name, hooks):
        def make(old):
            @functools.wraps(old)
            def method(*args, **kwargs):
                for hook in hooks:
                    cut = hook(None, args, kwargs)
                    if cut is not None:
                        args, kwargs = cut
                return old(*args, **kwargs)
            return method
        wrap_forward(module, self._forwards, make, name=name)

    def _install(self):
        mods = dict(self.model.named_modules())
        for key, actions in self.fplan.sequence.items():
            if key == "":
                continue
            path, _, method = key.partition(":")
            if method:  # a method whose inputs carry the image sequence (ComfyUI's forward_orig): cut them there
                if path not in mods or not callable(getattr(mods[path], method, None)):
                    raise KeyError(f"{self.fplan.family} plan names method {key!r}, which the model lacks")
                cuts = [self._cut_input(a) for a in actions if isinstance(a, SplitInput) and not a.text]
                self._wrap_method(mods[path], method, cuts)
                continue
            targets = [m for p, m in mods.items() if p and path_matches(p, path)]
            if not targets:
                raise KeyError(f"{self.fplan.family} plan names module {path!r}, which the model lacks")
            for mod in targets:
                for a in actions:
                    if isinstance(a, SplitOutput):
                        self._handles.append(mod.register_forward_hook(self._cut_output(a.dim)))
                    elif isinstance(a, GatherOutput):
                        self._handles.append(mod.register_forward_hook(self._scatter_output(a.dim)))
                    elif isinstance(a, SplitInput) and not a.text:  # before the block wrapper: every stage cuts its
                        # input (a patch is a band of image rows; the text goes whole with every patch)
                        self._handles.append(mod.register_forward_pre_hook(self._cut_input(a), with_kwargs=True))
        own = set()
        for j, (path, mod, spec) in enumerate(self.blocks):
            self._wrap(mod, self._block(j, spec))
            if self.start <= j < self.stop:
                own.add(path)
        n_attn = 0
        for path, mod in mods.items():
            if not any(path == b or path.startswith(b + ".") for b in own):
                continue
            for pattern, spec in self.fplan.attention.items():
                if path_matches(path, pattern):
                    self._wrap(mod, self._attention(path, spec))
                    n_attn += 1
                    break
        if n_attn == 0:
            raise KeyError(f"{self.fplan.family}: no self-attention module matched in blocks "
                           f"[{self.start}, {self.stop})")
        self._wrap(self.model, self._root())

    def remove(self):
        for h in self._handles:
            h.remove()
        restore_forwards(self._forwards)
        self._handles = []

    # ---- the image sequence ----
    @property
    def _cutting(self) -> bool:
        return self.run.mode == "patch" or bool(self.run.pieces)

    def _cut(self, x, dim):
        dim = dim % x.ndim
        if x.shape[dim] != self.run.n_tokens:
            raise RuntimeError(f"{self.fplan.family}: the sequence has {x.shape[dim]} tokens where "
                               f"{self.run.n_tokens} were expected; the pipeline plan is inconsistent")
        return x.narrow(dim, self.run.s0, self.run.s1 - self.run.s0)

    def _cut_output(self, dim):
        def hook(module, args, out):
            if not self._cutting:
                return out
            if isinstance(out, tuple):
                return tuple(self._cut(o, dim) if isinstance(o, torch.Tensor) else o for o in out)
            return self._cut(out, dim)
        return hook

    def _cut_input(self, spec):
        def hook(module, args, kwargs):
            if not self._cutting:
                return None
            value, where = _arg(args, kwargs, spec.name, spec.position)
            if not isinstance(value, torch.Tensor) or (spec.only_ndim is not None and value.ndim != spec.only_ndim):
                return None
            d = spec.dim % value.ndim
            if spec.only_full and value.shape[d] != self.run.n_tokens:
                n = value.shape[d]
                if not (spec.per_group and 1 < n < self.run.n_tokens and self.run.n_tokens % n == 0):
                    return None  # broadcast (one entry for every token): whole on every patch
                # one entry per equal group of tokens (Wan's per-frame modulation): per token, then this patch's
                value = value.repeat_interleave(self.run.n_tokens // n, dim=d)
            return _set_arg(args, kwargs, where, self._cut(value, spec.dim))
        return hook

    def _scatter_output(self, dim):
        def hook(module, args, out):
            if self.run.pieces:  # every sp rank gets the whole range [t0, t1)
                out = all_gather_uneven(out, dim % out.ndim, self.sp, sizes=self.run.pieces)
            if self.run.mode != "patch":
                return out
            d = dim % out.ndim
            shape = list(out.shape)
            shape[d] = self.run.n_tokens
            full = out.new_zeros(shape)
            full.narrow(d, self.run.t0, self.run.t1 - self.run.t0).copy_(out)
            return full
        return hook

    def _root(self):
        specs = [a for a in self.fplan.sequence.get("", []) if isinstance(a, SplitInput) and not a.text]

        def make(old):
            bind = _bind(old)

            @functools.wraps(old)
            def forward(*args, **kwargs):
                if self._cutting and specs:
                    b = bind(args, kwargs)
                    for s in specs:
                        v = b.arguments.get(s.name)
                        if isinstance(v, torch.Tensor) and (s.only_ndim is None or v.ndim == s.only_ndim):
                            b.arguments[s.name] = self._cut(v, s.dim)
                    args, kwargs = b.args, b.kwargs
                return old(*args, **kwargs)
            return forward
        return make

    # ---- blocks ----
    def _block(self, j, spec):
        """Block j's wrapper. The message between stages s and s+1 is what stage s's last block returns: stage
        s+1 runs that block as a pass-through and returns the received tensors in its place, so whatever the model
        does between two blocks (Flux joins text and image into one stream after its double blocks, ControlNet adds
        its residuals) runs on the receiving stage exactly as in the serial forward. A cancelled or skipped
        forward passes its streams through this stage's own blocks too and forwards the flag from its last one."""
        def make(old):
            where = _locators(old, spec.streams)

            def passed(args, kwargs) -> tuple:
                """This block's streams as it would return them had it computed nothing."""
                got = {}
                for n, pos in where:
                    got[n], _ = _arg(args, kwargs, n, pos)
                    if got[n] is None:
                        raise RuntimeError(f"{self.fplan.family} block {j}: stream {n!r} not among its arguments")
                return tuple(got[n] for n in spec.returns)

            def stop_here():
                if self.run.cancel:
                    raise PipelineCancelled("cancelled")
                if self.run.skip:
                    raise _StageSkipped

            def result(outs):
                return outs if len(outs) > 1 else outs[0]

            @functools.wraps(old)
            def forward(*args, **kwargs):
                run = self.run
                if j < self.start:  # an earlier stage's block
                    outs = passed(args, kwargs)
                    if j == self.start - 1:  # the previous stage's last block: its output comes from that stage
                        outs = self._receive(outs)
                        if self.last:
                            stop_here()
                    return result(outs)
                if j == self.start and self.first and self.last:
                    stop_here()
                if run.cancel or run.skip:  # pass through; the last own block tells the next stage
                    outs = passed(args, kwargs)
                    if j == self.stop - 1:
                        self._send(outs, flag=_FLAG_CANCEL if run.cancel else _FLAG_SKIP)
                        stop_here()
                    return result(outs)
                out = old(*args, **kwargs)
                if j == self.stop - 1 and not self.last:
                    self._send(out if isinstance(out, tuple) else (out,), flag=_FLAG_NONE)
                    raise _StageDone
                return out
            return forward
        return make

    def _receive(self, like: tuple) -> tuple:
        """The previous stage's last block's output, in the shapes of `like` (that block passed through here)."""
        buf = torch.empty(sum(t.numel() for t in like) + 1, dtype=like[0].dtype, device=like[0].device)
        buf = self.channel.wait(self.channel.recv(buf, self.index - 1, TAG_ACT), "activations from the previous stage")
        flag = float(buf[-1])
        self.run.cancel = self.run.cancel or flag == _FLAG_CANCEL
        self.run.skip = flag == _FLAG_SKIP
        off, out = 0, []
        for t in like:
            out.append(buf[off:off + t.numel()].view(t.shape))
            off += t.numel()
        return tuple(out)

    def _send(self, tensors: tuple, flag: float):
        parts = [t.reshape(-1) for t in tensors]
        flag = parts[0].new_full((1,), flag)
        self.channel.send(torch.cat(parts + [flag]), self.index + 1, TAG_ACT, "pp_activations")

    # ---- attention ----
    def _attention(self, path, spec):
        def make(old):
            @functools.wraps(old)
            def forward(*args, **kwargs):
                with _KVAttention(self, path, spec.text_first):
                    return old(*args, **kwargs)
            return forward
        return make

    # ---- one forward ----
    def forward(self, kwargs: dict, run: Run):
        """The model output on the last stage (SKIPPED when the step cache skipped it), None on the others (their
        part went to the next stage)."""
        run.s0, run.s1, run.pieces = run.t0, run.t1, ()
        if self.sp is not None:
            run.pieces = tuple(split_sizes(run.t1 - run.t0, self.sp.size))
            run.s0 = run.t0 + sum(run.pieces[:self.sp.rank])
            run.s1 = run.s0 + run.pieces[self.sp.rank]
        self.run = run
        try:
            with torch.no_grad():
                return self.call(self.model, kwargs)
        except _StageDone:
            return None
        except _StageSkipped:
            return SKIPPED if self.last else None
