"""Step mode's link to the pool: each model call ComfyUI's sampler makes is read by the proxy (workers/bridge/proxy.py,
ComfyUI's surface) and handed here, where the run's plan and state turn it into a typed forward job
(workers/messages.ForwardJob) and send it - the weights made resident first, a run's unchanged inputs sent once.

Why here and not in the proxy: the bridge reads ComfyUI and is called; reaching the pool, counting the run's calls
and keeping what the workers hold for it is the driver room's sequence (the path of a prompt goes one way).
"""
from __future__ import annotations

import torch

from ..bridge.proxy import make_apply_model_wrapper
from ..bridge.sampling import ComfyInterrupt, raise_if_interrupted
from ..messages import ForwardJob
from ..pool import JobCancelled
from .run_record import RunRecord


class StepRun:
    """One run's model calls on the pool: `state` (the RunRecord) holds its frozen plan and what the run did so far."""

    def __init__(self, runtime, hp, state: RunRecord):
        self.runtime, self.hp, self.state = runtime, hp, state

    @property
    def config(self):
        return self.hp.config

    def ensure_resident(self, diffusion_model, unhooked: dict) -> None:
        """ComfyUI's diffusion model resident on the workers under the plan's key (once per run)."""
        st, plan = self.state, self.state.plan
        st.family = self.runtime.ensure_native(self.hp, plan.key, plan.native, diffusion_model, plan.lineage,
                                               plan.weight_patches, unhooked=unhooked)
        st.resident = True

    def forward(self, call: dict, tensors: dict, changing: tuple):
        """Send one model call (`call`: what the proxy read - structure, hooks, bypass, conds, fbcache) as this run's
        next forward job, with the plan's per-call values."""
        st, plan = self.state, self.state.plan
        job = ForwardJob(key=plan.key, call_index=st.calls, object_values=plan.object_values or None,
                         compile=plan.compile or None, **call)
        st.calls += 1
        return submit_once(self.runtime.pool(self.hp), self.hp.config, job, tensors, st, changing)

    def progress(self, step: int, total: int) -> None:
        self.runtime.progress(step, total)


def step_wrapper(runtime, hp, state):
    """The APPLY_MODEL wrapper of a run: `hp` and `state` (the RunRecord) each the value, or a callable returning
    this run's (Parallel Model decides degrees "auto" and builds its record per run)."""
    return make_apply_model_wrapper(lambda: StepRun(runtime, hp() if callable(hp) else hp,
                                                    state() if callable(state) else state))


def submit_interruptible(pool, config, kind, values, tensors, **kw):
    """pool.submit that stops at ComfyUI's interrupt button and raises ComfyUI's own interrupt exception; `kw`: the
    rest of submit's arguments (a loop job's progress and previews). The interrupt is polled too, so it wins even when
    no progress arrives (a rank hangs)."""
    try:
        return pool.submit(config, kind, values, tensors, cancel=ComfyInterrupt(), **kw)
    except JobCancelled:
        raise_if_interrupted()
        raise


def submit_once(pool, config, job: ForwardJob, tensors: dict, state: RunRecord, changing: tuple):
    """A step-mode forward whose inputs that did not change since this run's previous call stay on the workers.

    Why: the conditioning (text, pooled, guidance, reference latents) is the same at every step of a run, yet
    ComfyUI hands it over as new tensors each call (it concatenates cond and uncond per call); sent every step it
    was most of the payload (9 MiB of a Flux 1024² step). A tensor equal to the one of the previous call is named
    in `reuse` and the workers take their copy of it (workers/jobs.py job_forward). `changing` (latent, timestep)
    is always sent. The previous call is identified by the run's id and call index, so a worker never reuses
    tensors of another run; a failed call sends everything again next time."""
    last, run = state.sent, state.run
    reuse = []
    if last is not None:
        for name, t in list(tensors.items()):
            prev = last["tensors"].get(name)
            if name not in changing and prev is not None and prev.shape == t.shape and prev.dtype == t.dtype \
                    and prev.device == t.device and (prev is t or torch.equal(prev, t)):
                reuse.append(name)
                del tensors[name]
    job = job.after(run=run, previous_call=None if last is None else last["call"], reuse=reuse, changing=changing)
    state.sent = None  # until this call succeeds
    res = submit_interruptible(pool, config, "forward", job.message(), tensors)
    kept = {n: t for n, t in tensors.items() if n not in changing}
    kept.update({n: last["tensors"][n] for n in reuse})
    state.sent = {"call": job.call_index, "tensors": kept}
    return res
