"""PipeFusion: layers split into pipeline stages, the image into patches, stale K/V across patches.

Loop mode only (patches flow across timesteps, so the denoising loop runs in
the workers): `run_pipefusion_loop`. With every step a warmup step it reproduces the one-device loop
(parallel/loop.run_loop).
"""
from .loop import run_pipefusion_loop
from .plans import BlockList, PipelinePlan, stage_ranges
from ..sampling import SAMPLERS, Convention, eps, flow
from .stage import PipelineCancelled

__all__ = ["BlockList", "Convention", "PipelineCancelled", "PipelinePlan", "SAMPLERS", "eps",
           "flow", "run_pipefusion_loop", "stage_ranges"]
