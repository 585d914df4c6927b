"""One adapter per model family: what is split, not how (the how is parallel/plan.py).

Each family module declares two plans on the same mechanism: `COMFY_PLAN` for ComfyUI's own
diffusion-model class (what the workers run for the nodes) and `PLAN` for the diffusers class
(the library API and the reference in tests).
"""
from . import flux, pixart, sd3, wan

_MODULES = (flux, sd3, pixart, wan)
PLANS = {p.PLAN.model_class: p.PLAN for p in _MODULES}
COMFY_PLANS = {p.COMFY_PLAN.model_class: p.COMFY_PLAN for p in _MODULES}
FAMILIES = {p.PLAN.family: p.PLAN for p in _MODULES}
COMFY_FAMILIES = {p.COMFY_PLAN.family: p.COMFY_PLAN for p in _MODULES}


def plan_for(model):
    """The plan for a diffusers or ComfyUI transformer instance, or a clear error naming the supported classes.

    A subclass of a supported ComfyUI class (e.g. a family variant) uses its base's plan.
    """
    for cls in type(model).__mro__:
        plan = PLANS.get(cls.__name__) or COMFY_PLANS.get(cls.__name__)
        if plan is not None:
            return plan
    raise ValueError(f"{type(model).__name__} is not supported for parallel sampling; supported: "
                     f"{sorted(COMFY_PLANS)} (ComfyUI) and {sorted(PLANS)} (diffusers)")
