"""What a rank keeps resident (parallel/engine.py): diffusion models counted apart from VAEs, room made before a
model is built (never after), on an accelerator by bytes, older patch versions of the same model dropped first,
memory given back at once. The accelerator's memory is stubbed here (a fake free-bytes reader and a recording
empty_cache): the calls and their order are what is checked; the GPU suite measures it on a GPU."""
from __future__ import annotations

import pytest
import torch

from comfyui_hybrid_parallel.parallel.engine import MESH_SEP, Engine, Resident

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


def test_vaes_are_not_counted_and_two_experts_stay(gpu):
    """Wan 2.2: a high- and a low-noise expert and a VAE, max_models=2: nothing is evicted."""
    engine, dev, _ = gpu
    for key, family in (("high", "wan"), ("low", "wan"), ("vae", "vae_comfy")):
        engine.make_room(key, 6 * GIB, torch.device("cuda", 0), is_vae=family.startswith("vae"))
        engine.models[key] = _resident(family, 6 * GIB)
    engine.make_room("high", 6 * GIB, torch.device("cuda", 0))  # its turn again: already resident, room is there
    assert list(engine.models) == ["high", "low", "vae"] and engine.evicted == []


def test_room_is_made_by_bytes_before_loading_least_recent_first(gpu):
    engine, dev, emptied = gpu
    for key in ("a", "b"):
        engine.models[key] = _resident("flux", 10 * GIB)
    engine.max_models = 4
    engine.make_room("c", 12 * GIB, torch.device("cuda", 0))  # 4 GiB free: one of 10 GiB must go
    assert engine.evicted == ["a"] and list(engine.models) == ["b"]
    assert emptied == [1]  # released right after the eviction, before the free memory is read again
    with pytest.raises(MemoryError, match=r"30.00 GiB of weights do not fit cuda:0, which has 24.00 GiB free"):
        engine.make_room("d", 30 * GIB, torch.device("cuda", 0))


def test_an_older_patch_version_is_dropped_first(gpu):
    """A LoRA strength change: the same model object (lineage) under a new key replaces the old version."""
    engine, dev, _ = gpu
    engine.models["m:lora0.5"] = _resident("flux", 8 * GIB, lineage="m")
    engine.models["other"] = _resident("flux", 8 * GIB, lineage="o")
    engine.make_room("m:lora0.8", 8 * GIB, torch.device("cuda", 0), lineage="m")
    assert engine.evicted == ["m:lora0.5"] and list(engine.models) == ["other"]


def test_host_models_are_counted_not_measured():
    engine = Engine(max_models=2, free_memory=lambda d: pytest.fail("a host rank reads no device memory"))
    for key in ("a", "b", "vae"):
        engine.models[key + MESH_SEP + "1-1"] = Resident("vae_comfy" if key == "vae" else "sd3", _Model(0))
    engine.make_room("c", 0, torch.device("cpu"))
    assert engine.evicted == ["a" + MESH_SEP + "1-1"]


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
