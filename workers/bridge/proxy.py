"""The pool's stand-in for ComfyUI's diffusion model during one model call, and the call's codec.

Step mode: ComfyUI runs the sampler exactly as KSampler does (same noise, sigmas, CFG, masks, previews); an
APPLY_MODEL wrapper (`make_apply_model_wrapper`) swaps the diffusion model for `PoolDiffusionModel` for the duration
of each model call, and the proxy reads that one forward's arguments as they are (`call_payload`) and what travels
with the call besides (workers/bridge/carry.py: transformer options, hook groups, a LoRA bypass), hands them to the
run's link to the pool (workers/driver/step.StepRun: the residency, the typed job, the send) and returns the workers'
output. Everything around the forward stays ComfyUI's code. In loop mode the proxy captures the first call's
conditioning instead (`Captured`, workers/bridge/loop_mode.py). This module never reaches the pool itself: the driver
room hands it the run.
"""
from __future__ import annotations

import torch

from ...parallel.models import adapter_for
from .carry import bypass_call, call_options, hook_call, skipped_blocks
from .fbcache import call_sigma
from .prepare import split_blocks
from .residency import unhooked
from .sampling import run_wrapped
from .spec import NotCarried, check_diffusion_wrappers, diffusion_wrappers, runs_diffusion_wrappers


class Captured(Exception):
    """Raised by the proxy in capture mode: carries one call's conditioning inputs; nothing was computed."""

    def __init__(self, inputs: dict, cond_or_uncond: list, x: torch.Tensor):
        super().__init__("captured")
        self.inputs, self.cond_or_uncond, self.x_shape = inputs, cond_or_uncond, x.shape
        self.x = x  # the model's input: the scaled latent, then ComfyUI's concat conditioning (image to video)



class PoolDiffusionModel(torch.nn.Module):
    """Stands in for ComfyUI's diffusion model during one call: sends the call's arguments to the workers, which run
    ComfyUI's own model, and returns their output."""

    def __init__(self, run, original: torch.nn.Module, patcher=None):
        super().__init__()
        self.run = run  # the run's link to the pool (workers/driver/step.StepRun): its plan, its state, its send
        self.state = run.state
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
        if not self.state.resident:
            # the weights as they are without a hook: ComfyUI patches a hook group into them in place before the
            # call (its per-call hooks travel separately: carry.hook_call)
            self.run.ensure_resident(self._original[0], unhooked(self.patcher))

    def _native_forward(self, x, timestep, context, transformer_options, extra):
        """ComfyUI's own model on the workers: its call's arguments go as they are (call_payload), its output
        comes back as is."""
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
        st = self.state
        plan = st.plan
        call = dict(structure=structure)
        hooks = getattr(self.patcher, "current_hooks", None)
        if hooks is not None or plan.hooks:  # the call's hook group (ComfyUI switches it per cond)
            if not plan.hooks:
                raise NotCarried("this model call runs under a hook group that was not on the MODEL or its "
                                 "conditioning when sampling started; the pack cannot carry it")
            call["hooks"], parts = hook_call(self.patcher, hooks, st.hooks_sent)
            tensors.update(parts)
            changing += parts
        if plan.bypass:  # LoRA bypass: its adapters once per run, injected around each call
            call["bypass"], parts = bypass_call(plan.bypass, st.bypass_sent)
            tensors.update(parts)
            changing += parts
        which = (transformer_options or {}).get("cond_or_uncond")
        if isinstance(which, (list, tuple)) and all(isinstance(i, int) for i in which):
            call["conds"] = which  # which conditionings this call holds: DistriFusion's lane
        if plan.fbcache:  # First Block Cache: its rule and this call's sigma (what the node compares)
            sigma = call_sigma(transformer_options)
            if sigma is None:
                raise NotCarried("First Block Cache needs the call's sigma, which ComfyUI did not hand this model call")
            call["fbcache"] = {"rule": plan.fbcache, "sigma": sigma}
        self._ensure_resident()
        res = self.run.forward(call, tensors, tuple(changing))
        device = (x[0] if isinstance(x, (list, tuple)) else x).device
        if "out_streams" in res.values:
            return [res.tensors[f"out.{i}"].to(device) for i in range(res.values["out_streams"])]
        # one tensor back for a multi-stream latent too (video-only LTX-2: x = [video], the model returns the video)
        return res.tensors["out"].to(device)

    def _check_skips(self, adapter, options) -> None:
        """A block skipped by this call (Skip Layer Guidance's extra call) where the family's plan splits the tokens
        would never split them: refused (the node's layers are checked before work; this is the net)."""
        skipped = skipped_blocks(options)
        if skipped and adapter is not None and self.run.config.sp_degree > 1:
            hit = sorted(skipped & split_blocks(adapter))
            if hit:
                raise NotCarried(f"this model call skips block {hit[0]}, where the pack splits the image tokens over "
                                 f"the ranks ({adapter.title}): skip layers from 1, or use cfg / dp degrees")

    def forward(self, x, timestep, context=None, control=None, transformer_options=None, **extra):
        """ComfyUI's diffusion model runs its DIFFUSION_MODEL wrappers around its forward; the ones that can run in
        the driver (EasyCache) run here, around the pool call, exactly as ComfyUI's class would run them."""
        found = diffusion_wrappers((transformer_options or {}).get("wrappers"))
        if not found or self.state.capture or not runs_diffusion_wrappers(self._original[0]):
            # none; loop mode (the workers apply EasyCache's rule themselves); or a class that ignores them
            return self._call(x, timestep, context, control, transformer_options, **extra)
        check_diffusion_wrappers((transformer_options or {}).get("wrappers"))
        return run_wrapped(self._call, self, [f for v in found.values() for f in v],
                           x, timestep, context, control, transformer_options, **extra)

    def _call(self, x, timestep, context=None, control=None, transformer_options=None, **extra):
        if control is not None and self.state.capture:
            if self.run.config.pp_degree > 1:  # sampling_mode step alone is refused with PipeFusion
                how = "PipeFusion, which always loops in the workers: set pp_degree to 1 (sampling_mode auto or step)"
            else:
                how = "loop mode: set sampling_mode to step"
            raise ValueError(f"ControlNet runs on the workers in step mode; this config uses {how}")
        if control is not None:
            extra = dict(extra, control=control)
        if self.state.capture:  # loop mode: hand ComfyUI's own conditioning over, compute nothing
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


def loop_tensors(inputs: dict) -> dict:
    """Tensors of the call's kwargs, nested dicts flattened as 'outer.inner'."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, dict):
            out.update({f"{k}.{ik}": iv for ik, iv in v.items() if isinstance(iv, torch.Tensor)})
        elif isinstance(v, torch.Tensor):
            out[k] = v
    return out


def loop_structure(inputs: dict) -> dict:
    """The non-tensor part of the kwargs (None leaves, nested dict names), JSON-safe."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, dict):
            out[k] = {ik: None for ik, iv in v.items() if not isinstance(iv, torch.Tensor)}
        elif not isinstance(v, torch.Tensor):
            out[k] = v
    return out


def _note_step(run, options) -> None:
    """The sampler step this model call belongs to, for the worker panel (ComfyUI's own bar is separate)."""
    sigmas, now = (options or {}).get("sample_sigmas"), (options or {}).get("sigmas")
    if isinstance(sigmas, torch.Tensor) and isinstance(now, torch.Tensor) and sigmas.numel() > 1 and now.numel():
        total = sigmas.numel() - 1
        run.progress(min(int((sigmas[:-1].cpu() > now.max().cpu()).sum()) + 1, total), total)


def make_apply_model_wrapper(run_of):
    """ComfyUI's APPLY_MODEL wrapper that puts the proxy in for each model call. `run_of()`: the run's link to the
    pool (workers/driver/step.StepRun) - asked at each call, so Parallel Model's run decided per sampling (degrees
    "auto", the record from the guider's whole graph) is the one the call goes to."""
    def wrapper(executor, *args, **kwargs):
        run = run_of()
        _note_step(run, kwargs.get("transformer_options", args[5] if len(args) > 5 else None))
        base = executor.class_obj
        original = base.diffusion_model
        proxy = PoolDiffusionModel(run, original, patcher=getattr(base, "current_patcher", None))
        base.diffusion_model = proxy
        try:
            return executor(*args, **kwargs)
        finally:
            base.diffusion_model = original
    return wrapper
