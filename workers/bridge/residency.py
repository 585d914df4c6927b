"""What identifies the weights the workers hold for a MODEL: the key says exactly what is in them.

Why: the key used to be the model object and ComfyUI's `patches_uuid`. ComfyUI rerolls that uuid when hooks register
on a patcher (ModelPatcher.add_hook_patches) and later clones inherit it, while the weights the driver sent were
read while a hook LoRA was patched into them in place (ModelPatcher.patch_hooks): the next plain prompt on the same
MODEL found "its" key resident and was served the hooked weights (4.9e-2 from KSampler, no error). Now:
- the key is the base model's identity plus a digest of the weight patches themselves (each patch tensor stamped
  with an id the first time it is seen, strengths, offsets): equal keys hold equal patches, whatever uuids say;
- the weights that travel never hold a hook: a key ComfyUI's hook patching replaced in place travels as the weight
  it saved before (`unhooked`); hooks travel per call (carry.py).
"""
from __future__ import annotations

import hashlib
import json
import uuid


def stamp(obj) -> str:
    """A uid attached to `obj` the first time it is seen (an id() of a dead object is reused; a uid is not)."""
    uid = getattr(obj, "_hp_uid", None)
    if uid is None:
        uid = uuid.uuid4().hex
        try:
            obj._hp_uid = uid
        except (AttributeError, TypeError):  # an object that takes no attributes: its identity for this process
            uid = f"id{id(obj)}"
    return uid


def _canonical(value):
    import torch
    if isinstance(value, torch.Tensor):
        return ["t", stamp(value), list(value.shape), str(value.dtype)]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    weights = getattr(value, "weights", None)
    if weights is not None:  # a comfy.weight_adapter object: its class and tensors
        return [type(value).__name__, sorted(getattr(value, "loaded_keys", None) or ()), _canonical(weights)]
    if callable(value):
        return ["fn", f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', '?')}", stamp(value)]
    return ["obj", type(value).__name__, stamp(value)]


def patches_digest(patches: dict) -> str:
    """A digest of ComfyUI weight patches ({key: [(strength_patch, data, strength_model, offset, function)]}):
    the same for the same patch tensors and strengths, different for any other."""
    if not patches:
        return "none"
    text = json.dumps(_canonical(patches), sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def weights_key(base_model, patches: dict, extra: str = "") -> str:
    """The key of the weights the workers hold for `base_model` (ComfyUI's BaseModel) under `patches` (what its
    ModelPatcher applies) and `extra` (the compute dtype and anything else that changes what is built)."""
    return f"{stamp(base_model)}:{patches_digest(patches)}" + (f"|{extra}" if extra else "")


def unhooked(patcher) -> dict:
    """{diffusion-model tensor name: the weight before any hook}: the keys ComfyUI's hook patching replaced in place
    (ModelPatcher.hook_backup), each as it saved it; {} when no hook is applied."""
    backup = getattr(patcher, "hook_backup", None) or {}
    prefix = "diffusion_model."
    return {k[len(prefix):]: v[0] for k, v in backup.items() if k.startswith(prefix)}
