"""ComfyUI node classes: thin - validate, turn ComfyUI objects into a job, call the pool."""
from .config_node import ParallelConfigNode
from .runtime import Runtime
from .sampler_node import HybridSampler
from .vae_node import PatchVAEDecode

RUNTIME = Runtime()  # this ComfyUI process's one connection to its worker pool
HybridSampler.runtime = RUNTIME
PatchVAEDecode.runtime = RUNTIME

NODE_CLASS_MAPPINGS = {
    "HybridParallelConfig": ParallelConfigNode,
    "HybridSampler": HybridSampler,
    "HybridPatchVAEDecode": PatchVAEDecode,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "HybridParallelConfig": "Parallel Config",
    "HybridSampler": "Hybrid Sampler",
    "HybridPatchVAEDecode": "Patch VAE Decode",
}
