"""FamilyAdapter: everything the pack knows about one model family, in one object.

Why one object: nodes, workers, benches and the mesh routes all ask family questions (which ComfyUI
class is this, where is its sequence split, does PipeFusion or tensor parallel apply). Spread over tables in several
packages those answers drifted; here each family module
(parallel/models/<family>.py) declares one `ADAPTER` and everybody reads it. Names only: nothing
here imports ComfyUI.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..plan import FamilyPlan


@dataclass(frozen=True)
class FamilyAdapter:
    family: str                    # the pack's name: "flux", "sd3", "pixart", "wan"
    title: str                     # what a user calls it, for messages: "Flux.1"
    comfy_plan: FamilyPlan         # ComfyUI's own class (what the workers run)
    # subclasses of comfy_class checked to run under comfy_plan (tests vs KSampler); any other subclass does not
    # inherit the plan (parallel/models/__init__.py: _match)
    comfy_subclasses: tuple = ()
    # the module(s) ComfyUI defines comfy_class (and the subclasses) in: a class of the same name elsewhere (AuraFlow's
    # `MMDiT` beside SD3's, a custom node's own `WanModel`) is another model and does not get this plan. One module,
    # or a tuple where the classes live in several (the same in every ComfyUI the tests ran); "" = any
    comfy_module: str | tuple = ""
    # dotted paths of call arguments that are a cache the model rebuilds from the other arguments when it is absent
    # (MiniMax H3's packed layout, an object ComfyUI builds once per run): the driver does not send them
    rebuilt_inputs: tuple = ()
    # transformer_options entries (JSON scalars) the model's forward reads, set by ComfyUI nodes (MiniMax H3's
    # sigma shifts): they travel with each call
    carried_options: tuple = ()
    # the model attribute holding the spatial patch size where the sequence split cuts a grid of patch rows
    # (plan.SplitGrid: Cosmos Predict2's `patch_spatial`): the driver refuses a latent with fewer patch rows than
    # sequence ranks before any work (workers/bridge/spec.check_native_grid); "" = no grid split
    grid_patch: str = ""

    def declares(self, cls) -> bool:
        """Whether this adapter's ComfyUI plan applies to instances of `cls` (the class itself, or a subclass listed
        as checked; in comfy_module where that is set)."""
        modules = (self.comfy_module,) if isinstance(self.comfy_module, str) else self.comfy_module
        if self.comfy_module and cls.__module__ not in modules:
            return False
        return cls.__name__ == self.comfy_class or cls.__name__ in self.comfy_subclasses

    @property
    def comfy_class(self) -> str:
        return self.comfy_plan.model_class

    @property
    def pipefusion_nodes(self) -> bool:
        """PipeFusion stages are declared for ComfyUI's class: the nodes can run it."""
        return self.comfy_plan.pipeline is not None
