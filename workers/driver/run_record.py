"""One prompt's run on the pool, typed in two parts: the plan (`RunPlan`, frozen) that plan.pool_state decided
before any worker started, and the record of what the run does as it goes (`RunRecord`, mutable, holding its plan).

Why two: the plan is what the refusals checked - the residency key, ComfyUI's model spec, what travels with each call
- and a reader that changed it mid-run (a hook flag turned off, another key) would run something the checks never saw;
frozen, such a write fails where it is made. The run's own state (the call counter, what the workers hold for this
run) changes at every call, from step mode (driver/step.py) and the loop (driver/loop.py) only. Dataclasses and not
dicts: a misspelt key in a dict read as None - a hook group silently not sent - where an attribute fails loudly.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from ..messages import NativeSpec


@dataclass(frozen=True)
class RunPlan:
    """Decided before any worker starts (plan.pool_state), after every refusal; read, never written, by the run."""
    key: str                       # the resident weights' key: base model, patches digest, compute dtype, method
    lineage: str                   # this model under other patches: replaced on the workers, not kept beside
    native: NativeSpec             # ComfyUI's model spec the workers build (workers/bridge/spec.py native_spec)
    weight_patches: tuple | None = None  # ComfyUI's weight patches as they travel, or None (the weights travel patched)
    compile: dict | None = None    # TorchCompileModel's options for the workers, or None
    object_values: dict | None = None  # plain object patches that travel with each call
    hooks: bool = False            # hook LoRAs: each call's hook group travels (carry.hook_call)
    bypass: dict = field(default_factory=dict)  # LoRA bypass adapters, injected around each call on the ranks
    fbcache: dict | None = None    # First Block Cache's rule (parallel/fbcache.FirstBlockRule), applied by the ranks


@dataclass
class RunRecord:
    """A run of `plan` as it goes: written by step mode (workers/driver/step.py, through the
    proxy) and the loop (workers/driver/loop.py, its capture flag through workers/bridge/loop_mode.py)."""
    plan: RunPlan
    calls: int = 0                 # model calls so far (the workers' call index)
    resident: bool = False         # the weights are on the workers for this run
    family: str | None = None      # the family adapter the workers run (their answer to the load)
    capture: bool = False          # loop mode: the next model call hands ComfyUI's inputs over, computing nothing
    run: str = field(default_factory=lambda: uuid.uuid4().hex)  # names this run's tensors on the workers
    sent: dict | None = None       # the previous call's tensors (submit_once reuses what did not change)
    hooks_sent: set = field(default_factory=set)   # hook groups the workers hold for this run
    bypass_sent: set = field(default_factory=set)  # bypass adapter sets the workers hold for this run
