"""First Block Cache on the ranks: Comfy-WaveSpeed's rule, run inside the workers' model, decided alike on every rank.

Why here: First Block Cache (Comfy-WaveSpeed's "Apply First Block Cache") looks inside the model call - it runs the
first transformer block, compares that block's residual on the image tokens with the previous step's, and below a
threshold skips the other blocks, adding the residual they made last time. Its node does this to ComfyUI's model in
ComfyUI's process, which never runs on the pool; so the workers apply the same rule to their model. With sequence
parallelism a rank holds part of the image tokens (with CFG or data parallel, part of the batch): the similarity is
a mean over the whole tensor, so each rank's sums are all-reduced over the world and every rank takes the decision
one device takes on the whole. The residuals a rank keeps are its own shard's.

The rule, as the node computes it (read in its public code; this is the pack's own implementation):
- a model call whose timestep is above the previous call's, or whose input differs in shape after the batch or in
  dtype, starts over (no cache); a call at the same timestep as the previous one is the next chunk of that step
  (ComfyUI splitting the batch) with its own buffers, at a lower timestep chunk 0;
- chunk 0 uses the cache when mean|r - r_prev| / mean|r_prev| < threshold (r: the first block's residual on the
  image stream), and - where the node validates - the timestep lies in its [end, start] sigma window and fewer than
  `max_hits` cache hits came in a row; a later chunk uses it where chunk 0 did and its residual's shape matches;
- a hit adds the stored residuals of the other blocks (image and text streams) to the first block's output; a miss
  runs them and stores their residuals.

Pure torch (no ComfyUI): the block list and its streams come from the family's pipeline plan (parallel/plan.py
BlockList); the driver reads the node's parameters (workers/bridge/fbcache.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class FirstBlockRule:
    blocks: str                 # the model's block list (the family's first BlockList: "joint_blocks")
    streams: tuple              # ((stream, position or None: by name), ...) the blocks take
    returns: tuple              # the streams a block returns, in order
    image: str                  # the stream whose first-block residual is compared ("x")
    threshold: float
    validate: bool = False      # the node's window and run limit apply
    start_sigma: float = float("inf")
    end_sigma: float = float("-inf")
    max_hits: int = -1          # -1: no limit

    def message(self) -> dict:
        return {k: (list(map(list, v)) if k == "streams" else list(v) if k == "returns" else v)
                for k, v in asdict(self).items()}

    @classmethod
    def from_message(cls, m: Optional[dict]) -> Optional["FirstBlockRule"]:
        if not m:
            return None
        m = dict(m)
        m["streams"] = tuple(tuple(s) for s in m["streams"])
        m["returns"] = tuple(m["returns"])
        return cls(**m)


class FirstBlockState:
    """One run's cache on one rank: the previous call's timestep and input, the chunk, and each chunk's residuals."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.prev_t, self.prev_input, self.chunk = None, None, 0
        self.buffers: dict = {}  # (name, chunk) -> tensor
        self.use, self.hits = False, 0
        self.skipped = 0  # calls whose other blocks were skipped (the benchmark reads it)

    def begin(self, x: torch.Tensor, t: float) -> None:
        """Before a model call (the node's bookkeeping around each call)."""
        shape = (tuple(x.shape[1:]), x.dtype)
        if self.prev_t is None or self.prev_input != shape or t > self.prev_t:
            skipped = self.skipped
            self.reset()
            self.skipped = skipped
        elif t == self.prev_t:
            self.chunk += 1
        else:
            self.chunk = 0
        self.t = t

    def end(self, x: torch.Tensor, t: float) -> None:
        self.prev_t, self.prev_input = t, (tuple(x.shape[1:]), x.dtype)

    def get(self, name: str):
        return self.buffers.get((name, self.chunk))

    def put(self, name: str, value) -> None:
        self.buffers[(name, self.chunk)] = value

    def decide(self, rule: FirstBlockRule, residual: torch.Tensor, reduce: Optional[Callable]) -> bool:
        """Whether this call uses the cache: the same answer on every rank (sums all-reduced by `reduce`)."""
        prev = self.get("first")
        if prev is None:
            return False
        if reduce is None:  # one rank: the node's own arithmetic
            similar = prev.shape == residual.shape and (
                self.chunk > 0 or ((prev - residual).abs().mean() / prev.abs().mean()).item() < rule.threshold)
        else:
            same = prev.shape == residual.shape
            sums = torch.zeros(3, dtype=torch.float64, device=residual.device)
            sums[0] = 0.0 if same else 1.0
            if same and self.chunk == 0:
                sums[1] = (prev - residual).abs().sum(dtype=torch.float64)
                sums[2] = prev.abs().sum(dtype=torch.float64)
            reduce(sums)
            similar = bool(sums[0] == 0) and (self.chunk > 0 or float(sums[1] / sums[2]) < rule.threshold)
        if self.chunk > 0:
            self.use = self.use and similar
            return self.use
        if rule.validate:
            similar = similar and rule.end_sigma <= self.t <= rule.start_sigma
            similar = similar and (rule.max_hits < 0 or self.hits < rule.max_hits)
            self.hits = self.hits + 1 if similar else 0
        self.use = similar
        return similar


class CachedBlocks(torch.nn.Module):
    """Stands in for the model's block list during a call: the first block, the decision, then the other blocks or
    their stored residuals. The blocks themselves (and the parallel plan's hooks on them) run unchanged."""

    def __init__(self, blocks, rule: FirstBlockRule, state: FirstBlockState, reduce: Optional[Callable]):
        super().__init__()
        self._blocks = [blocks]  # not a submodule: the model's own ModuleList stays its only owner
        self.rule, self.state, self.reduce = rule, state, reduce

    def _streams(self, args: tuple, kwargs: dict) -> dict:
        return {name: (args[pos] if pos is not None and pos < len(args) else kwargs.get(name))
                for name, pos in self.rule.streams}

    def _call(self, block, args: tuple, kwargs: dict, values: dict):
        args, kwargs = list(args), dict(kwargs)
        for name, pos in self.rule.streams:
            if pos is not None and pos < len(args):
                args[pos] = values[name]
            else:
                kwargs[name] = values[name]
        out = block(*args, **kwargs)
        out = out if isinstance(out, (tuple, list)) else (out,)
        return dict(zip(self.rule.returns, out))

    def forward(self, *args, **kwargs):
        blocks, rule, state = self._blocks[0], self.rule, self.state
        seen = {}

        def capture(module, a, kw):  # the first block's inputs after the plan's own hooks (its sequence split)
            seen.update(self._streams(a, kw))

        handle = blocks[0].register_forward_pre_hook(capture, with_kwargs=True)
        try:
            first = self._call(blocks[0], args, kwargs, self._streams(args, kwargs))
        finally:
            handle.remove()
        residual = first[rule.image] - seen[rule.image]
        if state.decide(rule, residual, self.reduce):
            state.skipped += 1
            out = {}
            for name, value in first.items():
                stored = state.get(f"rest.{name}")
                out[name] = None if stored is None or value is None else (stored + value).contiguous()
        else:
            state.put("first", residual)
            out = dict(first)
            for block in blocks[1:]:
                out = self._call(block, args, kwargs, {**seen, **out})
            for name in rule.returns:
                if out.get(name) is None or first.get(name) is None:
                    state.put(f"rest.{name}", None)
                else:
                    state.put(f"rest.{name}", out[name] - first[name])
        return tuple(out[name] for name in rule.returns)


@contextmanager
def first_block_cache(model: torch.nn.Module, rule: Optional[FirstBlockRule], state: Optional[FirstBlockState],
                      reduce: Optional[Callable]):
    """While a model call runs: the model's block list is one CachedBlocks over the same blocks (the node swaps the
    list the same way). Nothing happens without a rule."""
    if rule is None:
        yield
        return
    blocks = getattr(model, rule.blocks)
    setattr(model, rule.blocks, torch.nn.ModuleList([CachedBlocks(blocks, rule, state, reduce)]))
    try:
        yield
    finally:
        setattr(model, rule.blocks, blocks)
