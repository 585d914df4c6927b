"""One adapter per model family: what is split, not how (the how is parallel/plan.py)."""
from . import flux, pixart, sd3, wan

PLANS = {p.PLAN.model_class: p.PLAN for p in (flux, sd3, pixart, wan)}
FAMILIES = {p.PLAN.family: p.PLAN for p in (flux, sd3, pixart, wan)}


def plan_for(model):
    """The plan for a diffusers transformer instance, or a clear error naming the supported classes."""
    name = type(model).__name__
    if name not in PLANS:
        raise ValueError(f"{name} is not supported for parallel sampling; supported: {sorted(PLANS)}")
    return PLANS[name]
