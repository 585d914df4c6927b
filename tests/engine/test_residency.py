"""What a rank keeps resident: the room made before a model is built, decided by the driver from every rank's report
(workers/residency.room: diffusion models counted apart from VAEs, on an accelerator by bytes, older patch versions
of the same model dropped first) and executed by each rank's engine (parallel/engine.py), memory given back at once. The accelerator's memory is stubbed here (a fake free-bytes reader and a recording
empty_cache): the calls and their order are what is checked; the GPU suite measures it on a GPU."""
from __future__ import annotations

import pytest
import torch

from comfyui_hybrid_parallel.parallel.engine import MESH_SEP, Engine, Resident, RoomShort
from comfyui_hybrid_parallel.workers.residency import Report, Slot, room

GIB = 2**30


class _Model(torch.nn.Module):
    def __init__(self, nbytes: int):
        super().__init__()
        self.nbytes = nbytes


def _resident(family, nbytes, lineage=None):
    r = Resident(family, _Model(nbytes), lineage=lineage)
    r.device_bytes = lambda: nbytes  # as if on the GPU
    return r


class _Device:
    """A fake 24 GiB GPU: free = total - what the engine's resident models hold."""

    def __init__(self, engine, total):
        self.engine, self.total, self.calls = engine, total, []

    def free(self, device):
        self.calls.append("free")
        return self.total - sum(r.model.nbytes for r in self.engine.models.values())


@pytest.fixture
def gpu(monkeypatch):
    engine = Engine(max_models=2)
    dev = _Device(engine, 24 * GIB)
    engine.free_memory = dev.free
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(len(engine.models)))
    return engine, dev, emptied


def _slot(name, nbytes=0, family="flux", lineage=None):
    return Slot(slot=name, key=name.partition(MESH_SEP)[0], family=family, lineage=lineage, bytes=nbytes)


def test_vaes_are_not_counted_and_two_experts_stay():
    """Wan 2.2: a high- and a low-noise expert and a VAE, max_models=2: nothing is evicted for either expert; a third
    diffusion model evicts the least recently used expert, never the VAE."""
    held = Report((_slot("high", 6 * GIB, "wan"), _slot("low", 6 * GIB, "wan"), _slot("vae", GIB, "vae_comfy")))
    assert room([held], "high", lineage=None, is_vae=False, max_models=2) == ()
    assert room([held], "vae2", lineage=None, is_vae=True, max_models=2) == ()
    assert room([held], "third", lineage=None, is_vae=False, max_models=2) == ("high",)


def test_room_is_made_by_bytes_least_recent_first_or_refused_before_any_eviction():
    a, b = _slot("a", 10 * GIB), _slot("b", 10 * GIB)
    short = Report((a, b), free=4 * GIB, need=12 * GIB)  # 4 GiB free: one of 10 GiB must go
    assert room([short], "c", lineage=None, is_vae=False, max_models=4) == ("a",)
    with pytest.raises(MemoryError, match=r"30.00 GiB of weights do not fit rank 0's device, which has 24.00 GiB"):
        room([Report((a, b), free=4 * GIB, need=30 * GIB)], "d", lineage=None, is_vae=False, max_models=4)


def test_every_rank_evicts_what_the_shortest_needs():
    """The rank beside ComfyUI's own models has less free memory: the room is made on every rank alike (the ranks
    used to evict by their own free memory and diverge - a touch then failed a forward with a KeyError)."""
    a, b = _slot("a", 8 * GIB), _slot("b", 8 * GIB)
    roomy, beside_comfy = Report((a, b), free=20 * GIB, need=10 * GIB), Report((a, b), free=4 * GIB, need=10 * GIB)
    assert room([roomy, beside_comfy], "c", lineage=None, is_vae=False, max_models=4) == ("a",)
    assert room([roomy, Report((a, b), free=12 * GIB, need=10 * GIB)], "c", lineage=None, is_vae=False,
                max_models=4) == ()


def test_an_older_patch_version_is_dropped_first():
    """A LoRA strength change: the same model object (lineage) under a new key replaces the old version."""
    held = Report((_slot("m:lora0.5", 8 * GIB, lineage="m"), _slot("other", 8 * GIB, lineage="o")))
    assert room([held], "m:lora0.8", lineage="m", is_vae=False, max_models=2) == ("m:lora0.5",)


def test_host_models_are_counted_not_measured():
    held = Report(tuple(_slot(k + MESH_SEP + "1-1", family="vae_comfy" if k == "vae" else "sd3")
                        for k in ("a", "b", "vae")))
    assert room([held], "c", lineage=None, is_vae=False, max_models=2) == ("a" + MESH_SEP + "1-1",)
    engine = Engine(max_models=2)
    assert not engine.measured(torch.device("cpu")) and engine.report(torch.device("cpu"), measure=True)["free"] is None


def test_the_engine_executes_the_decided_room_and_checks_it(gpu):
    """A rank drops exactly the slots decided, released at once; if the decided room is not enough it raises
    RoomShort with its numbers (every rank does, agreed by an all-reduce: workers/load_job answers "short")."""
    engine, dev, emptied = gpu
    for key in ("a", "b"):
        engine.models[key] = _resident("flux", 10 * GIB)
    engine.evict(["a", "not-held"], torch.device("cuda", 0))
    assert engine.evicted == ["a"] and list(engine.models) == ["b"] and emptied == [1]
    engine.check_room("c", 12 * GIB, torch.device("cuda", 0), None)  # 14 GiB free
    with pytest.raises(RoomShort) as short:
        engine.check_room("c", 16 * GIB, torch.device("cuda", 0), None)
    assert (short.value.need, short.value.free) == (16 * GIB, 14 * GIB)
    assert engine.report(torch.device("cuda", 0), measure=True)["free"] == 14 * GIB


def test_a_mesh_change_rebuilds_from_the_tensors_the_rank_holds():
    """A config change that keeps the world (ulysses 2 -> cfg 2) rebuilds the model for the new mesh from what the rank
    already holds, whole-model layouts only: on a host rank the very tensors it was built from (the mapped pages), on
    an accelerator the model's own tensors after the move (here the move goes to the meta device, as a stand-in
    for a GPU): nothing travels again and no second copy is made."""
    from comfyui_hybrid_parallel.parallel.engine import held_tensors, to_device
    lin = torch.nn.Linear(4, 3)
    weights = {k: v.detach().clone() for k, v in lin.state_dict().items()}
    lin.load_state_dict(weights, assign=True)
    kept = held_tensors(lin, weights)
    assert all(kept[k] is weights[k] for k in weights)  # a host rank: the tensors it was built from
    to_device(lin, torch.device("meta"))
    kept = held_tensors(lin, {**weights, "not_a_weight": torch.ones(1)})
    assert kept["weight"].is_meta and kept["bias"].is_meta  # as the model holds them now
    assert kept["weight"].shape == (3, 4) and kept["not_a_weight"].device.type == "cpu"
