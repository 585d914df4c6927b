"""A run's plan, decided before any worker starts: the capture of what the graph put on the MODEL (refused where the
pool cannot carry it, naming the node), then the residency key, ComfyUI's model spec and what travels with each call,
with every refusal of what this config cannot run. The driver room sequences these; each check reads ComfyUI through
workers/bridge/ (capture.py, spec.py, prepare.py, carry.py, fbcache.py, inplace.py).
"""
from __future__ import annotations

from dataclasses import replace

from ..bridge.capture import capture
from ..bridge.carry import object_values
from ..bridge.inplace import build_key, in_place_findings
from ..bridge.prepare import (adapter_of, check_family, check_model_weights, compile_spec, first_block,
                              loader_patcher, portable_patches, residency_names, skip_layers, split_blocks)
from ..bridge.spec import NotCarried, native_spec
from .run_record import RunPlan, RunRecord


def capture_run(model, hp, who: str, graph, mode: str | None = None, conds=None, model_options=None):
    """Everything the graph put on `model` (and `conds`), refused before any work where the pool cannot carry it
    exactly, naming the node (workers/bridge/capture.py). Returns the capture (pool_state reads what it carries)."""
    adapter = adapter_of(model)
    mode = mode or ("loop" if hp.config.pp_degree > 1 or hp.mode == "loop" else "step")
    cap = capture(model, mode, model_options=model_options, conds=conds,
                  carried_options=adapter.carried_options if adapter is not None else ())
    cap.found += in_place_findings(model.model, build_key(model.model))  # changed outside ModelPatcher
    cap.check(who, graph)
    return cap


def pool_state(model, hp, cap) -> RunRecord:
    """How the pool runs this MODEL for `hp`: its residency key (what the weights hold - base, patches, compute
    dtype - and the method), ComfyUI's own model spec, what travels with each call (object values, hooks) and the call
    counter. Refuses, before any worker starts, what cannot travel (tp / pp where the family declares none, tp degrees
    the model cannot be sharded by, carried patches a method cannot run). `cap`: the run's capture (capture_run)."""
    # the workers keep the model parallelized for one method: the method is part of its identity
    method = f"{hp.config.method}" + (f"-w{hp.config.warmup_steps}" if hp.config.method != "usp" else "")
    cast = [f.detail["value"] for f in cap.carried("compute_dtype")]
    extra = f"cast-{str(cast[-1]).removeprefix('torch.')}" if cast and cast[-1] is not None else ""
    check_family(model, hp)  # a model no adapter declares: cfg / dp only; tp / pp where the family declares them
    compiled = compile_spec(model, hp)
    # ComfyUI's own model on the workers; refused here, before any worker starts, if it cannot travel
    native = native_spec(model.model, compute_dtype=cast[-1] if cast else None)
    check_model_weights(model, hp.config)  # its layout, an attention kernel it asks for, tp shards, GGUF's methods
    patches = portable_patches(model, hp.config)  # LoRA & co travel as patches where they can
    if patches is not None:
        native = replace(native, patcher=loader_patcher(model))  # a loader that patches its own way (GGUF)
    key, lineage = residency_names(model, extra, method)
    plan = RunPlan(key=key, lineage=lineage, native=native, weight_patches=patches, compile=compiled,
                   object_values=object_values(cap.carried("object_values")), hooks=bool(cap.carried("hooks")),
                   bypass={k: v for f in cap.carried("bypass") for k, v in f.detail["adapters"].items()},
                   fbcache=first_block(model, hp, cap, compiled))
    check_carried_calls(model, hp, cap, plan)
    return RunRecord(plan)


def check_carried_calls(model, hp, cap, plan) -> None:
    """Refuse, before any worker starts, carried per-call patches this config cannot apply exactly: hook LoRAs where
    the ranks do not hold whole weights they can patch (tp / pp / sharded, quantized or a loader's weights, a compiled
    model), and block skips (Skip Layer Guidance) of a block where the family's plan splits the sequence or with
    DistriFusion (its stale activations are kept per conditioning, which the extra call would overwrite)."""
    config = hp.config
    if plan.hooks:
        why = ("tensor parallel, PipeFusion or weight sharding" if not config.whole_model else
               "a compiled model (TorchCompileModel)" if plan.compile else
               "quantized weights" if plan.native.quantized or plan.native.tensors else "")
        if why:
            raise NotCarried(f"hook LoRAs switch weights per conditioning on the workers, which {why} cannot do "
                             f"exactly; use ulysses / ring / cfg / dp degrees with shard_weights none on bf16 / fp16 / "
                             f"fp32 weights, or load the LoRA with LoraLoaderModelOnly")
    if plan.bypass and (config.tp_degree > 1 or config.pp_degree > 1):
        raise NotCarried(f"{cap.creator(cap.carried('bypass')[0])} computes its LoRA beside each whole layer, which "
                         f"tensor parallel (a layer's output in shards) and PipeFusion (stages) do not run; use "
                         f"ulysses / ring / cfg / dp degrees or shard_weights, or LoraLoaderModelOnly")
    closures = cap.carried("closure")
    if closures and not config.batch_only:
        raise NotCarried(f"{cap.creator(closures[0])} patches the model's activations inside each call, which is exact "
                         f"only where every rank runs the whole model on whole images: use cfg_degree / dp_degree "
                         f"(ulysses / ring / tensor / pipeline degrees 1, shard_weights none)")
    extra_calls = cap.carried("skip_blocks") + cap.carried("value_attention")
    if not extra_calls:
        return
    if config.method == "distrifusion" and config.sp_degree > 1:
        raise NotCarried(f"{cap.creator(extra_calls[0])} makes an extra model call per step, which DistriFusion's "
                         f"stale activations (kept per conditioning) cannot tell from the real one: use method usp")
    adapter = adapter_of(model)
    split = split_blocks(adapter) if adapter is not None and config.sp_degree > 1 else set()
    for f in cap.carried("skip_blocks"):
        hit = sorted(split & skip_layers(f.detail.get("function")))
        if hit:
            raise NotCarried(f"{cap.creator(f)} skips block {hit[0]}, where the pack splits the image tokens over the "
                             f"ranks ({adapter.title}): choose layers from 1, or use cfg / dp degrees")


