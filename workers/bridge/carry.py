"""What travels with each model call besides its tensors, and how the workers put it back - both sides in one file.

Why both sides here: what the driver encodes and what a rank rebuilds must be the same shape, and the shape is
ComfyUI's (its transformer_options, its block-replacement keys, its hook patches). The driver side
(`call_options`, `hook_call`) reads ComfyUI's objects at each call; the worker side (`rebuild_options`,
`ObjectValues`, `HookWeights`) rebuilds them with plain Python and ComfyUI's own weight arithmetic.

- transformer_options: the RoPE options, the entries the model's family reads (FamilyAdapter.carried_options) and
  block replacements of two known shapes - a block that returns its input (Skip Layer Guidance's skip) and an
  attention that returns its values (Perturbed-Attention Guidance): each function is checked to be exactly that
  (its code against a reference compiled here), travels as a name, and is rebuilt on the workers. Anything else in
  the call's options that the model could read is refused at the call (capture.py refuses what it can see before
  any work; this is the net for what ComfyUI adds during sampling).
- object values: "diffusion_model.<attribute>" object patches holding a plain value, set on the rank's model for the
  call and put back after.
- hooks: the call's hook group (ComfyUI switches weights per cond batch): its combined weight patches travel once per
  run and group, and each rank patches the weights it holds as ComfyUI's ModelPatcher.patch_hooks does, putting
  back the previous group's first.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import types

import torch

from .known import TRANSFORMER_OPTIONS
from .origin import NotCarried, function_rule, origin_of
from .patches import NotPortable, _decode, _encode, _Holder, decode, encode, seed_of
from .residency import stamp

# ComfyUI's per-call bookkeeping in transformer_options, never sent: what its sampler and BaseModel set for the driver
# (the batch's conds, sigmas, wrappers, DynamicVRAM's prefetch flag, EasyCache's holder, the context window), and what
# the diffusion model sets itself inside its forward before reading it (ComfyUI reuses the dict across calls)
BOOKKEEPING = frozenset({"cond_or_uncond", "uuids", "sigmas", "sample_sigmas", "wrappers", "callbacks", "easycache",
                         "context_window", "prefetch_dynamic_vbars", "multigpu_thread_device",
                         "total_blocks", "block_type", "block_index", "block", "transformer_index", "activations_shape",
                         "original_shape", "grid_sizes", "img_slice", "reference_image_num_tokens", "x_ref_attn_map",
                         "model_patch_data"})


def encode_value(v):
    """JSON-safe form of a unet_config value: dtypes tagged, tuples tagged, nested containers kept."""
    if isinstance(v, torch.dtype):
        return {"__dtype__": str(v).removeprefix("torch.")}
    if isinstance(v, tuple):
        return {"__tuple__": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): encode_value(x) for k, x in v.items()}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise NotCarried(f"this model's ComfyUI config holds a {type(v).__name__} ({v!r:.60}), which the workers "
                     f"cannot rebuild; Hybrid Sampler runs models loaded by ComfyUI's own loaders")



def _skip(args, extra_args):
    return args


def _value(q, k, v, extra_options, mask=None):
    return v


SHAPES = {"skip": _skip, "value": _value}  # the block replacements the workers rebuild, by name


def shape_of(fn) -> str | None:
    """"skip" / "value" when `fn` computes exactly what the reference of that name does (same code, constants,
    names and arity; no closure it reads), else None."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    for name, ref in SHAPES.items():
        rc = ref.__code__
        if (code.co_code, code.co_consts, code.co_names, code.co_argcount, code.co_varnames) == \
                (rc.co_code, rc.co_consts, rc.co_names, rc.co_argcount, rc.co_varnames) and not code.co_freevars:
            return name
    return None


def call_options(opts: dict | None, carried: tuple = ()) -> dict:
    """The JSON part of a call's transformer_options that travels; NotCarried for what the workers cannot rebuild."""
    opts = opts or {}
    out = {}
    for key, value in opts.items():
        if value is None or key in BOOKKEEPING:
            continue
        if key == "rope_options":
            out[key] = encode_value(dict(value))
        elif key in carried:
            if not isinstance(value, (bool, int, float, str)):
                raise NotCarried(f"transformer_options[{key!r}] ({type(value).__name__}) cannot travel to the workers")
            out[key] = value
        elif key == "patches_replace":
            replaced = _replacements(value)
            if replaced:
                out[key] = replaced
        elif key == "patches":
            patches = {str(slot): [closure_of(fn) for fn in fns] for slot, fns in (value or {}).items() if fns}
            if patches:
                out[key] = patches
        elif key == "ar_state":
            rule = TRANSFORMER_OPTIONS["ar_state"]
            raise NotCarried(f"{rule.why}; {rule.fix}")
        else:
            raise NotCarried(f"this model call carries transformer_options[{key!r}] ({type(value).__name__}), which "
                             f"the pack does not know how to carry to the workers; remove the node that sets it, or "
                             f"sample without the pack")
    return out


def _replacements(value: dict) -> dict:
    """{kind: [[name, index or None, shape], ...]} of ComfyUI's patches_replace ({kind: {(name, index): fn}})."""
    out = {}
    for kind, entries in (value or {}).items():
        rows = []
        for where, fn in (entries or {}).items():
            shape = shape_of(fn)
            if shape is None:
                raise NotCarried(f"this model call replaces the '{kind}' block {where} with a function from another "
                                 f"node ({getattr(fn, '__qualname__', type(fn).__name__)}); it would run inside "
                                 f"ComfyUI's diffusion model, which runs on the workers - remove that node, or sample "
                                 f"without the pack")
            name, index = (where if isinstance(where, tuple) else (where, None))[:2]
            rows.append([name, index, shape])
        if rows:
            out[str(kind)] = rows
    return out


def rebuild_call(kwargs: dict) -> dict:
    """Worker side: a call's kwargs as ComfyUI's forward takes them - its transformer_options' block replacements and
    model patches (Skip Layer Guidance, PAG) made functions again (rebuild_options)."""
    if "transformer_options" in kwargs:
        kwargs["transformer_options"] = rebuild_options(kwargs["transformer_options"])
    return kwargs


def rebuild_options(opts: dict | None) -> dict:
    """Worker side: the call's transformer_options with its block replacements and model patches made functions
    again."""
    opts = dict(opts or {})
    rows = opts.pop("patches_replace", None)
    if rows:
        opts["patches_replace"] = {kind: {(name if index is None else (name, index)): SHAPES[shape]
                                          for name, index, shape in entries} for kind, entries in rows.items()}
    patches = opts.pop("patches", None)
    if patches:
        opts["patches"] = {slot: [rebuild_closure(c) for c in fns] for slot, fns in patches.items()}
    return opts


# ---- model patches carried as ComfyUI's own function around plain numbers (FreeU) ----
def closure_of(fn) -> dict:
    """A model patch as {"origin", "cells"}: where ComfyUI defined it (a node whose FUNCTIONS rule carries it as a
    closure) and the plain values its closure holds; NotCarried for any other function."""
    origin = origin_of(fn)
    rule = function_rule(origin)
    code = getattr(fn, "__code__", None)
    if rule is None or rule.carry != "closure" or code is None:
        raise NotCarried(f"this model call carries a model patch from another node ({origin.partition(':')[2]}); it "
                         f"runs inside ComfyUI's diffusion model in its own process and cannot run on the workers - "
                         f"remove that node, or sample without the pack")
    cells = {name: _plain(cell.cell_contents, origin) for name, cell in zip(code.co_freevars, fn.__closure__ or ())}
    return {"origin": origin, "cells": cells}


def _plain(value, origin: str):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_plain(v, origin) for v in value]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        return {"__dict__": [[_plain(k, origin), _plain(v, origin)] for k, v in value.items()]}
    if isinstance(value, torch.device):
        return {"__device__": str(value)}
    raise NotCarried(f"the model patch {origin} holds a {type(value).__name__}, which cannot travel to the workers")


def _unplain(value):
    if isinstance(value, list):
        return [_unplain(v) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(_unplain(v) for v in value["__tuple__"])
        if "__dict__" in value:
            return {_unplain(k): _unplain(v) for k, v in value["__dict__"]}
        if "__device__" in value:
            return torch.device(value["__device__"])
    return value


def rebuild_closure(spec: dict):
    """Worker side: ComfyUI's own function at `origin` (its code, found in the defining module on this rank), closed
    over the values that travelled."""
    module_name, _, qualname = spec["origin"].partition(":")
    module = importlib.import_module(module_name)
    parts = qualname.split(".")
    outer = module
    for part in parts[:parts.index("<locals>") - 1] if "<locals>" in parts else parts[:-1]:
        outer = getattr(outer, part)
    holder = getattr(outer, parts[parts.index("<locals>") - 1]) if "<locals>" in parts else None
    code = getattr(getattr(holder, "__func__", holder), "__code__", None)
    found = next((c for c in (code.co_consts if code is not None else ()) if isinstance(c, types.CodeType) and
                  c.co_qualname == qualname), None)
    if found is None:
        raise RuntimeError(f"{spec['origin']} is not in this rank's {module_name}: is it the driver's ComfyUI?")
    cells = tuple(types.CellType(_unplain(spec["cells"][name])) for name in found.co_freevars)
    return types.FunctionType(found, module.__dict__, found.co_name, None, cells)


def skipped_blocks(opts: dict | None) -> set:
    """Block indices a call's (encoded) options skip, of any kind."""
    return {index for entries in ((opts or {}).get("patches_replace") or {}).values()
            for _, index, shape in entries if shape == "skip" and index is not None}


# ---- object values ----
def object_values(found) -> dict:
    """{attribute path under the diffusion model: value} of the capture's plain "diffusion_model.*" object patches."""
    return {f.detail["key"][len("diffusion_model."):]: f.detail["value"] for f in found}


class ObjectValues:
    """Worker side: set plain attribute values on the rank's model for one call, put the old ones back after."""

    def __init__(self, model, values: dict | None):
        self.model, self.values, self.saved = model, dict(values or {}), []

    def __enter__(self):
        for path, value in self.values.items():
            owner, _, leaf = path.rpartition(".")
            target = self.model
            for part in owner.split(".") if owner else ():
                target = getattr(target, part)
            self.saved.append((target, leaf, getattr(target, leaf)))
            setattr(target, leaf, value)
        return self

    def __exit__(self, *exc):
        for target, leaf, old in reversed(self.saved):
            setattr(target, leaf, old)
        self.saved.clear()


# ---- hooks ----
def hook_group_patches(patcher, hooks) -> dict:
    """ComfyUI's combined weight patches of a hook group at its current keyframe strengths (what its
    ModelPatcher.patch_hooks applies), diffusion-model keys only."""
    if hooks is None:
        return {}
    return {k: v for k, v in patcher.get_combined_hook_patches(hooks).items() if k.startswith("diffusion_model.")}


def hook_call(patcher, hooks, sent: set) -> tuple:
    """(JSON, tensors) for a model call run under `hooks` (a HookGroup, or None): the group's id - a digest of its
    combined patches, strengths included - and, the first time this run sends that id (`sent`), its patches."""
    patches = hook_group_patches(patcher, hooks)
    if not patches:
        return {"id": None}, {}
    try:
        spec, tensors = encode(patches)
    except NotPortable as e:
        raise NotCarried(f"a hook LoRA on this conditioning cannot travel to the workers ({e}); the pack carries "
                         f"LoRA hooks (CreateHookLora / CreateHookLoraModelOnly), not a model used as a hook") from None
    if any(_model_as_lora(entry) for entries in spec.values() for entry in entries):
        raise NotCarried("a model used as a hook LoRA (CreateHookModelAsLora) needs that model's weights on the "
                         "workers, which the pack does not send; use CreateHookLora with a LoRA file")
    return _once(spec, tensors, sent, "hook.")


def _once(spec, tensors: dict, sent: set, prefix: str) -> tuple:
    """(JSON, tensors) naming `spec` by a digest of it and its tensors' identities; the spec and its tensors (names
    under `prefix`) only the first time this run sends that digest (`sent`)."""
    digest = hashlib.sha1(json.dumps([spec, {n: stamp(t) for n, t in tensors.items()}], sort_keys=True,
                                     default=str).encode()).hexdigest()[:16]
    if digest in sent:
        return {"id": digest}, {}
    sent.add(digest)
    return {"id": digest, "spec": spec}, {f"{prefix}{n}": t for n, t in tensors.items()}


def _model_as_lora(entry) -> bool:
    data = entry[1]
    return isinstance(data, dict) and isinstance(data.get("$tuple"), list) and data["$tuple"][:1] == ["model_as_lora"]


class HookWeights:
    """Worker side: the hook group the rank's weights hold now, switched as ComfyUI's ModelPatcher.patch_hooks does
    (unpatch the previous group's keys, then each key of the new group from the weight it holds without hooks, in
    float32, rounded back seeded by the key) - but always into a new tensor, never into the weight's pages, which
    other ranks and the resident base share."""

    def __init__(self):
        self.current = None   # the group id applied
        self.backup = {}      # key -> the tensor the model held before the group
        self.groups = {}      # (run, id) -> decoded patches, this run's

    def remember(self, run, hook: dict, tensors: dict) -> None:
        if hook.get("spec") is not None:
            self.groups = {k: v for k, v in self.groups.items() if k[0] == run}
            self.groups[(run, hook["id"])] = decode(hook["spec"], {k[len("hook."):]: v for k, v in tensors.items()
                                                                   if k.startswith("hook.")})

    def switch(self, model, run, group_id, device) -> None:
        """Make `model` hold the weights of hook group `group_id` (None: none)."""
        if group_id == self.current:
            return
        self.restore(model)
        if group_id is None:
            return
        patches = self.groups.get((run, group_id))
        if patches is None:
            raise RuntimeError(f"hook group {group_id} of run {run} was never sent to this worker")
        import comfy.float
        import comfy.lora
        import comfy.utils
        import torch
        from comfy.model_patcher import get_key_weight

        holder = _Holder(model)
        for key, patch in patches.items():
            weight, set_func, convert_func = get_key_weight(holder, key)
            self.backup[key] = weight
            temp = weight.to(device=device, dtype=torch.float32, copy=True)
            if convert_func is not None:
                temp = convert_func(temp, inplace=True)
            out = comfy.lora.calculate_weight(patch, temp, key)
            if set_func is None:
                out = comfy.float.stochastic_rounding(out, weight.dtype, seed=seed_of(key))
                comfy.utils.set_attr_param(holder, key, out)
            else:
                set_func(out, inplace_update=False, seed=seed_of(key))
        self.current = group_id

    def restore(self, model) -> None:
        if not self.backup:
            self.current = None
            return
        import comfy.utils

        holder = _Holder(model)
        for key, weight in self.backup.items():
            comfy.utils.set_attr_param(holder, key, weight)
        self.backup.clear()
        self.current = None


# ---- LoRA bypass (ComfyUI's LoraLoaderBypass: the LoRA computed beside each layer's forward, not merged) ----
def bypass_call(adapters: dict, sent: set) -> tuple:
    """(JSON, tensors) naming the run's bypass set by a digest; its adapters the first time (`sent`)."""
    if not adapters:
        return {"id": None}, {}
    tensors = {}
    try:
        spec = {key: [_encode(adapter, tensors), float(strength)] for key, (adapter, strength) in adapters.items()}
    except NotPortable as e:
        raise NotCarried(f"a LoRA in bypass mode cannot travel to the workers ({e})") from None
    return _once(spec, tensors, sent, "hook.bypass.")


class Bypass:
    """Worker side: ComfyUI's own bypass injections (BypassInjectionManager) on the rank's model for one call."""

    def __init__(self):
        self.specs = {}     # (run, id) -> {module key: (adapter, strength)}
        self.made = {}      # (id(model), run, id) -> the injections made on that model

    def remember(self, run, call: dict, tensors: dict) -> None:
        if call.get("spec") is None:
            return
        parts = {k[len("hook.bypass."):]: v for k, v in tensors.items() if k.startswith("hook.bypass.")}
        self.specs = {k: v for k, v in self.specs.items() if k[0] == run}
        self.made = {k: v for k, v in self.made.items() if k[1] == run}
        self.specs[(run, call["id"])] = {key: (_decode(data, parts), strength)
                                         for key, (data, strength) in call["spec"].items()}

    def active(self, model, run, bypass_id, device=None):
        """A context manager: the bypass set `bypass_id` injected into `model` for the call (nothing for None), its
        adapters' tensors on the rank's `device`."""
        if bypass_id is None:
            return contextlib.nullcontext()
        key = (id(model), run, bypass_id)
        if key not in self.made:
            adapters = self.specs.get((run, bypass_id))
            if adapters is None:
                raise RuntimeError(f"LoRA bypass set {bypass_id} of run {run} was never sent to this worker")
            import comfy.weight_adapter
            manager = comfy.weight_adapter.BypassInjectionManager()
            for module_key, (adapter, strength) in adapters.items():
                manager.add_adapter(module_key, adapter, strength=strength)
            self.made[key] = manager.create_injections(_Holder(model))
        adapters = [a for a, _ in self.specs.get((run, bypass_id), {}).values()]
        return _Injected(self.made[key], adapters, device)


class _Injected:
    def __init__(self, injections, adapters=(), device=None):
        self.injections, self.adapters, self.device = injections, adapters, device

    def __enter__(self):
        for inj in self.injections:
            inj.inject(None)
        if self.device is not None:
            # ComfyUI's inject moves the adapters to its compute device (comfy.model_management.get_torch_device,
            # the rank's GPU on a worker); the rank's own device, so that a strict CPU rank computes them where a
            # GPU rank would
            for a in self.adapters:
                if isinstance(getattr(a, "weights", None), (list, tuple)):
                    a.weights = type(a.weights)(w.to(self.device) if isinstance(w, torch.Tensor) else w
                                                for w in a.weights)
        return self

    def __exit__(self, *exc):
        for inj in reversed(self.injections):
            inj.eject(None)
