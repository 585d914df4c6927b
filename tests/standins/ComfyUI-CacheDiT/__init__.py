"""A stand-in of Jasonzzt/ComfyUI-CacheDiT's "CacheDiT Accelerator" (CacheDiT_Model_Optimizer), the tests' own code
written to its mechanism (read in its public code): its config in transformer_options["cache_dit_turbo"], an
OUTER_SAMPLE wrapper keyed "cache_dit_turbo" that, when sampling starts, replaces the diffusion model's forward on
ComfyUI's model object with a cache of whole calls (warmup calls computed, then every skip_interval-th call the last
result again), and a DIFFUSION_MODEL wrapper under the same key that counts the steps."""
from .nodes import CacheDiT_Model_Optimizer

NODE_CLASS_MAPPINGS = {"CacheDiT_Model_Optimizer": CacheDiT_Model_Optimizer}
