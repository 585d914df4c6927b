"""The load decision (workers/residency.py): made by the driver from the ranks' own report, one typed message, and
redone from a fresh report when the ranks answer "stale" - never from a guess of the driver's."""
from __future__ import annotations

import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.workers.residency import LoadDecision, Slot, decide
from comfyui_hybrid_parallel.workers.pool import WorkerPool

U2, CFG2 = ParallelConfig(ulysses_degree=2), ParallelConfig(cfg_degree=2)
HERE = U2.layout_name()


def slot(key, layout=HERE, lineage="m", base=False, source=False):
    name = key if layout is None else f"{key}@mesh={layout}"
    return Slot(slot=name, key=key, family="flux", layout=layout, lineage=lineage, base=base, source=source)


def plan(slots, key="k2", patches=False, whole=True, lineage="m"):
    return decide(slots, key, layout=HERE, lineage=lineage, patches=patches, whole_model=whole)


def test_each_decision_from_the_report():
    assert plan([]) == LoadDecision("build", "k2", weights="sent")
    assert plan([slot("k2")]).action == "touch"
    assert plan([slot("k2", layout=None)]).action == "touch"  # a VAE: filed for every layout
    assert plan([slot("k2", layout=CFG2.layout_name(), source=True)]) == LoadDecision("rebuild", "k2",
                                                                                     slot=f"k2@mesh={CFG2.layout_name()}")
    # another patch version of the same model, its base kept here: patched in place; unpatched: its patches undone
    rel = slot("k1", base=True)
    assert plan([rel], patches=True) == LoadDecision("patch", "k2", slot=rel.slot)
    assert plan([rel], patches=False) == LoadDecision("patch", "k2", slot=rel.slot, undo=True)


def test_what_must_not_be_served():
    rel = slot("k1", base=True)
    # another lineage, a relative without its base, or one built for another layout: built, never patched
    assert plan([slot("k1", lineage="other", base=True)], patches=True).action == "build"
    assert plan([slot("k1")], patches=True).action == "build"
    assert plan([slot("k1", layout=CFG2.layout_name(), base=True)], patches=True).action == "build"
    # tp / pp / sharded ranks (not whole): the driver sends ComfyUI's patched weights; no undo in place there
    assert plan([rel], patches=False, whole=False).action == "build"
    # a patched layout kept its *base* as its source: it serves another layout only when the patches come again
    # (the 0.77-from-KSampler bug of a LoRA'd MODEL run without its LoRA after a config change)
    patched_elsewhere = slot("k2", layout=CFG2.layout_name(), base=True, source=True)
    assert plan([patched_elsewhere], patches=False).action == "build"
    assert plan([patched_elsewhere], patches=True).action == "rebuild"


def test_a_decision_is_validated_and_travels_as_json():
    with pytest.raises(ValueError, match="touch, patch, rebuild, build"):
        LoadDecision("guess", "k")
    with pytest.raises(ValueError, match="names the resident slot"):
        LoadDecision("patch", "k")
    with pytest.raises(ValueError, match="where the weights come from"):
        LoadDecision("build", "k")
    d = LoadDecision("patch", "k", slot="s", undo=True)
    assert LoadDecision.from_message(d.message()) == d


def test_a_stale_report_is_decided_again(monkeypatch):
    """The driver's copy of the report says the model is resident (a lie, as after a failed job): the fake ranks
    answer "stale" to the touch and the driver builds from their own report, writing the weights then."""
    with WorkerPool(fake="serve") as pool:
        first = pool.ensure_model(U2, "m1", "flux", state_dict={"w": torch.ones(3)})
        assert first["loaded"]
        pool.world.slots = [Slot(slot="ghost", key="ghost", family="flux")]
        pool.world.slots.append(Slot(slot="m2", key="m2", family="flux"))  # says m2 is held; it is not
        again = pool.ensure_model(U2, "m2", "flux", state_dict={"w": torch.ones(3)})
        assert again["loaded"] and "m2" in again["resident"] and pool.last_load_bytes == 12
        assert {s.key for s in pool.world.slots} == {"m1", "m2"}  # the ranks' report replaced the lie
