"""Any diffusion model ComfyUI loads, with no family adapter: CFG and data parallel only.

Why this exists: CFG parallel and data parallel split the *batch* (the cond / uncond halves, the images of a
batch), never anything inside the model, so they need no knowledge of its blocks - every rank runs the whole
model, as ComfyUI core's own multi-GPU work units do. SD1.5, SDXL, Stable Cascade, audio models and any class
a family adapter does not declare (a subclass of a supported class whose forward was not checked, e.g. Wan's
VACE) run that way. Sequence, tensor and pipeline parallelism, DistriFusion and weight sharding reach into the
blocks and are refused for it before any worker starts (workers/bridge/spec.py: check_any_model).

The batch split is the same root wrapper as every family's (parallel/plan.py); `batch_inputs=("*",)` means
"every tensor argument whose first dimension is the batch" (nested dicts and lists included: ControlNet's
residuals), since nothing names this model's arguments.
"""
from .adapter import FamilyAdapter
from ..plan import FamilyPlan

FAMILY = "any"
RECIPE = "docs/adding-a-model.md"

COMFY_PLAN = FamilyPlan(
    family=FAMILY,
    model_class="*",
    batch_inputs=("*",),
    sequence={},
    attention={},
    tp_refusal="no family adapter declares this model's shard layout",
    pipeline_refusal="no family adapter declares this model's blocks",
    comfy=True,
)

ADAPTER = FamilyAdapter(family=FAMILY, title="any other model (CFG / data parallel)", comfy_plan=COMFY_PLAN)
