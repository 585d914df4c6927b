"""Hybrid Sampler: KSampler's inputs and ComfyUI's own sampling, with the diffusion model on the pool.

Step mode: ComfyUI runs the sampler exactly as KSampler does (same noise,
sigmas, CFG, masks, previews); an APPLY_MODEL wrapper swaps the diffusion
model for a proxy for the duration of each model call, and the proxy sends
that one forward to the workers. Everything around the forward - input
scaling, timestep conversion, denoised output - stays ComfyUI's code.
"""
from __future__ import annotations

import uuid
from contextlib import contextmanager

import torch

from .loop_mode import (Captured, check_loop_mode, ksampler_latent, loop_convention, make_loop_sampler,
                        uses_loop_mode)
from ..parallel.models import adapter_for
from ..workers.bridge.capture import capture
from ..workers.bridge.carry import bypass_call, call_options, hook_call, object_values, skipped_blocks
from ..workers.bridge.graph import given
from ..workers.bridge.residency import unhooked, weights_key
from .native import (NotCarried, check_any_model, check_declared, check_diffusion_wrappers, check_loader_methods,
                     check_memory, check_native_pipefusion, check_native_tp, check_weights, diffusion_wrappers,
                     native_spec, runs_diffusion_wrappers)
from .runtime import take_over_from_dynamic_vram

WRAPPER_KEY = "comfyui_hybrid_parallel"



class PoolDiffusionModel(torch.nn.Module):
    """Stands in for ComfyUI's diffusion model during one call: sends the call's arguments to the workers, which run
    ComfyUI's own model, and returns their output."""

    def __init__(self, runtime, hp, original: torch.nn.Module, state: dict, patcher=None):
        super().__init__()
        self.runtime, self.hp, self.state = runtime, hp, state
        self.patcher = patcher  # the ModelPatcher sampling now (BaseModel.current_patcher): its hooks, its backups
        self.dtype = original.dtype
        self.device = getattr(original, "device", None)
        self._original = [original]  # not a submodule: keep ComfyUI's weights out of this proxy

    def __getattr__(self, name):
        """ComfyUI's BaseModel reads helpers of its diffusion model while the proxy stands in (LTX-Video's
        process_timestep: `diffusion_model.patchifier`): those come from the original. Its submodules and weights do
        not - anything that would compute with the driver's copy fails here instead of running there."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_original")
            if not original:  # still being built (or copied): nothing to fall back to
                raise
            value = getattr(original[0], name)
            if isinstance(value, (torch.nn.Module, torch.Tensor)):
                raise AttributeError(f"the diffusion model runs on the workers: its {name!r} cannot be used by the "
                                     f"driver during a model call") from None
            return value

    def _ensure_resident(self):
        st = self.state
        if not st.get("resident"):
            # the weights as they are without a hook: ComfyUI patches a hook group into them in place before the
            # call (its per-call hooks travel separately: carry.hook_call)
            st["family"] = self.runtime.ensure_native(self.hp, st["key"], st["native"], self._original[0],
                                                      st.get("lineage"), st.get("patches"),
                                                      unhooked=unhooked(self.patcher))
            st["resident"] = True

    def _native_forward(self, x, timestep, context, transformer_options, extra):
        """ComfyUI's own model on the workers: its call's arguments go as they are (call_payload), its output
        comes back as is."""
        from ..parallel.models import adapter_for
        adapter = adapter_for(self._original[0])
        tensors, structure = call_payload(context, without_rebuilt(adapter, extra))  # refusals first
        changing = []  # what differs at every call: never reused from the previous one
        for name, value in (("x", x), ("timestep", timestep)):
            if isinstance(value, (list, tuple)):  # multi-stream (MiniMax H3, LTX-2: video + audio), one per stream
                structure[name], parts = _encode_nested(list(value), name)
                tensors.update(parts)
                changing += parts
            else:
                tensors[name] = value
                changing.append(name)
        options = call_options(transformer_options, adapter.carried_options if adapter is not None else ())
        structure["transformer_options"] = options
        self._check_skips(adapter, options)
        values = {"key": self.state["key"], "call_index": self.state["calls"], "structure": structure}
        if self.state.get("object_values"):
            values["object_values"] = self.state["object_values"]
        hooks = getattr(self.patcher, "current_hooks", None)
        if hooks is not None or self.state.get("hooks"):  # the call's hook group (ComfyUI switches it per cond)
            if not self.state.get("hooks"):
                raise NotCarried("this model call runs under a hook group that was not on the MODEL or its "
                                 "conditioning when sampling started; the pack cannot carry it")
            values["hooks"], parts = hook_call(self.patcher, hooks, self.state.setdefault("hooks_sent", set()))
            tensors.update(parts)
            changing += parts
        if self.state.get("bypass"):  # LoRA bypass: its adapters once per run, injected around each call
            values["bypass"], parts = bypass_call(self.state["bypass"], self.state.setdefault("bypass_sent", set()))
            tensors.update(parts)
            changing += parts
        which = (transformer_options or {}).get("cond_or_uncond")
        if isinstance(which, (list, tuple)) and all(isinstance(i, int) for i in which):
            values["conds"] = list(which)  # which conditionings this call holds: DistriFusion's lane
        if self.state.get("compile"):
            values["compile"] = self.state["compile"]
        self._ensure_resident()
        self.state["calls"] += 1
        res = submit_once(self.runtime.pool(self.hp), self.hp.config, values, tensors, self.state, tuple(changing))
        device = (x[0] if isinstance(x, (list, tuple)) else x).device
        if "out_streams" in res.values:
            return [res.tensors[f"out.{i}"].to(device) for i in range(res.values["out_streams"])]
        # one tensor back for a multi-stream latent too (video-only LTX-2: x = [video], the model returns the video)
        return res.tensors["out"].to(device)

    def _check_skips(self, adapter, options) -> None:
        """A block skipped by this call (Skip Layer Guidance's extra call) where the family's plan splits the tokens
        would never split them: refused (the node's layers are checked before work; this is the net)."""
        skipped = skipped_blocks(options)
        if skipped and adapter is not None and self.hp.config.sp_degree > 1:
            hit = sorted(skipped & split_blocks(adapter))
            if hit:
                raise NotCarried(f"this model call skips block {hit[0]}, where the pack splits the image tokens over "
                                 f"the ranks ({adapter.title}): skip layers from 1, or use cfg / dp degrees")

    def forward(self, x, timestep, context=None, control=None, transformer_options=None, **extra):
        """ComfyUI's diffusion model runs its DIFFUSION_MODEL wrappers around its forward; the ones that can run in
        the driver (EasyCache) run here, around the pool call, exactly as ComfyUI's class would run them."""
        found = diffusion_wrappers((transformer_options or {}).get("wrappers"))
        if not found or self.state.get("capture") or not runs_diffusion_wrappers(self._original[0]):
            # none; loop mode (the workers apply EasyCache's rule themselves); or a class that ignores them
            return self._call(x, timestep, context, control, transformer_options, **extra)
        check_diffusion_wrappers((transformer_options or {}).get("wrappers"))
        import comfy.patcher_extension as ext
        return ext.WrapperExecutor.new_class_executor(self._call, self, [f for v in found.values() for f in v]) \
            .execute(x, timestep, context, control, transformer_options, **extra)

    def _call(self, x, timestep, context=None, control=None, transformer_options=None, **extra):
        if control is not None and self.state.get("capture"):
            if self.hp.config.pp_degree > 1:  # sampling_mode step alone is refused with PipeFusion
                how = "PipeFusion, which always loops in the workers: set pp_degree to 1 (sampling_mode auto or step)"
            else:
                how = "loop mode: set sampling_mode to step"
            raise ValueError(f"ControlNet runs on the workers in step mode; this config uses {how}")
        if control is not None:
            extra = dict(extra, control=control)
        if self.state.get("capture"):  # loop mode: hand ComfyUI's own conditioning over, compute nothing
            cond, structure = call_payload(context, extra)
            if structure:
                raise NotCarried(f"loop mode cannot carry {sorted(structure)} (reference latents) yet; "
                                 f"set Parallel Config's sampling_mode to step (or use Parallel Model)")
            self._ensure_resident()
            raise Captured(cond, list((transformer_options or {}).get("cond_or_uncond") or [0]), x)
        return self._native_forward(x, timestep, context, transformer_options, extra)


def _encode_nested(value, path: str):
    """(JSON skeleton, {dotted path: tensor}) of nested dicts / lists holding tensors, None and scalars: the
    worker puts each tensor back at its path (workers/jobs.py _inputs)."""
    if isinstance(value, torch.Tensor):
        return None, {path: value}
    if isinstance(value, dict):
        skeleton, found = {}, {}
        for k, v in value.items():
            skeleton[str(k)], more = _encode_nested(v, f"{path}.{k}")
            found.update(more)
        return skeleton, found
    if isinstance(value, (list, tuple)):
        skeleton, found = [], {}
        for i, v in enumerate(value):
            s, more = _encode_nested(v, f"{path}.{i}")
            skeleton.append(s)
            found.update(more)
        return skeleton, found
    if value is None or isinstance(value, (str, int, float, bool)):
        return value, {}
    raise NotCarried(f"Hybrid Sampler cannot send {path} ({type(value).__name__}) to the workers")


def without_rebuilt(adapter, extra: dict) -> dict:
    """`extra` less the arguments the model's family adapter names as rebuilt by the model when absent
    (FamilyAdapter.rebuilt_inputs: a per-run cache object that cannot travel and need not); the dicts along each
    path are copied, never changed in place (ComfyUI reuses them at the next step)."""
    for path in (adapter.rebuilt_inputs if adapter is not None else ()):
        *parents, leaf = path.split(".")
        extra = dict(extra)
        node = extra
        for part in parents:
            if not isinstance(node.get(part), dict):
                break
            node[part] = dict(node[part])
            node = node[part]
        else:
            node.pop(leaf, None)
    return extra


def call_payload(context, extra: dict):
    """(tensors, JSON structure) of a diffusion-model call's arguments beyond x and timestep: tensors go as
    they are; nested ones (reference latent lists, ControlNet residual dicts) travel as dotted tensor paths
    under a JSON skeleton, plain values (the reference method) in the JSON; workers/jobs.py _inputs rebuilds
    them. Anything else is refused (NotCarried)."""
    tensors = {} if context is None else {"context": context}
    structure = {}
    for k, v in extra.items():
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            tensors[k] = v
        else:
            structure[k], found = _encode_nested(v, k)
            tensors.update(found)
    return tensors, structure


class ComfyInterrupt:
    """ComfyUI's interrupt flag as the pool's cancel token (polled while a job runs)."""

    def is_set(self) -> bool:
        import comfy.model_management
        return comfy.model_management.processing_interrupted()


def submit_interruptible(pool, config, kind, values, tensors):
    """pool.submit that stops at ComfyUI's interrupt button and raises ComfyUI's own interrupt exception."""
    from ..workers.pool import JobCancelled
    try:
        return pool.submit(config, kind, values, tensors, cancel=ComfyInterrupt())
    except JobCancelled:
        import comfy.model_management
        comfy.model_management.throw_exception_if_processing_interrupted()
        raise


def submit_once(pool, config, values: dict, tensors: dict, state: dict, changing: tuple):
    """A step-mode forward whose inputs that did not change since this run's previous call stay on the workers.

    Why: the conditioning (text, pooled, guidance, reference latents) is the same at every step of a run, yet
    ComfyUI hands it over as new tensors each call (it concatenates cond and uncond per call); sent every step it
    was most of the payload (9 MiB of a Flux 1024² step). A tensor equal to the one of the previous call is named
    in `reuse` and the workers take their copy of it (workers/jobs.py job_forward). `changing` (latent, timestep)
    is always sent. The previous call is identified by the run's id and call index, so a worker never reuses
    tensors of another run; a failed call sends everything again next time."""
    import uuid
    last = state.get("sent")
    run = state.setdefault("run", uuid.uuid4().hex)
    reuse = []
    if last is not None:
        for name, t in list(tensors.items()):
            prev = last["tensors"].get(name)
            if name not in changing and prev is not None and prev.shape == t.shape and prev.dtype == t.dtype \
                    and prev.device == t.device and (prev is t or torch.equal(prev, t)):
                reuse.append(name)
                del tensors[name]
    values = dict(values, run=run, previous_call=None if last is None else last["call"], reuse=reuse,
                  changing=list(changing))
    state["sent"] = None  # until this call succeeds
    res = submit_interruptible(pool, config, "forward", values, tensors)
    kept = {n: t for n, t in tensors.items() if n not in changing}
    kept.update({n: last["tensors"][n] for n in reuse})
    state["sent"] = {"call": values["call_index"], "tensors": kept}
    return res


def _flatten(inputs: dict) -> dict:
    """Tensors of the diffusers kwargs, nested dicts flattened as 'outer.inner'."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, dict):
            out.update({f"{k}.{ik}": iv for ik, iv in v.items() if isinstance(iv, torch.Tensor)})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _structure(inputs: dict) -> dict:
    """The non-tensor part of the kwargs (None leaves, nested dict names), JSON-safe."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, dict):
            out[k] = {ik: None for ik, iv in v.items() if not isinstance(iv, torch.Tensor)}
        elif not isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _note_step(runtime, options) -> None:
    """The sampler step this model call belongs to, for the worker panel (ComfyUI's own bar is separate)."""
    sigmas, now = (options or {}).get("sample_sigmas"), (options or {}).get("sigmas")
    if isinstance(sigmas, torch.Tensor) and isinstance(now, torch.Tensor) and sigmas.numel() > 1 and now.numel():
        total = sigmas.numel() - 1
        runtime.progress(min(int((sigmas[:-1].cpu() > now.max().cpu()).sum()) + 1, total), total)


def make_apply_model_wrapper(runtime, hp, state: dict):
    """`hp`: the config, or a callable returning this run's (Parallel Model decides degrees "auto" per run)."""
    def wrapper(executor, *args, **kwargs):
        _note_step(runtime, kwargs.get("transformer_options", args[5] if len(args) > 5 else None))
        base = executor.class_obj
        original = base.diffusion_model
        proxy = PoolDiffusionModel(runtime, hp() if callable(hp) else hp, original, state,
                                   patcher=getattr(base, "current_patcher", None))
        base.diffusion_model = proxy
        try:
            return executor(*args, **kwargs)
        finally:
            base.diffusion_model = original
    return wrapper


def is_dynamic(model) -> bool:
    """Whether ComfyUI holds this MODEL with its DynamicVRAM patcher (ComfyUI 0.33's ModelPatcherDynamic, the default
    on NVIDIA with torch >= 2.8); False on a ComfyUI without it."""
    probe = getattr(model, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def host_clone(model):
    """A clone of `model` that ComfyUI loads to its offload device (the host) only: the MODEL the pool's runs sample.

    Why: ComfyUI's sampling calls load_models_gpu on the MODEL it samples, which would otherwise put a second copy of
    the diffusion model on cuda:0 beside rank 0's. Loaded to the offload device, ComfyUI still applies the weight
    patches (LoRA) there where they cannot travel as patches (portable_patches), and those patched weights travel.

    ComfyUI 0.33's DynamicVRAM patcher (ModelPatcherDynamic) cannot be loaded to the host: it keeps per-device state
    (`dynamic_pins`) for its own load device only - ComfyUI's prompt bookkeeping (PromptModelTracker) and its loader
    read it under the patcher's load_device, a KeyError for the host - it reroutes a CPU patcher to the plain one
    itself, and it never writes weight patches into the weights (they are applied as each layer is cast on the GPU),
    so host weights read after its load would be unpatched. ComfyUI's own way to put such a model on the CPU
    (comfy_extras/nodes_multigpu.py) is a non-dynamic clone, `clone(disable_dynamic=True)`. It is made over the same
    model object (`model_override`, as get_non_dynamic_delegate passes its own): otherwise ComfyUI would load the
    checkpoint a second time (and fail for a loader that records no cached_patcher_init), and the pool identifies the
    weights by that object - a LoRA strength change then moves only the patch. ComfyUI treats the two patchers as
    clones of one model (ModelPatcher.is_clone): loading either unloads the other, and they share the weights'
    backups, so each puts back what the other patched."""
    if not is_dynamic(model):
        m = model.clone()
    else:
        import inspect
        try:
            params = inspect.signature(model.clone).parameters
        except (TypeError, ValueError):
            params = {}
        if not ({"disable_dynamic", "model_override"} <= set(params) and
                callable(getattr(model, "get_clone_model_override", None))):
            raise NotCarried(f"this MODEL's patcher ({type(model).__name__}) loads its weights dynamically "
                             f"(DynamicVRAM) and offers no non-dynamic clone to keep ComfyUI's copy on the host; "
                             f"start ComfyUI with --disable-dynamic-vram")
        m = model.clone(disable_dynamic=True, model_override=model.get_clone_model_override())
    m.load_device = m.offload_device
    return m


def check_not_on_pool(model, who: str) -> None:
    """A MODEL that already runs on the pool (Parallel Model) must not be wrapped again: each model call would
    go to the workers twice over."""
    import comfy.patcher_extension as ext
    if (model.wrappers.get(ext.WrappersMP.APPLY_MODEL) or {}).get(WRAPPER_KEY):
        raise ValueError(f"{who}: this MODEL already runs on the workers (it comes from a Parallel Model node); "
                         f"sample it with KSampler or any sampler node, or remove the Parallel Model node")


def check_not_multigpu(model, who: str) -> None:
    """ComfyUI's own MultiGPU CFG Split (node MultiGPU_WorkUnits, ComfyUI >= 0.23) gives the MODEL whole-model copies
    on other GPUs (additional models under "multigpu") and runs the cond / uncond batches on them in threads. The pack
    splits that same work over its workers: on one MODEL the two would send each model call to the pool from several
    threads at once, each on part of the batch. Refused before any work, saying which to keep."""
    getter = getattr(model, "get_additional_models_with_key", None)  # ComfyUI's seam (workers/comfy_seams.py)
    if getter is not None and getter("multigpu"):
        raise ValueError(
            f"{who}: this MODEL went through ComfyUI's MultiGPU CFG Split node, which already runs the cond / uncond "
            f"batch on whole-model copies on other GPUs. Use one of the two: remove MultiGPU CFG Split and keep "
            f"{who} (cfg_degree 2 is the same split; the pack also splits one image - cfg 1 and distilled models - "
            f"shards weights and runs video), or remove {who} to keep ComfyUI's split")


COMPILE_KEY = "torch.compile"  # ComfyUI's TorchCompileModel wrapper (comfy_api/torch_helpers/torch_compile.py)


def compile_spec(model, hp) -> dict | None:
    """ComfyUI's TorchCompileModel options on this MODEL, for the workers to compile their model with (None: not
    compiled). ComfyUI's own wrapper would swap in a compiled copy of the driver's model around each call: the nodes
    take it out (without_compile_wrapper) and the workers compile theirs instead, once per resident model and mesh.
    Refused, before any worker starts: a backend that is not a name (a callable cannot travel), and loop mode /
    PipeFusion, which run the model from the workers' own loop."""
    import comfy.patcher_extension as ext
    if not (model.wrappers.get(ext.WrappersMP.APPLY_MODEL) or {}).get(COMPILE_KEY):
        return None
    kw = dict(model.model_options.get("torch_compile_kwargs") or {})
    if not isinstance(kw.get("backend"), str):
        raise NotCarried(f"this MODEL is compiled with a torch.compile backend that is not a name "
                         f"({kw.get('backend')!r:.60}); the workers compile by name (inductor, cudagraphs...): use "
                         f"TorchCompileModel's own backends")
    if hp.config.pp_degree > 1 or hp.mode == "loop":
        raise NotCarried("a MODEL compiled by TorchCompileModel runs compiled in step mode only: set sampling_mode to "
                         "auto or step and pp_degree to 1, or remove the TorchCompileModel node")
    options = kw.get("options")
    if options is not None and not (isinstance(options, dict) and all(
            isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in options.items())):
        raise NotCarried(f"TorchCompileModel options {options!r:.80} cannot travel to the workers (plain values only)")
    return {"backend": kw["backend"], "options": options, "mode": kw.get("mode"),
            "fullgraph": bool(kw.get("fullgraph")), "dynamic": kw.get("dynamic")}


def without_compile_wrapper(wrappers: dict) -> None:
    """Take ComfyUI's TorchCompileModel wrapper out of `wrappers` (a clone's, or a run's model options): the workers
    compile their own model; the driver's compiled copy must never stand in for the pool's proxy."""
    import comfy.patcher_extension as ext
    (wrappers.get(ext.WrappersMP.APPLY_MODEL) or {}).pop(COMPILE_KEY, None)


def capture_run(model, hp, who: str, graph, mode: str | None = None, conds=None, model_options=None):
    """Everything the graph put on `model` (and `conds`), refused before any work where the pool cannot carry it
    exactly, naming the node (workers/bridge/capture.py). Returns the capture (pool_state reads what it carries)."""
    adapter = adapter_for(model.model.diffusion_model)
    mode = mode or ("loop" if hp.config.pp_degree > 1 or hp.mode == "loop" else "step")
    cap = capture(model, mode, model_options=model_options, conds=conds,
                  carried_options=adapter.carried_options if adapter is not None else ())
    cap.check(who, graph)
    return cap


def pool_state(model, hp, cap) -> dict:
    """How the pool runs this MODEL for `hp`: its residency key (what the weights hold - base, patches, compute
    dtype - and the method), ComfyUI's own model spec, what travels with each call (object values, hooks) and the call
    counter. Refuses, before any worker starts, what cannot travel (tp / pp where the family declares none, tp degrees
    the model cannot be sharded by, carried patches a method cannot run). `cap`: the run's capture (capture_run)."""
    # the workers keep the model parallelized for one method: the method is part of its identity
    method = f"{hp.config.method}" + (f"-w{hp.config.warmup_steps}" if hp.config.method != "usp" else "")
    cast = [f.detail["value"] for f in cap.carried("compute_dtype")]
    extra = f"cast-{str(cast[-1]).removeprefix('torch.')}" if cast and cast[-1] is not None else ""
    state = {"key": f"native:{weights_key(model.model, model.patches, extra)}|{method}", "calls": 0,
             "lineage": f"{model.model._hp_uid}|{method}"}  # this model under other patches: replaced, not kept
    check_any_model(model.model.diffusion_model, hp)  # a model no adapter declares: cfg / dp only
    check_declared(model.model.diffusion_model, hp.config)  # tp / pp where the family declares them
    compiled = compile_spec(model, hp)
    # ComfyUI's own model on the workers; refused here, before any worker starts, if it cannot travel
    state["native"] = native_spec(model.model, compute_dtype=cast[-1] if cast else None)
    check_weights(model.model.diffusion_model)
    check_native_tp(model.model.diffusion_model, hp.config)
    check_loader_methods(model.model.diffusion_model, hp.config, patched=bool(model.patches))  # GGUF
    state["patches"] = portable_patches(model, hp.config)  # LoRA & co travel as patches where they can
    if state["patches"] is not None:
        state["native"]["patcher"] = loader_patcher(model)  # a loader that patches its own way (GGUF)
    state["compile"] = compiled
    state["object_values"] = object_values(cap.carried("object_values"))
    state["hooks"] = bool(cap.carried("hooks"))
    state["bypass"] = {k: v for f in cap.carried("bypass") for k, v in f.detail["adapters"].items()}
    check_carried_calls(model, hp, cap, state)
    return state


def check_carried_calls(model, hp, cap, state) -> None:
    """Refuse, before any worker starts, carried per-call patches this config cannot apply exactly: hook LoRAs where
    the ranks do not hold whole weights they can patch (tp / pp / sharded, quantized or a loader's weights, a compiled
    model), and block skips (Skip Layer Guidance) of a block where the family's plan splits the sequence or with
    DistriFusion (its stale activations are kept per conditioning, which the extra call would overwrite)."""
    config = hp.config
    if state["hooks"]:
        why = ("tensor parallel, PipeFusion or weight sharding" if not config.whole_model else
               "a compiled model (TorchCompileModel)" if state["compile"] else
               "quantized weights" if state["native"].get("quantized") or state["native"].get("tensors") else "")
        if why:
            raise NotCarried(f"hook LoRAs switch weights per conditioning on the workers, which {why} cannot do "
                             f"exactly; use ulysses / ring / cfg / dp degrees with shard_weights none on bf16 / fp16 / "
                             f"fp32 weights, or load the LoRA with LoraLoaderModelOnly")
    if state["bypass"] and (config.tp_degree > 1 or config.pp_degree > 1):
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
    adapter = adapter_for(model.model.diffusion_model)
    split = split_blocks(adapter) if adapter is not None and config.sp_degree > 1 else set()
    for f in cap.carried("skip_blocks"):
        hit = sorted(split & skip_layers(f.detail.get("function")))
        if hit:
            raise NotCarried(f"{cap.creator(f)} skips block {hit[0]}, where the pack splits the image tokens over the "
                             f"ranks ({adapter.title}): choose layers from 1, or use cfg / dp degrees")


def split_blocks(adapter) -> set:
    """The block indices the family's sequence plan hooks into ("blocks.0" splits the tokens): a block a replacement
    skips never runs its hooks."""
    found = set()
    for path in adapter.comfy_plan.sequence:
        last = path.rsplit(".", 1)[-1]
        if last.isdigit():
            found.add(int(last))
    return found


def skip_layers(fn) -> set:
    """The layer indices Skip Layer Guidance's function skips (its closure's double_layers / single_layers)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return set()
    found = set()
    for name, cell in zip(code.co_freevars, cells):
        if name in ("double_layers", "single_layers", "layers"):
            try:
                found |= {int(i) for i in cell.cell_contents}
            except (TypeError, ValueError):
                pass
    return found


def portable_patches(model, config):
    """(spec, tensors) of the MODEL's weight patches (LoRA, LoHa, LoKr, OFT, diffs) when they can travel to the
    workers and be applied there to the base weights (workers/comfy_patches.py): the ranks must hold the whole model
    (no tp / pp / weight sharding, which cut the weights before any patch could apply). None: no patches, or
    ComfyUI patches its own copy and the patched weights travel, as before."""
    if not model.patches or not config.whole_model:
        return None
    from ..workers.comfy_patches import NotPortable, encode
    try:
        return encode(model.patches)
    except NotPortable:
        return None


def loader_patcher(model):
    """The MODEL's ModelPatcher class when a custom loader patches weights its own way (workers/loader_types.py),
    refused before any worker starts where the workers could not import it; None for ComfyUI's own."""
    from ..workers.loader_types import NotCarriable, describe_patcher
    try:
        return describe_patcher(model)
    except NotCarriable as e:
        raise NotCarried(f"this MODEL's patcher cannot be rebuilt on the workers: {e}") from None


@contextmanager
def patches_on_workers(patcher, state):
    """While ComfyUI samples `patcher`, leave its weights unpatched when the workers apply the patches themselves:
    no patched copy (and backup) on the host, and the base weights are what travels. A new patches_uuid makes
    ComfyUI restore the base weights if another sampler left them patched, and re-patch them for the next one."""
    if not state.get("patches"):
        yield
        return
    saved = patcher.patches, patcher.patches_uuid
    patcher.patches, patcher.patches_uuid = {}, uuid.uuid4()
    try:
        yield
    finally:
        patcher.patches, patcher.patches_uuid = saved


class HybridSampler:
    DESCRIPTION = ("A drop-in KSampler that runs the diffusion model across the devices of a Parallel Config. "
                   "Same inputs and the same result as KSampler (exactly, at degree 1 and for the exact methods).")
    CATEGORY = "Hybrid Parallel"
    RETURN_TYPES = ("LATENT",)
    OUTPUT_TOOLTIPS = ("The denoised latent.",)
    FUNCTION = "sample"
    runtime = None  # set by the pack's entry point

    @classmethod
    def INPUT_TYPES(cls):
        import comfy.samplers
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model: Flux.1 / Kontext / Chroma / Flux.2, SD3 / 3.5, "
                                "Qwen-Image, Wan 2.1 / 2.2, HunyuanVideo 1.5, Lumina 2, PixArt-Sigma (README: "
                                "supported models)."}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xffffffffffffffff, "control_after_generate": True,
                             "tooltip": "The random seed used for creating the noise."}),
            "steps": ("INT", {"default": 20, "min": 1, "max": 10000, "tooltip": "Denoising steps."}),
            "cfg": ("FLOAT", {"default": 8.0, "min": 0.0, "max": 100.0, "step": 0.1, "round": 0.01,
                              "tooltip": "Classifier-free guidance scale."}),
            "sampler_name": (comfy.samplers.KSampler.SAMPLERS, {"tooltip": "ComfyUI's sampler."}),
            "scheduler": (comfy.samplers.KSampler.SCHEDULERS, {"tooltip": "ComfyUI's scheduler."}),
            "positive": ("CONDITIONING", {"tooltip": "What to include."}),
            "negative": ("CONDITIONING", {"tooltip": "What to exclude."}),
            "latent_image": ("LATENT", {"tooltip": "The latent to denoise."}),
            "parallel_config": ("PARALLEL_CONFIG", {"tooltip": "From Parallel GPUs (simple) or Parallel Config."}),
            "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "Below 1.0 keeps part of the input latent (img2img)."}),
        }, "hidden": {"prompt": "PROMPT", "unique_id": "UNIQUE_ID"}}  # (to name a node whose patch is refused)

    def sample(self, model, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
               parallel_config, denoise=1.0, prompt=None, unique_id=None):
        import comfy.patcher_extension

        from .auto import resolve_auto, warn_idle_cfg  # degrees "auto": chosen here, where the latent is known
        report = {}
        latent_image = ksampler_latent(model, latent_image)  # KSampler's empty latent, before its shape is read
        hp = resolve_auto(parallel_config, model, tuple(latent_image["samples"].shape), cfg, negative, positive,
                          report=report, probes=getattr(self.runtime, "cost_probes", None))
        if report:
            self.runtime.last_auto = report  # the mesh picture shows it (nodes/routes.py)
        warn_idle_cfg(hp, cfg, negative, "Hybrid Sampler")
        loop = uses_loop_mode(hp)
        if loop:
            check_loop_mode(sampler_name)  # before any work
            loop_convention(model.get_model_object("model_sampling"))  # a sampling the workers' loop computes
        check_not_on_pool(model, "Hybrid Sampler")
        check_not_multigpu(model, "Hybrid Sampler")
        # everything the graph put on the MODEL and the conditioning: carried exactly, or refused here
        cap = capture_run(model, hp, "Hybrid Sampler", given(prompt, unique_id),
                          conds={"positive": positive, "negative": negative})
        m = host_clone(model)  # ComfyUI's copy of the diffusion model stays on the host (see host_clone)
        without_compile_wrapper(m.wrappers)  # the workers compile their own model (compile_spec)
        state = pool_state(model, hp, cap)
        check_native_pipefusion(model.model.diffusion_model, hp.config, tuple(latent_image["samples"].shape))
        # fits the devices? (the plan it checked is what the mesh picture shows: nodes/routes.py)
        self.runtime.last_memory = check_memory(model, hp, tuple(latent_image["samples"].shape), positive, cfg)
        m.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.APPLY_MODEL, WRAPPER_KEY,
                               make_apply_model_wrapper(self.runtime, hp, state))
        take_over_from_dynamic_vram(m)  # ComfyUI's DynamicVRAM copy (a KSampler before) leaves the GPU
        with self.runtime.track("sample", total=steps), self.runtime.quiet_driver(hp), patches_on_workers(m, state):
            return self._run(m, hp, state, loop, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                             latent_image, denoise, preview_from=model)

    def _run(self, m, hp, state, loop, seed, steps, cfg, sampler_name, scheduler, positive, negative,
             latent_image, denoise, preview_from):
        if not loop:  # step mode: ComfyUI's KSampler, one pool forward per model call
            return self._step_mode(m, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                                   denoise, preview_from)
        return self._loop_mode(m, hp, state, seed, steps, cfg, sampler_name, scheduler, positive, negative,
                               latent_image, denoise, preview_from)

    @staticmethod
    def _step_mode(m, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent, denoise, preview_from):
        """What KSampler does (nodes.common_ksampler), with the previews rendered where ComfyUI would render them:
        on the MODEL's own load device (its GPU), not on the host where ComfyUI's copy of the weights stays."""
        import comfy.sample
        import comfy.utils
        import latent_preview

        latent_image = latent["samples"]  # KSampler's (sample: ksampler_latent)
        noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
        callback = latent_preview.prepare_callback(preview_from, steps)
        samples = comfy.sample.sample(m, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                                      denoise=denoise, noise_mask=latent.get("noise_mask"), callback=callback,
                                      disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)
        out = latent.copy()
        out["samples"] = samples
        return (out,)

    def _loop_mode(self, m, hp, state, seed, steps, cfg, sampler_name, scheduler, positive, negative, latent,
                   denoise, preview_from):
        """ComfyUI's noise, sigmas and conditioning; the loop runs in the workers (PipeFusion or loop mode)."""
        import comfy.sample
        import comfy.samplers

        latent_image = latent["samples"]  # KSampler's (sample: ksampler_latent)
        noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
        sigmas = comfy.samplers.KSampler(m, steps=steps, device=m.load_device, sampler=sampler_name,
                                         scheduler=scheduler, denoise=denoise, model_options=m.model_options).sigmas
        sampler = make_loop_sampler(self.runtime, hp, state, sampler_name, cfg,
                                    m.get_model_object("model_sampling"), lambda: state["family"],
                                    base_model=m.model)
        import latent_preview  # ComfyUI's: its callback renders previews (when enabled) and moves the bar
        callback = latent_preview.prepare_callback(preview_from, sigmas.shape[-1] - 1)  # on the MODEL's GPU
        samples = comfy.sample.sample_custom(m, noise, cfg, sampler, sigmas, positive, negative, latent_image,
                                             noise_mask=latent.get("noise_mask"), callback=callback, seed=seed)
        out = latent.copy()
        out["samples"] = samples
        return (out,)
