"""ComfyUI node classes: thin - validate, turn ComfyUI objects into a job, call the pool."""
import sys

from .cluster_node import ClusterNode
from .config_node import ParallelConfigNode
from .model_node import ParallelModel
from .runtime import Runtime
from .sampler_node import HybridSampler
from .vae_node import PatchVAEDecode

RUNTIME = Runtime()  # this ComfyUI process's one connection to its worker pool
HybridSampler.runtime = RUNTIME
PatchVAEDecode.runtime = RUNTIME
ParallelModel.runtime = RUNTIME

# The web extension's routes, only inside a running ComfyUI server (never import `server` ourselves: in
# pytest or a plain `import` of the pack there is no PromptServer, and importing ComfyUI's would start one).
_prompt_server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
if _prompt_server is not None:
    from .routes import register as _register_routes
    _register_routes(_prompt_server, RUNTIME)
    ParallelConfigNode.runtime = RUNTIME  # only in a server: Parallel Config starts the workers early
    RUNTIME.follow_comfy_unload()  # ComfyUI's "Unload models" / /free release the workers' models too
    # Nothing starts here: no process, no memory until the pack is used. The frontend asks for the spare
    # interpreters (/hybrid_parallel/warm) when a workflow holding the pack's nodes is opened; Parallel Config
    # starts the workers when such a prompt is queued.

NODE_CLASS_MAPPINGS = {
    "HybridParallelConfig": ParallelConfigNode,
    "HybridSampler": HybridSampler,
    "HybridPatchVAEDecode": PatchVAEDecode,
    "HybridParallelCluster": ClusterNode,
    "HybridParallelModel": ParallelModel,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "HybridParallelConfig": "Parallel Config",
    "HybridSampler": "Hybrid Sampler",
    "HybridPatchVAEDecode": "Patch VAE Decode",
    "HybridParallelCluster": "Hybrid Parallel Cluster",
    "HybridParallelModel": "Parallel Model",
}
