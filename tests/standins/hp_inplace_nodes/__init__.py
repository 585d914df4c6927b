"""Nodes that change ComfyUI's model in place, outside ModelPatcher - the mechanisms of ComfyUI-PuLID-Flux (a core
method replaced on the diffusion model instance, attention modules added to it) and ComfyUI-Easy-Use's BrushNet
(ComfyUI's sampling function and the UNet's apply_control replaced module-wide), and of packs that replace a method
on one of ComfyUI's classes. The tests' own code (tests/server_e2e/test_in_place.py): each change scales what the model
computes a little, so KSampler with the node differs from KSampler without it.

The changes outlive the prompt, as the real packs' do: `what: restore` puts everything back (the node always runs:
IS_CHANGED). The replacements are module-level functions, as PuLID-Flux's `forward_orig` is - the refusal names the
node by the module that defined them.
"""
import types

import torch

SCALE = 1.01
_SAVED = {}  # (owner, name) -> the original, for `restore`


def scaled_core(self, *args, **kwargs):
    """An instance's replacement of ComfyUI's MMDiT.forward_core_with_concat (PuLID-Flux replaces Flux.forward_orig)."""
    return type(self).forward_core_with_concat(self, *args, **kwargs) * SCALE


def scaled_block_forward(self, *args, **kwargs):
    """A class-wide replacement of ComfyUI's JointBlock.forward."""
    context, x = _SAVED[("JointBlock", "forward")](self, *args, **kwargs)
    return (None if context is None else context * SCALE), x * SCALE


def passing_sample(*args, **kwargs):
    """BrushNet's replacement of comfy.samplers.sample: here it samples as ComfyUI does."""
    return _SAVED[("comfy.samplers", "sample")](*args, **kwargs)


def scaled_apply_control(h, control, name):
    """BrushNet's replacement of the UNet's apply_control (it adds its own features there)."""
    return _SAVED[("openaimodel", "apply_control")](h, control, name) * SCALE


class ExtraCrossAttention(torch.nn.Module):
    """The kind of module PuLID adds to the model (its `pulid_ca`): weights ComfyUI's class does not have."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)


def _set(owner, key, name, value):
    _SAVED.setdefault(key, getattr(owner, name))
    setattr(owner, name, value)


def _restore(dm):
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
    import comfy.samplers
    owners = {"JointBlock": mmdit.JointBlock, "comfy.samplers": comfy.samplers, "openaimodel": openaimodel}
    for (owner, name), value in list(_SAVED.items()):
        setattr(owners[owner], name, value)
    _SAVED.clear()
    for name in ("forward_core_with_concat", "hp_extra_ca"):
        dm.__dict__.pop(name, None)
        dm._modules.pop(name, None)


class HPTestInPlacePatch:
    WHAT = ("instance_method", "added_module", "class_method", "brushnet", "restore")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "what": (list(cls.WHAT),)}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "hp_test"

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def patch(self, model, what):
        import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
        import comfy.ldm.modules.diffusionmodules.openaimodel as openaimodel
        import comfy.samplers
        dm = model.model.diffusion_model
        _restore(dm)
        if what == "instance_method":
            dm.forward_core_with_concat = types.MethodType(scaled_core, dm)
        elif what == "added_module":
            dm.hp_extra_ca = torch.nn.ModuleList([ExtraCrossAttention()])
        elif what == "class_method":
            _set(mmdit.JointBlock, ("JointBlock", "forward"), "forward", scaled_block_forward)
        elif what == "brushnet":
            _set(comfy.samplers, ("comfy.samplers", "sample"), "sample", passing_sample)
            _set(openaimodel, ("openaimodel", "apply_control"), "apply_control", scaled_apply_control)
        return (model.clone(),)


NODE_CLASS_MAPPINGS = {"HPTestInPlacePatch": HPTestInPlacePatch}
