"""The nodes in a real ComfyUI server: Hybrid Sampler + Parallel VAE Decode against KSampler + VAEDecode."""
import pytest
import torch
from safetensors.torch import load_file

from comfy_server import workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72  # latent 13 x 9: odd on both axes (ComfyUI pads SD3 circularly)
# `server`: the session's one real ComfyUI (tests/conftest.py), shared with the web tests.


def _graph(parallel, tag, **kw):
    return workflow(parallel, tag, W, H, **kw)


def _ok(server, entry):
    assert "rejected" not in entry, entry
    assert entry["status"]["status_str"] == "success", (entry["status"], server.tail())


def _load(server, name, key):
    return load_file(str(server.output(f"{name}.safetensors")))[key]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def reference(server):
    _ok(server, server.run(_graph(None, "ref")))
    return _load(server, "lat_ref", "images"), _load(server, "img_ref", "images")


# The tests below run grouped by the pool's world (world size, devices, whether attention is intercepted): a world
# switch costs 7-12 s on 2 cores, a prompt on the running world 1-2 s. Degree 1; then the 2-rank worlds that
# intercept (ulysses, ring, DistriFusion, PipeFusion); then those that do not (cfg, tp); then the 4-rank ones.
# cfg2 with the slow set (in CI it would be a 2-rank world of its own between degree 1 and ulysses 2): cfg 2 through
# Hybrid Sampler equals KSampler in test_lora_then_a_layout_that_takes_no_patches_equals_ksampler and
# test_bad_config_is_a_clear_error_and_the_next_prompt_works, cfg 2 x ulysses 2 in
# test_any_comfyui_sampler_in_step_mode, Parallel VAE Decode over 2 ranks equals VAEDecode in [ulysses2] (the decode
# does not depend on the mesh), and cfg 2's forward equals ComfyUI's in
# tests/families/test_native_pool.py::test_native_forward_equals_comfyui[cfg2]
@pytest.mark.parametrize("degrees", [{}, pytest.param({"cfg_degree": 2}, marks=pytest.mark.slow),
                                     {"ulysses_degree": 2}, {"ring_degree": 2}],
                         ids=["degree1", "cfg2", "ulysses2", "ring2"])
def test_hybrid_sampler_and_patch_decode_equal_ksampler(server, reference, degrees):
    tag = "_".join(f"{k}{v}" for k, v in degrees.items()) or "d1"
    _ok(server, server.run(_graph(degrees, tag)))
    lat_ref, img_ref = reference
    lat, img = _load(server, f"lat_{tag}", "images"), _load(server, f"img_{tag}", "images")
    assert lat.shape == lat_ref.shape and img.shape == img_ref.shape
    assert _rel(lat, lat_ref) <= 1e-4, _rel(lat, lat_ref)
    assert (img - img_ref).abs().max().item() <= 1e-4
    if not degrees:  # the workers run ComfyUI's own model: same code, same weights, same kernel
        assert torch.equal(lat, lat_ref), _rel(lat, lat_ref)


# All UNETLoader's fp8 weight dtypes are the pool tests' precisions (families/test_native_pool.py: degree 1
# bitwise, u2 and t2 on fp8 weights against ComfyUI's forward) and the sharded fp8 server run below
@pytest.mark.parametrize("weight_dtype", [pytest.param("fp8_e4m3fn", marks=pytest.mark.slow),
                                          pytest.param("fp8_e4m3fn_fast", marks=pytest.mark.slow),
                                          pytest.param("fp8_e5m2", marks=pytest.mark.slow)])
def test_fp8_weight_dtype_equals_ksampler(server, weight_dtype):
    """UNETLoader's fp8 weight dtypes (how most people run Flux and Wan 14B) through the workers: ComfyUI's
    own fp8 ops on the ranks; degree 1 bitwise, ulysses 2 and tensor parallel 2 (fp8 shards) within the
    exact-method bound."""
    tags = {d: f"{weight_dtype}_{d}" for d in ("ref", "d1", "u2", "t2")}
    _ok(server, server.run(_graph(None, tags["ref"], weight_dtype=weight_dtype)))
    _ok(server, server.run(_graph({}, tags["d1"], weight_dtype=weight_dtype)))
    _ok(server, server.run(_graph({"ulysses_degree": 2}, tags["u2"], weight_dtype=weight_dtype)))
    _ok(server, server.run(_graph({"tp_degree": 2}, tags["t2"], weight_dtype=weight_dtype)))
    ref, d1, u2, t2 = (_load(server, f"lat_{tags[d]}", "images") for d in ("ref", "d1", "u2", "t2"))
    print(f"{weight_dtype}: latent relative error vs KSampler: ulysses2 {_rel(u2, ref):.2e}, tp2 {_rel(t2, ref):.2e}")
    assert torch.equal(d1, ref), _rel(d1, ref)
    assert _rel(u2, ref) <= 1e-5
    assert _rel(t2, ref) <= 1e-5


SHARDED = {"u2": {"ulysses_degree": 2, "shard_weights": "sequence"}, "cfg2": {"cfg_degree": 2, "shard_weights": "all"}}


# fp8 with cfg 2 / shard_weights all in the slow set (in CI a 2-rank world that does not intercept attention, between
# ulysses worlds): its forward on UNETLoader's fp8_e4m3fn weights equals ComfyUI's in CI in
# tests/engine/test_shard.py::test_sharded_forward_equals_comfyui[cfg2-all] (PixArt fp8_e4m3fn, odd and even latents)
# and on quantized files (scaled fp8, float8_e4m3fn, ...) with each rank's bytes in
# tests/driver/test_quantized_weights.py::test_sharded_pool_forward_and_bytes[cfg2-all]
@pytest.mark.parametrize("weight_dtype, meshes", [
    pytest.param("default", ("u2", "cfg2"), marks=pytest.mark.slow, id="default"),
    pytest.param("fp8_e4m3fn", ("u2",), id="fp8_e4m3fn"),
    pytest.param("fp8_e4m3fn", ("cfg2",), marks=pytest.mark.slow, id="fp8_e4m3fn-cfg2")])
def test_sharded_weights_equal_ksampler(server, weight_dtype, meshes):
    """Parallel Config's shard_weights: each rank keeps half of ComfyUI's (fp8) weights and gathers a block's
    weights one block ahead; the prompt equals KSampler, with Ulysses and with CFG parallel."""
    ref_tag = f"shard_ref_{weight_dtype}"
    _ok(server, server.run(_graph(None, ref_tag, weight_dtype=weight_dtype)))
    ref = _load(server, f"lat_{ref_tag}", "images")
    for degrees in (SHARDED[m] for m in meshes):
        tag = f"shard_{weight_dtype}_{'_'.join(f'{k}{v}' for k, v in degrees.items())}"
        _ok(server, server.run(_graph(degrees, tag, weight_dtype=weight_dtype)))
        err = _rel(_load(server, f"lat_{tag}", "images"), ref)
        print(f"sharded weights {weight_dtype} {degrees}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (degrees, err)


@pytest.mark.parametrize("warmup", [3, 1])
def test_distrifusion_in_step_mode(server, reference, warmup):
    """warmup = all steps: equal to KSampler; warmup 1: stale K/V, close but not equal (measured)."""
    tag = f"df_w{warmup}"
    _ok(server, server.run(_graph({"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": warmup}, tag)))
    err = _rel(_load(server, f"lat_{tag}", "images"), reference[0])
    print(f"DistriFusion warmup {warmup}/3 steps: latent relative error vs KSampler {err:.2e}")
    if warmup == 3:
        assert err <= 1e-4
    else:
        assert 1e-7 < err < 0.5


# PixArt: ComfyUI needs even latent sides with (H+W)//2 >= 33 -> 66 x 68 latent (1122 tokens);
# Wan: 5 frames (2 latent frames) of an odd 13 x 9 latent, 2 heads.
FAMILY_SIZES = {"pixart": (544, 528), "wan": (W, H)}


# PixArt (a 544 x 528 image through the KL VAE: 2+ min on 2 cores) runs with the slow set; Wan stays in CI
@pytest.mark.parametrize("family", [pytest.param("pixart", marks=pytest.mark.slow), "wan"])
def test_other_families_equal_ksampler(server, family):
    """Ulysses 2 (and for PixArt tensor parallel 2 on ComfyUI's own model: its attentions are shown their local
    width) through Hybrid Sampler and Parallel VAE Decode, against KSampler and VAE Decode."""
    w, h = FAMILY_SIZES[family]
    kw = dict(family=family, steps=2)
    _ok(server, server.run(workflow(None, f"{family}_ref", w, h, **kw)))
    lat_ref, img_ref = _load(server, f"lat_{family}_ref", "images"), _load(server, f"img_{family}_ref", "images")
    for name, degrees in [("u2", {"ulysses_degree": 2})] + ([("t2", {"tp_degree": 2})] if family == "pixart" else []):
        _ok(server, server.run(workflow(degrees, f"{family}_{name}", w, h, **kw)))
        lat, img = _load(server, f"lat_{family}_{name}", "images"), _load(server, f"img_{family}_{name}", "images")
        print(f"{family} {name}: latent relative error vs KSampler {_rel(lat, lat_ref):.2e}")
        assert lat.shape == lat_ref.shape and img.shape == img_ref.shape
        assert _rel(lat, lat_ref) <= 1e-4, (name, _rel(lat, lat_ref))
        assert (img - img_ref).abs().max().item() <= 1e-4


PF_W, PF_H = 112, 80  # PipeFusion needs an even latent: 14 x 10


@pytest.mark.parametrize("sampler", ["euler", "dpmpp_2m"])
def test_pipefusion_loop_mode(server, sampler):
    """pp2 with warmup = all steps equals KSampler; with warmup 1 the stale patches give a measured error."""
    kw = dict(steps=3, sampler=sampler)
    _ok(server, server.run(workflow(None, f"pf_ref_{sampler}", PF_W, PF_H, **kw)))
    ref = _load(server, f"lat_pf_ref_{sampler}", "images")
    for warmup in (3, 1):
        tag = f"pf_{sampler}_w{warmup}"
        degrees = {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": warmup}
        _ok(server, server.run(workflow(degrees, tag, PF_W, PF_H, **kw)))
        err = _rel(_load(server, f"lat_{tag}", "images"), ref)
        print(f"PipeFusion pp2/2 patches {sampler}, warmup {warmup}/3: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4 if warmup == 3 else 1e-7 < err < 0.5


def test_pipefusion_refuses_an_unsupported_sampler_before_work(server):
    entry = server.run(workflow({"pp_degree": 2}, "pf_bad", PF_W, PF_H, sampler="heun"))
    text = str(entry)
    assert "euler" in text and "dpmpp_2m" in text and "heun" in text, text[:2000]


def test_lora_patched_weights_are_used(server, reference):
    """A LoRA on the MODEL changes the result, and Hybrid Sampler follows it (and a new strength) exactly."""
    for strength in (1.0, 0.5):
        lora = ("tiny_lora.safetensors", strength)
        _ok(server, server.run(_graph(None, f"lora_ref_{strength}", lora=lora)))
        _ok(server, server.run(_graph({"ulysses_degree": 2}, f"lora_u2_{strength}", lora=lora)))
        ref = _load(server, f"lat_lora_ref_{strength}", "images")
        par = _load(server, f"lat_lora_u2_{strength}", "images")
        assert _rel(ref, reference[0]) > 1e-3, "the LoRA did not change the reference: the test proves nothing"
        assert _rel(par, ref) <= 1e-4, (strength, _rel(par, ref))


def test_an_invalid_workflow_is_rejected_like_ksamplers(server):
    """An 8-pixel image fails ComfyUI's input validation: KSampler's graph is rejected (HTTP 400), and so is the
    Hybrid graph - Parallel Config is not an output node, so nothing runs and nothing reports success."""
    for degrees, tag in ((None, "invalid_ref"), ({"ulysses_degree": 2}, "invalid_u2")):
        entry = server.run(workflow(degrees, tag, 8, 8, steps=1))
        assert "rejected" in entry, (tag, str(entry)[:2000])
        assert not server.output(f"lat_{tag}.safetensors").exists()


def test_a_device_this_machine_lacks_leaves_the_working_pool_alone(server, reference):
    """device 'cuda' on this CPU machine is refused by Parallel Config before anything touches the running pool:
    the same workers serve the next prompt (the probe saw the working pool shut down first)."""
    _ok(server, server.run(_graph({"ulysses_degree": 2}, "pool_before_bad_device", steps=1)))
    before = sorted(_wait_for_workers(server, 2))
    entry = server.run(_graph({"ulysses_degree": 2, "device": "cuda"}, "bad_device", steps=1))
    assert "no CUDA device" in str(entry) and "'cpu'" in str(entry), str(entry)[:2000]
    assert sorted(_worker_pids(server)) == before
    _ok(server, server.run(_graph({"ulysses_degree": 2}, "pool_after_bad_device", steps=1)))
    assert sorted(_worker_pids(server)) == before


def _queue(server, graph):
    import uuid
    resp = server.post("/prompt", {"prompt": graph, "client_id": str(uuid.uuid4())})
    assert "prompt_id" in resp, resp
    return resp["prompt_id"]


def _wait(server, pid, timeout_s=120):
    return server.wait(pid, timeout_s)


def _worker_pids(server):
    return server.worker_pids()


def _wait_for_workers(server, n, timeout_s=120):
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = _worker_pids(server)
        if len(pids) >= n:
            return pids
        time.sleep(0.3)
    raise AssertionError(f"{n} workers did not start:\n{server.tail()}")


def _wait_for_steps(server, total, timeout_s=180):
    """Until ComfyUI's progress bar (in the server log) shows a few of `total` steps done."""
    import re
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [int(m) for m in re.findall(rf"(\d+)/{total} \[", server.tail(5))]
        if done and max(done) >= 3:
            return
        time.sleep(0.2)
    raise AssertionError(f"sampling did not start:\n{server.tail()}")


def test_interrupt_stops_the_run_and_the_next_prompt_works(server, reference):
    import time
    pid = _queue(server, _graph({"ulysses_degree": 2}, "interrupted", steps=5000))
    _wait_for_steps(server, 5000)  # sampling is running on the workers
    t = time.monotonic()
    server.post("/interrupt", {})
    entry = _wait(server, pid)
    assert time.monotonic() - t < 10
    assert entry["status"]["status_str"] == "error"
    assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"]), entry["status"]
    _ok(server, server.run(_graph({"ulysses_degree": 2}, "after_interrupt")))
    lat = _load(server, "lat_after_interrupt", "images")
    assert _rel(lat, reference[0]) <= 1e-4


def test_worker_killed_mid_run_fails_clearly_and_the_next_prompt_works(server, reference):
    import os
    import signal
    import time
    pid = _queue(server, _graph({"ring_degree": 2}, "killed", steps=5000))
    _wait_for_steps(server, 5000)
    workers = _wait_for_workers(server, 2)  # the ring2 world's workers, now busy sampling
    os.kill(max(workers), signal.SIGKILL)
    entry = _wait(server, pid)
    assert entry["status"]["status_str"] == "error"
    text = str(entry["status"]["messages"])
    assert "rank" in text and ("died" in text or "exit" in text), text[:2000]
    _ok(server, server.run(_graph({"ring_degree": 2}, "after_kill")))
    assert _rel(_load(server, "lat_after_kill", "images"), reference[0]) <= 1e-4


def test_example_api_prompts_match_the_server_schema(server):
    """Every node and input of examples/api/*.json exists in this ComfyUI (with our pack loaded)."""
    import json
    from pathlib import Path
    info = server.get("/object_info")
    files = sorted((Path(__file__).resolve().parents[2] / "examples" / "api").glob("*.json"))
    assert len(files) >= 4
    for f in files:
        for nid, node in json.loads(f.read_text()).items():
            assert node["class_type"] in info, (f.name, nid, node["class_type"])
            spec = info[node["class_type"]]["input"]
            declared = set(spec.get("required", {})) | set(spec.get("optional", {}))
            unknown = set(node["inputs"]) - declared
            assert not unknown, (f.name, nid, node["class_type"], unknown)
            missing = set(spec.get("required", {})) - set(node["inputs"])
            assert not missing, (f.name, nid, node["class_type"], missing)


# the 2-rank worlds that intercept attention first, then those that do not: the cfg / tp tests below follow on that
@pytest.mark.parametrize("family,degrees", [
    ("sd3", {"ulysses_degree": 2, "method": "distrifusion", "warmup_steps": 3}),
    ("wan", {"ulysses_degree": 2}),
    ("sd3", {"cfg_degree": 2}),
    ("wan", {"tp_degree": 2}),
], ids=["sd3-distrifusion-u2", "wan-u2", "sd3-cfg2", "wan-tp2"])
def test_loop_mode_without_pipeline_equals_ksampler(server, reference, family, degrees):
    """sampling_mode=loop: the whole loop in the workers, one parallel forward per step, on odd latents."""
    tag = f"loop_{family}_" + "_".join(f"{k}{v}" for k, v in degrees.items())
    kw = dict(family=family, sampler="dpmpp_2m" if family == "wan" else "euler")
    if family == "sd3":
        ref = reference[0]
    else:
        _ok(server, server.run(workflow(None, f"{tag}_ref", W, H, steps=3, **kw)))
        ref = _load(server, f"lat_{tag}_ref", "images")
    _ok(server, server.run(workflow({**degrees, "sampling_mode": "loop"}, tag, W, H, steps=3, **kw)))
    err = _rel(_load(server, f"lat_{tag}", "images"), ref)
    print(f"loop mode {tag}: latent relative error vs KSampler {err:.2e}")
    assert err <= 1e-4


def test_loop_mode_refuses_step_only_choices_before_work(server):
    entry = server.run(workflow({"pp_degree": 2, "sampling_mode": "step"}, "loop_bad", PF_W, PF_H))
    assert "sampling_mode" in str(entry) and "auto or loop" in str(entry), str(entry)[:2000]


def test_lora_then_a_layout_that_takes_no_patches_equals_ksampler(server):
    """A LoRA travels as patches to ranks that hold the whole model (cfg / ulysses: base weights + patches applied
    there); tensor parallel takes ComfyUI's patched weights instead. A config change that keeps the world rebuilds
    the new layout from what the ranks hold - which, after a patched whole-model layout, is the *base*: tp 2 after
    cfg 2 on the same MODEL ran without its LoRA, 0.77 from KSampler and no error (parallel/engine.source_weights).
    And a new strength under tp after a patched version: the weights travel complete, never "undone in place"."""
    from comfy_server import equal_ksampler, on_pool, workflow
    for strength, cases in ((0.8, [("cfg2", {"cfg_degree": 2}, "sampler"), ("t2", {"tp_degree": 2}, "model")]),
                            (0.3, [("t2", {"tp_degree": 2}, "sampler")])):
        def graph(tag, degrees=None, node="model", strength=strength):
            g = workflow(None, tag, 104, 72, family="sd3", steps=2, lora=("tiny_lora.safetensors", strength))
            for k in ("7", "8", "11"):  # the latent is what is compared
                g.pop(k, None)
            return g if degrees is None else on_pool(g, degrees, node)
        equal_ksampler(server, graph, f"lora_layouts_{int(strength * 10)}", cases)


def test_bad_config_is_a_clear_error_and_the_next_prompt_works(server, reference):
    entry = server.run(_graph({"tp_degree": 3}, "bad"))
    text = str(entry)
    assert "error" in text.lower() and "tp_degree=3" in text and "attention heads" in text, text[:2000]
    _ok(server, server.run(_graph({"cfg_degree": 2}, "after_bad", steps=2)))


# the 4-rank world (cfg 2 x ulysses 2) from here on: PipeFusion x ulysses and the noise mask follow on it. A multistep
# sampler and a 2-evaluation one with img2img in CI; UniPC (multistep too) with the slow set
@pytest.mark.parametrize("sampler, scheduler, denoise", [("dpmpp_2m", "karras", 1.0), ("heun", "simple", 0.6),
                                                         pytest.param("uni_pc", "sgm_uniform", 1.0,
                                                                      marks=pytest.mark.slow)])
def test_any_comfyui_sampler_in_step_mode(server, sampler, scheduler, denoise):
    """Step mode runs ComfyUI's own sampler: multistep, 2-evaluation and img2img (denoise < 1) included."""
    kw = dict(sampler=sampler, scheduler=scheduler, denoise=denoise, batch=2)
    tag = f"{sampler}_{denoise}"
    _ok(server, server.run(_graph(None, f"ref_{tag}", **kw)))
    _ok(server, server.run(_graph({"cfg_degree": 2, "ulysses_degree": 2}, f"par_{tag}", **kw)))
    ref, par = _load(server, f"lat_ref_{tag}", "images"), _load(server, f"lat_par_{tag}", "images")
    assert par.shape == ref.shape and ref.shape[0] == 2
    assert _rel(par, ref) <= 1e-4


def test_pipefusion_with_ulysses_equals_ksampler(server):
    """pp2 x ulysses2 (4 workers): each patch split again over the sp ranks; warmup = all steps is exact."""
    kw = dict(steps=3, sampler="euler")
    ref_tag = "pf_ref_euler"
    if not server.output(f"lat_{ref_tag}.safetensors").exists():
        _ok(server, server.run(workflow(None, ref_tag, PF_W, PF_H, **kw)))
    tag = "pf_u2_w3"
    degrees = {"pp_degree": 2, "ulysses_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 3}
    _ok(server, server.run(workflow(degrees, tag, PF_W, PF_H, **kw)))
    err = _rel(_load(server, f"lat_{tag}", "images"), _load(server, f"lat_{ref_tag}", "images"))
    print(f"PipeFusion pp2 x ulysses2, warmup 3/3: latent relative error vs KSampler {err:.2e}")
    assert err <= 1e-4


def test_noise_mask_is_honoured_in_step_mode(server):
    """SetLatentNoiseMask (inpainting-style): ComfyUI's own masking around the pool's forwards."""
    _ok(server, server.run(workflow(None, "mask_ref", W, H, mask=True, sampler="dpmpp_2m")))
    _ok(server, server.run(workflow({"cfg_degree": 2, "ulysses_degree": 2}, "mask_cfg2u2", W, H, mask=True,
                                    sampler="dpmpp_2m")))
    ref, lat = _load(server, "lat_mask_ref", "images"), _load(server, "lat_mask_cfg2u2", "images")
    assert _rel(lat, ref) <= 1e-4, _rel(lat, ref)
    kept = ref[..., : ref.shape[-2] // 2 - 1, : ref.shape[-1] // 2 - 1]  # the masked-out quarter stays the input
    assert torch.all(kept == kept.flatten()[0]) and ref.std().item() > 0.1  # (SD3's empty latent is a constant)
    entry = server.run(workflow({"ulysses_degree": 2, "sampling_mode": "loop"}, "mask_loop", W, H, mask=True))
    assert "noise masks" in str(entry) and "step mode" in str(entry), str(entry)[:2000]


@pytest.mark.slow  # Flux in CI: its forward at d1 / u2 / t2 (families/test_native_pool.py), its server run (templates)
def test_flux_dev_equals_ksampler(server):
    """Flux.1-dev (guidance embedder; ComfyUI forces width 3072: 531M parameters) on an odd 13 x 9 latent,
    which Flux pads circularly: ulysses2 and tensor parallel 2 in step mode and ring2 in loop mode equal
    KSampler."""
    from comfy_server import write_flux_checkpoint
    write_flux_checkpoint(server.base)
    kw = dict(family="flux", steps=2, cfg=1.0, scheduler="simple")
    _ok(server, server.run(workflow(None, "flux_ref", W, H, **kw)))
    ref = _load(server, "lat_flux_ref", "images")
    for tag, degrees in [("flux_u2", {"ulysses_degree": 2}), ("flux_r2_loop", {"ring_degree": 2,
                                                                                "sampling_mode": "loop"}),
                         ("flux_t2", {"tp_degree": 2})]:
        _ok(server, server.run(workflow(degrees, tag, W, H, **kw)))
        err = _rel(_load(server, f"lat_{tag}", "images"), ref)
        print(f"Flux.1-dev {tag}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-4
    img_ref, img = _load(server, "img_flux_ref", "images"), _load(server, "img_flux_u2", "images")
    assert (img - img_ref).abs().max().item() <= 1e-4
