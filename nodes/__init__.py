"""ComfyUI node classes: thin - validate, turn ComfyUI objects into a job, call the pool."""
from ..workers.bridge.graph import prompt_server

from .cluster_node import ClusterNode
from .config_node import ParallelConfigNode
from .model_node import ParallelModel
from ..workers.driver.runtime import Runtime
from .sampler_node import HybridSampler
from .simple_node import ParallelGPUsNode
from .vae_node import PatchVAEDecode

RUNTIME = Runtime()  # this ComfyUI process's one connection to its worker pool
HybridSampler.runtime = RUNTIME
PatchVAEDecode.runtime = RUNTIME
ParallelModel.runtime = RUNTIME

# The web extension's routes, only inside a running ComfyUI server (never import `server` ourselves: in
# pytest or a plain `import` of the pack there is no PromptServer, and importing ComfyUI's would start one).
_prompt_server = prompt_server()
if _prompt_server is not None:
    from ..workers.bridge.seams import problem_line as _problem_line
    if _problem_line():  # the nodes refuse with the same line before any worker starts (Runtime.check_comfyui)
        import logging as _logging
        _logging.getLogger(__name__).error("%s", _problem_line())
    from ..workers.driver.routes import register as _register_routes
    _register_routes(_prompt_server, RUNTIME)
    ParallelConfigNode.runtime = RUNTIME  # only in a server: the config nodes start the workers early
    ParallelGPUsNode.runtime = RUNTIME
    RUNTIME.follow_comfy_unload()  # ComfyUI's "Unload models" / /free release the workers' models too
    # Nothing starts here unless HP_PRESTART asks (a headless server: workers/driver/routes.prestart_from_env): no
    # process, no memory until the pack is used. The frontend asks for the spare interpreters (/hybrid_parallel/warm) when a
    # workflow holding the pack's nodes is opened; such a prompt starts its world when it is queued.
    from ..workers.driver.routes import prestart_from_env as _prestart_from_env
    _prestart_from_env(RUNTIME)

# The keys are what saved workflows store: never renamed. The display names say what each node is in ComfyUI's
# terms ("patch" there means model patching, so the tiled decoder is "Parallel VAE Decode"); one category.
NODE_CLASS_MAPPINGS = {
    "HybridParallelGPUs": ParallelGPUsNode,
    "HybridParallelConfig": ParallelConfigNode,
    "HybridSampler": HybridSampler,
    "HybridPatchVAEDecode": PatchVAEDecode,
    "HybridParallelCluster": ClusterNode,
    "HybridParallelModel": ParallelModel,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "HybridParallelGPUs": "Parallel GPUs",
    "HybridParallelConfig": "Parallel Config (advanced)",
    "HybridSampler": "Hybrid Sampler",
    "HybridPatchVAEDecode": "Parallel VAE Decode",
    "HybridParallelCluster": "Parallel Cluster",
    "HybridParallelModel": "Parallel Model",
}
