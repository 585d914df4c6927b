"""The typed wire of a model call (workers/messages.ForwardJob, LoopJob, LoadJob and the ComfyUI model spec a load
carries): built by field, travels as JSON, read back by the rank through the same class - a misspelt or unknown field
fails at the boundary, not as a value silently missing."""
from __future__ import annotations

import json

import pytest
import torch

from comfyui_hybrid_parallel.workers.messages import ForwardJob


def test_a_forward_job_travels_as_json_and_comes_back_equal():
    job = ForwardJob(key="m", structure={"transformer_options": {}}, call_index=3, conds=[0, 1],
                     fbcache={"rule": {"threshold": 0.1}, "sigma": 0.5})
    sent = job.after(run="r1", previous_call=2, reuse=["context"], changing=("x", "timestep"))
    wire = json.loads(json.dumps(sent.message()))
    assert ForwardJob.from_message(wire) == sent and sent.reuse == ("context",) and sent.conds == (0, 1)
    assert "hooks" not in wire and "reuse" in wire  # unset fields do not travel
    assert ForwardJob.from_message({"key": "m"}).structure == {}


def test_a_misspelt_or_missing_field_fails_at_the_boundary():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['call_idx'\]"):
        ForwardJob.from_message({"key": "m", "call_idx": 1})
    with pytest.raises(ValueError, match="no key"):
        ForwardJob.from_message({"structure": {}})
    with pytest.raises(TypeError):
        ForwardJob(key="m", call_idx=1)  # the driver's side: a misspelt field where it is written
    with pytest.raises(ValueError, match="names its resident model"):
        ForwardJob(key="")


def test_a_loop_job_travels_as_json_and_a_missing_or_misspelt_field_fails():
    from comfyui_hybrid_parallel.workers.messages import LoopJob
    job = LoopJob(key="m", sampler="euler", convention={"kind": "flow", "timestep_scale": 1.0}, cfg_scale=3.0,
                  structure={"transformer_options": {}}, step_cache={"threshold": 0.2})
    wire = json.loads(json.dumps(job.message()))
    assert LoopJob.from_message(wire) == job and "bypass" not in wire
    # the pool's submit adds the previews flag to the same values: the rank reads it as a field
    assert LoopJob.from_message({**wire, "previews": True}).previews is True
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['cfg'\]"):
        LoopJob.from_message({**wire, "cfg": 3.0})
    with pytest.raises(ValueError, match="no convention"):
        LoopJob.from_message({"key": "m", "sampler": "euler"})
    with pytest.raises(TypeError):
        LoopJob(key="m", sampler="euler", convention={}, cfg=3.0)


def test_a_run_plan_is_frozen_and_the_run_record_holds_it():
    """The plan the refusals checked cannot be changed by the run that reads it; the run's own state can."""
    import dataclasses
    from comfyui_hybrid_parallel.workers.driver.run_record import RunPlan, RunRecord
    record = RunRecord(RunPlan(key="k", lineage="l", native=_hand_spec(), hooks=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.plan.hooks = False
    record.calls += 1
    record.hooks_sent.add("g")
    assert record.calls == 1 and record.plan.key == "k" and RunRecord(record.plan).run != record.run


def _hand_spec():
    """A NativeSpec written by hand (no ComfyUI): the wire's shape, not a model any rank could build."""
    from comfyui_hybrid_parallel.workers.messages import ComfyRuntime, ModelOps, NativeSpec
    return NativeSpec(module="comfy.ldm.flux.model", class_name="Flux", unet_config={"depth": 1}, ops=ModelOps(),
                      runtime=ComfyRuntime(comfy_dir="/comfy", attention="pytorch"))


def test_a_load_job_travels_as_json_and_a_misspelt_field_fails():
    from comfyui_hybrid_parallel.workers.messages import LoadJob
    from comfyui_hybrid_parallel.workers.residency import LoadDecision
    decision = LoadDecision(action="build", key="m", weights="sent").message()
    job = LoadJob(key="m", family="flux", decision=decision, native=_hand_spec(), lineage="l")
    wire = json.loads(json.dumps(job.message()))
    assert LoadJob.from_message(wire) == job and "patch_spec" not in wire
    assert LoadJob(key="m", family="flux", decision=decision, patch_spec={}).message()["patch_spec"] == {}  # an undo
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['linage'\]"):
        LoadJob.from_message({**wire, "linage": "l"})
    with pytest.raises(ValueError, match="no decision"):
        LoadJob.from_message({"key": "m", "family": "flux"})


@pytest.fixture(scope="module")
def comfy_models(tmp_path_factory):
    """ComfyUI's own models as its loaders load them - a tiny SD3 in fp32 and as a scaled-fp8 checkpoint, a tiny KL
    VAE - for the real spec writers (native_spec / native_vae_spec) to read. Files shared with the families' tests."""
    from comfy_env import setup_comfy
    setup_comfy()
    from comfyui_hybrid_parallel.doctor.methods import _vae
    from test_native_pool import load_model
    folder = tmp_path_factory.getbasetemp() / "native_ckpt"
    folder.mkdir(exist_ok=True)
    return {"fp32": load_model(folder, "sd3", "fp32").model,
            "scaled_fp8": load_model(folder, "sd3", "scaled_fp8").model, "vae": _vae(folder)}


def _decision(key: str) -> dict:
    from comfyui_hybrid_parallel.workers.residency import LoadDecision
    return LoadDecision(action="build", key=key, weights="sent").message()


@pytest.mark.comfy
@pytest.mark.parametrize("precision,cast", [("fp32", None), ("fp32", "bfloat16"), ("scaled_fp8", None)])
def test_a_native_spec_travels_inside_a_load_job_and_comes_back_equal(comfy_models, precision, cast):
    """What native_spec writes for a real ComfyUI model (its ops, a compute dtype, quantized weights' descriptions,
    a loader's patcher) is what the rank reads back: the same typed spec, nested parts and all, not a dict."""
    from dataclasses import replace

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    from comfyui_hybrid_parallel.workers.messages import ComfyRuntime, LoadJob, ModelOps, NativeSpec
    base = comfy_models[precision]
    spec = native_spec(base, compute_dtype=getattr(torch, cast) if cast else None)
    assert isinstance(spec.ops, ModelOps) and isinstance(spec.runtime, ComfyRuntime) and spec.runtime.comfy_dir
    assert spec.force_cast is (cast is not None) and spec.class_name == type(base.diffusion_model).__qualname__
    spec = replace(spec, patcher={"class": "some_loader.nodes:Patcher", "settings": {}, "packages": []})
    job = LoadJob(key="m", family=family_adapter(base.diffusion_model).family, decision=_decision("m"), native=spec)
    wire = json.loads(json.dumps(job.message()))
    back = LoadJob.from_message(wire)
    assert back == job and isinstance(back.native, NativeSpec) and back.native.ops == spec.ops
    assert "tensors" not in wire["native"] and "custom" not in wire["native"]["ops"]  # unset fields do not travel
    assert NativeSpec.from_message(spec.message()) == spec


@pytest.mark.comfy
def test_a_vae_spec_travels_inside_a_load_job_and_comes_back_equal(comfy_models):
    """The VAE family's load job reads its spec back as a VaeSpec (chosen by the family), equal to what
    native_vae_spec wrote; a spec of the other kind for the family is refused, not built as the wrong model."""
    from comfyui_hybrid_parallel.workers.bridge.vae import native_vae_spec
    from comfyui_hybrid_parallel.workers.messages import LoadJob, VaeSpec
    spec = native_vae_spec(comfy_models["vae"])
    job = LoadJob(key="vae", family="vae_comfy", decision=_decision("vae"), native=spec)
    wire = json.loads(json.dumps(job.message()))
    back = LoadJob.from_message(wire)
    assert back == job and isinstance(back.native, VaeSpec) and back.native.dtype == {"__dtype__": "float32"}
    with pytest.raises(ValueError, match="builds from a NativeSpec, got a VaeSpec"):
        LoadJob(key="vae", family="sd3", decision=_decision("vae"), native=spec)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['attrs', 'dtype'\]"):
        LoadJob.from_message({**wire, "family": "sd3"})  # a VAE's spec read as a diffusion model's


@pytest.mark.comfy
def test_a_misspelt_field_inside_the_spec_fails_at_the_rank_naming_it(comfy_models):
    """A key misspelt deep in the spec (the unet config's field, an ops field, the runtime's) fails where the rank
    reads the load job, naming it - before, the build read a missing key as None and picked other ops."""
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    from comfyui_hybrid_parallel.workers.messages import ComfyRuntime, LoadJob, ModelOps, NativeSpec
    spec = native_spec(comfy_models["fp32"])
    wire = json.loads(json.dumps(LoadJob(key="m", family="sd3", decision=_decision("m"), native=spec).message()))
    native = wire["native"]
    unet = {k: v for k, v in native.items() if k != "unet_config"}
    cases = {"unet_cfg": {**unet, "unet_cfg": native["unet_config"]},
             "fp8_optimisations": {**native, "ops": {**native["ops"], "fp8_optimisations": True}},
             "comfy_directory": {**native, "runtime": {**native["runtime"], "comfy_directory": "/c"}}}
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=rf"'m': its native spec: .*unknown field\(s\) \['{name}'\]"):
            LoadJob.from_message({**wire, "native": bad})
    with pytest.raises(ValueError, match="no unet_config"):
        NativeSpec.from_message(unet)
    with pytest.raises(TypeError):
        NativeSpec(module="m", class_name="C", unet_cfg={}, ops=ModelOps(), runtime=ComfyRuntime())
    with pytest.raises(TypeError):
        ModelOps(weight_dtyp=None)  # the writer's side: a misspelt field where it is written


@pytest.mark.comfy
def test_a_run_plan_keeps_its_native_spec_frozen(comfy_models):
    """The plan's spec is what the refusals checked (quantized, a loader's tensors): the run cannot change it, down to
    its ops; plan.py makes a new spec (dataclasses.replace) to add the loader's patcher before the plan is made."""
    import dataclasses

    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    from comfyui_hybrid_parallel.workers.driver.run_record import RunPlan
    spec = native_spec(comfy_models["fp32"])
    plan = RunPlan(key="k", lineage="l", native=spec)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.native.quantized = {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.native.ops.custom = {"class": "x:y"}
    patched = dataclasses.replace(spec, patcher={"class": "x:P"})
    assert plan.native.patcher is None and patched.patcher == {"class": "x:P"} and patched.ops is spec.ops
