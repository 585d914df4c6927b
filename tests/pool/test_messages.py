"""The typed wire of a model call (workers/messages.ForwardJob): built by field, travels as JSON, read back by the
rank through the same class - a misspelt or unknown field fails at the boundary, not as a value silently missing."""
from __future__ import annotations

import json

import pytest

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
    record = RunRecord(RunPlan(key="k", lineage="l", native={}, hooks=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.plan.hooks = False
    record.calls += 1
    record.hooks_sent.add("g")
    assert record.calls == 1 and record.plan.key == "k" and RunRecord(record.plan).run != record.run


def test_a_load_job_travels_as_json_and_a_misspelt_field_fails():
    from comfyui_hybrid_parallel.workers.messages import LoadJob
    from comfyui_hybrid_parallel.workers.residency import LoadDecision
    decision = LoadDecision(action="build", key="m", weights="sent").message()
    job = LoadJob(key="m", family="flux", decision=decision, native={"module": "comfy.ldm.flux.model"}, lineage="l")
    wire = json.loads(json.dumps(job.message()))
    assert LoadJob.from_message(wire) == job and "patch_spec" not in wire
    assert LoadJob(key="m", family="flux", decision=decision, patch_spec={}).message()["patch_spec"] == {}  # an undo
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['linage'\]"):
        LoadJob.from_message({**wire, "linage": "l"})
    with pytest.raises(ValueError, match="no decision"):
        LoadJob.from_message({"key": "m", "family": "flux"})
