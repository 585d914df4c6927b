"""One adapter per model family (parallel/models/<family>.py: `ADAPTER`): what is split, not how
(the how is parallel/plan.py).

Each adapter holds two plans on the same mechanism: `comfy_plan` for ComfyUI's own diffusion-model
class (what the workers run for the nodes) and `plan` for the diffusers class (the library API and
the reference in tests).
"""
from . import chroma, flux, hunyuan_video, lumina2, pixart, qwen_image, sd3, wan
from .adapter import FamilyAdapter

ADAPTERS = {m.ADAPTER.family: m.ADAPTER for m in (flux, sd3, pixart, wan, qwen_image, chroma, lumina2, hunyuan_video)}
PLANS = {a.diffusers_class: a.plan for a in ADAPTERS.values() if a.plan is not None}
COMFY_PLANS = {a.comfy_class: a.comfy_plan for a in ADAPTERS.values()}
FAMILIES = {f: a.plan for f, a in ADAPTERS.items() if a.plan is not None}


def adapter(family: str) -> FamilyAdapter:
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[family]


def _match(model):
    """(adapter, plan) for a ComfyUI or diffusers transformer instance (a subclass uses its base's), or None."""
    for cls in type(model).__mro__:
        for a in ADAPTERS.values():
            if cls.__name__ == a.comfy_class:
                return a, a.comfy_plan
            if a.plan is not None and cls.__name__ == a.diffusers_class:
                return a, a.plan
    return None


def adapter_for(model) -> FamilyAdapter | None:
    m = _match(model)
    return None if m is None else m[0]


def plan_for(model):
    """The plan for a diffusers or ComfyUI transformer instance, or a clear error naming the supported classes."""
    m = _match(model)
    if m is None:
        raise ValueError(f"{type(model).__name__} is not supported for parallel sampling; supported: "
                         f"{sorted(COMFY_PLANS)} (ComfyUI) and {sorted(PLANS)} (diffusers)")
    return m[1]


def supported_titles() -> str:
    """"Flux.1 (Flux), SD3/3.5 (OpenAISignatureMMDITWrapper), ..." for messages."""
    return ", ".join(f"{a.title} ({a.comfy_class})" for a in ADAPTERS.values())
