"""ComfyUI checkpoints -> diffusers models (pure torch + diffusers, never imports ComfyUI): test references.

The pack runs ComfyUI's own modules everywhere; these converters (once the nodes' diffusers path) now only let
the tests check the diffusers library API (parallelize a diffusers transformer)
against ComfyUI's forward on the same weights. `convert(family, comfy_state_dict)` gives everything a worker needs to do that
without hub access: the diffusers class name, a config inferred from the weights' shapes (the
few constants that shapes cannot tell are shipped in the family modules), and the state dict in
diffusers' layout (diffusers' own single-file converters where they exist). Each family module
also has `comfy_to_diffusers_inputs` / `diffusers_to_comfy_output`, the input/output
conventions under which diffusers' forward equals ComfyUI's diffusion-model forward.

Families: flux, sd3, pixart, wan (diffusion models).
"""
from __future__ import annotations

from types import ModuleType
from typing import Mapping

import torch

from . import flux, pixart, sd3, wan
from ._util import CheckpointError, strip_prefix

__all__ = ["FAMILIES", "CheckpointError", "build_model", "convert", "detect_family", "family_module",
           "flux", "pixart", "sd3", "to_diffusers", "wan"]

FAMILIES = ("flux", "sd3", "pixart", "wan")

_DETECT = (
    ("flux", flux.is_flux),
    ("sd3", sd3.is_sd3),
    ("pixart", pixart.is_pixart),
    ("wan", wan.is_wan),
)
_CONVERT = {
    "flux": flux.convert,
    "sd3": sd3.convert,
    "pixart": pixart.convert,
    "wan": wan.convert,
}
_MODULES = {"flux": flux, "sd3": sd3, "pixart": pixart, "wan": wan}


def detect_family(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Which family a ComfyUI state dict (keys with or without a component prefix) belongs to."""
    sd = strip_prefix(state_dict)
    for name, test in _DETECT:
        if test(sd):
            return name
    sample = ", ".join(sorted(sd)[:5])
    raise CheckpointError(f"not a supported ComfyUI checkpoint (supported: {', '.join(FAMILIES)}); "
                          f"first keys: {sample}")


def convert(family: str, comfy_state_dict: Mapping[str, torch.Tensor]) -> tuple[str, dict, dict]:
    """(diffusers class name, diffusers config, diffusers state dict) for a ComfyUI state dict.

    The input is not modified; tensors are shared (or views) where the mapping allows, not copied.
    """
    if family not in _CONVERT:
        raise CheckpointError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    sd = strip_prefix(comfy_state_dict)
    found = detect_family(sd)
    if found != family:
        raise CheckpointError(f"this state dict is a {found} checkpoint, not {family}: pass family={found!r}")
    return _CONVERT[family](sd)


def family_module(family: str) -> ModuleType:
    """The module holding a family's converter and its input/output conventions."""
    if family not in _MODULES:
        raise CheckpointError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")
    return _MODULES[family]


def build_model(class_name: str, config: dict, state_dict: Mapping[str, torch.Tensor],
                dtype: torch.dtype | None = torch.float32) -> torch.nn.Module:
    """Instantiate the diffusers class from `config` and load `state_dict` strictly (eval mode).

    Random init is skipped (the weights are overwritten anyway: for Flux that is seconds saved);
    every parameter and persistent buffer must be provided, so a wrong mapping fails here.
    """
    import diffusers
    from diffusers.models.modeling_utils import no_init_weights

    cls = getattr(diffusers, class_name, None)
    if cls is None:
        raise CheckpointError(f"diffusers {diffusers.__version__} has no model class {class_name!r}")
    with no_init_weights():
        model = cls(**config)
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{class_name}: converted weights do not fit the inferred config: "
                              f"missing {sorted(missing)[:8]}, unexpected {sorted(unexpected)[:8]}")
    if dtype is not None and dtype != torch.float32:  # built in float32; load_state_dict already cast
        model = model.to(dtype)
    return model.eval()


def to_diffusers(module: torch.nn.Module, family: str):
    """(family, diffusers config, diffusers state dict) of a ComfyUI module's weights."""
    _class_name, config, dsd = convert(family, {k: v.detach() for k, v in module.state_dict().items()})
    return family, config, dsd
