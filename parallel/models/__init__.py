"""One adapter per model family (parallel/models/<family>.py: `ADAPTER`): what is split, not how
(the how is parallel/plan.py). Each adapter's `comfy_plan` is declared for ComfyUI's own diffusion-model class, the
one the workers run.
"""
from . import (any_model, auraflow, chroma, cogvideox, cosmos, ernie, flux, hidream_o1, hunyuan_video, kandinsky5,
               krea2, lumina2, ltxav, ltxv, minimax_h3, pixart, qwen_image, sd3, wan)
from ..plan import resolve_plan
from .adapter import FamilyAdapter

ADAPTERS = {a.family: a for m in (flux, sd3, pixart, wan, qwen_image, chroma, lumina2, hunyuan_video, ltxv, auraflow,
                                   kandinsky5, krea2, cogvideox, ernie, minimax_h3, ltxav, cosmos, hidream_o1)
            for a in (m.ADAPTER, *getattr(m, "VARIANTS", ()))}  # a variant: its own class, its own plan (Wan VACE)
COMFY_PLANS = {a.comfy_class: a.comfy_plan for a in ADAPTERS.values()}


ANY = any_model.ADAPTER  # CFG / data parallel for a model no adapter declares (not in ADAPTERS: it matches no class)


def adapter(family: str) -> FamilyAdapter:
    if family == ANY.family:
        return ANY
    if family not in ADAPTERS:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(ADAPTERS)}")
    return ADAPTERS[family]


def _match(model):
    """(adapter, plan) for a ComfyUI diffusion-model instance, or None.

    The class itself must be the one an adapter declares (or a subclass it lists as checked): a subclass
    inherits its base's blocks but may change its forward (Wan's VACE adds hint blocks whose inputs the Wan
    plan does not split), so it does not inherit the plan - it runs as `ANY` (CFG / data parallel) instead."""
    cls = type(model)
    for a in ADAPTERS.values():
        if a.declares(cls):
            return a, a.comfy_plan
    return None


def unchecked_base(model) -> FamilyAdapter | None:
    """The adapter of a supported base class of this model's class, when the class itself is not declared (a
    subclass nobody checked): for a message that says why its family's methods do not apply."""
    if _match(model) is not None:
        return None
    for cls in type(model).__mro__[1:]:
        for a in ADAPTERS.values():
            if a.declares(cls):
                return a
    return None


def adapter_for(model) -> FamilyAdapter | None:
    m = _match(model)
    return None if m is None else m[0]


def plan_for(model):
    """The plan for a ComfyUI diffusion-model instance (decided for it where a declaration depends on the
    model's code: plan.resolve_plan), or a clear error naming the supported classes."""
    m = _match(model)
    if m is None:
        raise ValueError(f"{type(model).__name__} is not supported for parallel sampling; supported: "
                         f"{sorted(COMFY_PLANS)} (ComfyUI's classes); any other ComfyUI model runs"
                         f" CFG / data parallel only; to add a family see {any_model.RECIPE}")
    return resolve_plan(m[1], model)


def supported_titles() -> str:
    """"Flux.1 (Flux), SD3/3.5 (OpenAISignatureMMDITWrapper), ..." for messages."""
    return ", ".join(f"{a.title} ({a.comfy_class})" for a in ADAPTERS.values())
