"""What the ranks hold, and the one decision of how a model becomes resident: the driver's.

Why one owner: whether a model is already resident, whether a LoRA strength change patches the resident version in
place, whether a config change rebuilds from weights the ranks kept, and whether weights must travel used to be
decided twice - by the pool from its own guesses (the keys it had loaded through patches, the lineages it had seen)
and again by each worker from what it held - with a "send me the weights" round trip between them. Two owners drift:
a guess that a patched version was resident is how a state leak serves one prompt another's weights.

Now the ranks report their residency after every job (`Slot`s: which key, built for which layout, of which
lineage, whether its unpatched base and its source weights are kept), the driver decides from that report alone
(`decide`), and sends the decision as one typed message (`LoadDecision`). A worker executes it straight through; if
its state is not what the report said (a job failed after the report), it answers "stale" with its own report and
the driver decides again - never a guess.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
import os
from typing import Optional

from .transport import nbytes, unlink

ACTIONS = ("touch", "patch", "rebuild", "build")


@dataclass(frozen=True)
class Slot:
    """One resident model as a rank reports it (parallel/engine.Engine.ledger)."""
    slot: str                     # the engine's name for it: the key, scoped by its layout where parallelized
    key: str                      # the driver's key: what the weights hold (workers/bridge/residency.weights_key)
    family: str
    layout: Optional[str] = None  # the layout it was parallelized for (ParallelConfig.layout_name); None: any
    lineage: Optional[str] = None  # the driver's model object: other patch versions share it
    base: bool = False            # its unpatched weights are kept: a new patch version is applied to it in place
    source: bool = False          # the weights it was built from are kept: another layout rebuilds from them

    @classmethod
    def from_report(cls, d: dict) -> "Slot":
        return cls(**{k: d.get(k) for k in cls.__dataclass_fields__ if k in d})


@dataclass(frozen=True)
class LoadDecision:
    """How `key` becomes resident on every rank. `touch`: it is (most recently used now). `patch`: the version in
    `slot` (same lineage, base kept) is re-patched in place with the patches that travel (none: back to its base).
    `rebuild`: built for this layout from the weights `slot` kept (a config change; no weights travel). `build`:
    from weights that travel (`weights`: "sent", through shared memory)."""
    action: str
    key: str
    slot: Optional[str] = None
    weights: Optional[str] = None
    undo: bool = False  # patch: the model's unpatched version (an empty patch set travels)

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"load action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.action in ("patch", "rebuild") and not self.slot:
            raise ValueError(f"a {self.action} decision names the resident slot it works on")
        if self.action == "build" and self.weights != "sent":
            raise ValueError("a build decision says where the weights come from: 'sent'")

    @property
    def needs_weights(self) -> bool:
        return self.action == "build"

    def message(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_message(cls, d: dict) -> "LoadDecision":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


def decide(slots: list, key: str, *, layout: str, lineage: Optional[str], patches: bool,
           whole_model: bool) -> LoadDecision:
    """The load decision for `key` on ranks that report `slots`, for a config of `layout`.

    `patches`: the weights are the model's base and its weight patches travel (workers/bridge/patches.py);
    `whole_model`: the ranks hold whole weights (no tp / pp / sharding - what patches in place need; what a rank
    keeps to rebuild another layout from)."""
    here = [s for s in slots if s.layout in (None, layout)]
    if any(s.key == key for s in here):
        return LoadDecision("touch", key)
    if lineage is not None and (patches or whole_model):
        # another patch version of this model, built for this layout with its base kept: patch it in place (an
        # unpatched version of a model whose patched one is resident undoes its patches the same way)
        relative = next((s for s in here if s.lineage == lineage and s.base), None)
        if relative is not None:
            return LoadDecision("patch", key, slot=relative.slot, undo=not patches)
    # built for another layout: its kept weights serve, unless they are a patched layout's base and no patches
    # come to be applied again (that would run the model without its LoRA)
    kept = next((s for s in slots if s.key == key and s.source and (patches or not s.base)), None)
    if kept is not None:
        return LoadDecision("rebuild", key, slot=kept.slot)
    return LoadDecision("build", key, weights="sent")


def ledger(world) -> list:
    """The slots rank 0 of `world` reported last ([] for no world: nothing is resident)."""
    return [] if world is None else list(world.slots)


def report(values: dict) -> Optional[list]:
    """The Slots of a job's reply, or None when it carries no report (workers/jobs.make_executor adds it)."""
    slots = values.get("residency")
    return None if slots is None else [Slot.from_report(d) for d in slots]


STALE_RETRIES = 2  # a decision the ranks answer "stale" is made again from their report; more means a bug


def ensure_model(pool, config, base: dict, *, state_dict, timeout_s, lineage, adopt, patches) -> dict:
    """Make `base["key"]` resident on every rank of `pool` as decided here (see the module's docstring); the job's
    `base` values (key, family, config, native spec) travel with the decision. Weights are written before the pool is
    taken when the ranks' last report says they will travel (the copy overlaps Parallel Config's prestart), and only
    then; patches travel with a build or a patch decision. Returns rank 0's answer."""
    key = base["key"]
    request = dict(layout=config.layout_name(), lineage=lineage, patches=patches is not None,
                   whole_model=config.whole_model)
    pool.last_load_bytes = 0
    written = {}

    def write() -> dict:
        sd = state_dict() if callable(state_dict) else state_dict
        pool.last_load_bytes += nbytes(sd)
        # a dict made for this call (a callable's) is emptied as it is written: each tensor is let go at once
        return pool._write_weights(sd if callable(state_dict) else dict(sd), adopt)

    if decide(ledger(pool.world), key, **request).weights == "sent":
        written = write()
    try:
        with pool._lock:
            for _ in range(STALE_RETRIES + 1):
                decision = decide(ledger(pool.ensure_world(config)), key, **request)
                values = {**base, "decision": decision.message()}
                tensors = {}
                if decision.action in ("build", "rebuild", "patch") and (patches is not None or decision.undo):
                    spec, tensors = patches if patches is not None else ({}, {})
                    values["patch_spec"], tensors = spec, dict(tensors)
                    pool.last_load_bytes += nbytes(tensors)
                if decision.weights == "sent" and not written:
                    written = write()
                res = pool.submit(config, "load_model", values, tensors, timeout_s=timeout_s,
                                  written=written if decision.weights == "sent" else None)
                if not res.values.get("stale"):
                    pool.last_load = dict(res.values)
                    return pool.last_load
            raise RuntimeError(f"load_model {key!r}: the ranks answered {res.values['stale']!r} to a decision made from "
                               f"their own report {STALE_RETRIES + 1} times")
    finally:
        for d in written.values():  # normally removed by the job that carried them; not if it never started
            unlink(d, pool.shm_prefix)
        pool._written.difference_update(d["name"] for d in written.values())
