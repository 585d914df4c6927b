"""The one run pipeline of Hybrid Sampler and Parallel Model: `prepare_run` decides and refuses everything before any
worker starts, `running` is the context the sampler runs in.

Why one: the two nodes kept hand-made copies of this sequence and they drifted - Parallel Model never checked that
the model fits the devices before loading it (parallel/memory.py), Hybrid Sampler did. Each node now only does what
is its own: Hybrid Sampler its loop mode and KSampler's latent, Parallel Model its wrappers and the guider it reads
at sampling time.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..bridge.host import take_over_from_dynamic_vram
from ..bridge.prepare import check_latent, check_not_multigpu, patches_on_workers
from ..bridge.spec import check_memory
from .auto import resolve_auto, warn_idle_cfg
from .plan import capture_run, pool_state


def prepare_run(runtime, hp, patcher, who: str, graph, *, shape: tuple, cfg: float, positive, negative,
                mode=None, conds=None, model_options=None):
    """(the config this run uses, its run record) for sampling `patcher` at latent `shape`: degrees "auto" decided
    (the mesh picture shows the choice), an idle CFG split said, ComfyUI-MultiGPU's split refused, the latent's shape
    and the memory the plan needs checked, and everything the graph put on the MODEL (and the conditioning: `conds`,
    or the guider's `model_options`) carried exactly or refused, naming the node - all before any work."""
    check_not_multigpu(patcher, who)  # (MultiGPU CFG Split placed after Parallel Model is seen only here)
    report = {}
    hp = resolve_auto(hp, patcher, tuple(shape), cfg, negative, positive, report=report,
                      probes=getattr(runtime, "cost_probes", None))
    if report:
        runtime.last_auto = report  # the mesh picture shows it (workers/driver/routes.py)
    warn_idle_cfg(hp, cfg, negative, who)
    # what the graph put on the MODEL first: a model no adapter declares is refused in those words, not the planner's
    cap = capture_run(patcher, hp, who, graph, mode=mode, conds=conds, model_options=model_options)
    state = pool_state(patcher, hp, cap)
    check_latent(patcher, hp.config, tuple(shape))
    # fits the devices? before any load (the plan it checked is what the mesh picture shows)
    runtime.last_memory = check_memory(patcher, hp, tuple(shape), positive, cfg)
    return hp, state


@contextmanager
def running(runtime, hp, patcher, state, total=None):
    """The context a prepared run samples in: ComfyUI's DynamicVRAM copy leaves the GPU first, progress is tracked,
    the driver stays quiet (its threads), and the patches the workers applied are undone on ComfyUI's copy after."""
    take_over_from_dynamic_vram(patcher)
    on_workers = bool(state.plan.weight_patches)
    with runtime.track("sample", total=total), runtime.quiet_driver(hp), patches_on_workers(patcher, on_workers):
        yield
