"""The ComfyUI process's side of the worker pool: one pool, model residency keys, conversions.

One ComfyUI process drives one set of devices, so it owns one `WorkerPool`; the
`Runtime` object holding it is created by the pack's entry point and handed to
the nodes (class attribute), rather than living in a module global. The pool
restarts itself when a prompt asks for a different mesh.
"""
from __future__ import annotations

import threading
import uuid

import torch

from ..parallel.checkpoints import convert, detect_family
from ..workers.pool import WorkerPool

FAMILY_BY_COMFY_CLASS = {  # ComfyUI diffusion-model class -> our family
    "Flux": "flux", "MMDiT": "sd3", "OpenAISignatureMMDITWrapper": "sd3", "PixArtMS": "pixart", "WanModel": "wan",
}


class Runtime:
    MAX_MODEL_INFO = 16

    def __init__(self):
        self._pool = None
        self._lock = threading.Lock()
        self.model_info = {}  # weights key -> (family, diffusers config): skip converting weights twice

    def remember(self, key: str, info) -> None:
        self.model_info[key] = info
        while len(self.model_info) > self.MAX_MODEL_INFO:
            self.model_info.pop(next(iter(self.model_info)))

    def pool(self, hp) -> WorkerPool:
        with self._lock:
            if self._pool is None or self._pool.device != hp.device:
                if self._pool is not None:
                    self._pool.close()
                self._pool = WorkerPool(device=hp.device)
            return self._pool

    def ensure_resident(self, hp, key: str, convert_weights):
        """Make `key` resident on the workers; returns (family, diffusers config).

        `convert_weights()` -> (family, diffusers config, diffusers state dict) runs the first time a key
        is seen here, and later only when the workers lost the weights (restart, eviction).
        """
        pool = self.pool(hp)
        info = self.model_info.get(key)
        if info is None:
            family, config, dsd = convert_weights()
            pool.ensure_model(hp.config, key, family, config, state_dict=dsd)
            self.remember(key, (family, config))
            return family, config
        family, config = info
        pool.ensure_model(hp.config, key, family, config, state_dict=lambda: convert_weights()[2])
        return family, config

    def stop(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def health(self) -> list:
        return [] if self._pool is None else self._pool.health()


def weights_key(base_model, patches_uuid) -> str:
    """Identify the weights the workers must hold: this model object and its applied patches (LoRA...).

    A uid is attached to the model object on first sight (ids of dead objects get reused; a uid does not);
    ComfyUI renews `patches_uuid` whenever patches or their strengths change.
    """
    uid = getattr(base_model, "_hp_uid", None)
    if uid is None:
        uid = uuid.uuid4().hex
        base_model._hp_uid = uid
    return f"{uid}:{patches_uuid}"


def family_of(diffusion_model: torch.nn.Module, state_dict=None) -> str:
    name = type(diffusion_model).__name__
    if name in FAMILY_BY_COMFY_CLASS:
        return FAMILY_BY_COMFY_CLASS[name]
    if state_dict is not None:
        try:
            return detect_family(state_dict)
        except Exception:  # noqa: BLE001 - fall through to the clear error below
            pass
    raise ValueError(f"Hybrid Sampler supports Flux.1, SD3/3.5, PixArt-alpha/Sigma and Wan 2.1/2.2 models; "
                     f"this MODEL's diffusion model is {name}")


def to_diffusers(module: torch.nn.Module, family: str = None):
    """(family, diffusers config, diffusers state dict) of a ComfyUI module's current (patched) weights."""
    sd = {k: v.detach() for k, v in module.state_dict().items()}
    family = family or family_of(module, sd)
    _class_name, config, dsd = convert(family, sd)
    return family, config, dsd
