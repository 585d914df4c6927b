"""The typed messages of a run's model calls: what the driver sends and what a rank reads, through one class each
(a step-mode call: ForwardJob; the workers' whole loop: LoopJob; a model made resident: LoadJob).

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


class _Message:
    """message() / from_message() of a frozen message dataclass: JSON out without the unset fields, and back in
    refusing a field the class does not know (the driver and the rank not the same version, or a misspelt key)."""
    _required = ("key",)
    _what = "a job"

    def _check_key(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"{self._what} names its resident model (key), got {self.key!r}")

    def message(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if v is not None and v != ()}

    @classmethod
    def from_message(cls, d: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        what = cls.__name__
        if unknown:
            raise ValueError(f"{what}: unknown field(s) {unknown} (a {what} has {sorted(known)}): the driver "
                             f"and this rank are not the same version of the pack, or a field is misspelt")
        missing = [k for k in cls._required if k not in d]
        if missing:
            raise ValueError(f"{what}: no {', '.join(missing)} (a {what} needs {list(cls._required)})")
        return cls(**d)


@dataclass(frozen=True)
class ForwardJob(_Message):
    """One step-mode model call (workers/jobs.job_forward), built by workers/driver/step.py from what the proxy
    (workers/bridge/proxy.py) read of ComfyUI's call."""
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
    _what = "a forward job"

    def __post_init__(self):
        for name in _SEQUENCES:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(value))
        self._check_key()

    def after(self, **changes) -> "ForwardJob":
        """This call with some fields set (the run's reuse of the previous call's inputs: step.submit_once)."""
        return replace(self, **changes)


@dataclass(frozen=True)
class LoopJob(_Message):
    """The workers' whole denoising loop (loop mode, PipeFusion: workers/jobs.job_loop), built by
    workers/driver/loop.py; the noise, sigmas and conditioning tensors travel beside it by name."""
    key: str                              # the resident model
    sampler: str                          # ComfyUI's sampler name the workers' loop runs (parallel/sampling.py)
    convention: dict                      # how sigma and the model output map to ComfyUI's denoised (loop_convention)
    structure: dict = field(default_factory=dict)  # the captured conditioning as JSON, tensors named beside it
    cfg_scale: Optional[float] = None     # classifier-free guidance, None when the batch holds no uncond
    step_cache: Optional[dict] = None     # EasyCache's rule (ComfyUI's node or Parallel Config's step_cache)
    object_values: Optional[dict] = None  # ComfyUI object patches of plain values, set around the loop
    run: Optional[str] = None             # names the run's bypass adapters on the workers
    bypass: Optional[dict] = None         # LoRA bypass adapters (workers/bridge/carry.bypass_call)
    previews: Optional[bool] = None       # rank 0 sends its denoised latent each step (set by the pool's submit)
    _required = ("key", "sampler", "convention")
    _what = "a loop job"

    def __post_init__(self):
        self._check_key()


@dataclass(frozen=True)
class LoadJob(_Message):
    """A model made resident on every rank as the driver decided (workers/load_job.job_load_model), built by
    workers/pool.py; the weights and the patches' tensors travel beside it by name."""
    key: str                              # the model's residency key
    family: str                           # the family adapter it runs under (parallel/models), or "vae_comfy"
    decision: dict                        # the driver's LoadDecision (workers/residency.py), as its message()
    native: Optional[dict] = None         # ComfyUI's model spec the rank builds (workers/bridge/spec.native_spec)
    lineage: Optional[str] = None         # this model under other patches: another version is replaced, not kept
    patch_spec: Optional[dict] = None     # ComfyUI's weight patches (workers/bridge/patches.py), their tensors beside
    _required = ("key", "family", "decision")
    _what = "a load job"

    def __post_init__(self):
        self._check_key()
