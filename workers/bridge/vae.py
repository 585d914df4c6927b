"""ComfyUI's VAE (comfy.sd.VAE) as Parallel VAE Decode needs it: the module the workers build and decode with, what
rebuilds it there, and the latent in / image out the way ComfyUI's VAE.decode converts them. The bridge is the only
code that reads the VAE wrapper (tests/driver/test_comfy_seams.py)."""
from __future__ import annotations

from ...parallel.vae.comfy_vaes import comfy_vae_for
from ..messages import VaeSpec
from .build import comfy_runtime
from .carry import encode_value


def vae_module(vae):
    """The VAE's model (first_stage_model): what the workers build and what the decode plan is checked against."""
    return vae.first_stage_model


def vae_input(vae, latent):
    """The latent as ComfyUI's VAE.decode hands it to its model: in the VAE's dtype."""
    return latent.to(vae.vae_dtype)


def vae_output(vae, decoded):
    """The model's output as VAE.decode returns it: float, through the VAE's process_output, channels last."""
    return vae.process_output(decoded.float()).movedim(1, -1)


def native_vae_spec(vae) -> VaeSpec:
    """What the workers build ComfyUI's VAE model from (workers/bridge/build.build_native_vae): its class, dtype and
    the classes it was built with, plus this process's ComfyUI runtime (family "vae_comfy" in the pool)."""
    first = vae.first_stage_model
    declared = comfy_vae_for(first)
    # a configuration the weights alone do not give (LTX)
    metadata = declared.metadata(first) if declared is not None and declared.metadata is not None else None
    return VaeSpec(class_name=qualname(first), dtype=encode_value(vae.vae_dtype), attrs=settings(first),
                   metadata=metadata, runtime=comfy_runtime())


def settings(module) -> dict:
    """The classes the VAE model was built with (TAEHV's latent format, which ComfyUI picks from the weights' dtype),
    by name: the workers' build must reproduce them (workers/bridge/build.build_native_vae compares). Plain numbers
    are left out: ComfyUI's model management keeps its own bookkeeping on the module."""
    return {k: f"class {v.__module__}.{v.__qualname__}" for k, v in vars(module).items()
            if not k.startswith("_") and isinstance(v, type)}


def qualname(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
