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

Eviction has the same one owner (`room`): every rank reports (`Report`: its slots with their device bytes, its
free device bytes after a load), the driver picks the slots to evict from all the reports and every rank drops
exactly those. Why: each rank used to evict by its own free memory; the rank beside ComfyUI's own models, shorter
of memory, dropped a model rank 0 kept, and the next "touch" of it failed a forward with a KeyError. A rank that
finds, building, that the decided room is not enough does not evict on its own either: all the ranks agree on it
(one all-reduce, parallel/engine.Engine.add) and answer "short" with their numbers, and the driver decides again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Optional


ACTIONS = ("touch", "patch", "rebuild", "build")


def is_vae_family(family: str) -> bool:
    """A VAE's family name (vae_comfy, ...): VAEs are not counted against max_models."""
    return family.startswith("vae")


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
    bytes: int = 0                # its parameters and buffers on the rank's accelerator (0: a host rank)

    @property
    def is_vae(self) -> bool:
        return is_vae_family(self.family)

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
    evict: tuple = ()   # build / rebuild: the slots every rank drops first (`room`), least recently used first

    def __post_init__(self):
        object.__setattr__(self, "evict", tuple(self.evict))
        if self.action not in ACTIONS:
            raise ValueError(f"load action must be one of {', '.join(ACTIONS)}, got {self.action!r}")
        if self.action in ("patch", "rebuild") and not self.slot:
            raise ValueError(f"a {self.action} decision names the resident slot it works on")
        if self.action == "build" and self.weights != "sent":
            raise ValueError("a build decision says where the weights come from: 'sent'")
        if self.evict and self.action not in ("build", "rebuild"):
            raise ValueError(f"only a build or a rebuild makes room; a {self.action} decision evicts nothing")

    @property
    def needs_weights(self) -> bool:
        return self.action == "build"

    def message(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()
                if v is not None and v != ()}

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


@dataclass(frozen=True)
class Report:
    """One rank's answer about what it holds: its slots (least recently used first), and on an accelerator the
    bytes free there (measured after a load, the allocator's cache emptied; None: a host rank, models counted only)
    and, in a "short" answer, the bytes the decided model needed on this rank."""
    slots: tuple = ()
    free: Optional[int] = None
    need: Optional[int] = None

    @classmethod
    def from_message(cls, d) -> "Report":
        """Read back what parallel/engine.Engine.report sent (the engine builds the message: it imports no workers/)."""
        if isinstance(d, list):  # slots only (a fake rank's or an older reply's)
            d = {"slots": d}
        return cls(tuple(Slot.from_report(s) for s in d.get("slots") or ()), d.get("free"), d.get("need"))


def ledger(world) -> list:
    """The slots every rank of `world` reported holding last, in rank 0's order ([] for no world: nothing is
    resident). A slot one rank lacks (a job that failed on some ranks) counts as not resident: it is built again."""
    if world is None:
        return []
    held = [{s.slot for s in r.slots} for r in world.reports[1:]]
    return [s for s in world.slots if all(s.slot in h for h in held)]


def report(values: dict) -> Optional[Report]:
    """The Report of a job's reply, or None when it carries none (workers/jobs.make_executor adds it)."""
    d = values.get("residency")
    return None if d is None else Report.from_message(d)


def room(reports: list, key: str, *, lineage: Optional[str], is_vae: bool, max_models: int) -> tuple:
    """The slots every rank drops before `key` is built, least recently used first: older patch versions of its
    lineage (a LoRA strength change replaces the old one), the diffusion models beyond `max_models` counting it (VAEs
    are not counted: a Wan 2.2 workflow holds two experts and a VAE), and on an accelerator, where a rank's report
    says what `key` needs there (a "short" answer), models until every rank has room. Raises MemoryError, before
    anything is evicted, when a rank could not hold `key` with nothing else resident."""
    order = list(dict.fromkeys(s.slot for r in reports for s in r.slots))  # rank 0's order first, then others'
    info = {s.slot: s for r in reversed(reports) for s in r.slots}
    others = [n for n in order if info[n].key != key]
    evict = [n for n in others if lineage is not None and info[n].lineage == lineage]
    if not is_vae:
        dits = [n for n in others if not info[n].is_vae and n not in evict]
        evict += dits[: max(0, len(dits) - (max_models - 1))]
    for rank, r in enumerate(reports):
        if r.need is None or r.free is None:
            continue
        held = {s.slot: s.bytes for s in r.slots}
        freed = lambda: sum(held.get(n, 0) for n in evict)  # noqa: E731
        for n in (n for n in others if n not in evict):
            if r.free + freed() >= r.need:
                break
            evict.append(n)
        if r.free + freed() < r.need:
            raise MemoryError(f"{key}: {r.need / 2**30:.2f} GiB of weights do not fit rank {rank}'s device, which "
                              f"has {(r.free + freed()) / 2**30:.2f} GiB free with nothing else resident")
    return tuple(evict)


STALE_RETRIES = 2  # a decision the ranks answer "stale" is made again from their report; more means a bug


def load_decision(world, key: str, *, request: dict, family: str, max_models: int) -> LoadDecision:
    """The next load of `key` on `world` (None: no world yet), from every rank's last report: what to do with the
    weights (`decide`), then the room every rank makes first (`room`) for a build or a rebuild. `request`: decide's
    keyword arguments (layout, lineage, patches, whole_model)."""
    return _with_room(decide(ledger(world), key, **request), world, key, request.get("lineage"),
                      is_vae_family(family), max_models)


def _with_room(decision: LoadDecision, world, key: str, lineage, is_vae: bool, max_models: int) -> LoadDecision:
    """A build or a rebuild with the room every rank makes first (`room`), from every rank's last report; what `key`
    needed on a rank is remembered from its "short" answer (the next load of it on a full device goes straight)."""
    if decision.action not in ("build", "rebuild") or world is None:
        return decision
    reports = world.reports or [Report(tuple(world.slots))]
    needs = world.needs.setdefault(key, {})
    for rank, r in enumerate(reports):
        if r.need is not None:
            needs[rank] = r.need
    reports = [Report(r.slots, r.free, needs.get(rank)) for rank, r in enumerate(reports)]
    return replace(decision, evict=room(reports, key, lineage=lineage, is_vae=is_vae, max_models=max_models))
