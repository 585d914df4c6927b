"""ComfyUI's EasyCache (a step cache) with the diffusion model on the pool, in a real ComfyUI.

EasyCache wraps the diffusion model's forward (a DIFFUSION_MODEL wrapper): from the change of the call's input it
predicts the output change and, below its threshold, returns the last output difference instead of running the
model. On the pool that forward runs in the workers, so before this was handled EasyCache was silently left out.
Step mode: the driver runs it around the pool call - a step it skips is skipped on every rank at once (one
decision, in ComfyUI's process). Loop mode and PipeFusion: the workers apply the same rule (parallel/stepcache.py),
the decision agreed by one all-reduce; PipeFusion keeps one cache per patch in its stale patch steps.

Checked against KSampler with the same EasyCache: Parallel Model (EasyCache before and after it) and Hybrid Sampler
with ulysses 2 and cfg 2, loop mode ulysses 2, and PipeFusion with warmup = all steps: equal (<= 1e-5) with the
same skipped-step count in ComfyUI's own log line; the cache really skipped (the latent differs from the uncached
one). PipeFusion's stale patch steps with the per-patch cache: skips counted, error vs KSampler + EasyCache
measured. Other nodes' diffusion-model wrappers are refused before any worker starts.
"""
import re

import pytest

from comfy_server import assert_ok, error_text, latent, parallel_config_node, parallel_model, rel, workflow

pytestmark = pytest.mark.comfy

W, H, STEPS = 104, 72, 10


def _graph(tag, degrees=None, node="model", cache=True, order="before", mode="auto", family="wan", size=(W, H)):
    g = workflow(None, tag, *size, steps=STEPS, family=family, length=5)
    for k in ("7", "8", "11"):
        g.pop(k, None)
    model = ["1", 0]
    ec = {"class_type": "EasyCache", "inputs": {"reuse_threshold": 1.5, "start_percent": 0.1, "end_percent": 0.95,
                                                "verbose": False}}
    if cache and order == "before":
        g["30"] = dict(ec, inputs=dict(ec["inputs"], model=model))
        model = ["30", 0]
    if degrees is not None and node == "model":
        model = parallel_model(g, degrees, model=tuple(model))
    if cache and order == "after":
        g["30"] = dict(ec, inputs=dict(ec["inputs"], model=model))
        model = ["30", 0]
    g["5"]["inputs"]["model"] = model
    if degrees is not None and node == "sampler":
        g["9"] = parallel_config_node(dict(degrees, sampling_mode=mode))
        g["5"] = {"class_type": "HybridSampler", "inputs": {**g["5"]["inputs"], "parallel_config": ["9", 0]}}
    return g


def _log(server) -> str:
    return (server.base / "comfyui.log").read_text(errors="replace")


def _skipped(server, before: str) -> list:
    """The 'EasyCache - skipped k/N steps' counts ComfyUI logged since the log was `before`."""
    return [float(k) for k in re.findall(r"EasyCache - skipped ([\d.]+)/\d+ steps", _log(server)[len(before):])]


def test_easycache_on_the_pool_equals_ksampler_with_easycache(server):
    assert_ok(server, server.run(_graph("ec_plain", cache=False)))
    mark = _log(server)
    assert_ok(server, server.run(_graph("ec_ref")))
    ref, plain = latent(server, "ec_ref"), latent(server, "ec_plain")
    skipped = _skipped(server, mark)
    assert skipped and skipped[-1] > 0, skipped  # the cache did skip steps ...
    assert rel(ref, plain) > 1e-3, rel(ref, plain)  # ... and that shows in the result
    cases = [("cfg2_model", {"cfg_degree": 2}, "model", "before"),  # first: then one 2-rank ulysses world to the end
             ("u2_model", {"ulysses_degree": 2}, "model", "before"),
             ("u2_model_after", {"ulysses_degree": 2}, "model", "after"),
             ("u2_sampler", {"ulysses_degree": 2}, "sampler", "before"),
             ("u2_loop", {"ulysses_degree": 2}, "loop", "before")]  # the workers apply the rule
    for name, degrees, node, order in cases:
        mark = _log(server)
        mode = "loop" if node == "loop" else "auto"
        assert_ok(server, server.run(_graph(f"ec_{name}", degrees, "sampler" if node == "loop" else node,
                                            order=order, mode=mode)))
        err = rel(latent(server, f"ec_{name}"), ref)
        print(f"EasyCache {name}: latent relative error vs KSampler + EasyCache {err:.2e}; skipped "
              f"{_skipped(server, mark)} (KSampler {skipped[-1]})")
        assert _skipped(server, mark)[-1:] == skipped[-1:], (name, _skipped(server, mark), skipped)
        assert err <= 1e-5, (name, err)


def test_easycache_is_a_no_op_where_comfyui_ignores_it(server):
    """SD3's MMDiT does not run DIFFUSION_MODEL wrappers in ComfyUI, so EasyCache changes nothing under KSampler;
    on the pool it must change nothing either (not apply a cache ComfyUI would not)."""
    assert_ok(server, server.run(_graph("ecs_plain", cache=False, family="sd3")))
    assert_ok(server, server.run(_graph("ecs_ref", family="sd3")))
    ref = latent(server, "ecs_ref")
    assert rel(ref, latent(server, "ecs_plain")) == 0.0
    for name, degrees, node, mode in (("u2", {"ulysses_degree": 2}, "model", "auto"),
                                      ("loop_u2", {"ulysses_degree": 2}, "sampler", "loop")):
        assert_ok(server, server.run(_graph(f"ecs_{name}", degrees, node, mode=mode, family="sd3")))
        assert rel(latent(server, f"ecs_{name}"), ref) <= 1e-5, name


def _hp_skipped(server, before: str) -> list:
    return [float(k) for k in re.findall(r"Hybrid Sampler step cache - skipped ([\d.]+)/\d+ steps",
                                         _log(server)[len(before):])]


def test_parallel_config_step_cache_with_pipefusion(server):
    """Parallel Config's step_cache (SD3 ignores ComfyUI's EasyCache node): PipeFusion with warmup = all steps makes
    the same decisions as loop mode (one cache over the latent) and equals it; with stale patch steps (one cache per
    patch) it skips patch steps and its error vs the cached loop is measured. Step mode refuses the knob."""
    size, t = (112, 80), 1.5  # PipeFusion needs an even latent (14 x 10)
    lat = {}
    for name, degrees in (("plain", {"ulysses_degree": 2, "sampling_mode": "loop"}),
                          ("loop", {"ulysses_degree": 2, "sampling_mode": "loop", "step_cache": t}),
                          ("pp_sync", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": STEPS, "step_cache": t}),
                          ("pp_stale", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2, "step_cache": t}),
                          ("pp_stale_plain", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2})):
        mark = _log(server)
        mode = degrees.pop("sampling_mode", "auto")
        assert_ok(server, server.run(_graph(f"hpc_{name}", degrees, "sampler", cache=False, mode=mode, family="sd3",
                                            size=size)))
        lat[name] = (latent(server, f"hpc_{name}"), _hp_skipped(server, mark))
    print({k: v[1] for k, v in lat.items()})
    (loop, k_loop), (sync, k_sync), (stale, k_stale) = lat["loop"], lat["pp_sync"], lat["pp_stale"]
    assert k_loop and k_loop[-1] > 0 and rel(loop, lat["plain"][0]) > 1e-3, (k_loop, rel(loop, lat["plain"][0]))
    assert k_sync == k_loop and rel(sync, loop) <= 1e-5, (k_sync, rel(sync, loop))
    assert k_stale and k_stale[-1] > 0, k_stale
    print(f"PipeFusion stale + step cache: skipped {k_stale[-1]} steps' worth of patches; rel vs the cached loop "
          f"{rel(stale, loop):.2e}, vs stale PipeFusion without the cache {rel(stale, lat['pp_stale_plain'][0]):.2e}")
    entry = server.run(_graph("hpc_step", {"ulysses_degree": 2, "step_cache": t}, "sampler", cache=False, family="sd3"))
    assert entry["status"]["status_str"] == "error" and "sampling_mode to loop" in error_text(entry), error_text(entry)


def test_other_diffusion_model_wrappers_are_refused():
    """A DIFFUSION_MODEL wrapper other than EasyCache would act inside a model the workers run: refused by name."""
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.patcher_extension as ext
    from comfyui_hybrid_parallel.workers.bridge.spec import NotCarried, check_diffusion_wrappers
    ok = {ext.WrappersMP.DIFFUSION_MODEL: {"easycache": [print]}, ext.WrappersMP.OUTER_SAMPLE: {"x": [print]}}
    check_diffusion_wrappers(ok)
    check_diffusion_wrappers({ext.WrappersMP.DIFFUSION_MODEL: {"someone": []}})  # empty: nothing would run
    with pytest.raises(NotCarried, match=r"\['someone'\].*remove that node or use KSampler"):
        check_diffusion_wrappers({ext.WrappersMP.DIFFUSION_MODEL: {"easycache": [print], "someone": [print]}})
