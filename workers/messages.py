"""The typed messages of a run's model calls: what the driver sends and what a rank reads, through one class each.

Why: the ranks read about forty string keys out of payload dicts, so a key spelt one way by the driver and another
by a rank was a value silently missing (a `.get()` answering None) - a reuse not made, a hook group not switched.
A message is a frozen dataclass: the driver builds it by field name (a misspelt field is a TypeError where it is
written), it travels as JSON (`message()`), and a rank reads it back with `from_message()`, which refuses a field it
does not know. Like the load decision (workers/residency.LoadDecision); the tensors travel beside it, by name.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Optional

_SEQUENCES = ("reuse", "changing", "conds")


@dataclass(frozen=True)
class ForwardJob:
    """One step-mode model call (workers/jobs.job_forward), built by workers/bridge/proxy.py."""
    key: str                              # the resident model (workers/bridge/residency.weights_key)
    structure: dict = field(default_factory=dict)  # the call's arguments as JSON, tensors named beside it
    call_index: Optional[int] = None      # the sampler's model call in this run (DistriFusion's warmup / stale step)
    run: Optional[str] = None             # the run these calls belong to (inputs reused only within it)
    previous_call: Optional[int] = None   # the call whose unchanged inputs the workers hold
    reuse: tuple = ()                     # tensors equal to the previous call's: taken from the workers' copy
    changing: tuple = ()                  # tensors new at every call (the latent, the timestep): never kept
    object_values: Optional[dict] = None  # ComfyUI object patches of plain values, set around the call
    hooks: Optional[dict] = None          # the call's hook group (workers/bridge/carry.hook_call)
    bypass: Optional[dict] = None         # LoRA bypass adapters (workers/bridge/carry.bypass_call)
    conds: Optional[tuple] = None         # which conditionings the call holds (ComfyUI's cond_or_uncond)
    compile: Optional[dict] = None        # ComfyUI's TorchCompileModel options
    fbcache: Optional[dict] = None        # First Block Cache's rule and the call's sigma
    kwargs: Optional[dict] = None         # the call's arguments given whole (the doctor, tests) instead of structure

    def __post_init__(self):
        for name in _SEQUENCES:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"a forward job names its resident model (key), got {self.key!r}")

    def message(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if v is not None and v != ()}

    @classmethod
    def from_message(cls, d: dict) -> "ForwardJob":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"forward job: unknown field(s) {unknown} (a ForwardJob has {sorted(known)}): the driver "
                             f"and this rank are not the same version of the pack, or a field is misspelt")
        if "key" not in d:
            raise ValueError("forward job: no key (which resident model to call)")
        return cls(**d)

    def after(self, **changes) -> "ForwardJob":
        """This call with some fields set (the run's reuse of the previous call's inputs: proxy.submit_once)."""
        return replace(self, **changes)
