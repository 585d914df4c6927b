"""PipeFusion: layers split into pipeline stages, the image into patches, stale K/V across patches.

Loop mode only (patches flow across timesteps, so the denoising loop runs in
the workers): `run_pipefusion_loop`. `run_serial_loop` is the one-device loop
it reproduces when every step is a warmup step.
"""
from .loop import run_pipefusion_loop, run_serial_loop
from .plans import BlockList, PipelinePlan, stage_ranges
from ..sampling import SAMPLERS, Convention, eps, flow
from .stage import PipelineCancelled

__all__ = ["BlockList", "Convention", "PipelineCancelled", "PipelinePlan", "SAMPLERS", "eps",
           "flow", "run_pipefusion_loop", "run_serial_loop", "stage_ranges"]
