"""Comfy-WaveSpeed's First Block Cache on the pool equals KSampler with the same node (the tests' stand-in of it,
tests/standins/Comfy-WaveSpeed, to the node's contract): its rule runs on the workers' model, the similarity of the
first block's residual reduced over the ranks, so every rank skips the same steps one device skips
(parallel/fbcache.py, workers/bridge/fbcache.py).

The threshold is set so that the tiny SD3 skips some steps and computes others: the node changes KSampler's latent,
the workers report cache hits, and the pool's latent equals KSampler's with the node at ulysses / ring / cfg through
Parallel Model and Hybrid Sampler (odd 11 x 9 latent: an uneven split). Where the rule cannot run exactly - the
workers' own loop, the UNet (the node replaces its forward) - the prompt is refused before work, naming the node.
"""
import pytest

from comfy_server import assert_ok, latent, rel
from test_every_graph import _equal, _family, _graph, _refused

pytestmark = pytest.mark.comfy

STEPS = 8
THRESHOLD = 0.8  # the tiny SD3's first-block residual changes by 0.7-0.9 of itself per step: some steps hit
NODE = "ApplyFBCacheOnModel (node 20)"


def _fb(threshold=THRESHOLD, start=0.0, end=1.0, hits=-1):
    return {"20": {"class_type": "ApplyFBCacheOnModel", "inputs": {
        "object_to_patch": "diffusion_model", "residual_diff_threshold": threshold, "start": start, "end": end,
        "max_consecutive_cache_hits": hits}}}


def _hits(server) -> int:
    return sum(w.get("first_block_hits", 0) for w in server.get("/hybrid_parallel/pool")["workers"]
               if w.get("rank") == 0)


def test_first_block_cache_equals_ksampler_with_the_node(server):
    assert_ok(server, server.run(_graph("fb_plain", steps=STEPS)))
    assert_ok(server, server.run(_graph("fb_ref", model_nodes=_fb(), steps=STEPS)))
    ref = latent(server, "fb_ref")
    effect = rel(ref, latent(server, "fb_plain"))
    print(f"First Block Cache changes KSampler's latent by {effect:.2e}")
    assert effect > 1e-4, effect
    for name, degrees, node in (("pm_d1", {}, "model"), ("pm_u2", {"ulysses_degree": 2}, "model"),
                                ("pm_r2", {"ring_degree": 2}, "model"),
                                ("pm_cfg2", {"cfg_degree": 2}, "model"), ("hs_u2", {"ulysses_degree": 2}, "sampler")):
        assert_ok(server, server.run(_graph(f"fb_{name}", degrees, node, model_nodes=_fb(), steps=STEPS)))
        err, hits = rel(latent(server, f"fb_{name}"), ref), _hits(server)
        print(f"First Block Cache {name}: {err:.2e} from KSampler with the node; {hits} model calls served from the "
              f"cache on the workers")
        assert err <= (0.0 if name == "pm_d1" else 1e-5), (name, err)  # degree 1: the node's own arithmetic, bitwise
        assert hits > 0, "the workers' rule never used its cache: the comparison would prove nothing"


def test_first_block_cache_window_and_run_limit(server):
    """The node's sigma window and its limit on hits in a row (its validation) decide alike on the workers."""
    _equal(server, "fb_window", [("pm_u2", {"ulysses_degree": 2}, "model")],
           model_nodes=_fb(threshold=0.9, start=0.2, end=0.9, hits=1), steps=STEPS)
    assert _hits(server) > 0


def test_first_block_cache_is_refused_where_it_cannot_run(server):
    _refused(server, _graph("fb_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler", model_nodes=_fb(),
                            steps=STEPS),
             NODE, "sampling_mode to step", node_type="HybridSampler")
    _family(server, "sd15")
    _refused(server, _graph("fb_unet", {"cfg_degree": 2}, "model", model_nodes=_fb(), family="sd15", steps=STEPS),
             NODE, "inside the model's own forward", "step_cache")


def test_cache_dit_is_refused_with_the_reason(server):
    """ComfyUI-CacheDiT replaces the model's forward on ComfyUI's model object when sampling starts: refused before
    any work, saying why and which caches run on the pool."""
    node = {"20": {"class_type": "CacheDiT_Model_Optimizer", "inputs": {"enable": True, "warmup_steps": 2,
                                                                         "skip_interval": 2}}}
    _refused(server, _graph("cachedit", {"ulysses_degree": 2}, "model", model_nodes=node, steps=STEPS),
             "CacheDiT_Model_Optimizer (node 20)", "replaces the diffusion model's forward", "EasyCache")
