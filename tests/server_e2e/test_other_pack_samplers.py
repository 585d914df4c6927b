"""Samplers of other packs through Parallel Model: the way Ultimate SD Upscale, Impact Pack's detailers and
KSampler (pipe), Inspire's KSampler and Easy-Use's samplers call ComfyUI's sampling with the MODEL - tiles of several
sizes, each at its own denoise, several samplings in one prompt, ComfyUI's common_ksampler among them - equal the
same graph without the pack (tests/standins/hp_sampler_nodes: the tests' stand-in of that mechanism). Each sampling is
a run of its own on the pool (its own latent size, its own degrees decided by Parallel Model at the run).
"""
import pytest
import torch

from comfy_server import assert_ok, latent, parallel_model, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72  # a 13 x 9 latent: tiles of 5 x 7, 5 x 6, 4 x 7, 4 x 6 latent pixels
STEPS = 3


def _graph(tag, degrees=None):
    g = workflow(None, tag, W, H, steps=STEPS)
    for k in ("5", "7", "8", "10", "11"):
        g.pop(k, None)
    model = ["1", 0] if degrees is None else parallel_model(g, degrees)
    g["5"] = {"class_type": "HPTestTiledSampler", "inputs": {"model": model, "positive": ["2", 0],
                                                             "negative": ["3", 0], "latent_image": ["4", 0],
                                                             "seed": 11, "steps": STEPS, "cfg": 4.0}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g


def test_tiled_samplings_through_parallel_model_equal_the_graph_without_it(server):
    entry = server.run(_graph("tiles_ref"))
    assert_ok(server, entry)
    assert not entry["_hp_model_calls"], "the graph without the pack ran on the workers"
    ref = latent(server, "tiles_ref")
    for mesh, degrees in (("d1", {}), ("u2", {"ulysses_degree": 2}), ("cfg2", {"cfg_degree": 2})):
        entry = server.run(_graph(f"tiles_{mesh}", degrees))
        assert_ok(server, entry)
        got = latent(server, f"tiles_{mesh}")
        err = rel(got, ref)
        print(f"4 tiled samplings through Parallel Model {mesh}: {err:.2e} from the graph without it, "
              f"{entry['_hp_model_calls']} model calls on the workers")
        # each tile's steps (denoise 0.35 / 0.5 / 0.7 / 1.0 of 3 steps, cfg batched: one call a step) on the pool
        assert entry["_hp_model_calls"] >= 4, entry["_hp_model_calls"]
        if mesh == "d1":
            assert torch.equal(got, ref), err
        assert err <= 1e-5, (mesh, err)


def test_a_device_choosing_loader_in_front_of_parallel_model(server):
    """ComfyUI-MultiGPU's kind of loader (tests/standins/ComfyUI-MultiGPU: a device chosen for ComfyUI's copy, and
    ComfyUI's device function wrapped at import) in front of Parallel Model: the model it loads runs on the pool and
    equals KSampler on the same loader - a loader placing weights and this pack splitting the work combine."""
    def graph(tag, degrees=None):
        g = workflow(None, tag, W, H, steps=STEPS)
        for k in ("7", "8", "11"):
            g.pop(k, None)
        g["1"] = {"class_type": "UNETLoaderMultiGPU", "inputs": {**g["1"]["inputs"], "device": "cpu"}}
        if degrees is not None:
            g["5"]["inputs"]["model"] = parallel_model(g, degrees)
        return g
    assert_ok(server, server.run(graph("multigpu_ref")))
    ref = latent(server, "multigpu_ref")
    for mesh, degrees in (("u2", {"ulysses_degree": 2}), ("cfg2", {"cfg_degree": 2})):
        entry = server.run(graph(f"multigpu_{mesh}", degrees))
        assert_ok(server, entry)
        err = rel(latent(server, f"multigpu_{mesh}"), ref)
        print(f"UNETLoaderMultiGPU -> Parallel Model {mesh}: {err:.2e} from KSampler, {entry['_hp_model_calls']} calls")
        assert err <= 1e-5, (mesh, err)
