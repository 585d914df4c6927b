"""Job kinds the real worker runs: transport around the engine facade (parallel/engine.py).

A handler turns a job's payload into engine calls and the results into a reply; what computes (load,
forward, loop, decode) is the engine's. Building a model from its weights is the load_model job's
(workers/load_job.py), not the engine's: the ComfyUI-native build imports ComfyUI (workers/bridge/build.py),
which parallel/ never does.
A handler is `fn(state, ctx, payload) -> dict`: `ctx` is the worker's
ParallelContext, `payload` the job's JSON values with its tensors (already
read from shared memory; model weights are mapped) merged in. Every rank runs the same handler on the
same payload; tensors in the returned dict travel back from rank 0 only, JSON
values from every rank (the driver keeps rank 0's and lists all of them).
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from .bridge.build import prepare_comfy
from .bridge.carry import Bypass, HookWeights, ObjectValues, rebuild_call
from .load_job import job_load_model, unhook_all
from .job_run import Cancelled, JobRun
from .messages import ComfyRuntime, ForwardJob, LoopJob
from .transport import WEIGHT_PREFIX, Arena, read_tensor, tensor_dtype



def _test_budget(rank: int, engine):
    """The tests' stand-in for an accelerator's memory on a CPU rank (HP_TEST_DEVICE_BYTES: one byte count per rank,
    comma separated): free = that budget - what `engine`'s resident models took. None (the device's own reading)
    when unset - the room the driver makes (workers/residency.room) is then tested on CPU with uneven ranks."""
    spec = os.environ.get("HP_TEST_DEVICE_BYTES")
    if not spec:
        return None
    budget = int(spec.split(",")[rank])
    return lambda device: budget - sum(r.bytes for r in engine.models.values())


class WorkerState:
    """Everything one worker keeps between jobs: its resident models (LRU) and counters."""

    def __init__(self, rank: int, device: torch.device, shm_prefix: str, max_models: int,
                 broadcast_tensors: bool = False):
        self.rank, self.device, self.shm_prefix = rank, device, shm_prefix
        self.broadcast_tensors = broadcast_tensors  # a cluster world: only rank 0 sees the driver's /dev/shm
        self.arena = Arena(shm_prefix)  # rank 0's results, reused by every job
        self.arena_maps: dict = {}      # the driver's input arena, mapped once
        self.preview_arenas = None      # rank 0's loop-mode previews: two, alternating, so the driver reads
                                        # one while the next step fills the other
        from comfyui_hybrid_parallel.parallel.engine import Engine
        self.engine = Engine(max_models)  # the resident models and what computes with them
        self.engine.free_memory = _test_budget(rank, self.engine) or self.engine.free_memory
        self.run: JobRun | None = None
        self.call_inputs: dict | None = None  # the latest step-mode call's inputs that a run may reuse
        self.bypass = None  # ComfyUI's LoRA-bypass sets of the running run (workers/bridge/carry.py Bypass)
        self.model_calls = 0  # diffusion-model calls this worker served (step-mode forwards, loop-mode steps)

    def stop_point(self, ctx) -> None:
        """Agree over the whole world whether the job was cancelled; raise Cancelled on every rank if so.

        A collective rather than a local check, so that all ranks stop at the same
        step and none is left waiting in the next collective.
        """
        flag = torch.tensor([1 if self.run.cancel_requested else 0], dtype=torch.int32, device=self.device)
        if ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if int(flag.item()):
            raise Cancelled(f"job {self.run.job_id} cancelled")


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def job_health(state: WorkerState, ctx, payload: dict) -> dict:
    return {"pid": os.getpid(), "device": "cpu" if state.device.type == "cpu" else str(state.device),  # cpu:0 = strict
            "resident": state.engine.resident(),
            "layouts": len(state.engine.models),  # resident models counting each mesh's layout of one key
            "evicted": list(state.engine.evicted),
            "loads": state.engine.loads, "model_calls": state.model_calls,
            "first_block_hits": state.engine.first_block_hits(), "rss_bytes": _rss_bytes(),
            "comfy_imported": "comfy.model_management" in sys.modules,
            # the collector runs here (imports only pause it) and skips what a fork server imported (frozen there)
            "gc": {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count()},
            "staged": _staged(), "speeds": ctx.speeds,
            # what this rank's allocator holds on its GPU (the session's "memory returned" reads it); None on a CPU
            "device_reserved_bytes": torch.cuda.memory_reserved(state.device) if state.device.type == "cuda" else None}


def _staged() -> bool:
    from comfyui_hybrid_parallel.parallel.staged import StagedComm
    return StagedComm.installed()


def job_steps(state: WorkerState, ctx, payload: dict) -> dict:
    """Diagnostic: n steps of a small all-reduce each, with progress, cancel and fault injection.

    The result is checkable: after step s every rank holds s * sum(rank+1).
    `raise_at` / `die_at` / `hang_at` make `fault_rank` misbehave at that step
    (tests of the pool's fault handling); `alloc_bytes` asks for an allocation
    that cannot succeed (the OOM report).
    """
    n, size = int(payload.get("n", 4)), int(payload.get("size", 1024))
    sleep_s = float(payload.get("sleep_s", 0.0))
    fault_rank = int(payload.get("fault_rank", ctx.world_size - 1))
    if payload.get("alloc_bytes"):
        torch.empty(int(payload["alloc_bytes"]), dtype=torch.uint8)
    x = torch.full((size,), float(ctx.rank + 1), device=state.device)
    y = x
    for step in range(1, n + 1):
        state.stop_point(ctx)
        if ctx.rank == fault_rank:
            if payload.get("raise_at") == step:
                raise RuntimeError(f"injected failure at step {step} on rank {ctx.rank}")
            if payload.get("die_at") == step:
                os._exit(17)
            if payload.get("hang_at") == step:
                time.sleep(3600)
        y = x * step
        if ctx.world_size > 1:
            dist.all_reduce(y)
        if sleep_s:
            time.sleep(sleep_s)
        state.run.progress(step, n)
    return {"steps": n, "value": float(y[0]) if n else 0.0}


HOOK_PREFIX = "hook."  # the tensors of a hook group's weight patches (workers/bridge/carry.py hook_call)


def _inputs(state: WorkerState, payload: dict, skeleton: dict | None = None) -> dict:
    """The forward's kwargs: the JSON part (`skeleton`, else the payload's `kwargs`, or `structure` as the nodes send
    it, nested dicts and lists allowed) with every tensor put in place; a tensor named "a.b.2" goes to
    kwargs[a][b][2] (a list slot comes from the structure's placeholder)."""
    if skeleton is None:
        skeleton = payload.get("kwargs") or payload.get("structure")
    kwargs = json_copy(skeleton or {})
    for name, v in payload.items():
        if not isinstance(v, torch.Tensor) or name.startswith(HOOK_PREFIX):  # a hook group's patches: not an input
            continue
        v = v.to(state.device)
        *parents, leaf = name.split(".")
        node = kwargs
        for part in parents:  # dicts are made as needed; lists come from the JSON skeleton (placeholders)
            if isinstance(node, list):
                node = node[int(part)]
            else:
                node = node.setdefault(part, {})
        if isinstance(node, list):
            if not leaf.isdigit() or int(leaf) >= len(node):
                raise ValueError(f"tensor {name!r}: no slot {leaf} in its list")
            node[int(leaf)] = v
        elif isinstance(node, dict):
            node[leaf] = v
        else:
            raise ValueError(f"tensor {name!r} needs a dict or a list at {'.'.join(parents)!r}")
    return kwargs


def json_copy(value):
    if isinstance(value, dict):
        return {k: json_copy(v) for k, v in value.items()}
    return [json_copy(v) for v in value] if isinstance(value, list) else value


def _reuse_inputs(state: WorkerState, job: ForwardJob, payload: dict) -> None:
    """Step mode sends a run's unchanged inputs (its conditioning) once (workers/driver/step.py submit_once): put
    back the tensors the previous call of the same run had, then remember this call's. Only the latest call is
    kept (one run's conditioning per worker); a gap in the run's calls is an error, never a stale input."""
    held = state.call_inputs
    if job.reuse:
        if held is None or held["key"] != job.key or held["run"] != job.run or held["call"] != job.previous_call:
            raise RuntimeError(f"forward {job.call_index} reuses {list(job.reuse)} from call {job.previous_call} of "
                               f"its run, which this worker does not hold")
        payload.update({n: held["tensors"][n] for n in job.reuse})
    state.call_inputs = None
    if job.run is not None:
        changing = set(job.changing)  # the latent and timestep: new at every call
        kept = {n: v.to(state.device) for n, v in payload.items() if isinstance(v, torch.Tensor) and n not in changing}
        payload.update(kept)  # on the device once per run
        state.call_inputs = {"key": job.key, "run": job.run, "call": job.call_index, "tensors": kept}


def job_forward(state: WorkerState, ctx, payload: dict) -> dict:
    """Step mode: the resident model on the full inputs; every rank returns the full output. The job is a
    ForwardJob (workers/messages.py): a field this rank does not know fails here, before the model is called;
    the payload's tensors are the call's inputs by name.

    `call_index` is the sampler's model call (DistriFusion's warmup / stale decision).
    """
    job = ForwardJob.from_message({k: v for k, v in payload.items() if not isinstance(v, torch.Tensor)})
    _reuse_inputs(state, job, payload)
    kwargs = rebuild_call(_inputs(state, payload, job.kwargs or job.structure))  # Skip Layer Guidance's blocks
    r = state.engine.get(job.key, ctx)
    hook = job.hooks or {"id": None}
    if hook["id"] is not None or r.hooks is not None:  # this call's hook group on the weights (ComfyUI's per cond)
        if r.hooks is None:
            r.hooks = HookWeights()
        r.hooks.remember(job.run, hook, payload)
        r.hooks.switch(r.model, job.run, hook["id"], state.device)
    with ObjectValues(r.model, job.object_values), _bypass(state, r.model, job.run, job.bypass, payload):
        out = state.engine.forward(job.key, ctx, kwargs, call_index=job.call_index,
                                   conds=list(job.conds) if job.conds is not None else None,
                                   before=lambda: state.stop_point(ctx), compile_spec=job.compile,
                                   first_block=dict(job.fbcache, run=job.run) if job.fbcache else None)
    state.model_calls += 1
    if isinstance(out, (list, tuple)):  # a multi-stream model (MiniMax H3, LTX-2: video + audio): a tensor per stream
        reply = {**{f"out.{i}": t for i, t in enumerate(out)}, "out_streams": len(out), "parallelized": r.parallelized}
    else:
        reply = {"out": out, "parallelized": r.parallelized}
    if job.compile:  # how often dynamo compiled a graph in this process (a second prompt adds none)
        from torch._dynamo.utils import counters
        reply["compiled_graphs"] = int(counters["stats"]["unique_graphs"])
    return reply


def _bypass(state: WorkerState, model, run, call, payload: dict):
    """ComfyUI's LoRA-bypass injections of the job (workers/bridge/carry.py Bypass) around its model calls: `call`
    the job's bypass field (None: none), `payload` holding its tensors."""
    call = call or {"id": None}
    if state.bypass is None:
        state.bypass = Bypass()
    state.bypass.remember(run, call, payload)
    return state.bypass.active(model, run, call["id"], state.device)


def job_loop(state: WorkerState, ctx, payload: dict) -> dict:
    """Loop mode: the whole denoising loop in the workers; every rank gets the final latent.

    `noise` is the sample at sigmas[0]; `convention` says how sigma and the model output map to ComfyUI's
    denoised ({"kind": "flow", "timestep_scale"} or {"kind": "eps", "timesteps": one per sigma}).
    Progress goes to the driver every step, with rank 0's denoised latent when it asks for previews.
    """
    from comfyui_hybrid_parallel.parallel.pipefusion import PipelineCancelled

    job = LoopJob.from_message({k: v for k, v in payload.items() if not isinstance(v, torch.Tensor)})
    unhook_all(state.engine)
    sigmas = payload["sigmas"]
    n_steps = len(sigmas) - 1
    inputs = {k: v for k, v in _inputs(state, payload, job.structure).items() if k not in ("noise", "sigmas")}

    def progress(i, n, denoised):
        state.model_calls += 1  # (a step of the workers' loop: one call per step, PipeFusion's patches counted once)
        desc = None
        if denoised is not None and job.previews and state.rank == 0:
            if state.preview_arenas is None:
                state.preview_arenas = (Arena(state.shm_prefix), Arena(state.shm_prefix))
            desc = state.preview_arenas[i % 2].write({"p": denoised.float().cpu()})["p"]
        state.run.progress(i + 1, n_steps, preview=desc)

    report = {}
    try:
        model = state.engine.get(job.key, ctx).model
        with ObjectValues(model, job.object_values), _bypass(state, model, job.run, job.bypass, payload):
            out = state.engine.loop(job.key, ctx, inputs, sigmas, payload["noise"].to(state.device),
                                    convention=job.convention, sampler=job.sampler, cfg_scale=job.cfg_scale,
                                    before_step=lambda i, n: state.stop_point(ctx), callback=progress,
                                    cancel=lambda: state.run.cancel_requested, step_cache=job.step_cache,
                                    cache_report=report)
    except PipelineCancelled as e:
        raise Cancelled(str(e)) from None
    return {"out": out, **({"step_cache": report} if report else {})}


def job_vae_decode(state: WorkerState, ctx, payload: dict) -> dict:
    """Patch-parallel decode over `axis` (default: every rank of the world); full image from rank 0."""
    out = state.engine.decode(payload["key"], ctx, payload["latent"].to(state.device),
                              axis=payload.get("axis", "world"), block_size=payload.get("block_size"),
                              before=lambda: state.stop_point(ctx))
    return {"image": out, "patch_parallel": True}


def job_prepare(state: WorkerState, ctx, payload: dict) -> dict:
    """Import ComfyUI as the driver's ComfyUI is configured, ahead of the first model: the pack starts the workers
    and this import while ComfyUI is still loading the model (or, on a model ComfyUI holds already, while the driver
    writes its weights)."""
    prepare_comfy(ComfyRuntime.from_message(payload.get("comfy") or {}),
                  sequence_parallel=ctx.config.intercepts_attention)
    return {"prepared": True}


def job_model_bytes(state: WorkerState, ctx, payload: dict) -> dict:
    """Diagnostic: the bytes (and bytes per dtype) of a resident model's parameters and buffers on this rank."""
    return state.engine.weight_bytes(payload["key"], ctx)


def job_release(state: WorkerState, ctx, payload: dict) -> dict:
    """Drop every resident model and return its memory (ComfyUI unloaded its models); the process stays warm."""
    state.call_inputs = None
    return {"released": state.engine.release(), "rss_bytes": _rss_bytes()}


def job_echo(state: WorkerState, ctx, payload: dict) -> dict:
    """Diagnostic: return the job's tensors unchanged (the transport's round trip, for tests and bench)."""
    return {k: v for k, v in payload.items() if isinstance(v, torch.Tensor)}


JOBS = {
    "health": job_health,
    "release": job_release,
    "echo": job_echo,
    "model_bytes": job_model_bytes,
    "prepare": job_prepare,
    "steps": job_steps,
    "load_model": job_load_model,
    "forward": job_forward,
    "vae_decode": job_vae_decode,
    "loop": job_loop,
    "pipefusion_loop": job_loop,  # the name of protocol version 1
}


def landing_device(state: WorkerState, name: str) -> torch.device:
    """Where a broadcast tensor of a cluster job stays: a model weight on the host, as a local rank's mapped weights
    (the model is built there and a TP / PipeFusion / sharded rank moves only its part to its GPU: engine.add),
    everything else on the rank's device. The broadcast itself goes through the device (NCCL), one tensor at a
    time, so a GPU never holds more than one whole weight beside the model."""
    return torch.device("cpu") if name.startswith(WEIGHT_PREFIX) else state.device


def _broadcast_tensors(state: WorkerState, descs: dict) -> dict:
    """Cluster worlds: rank 0 reads the job's tensors from the driver's shared memory and broadcasts
    their raw bytes to every rank (other machines cannot map those files); shapes and dtypes come
    from the descriptors every rank already has."""
    out = {}
    for name in sorted(descs):
        desc = descs[name]
        if state.rank == 0:
            t = read_tensor(desc, state.shm_prefix, maps=state.arena_maps).contiguous()
        else:
            t = torch.empty([int(s) for s in desc["shape"]], dtype=tensor_dtype(desc["dtype"]))
        if t.numel():
            buf = t.reshape(-1).view(torch.uint8).to(state.device)
            dist.broadcast(buf, src=0)
            t = buf.view(t.dtype).view(t.shape).to(landing_device(state, name))
            del buf
        out[name] = t
    return out


def context_for(contexts: dict, config):
    """The ParallelContext of `config` on this rank: a config of a known mesh shares its groups; a new mesh (a config
    change that kept the world size) builds its process groups now - every rank runs the same job, so every rank
    creates them in the same order (new_group is collective). `contexts`: mesh_key -> context, kept per world."""
    key = config.mesh_key()
    base = contexts.get(key)
    if base is None:
        from comfyui_hybrid_parallel.parallel import ParallelContext
        any_ctx = next(iter(contexts.values()))
        base = contexts[key] = ParallelContext(config, device=any_ctx.device, timeout_s=any_ctx.timeout_s)
        base.attention_backend = any_ctx.attention_backend
        base.set_speeds(any_ctx.speeds)  # the ranks' speeds hold for every mesh of the world
    return base if config == base.config else base.with_config(config)


def _read_tensors(state: WorkerState, msg: dict, payload: dict) -> None:
    if state.broadcast_tensors:
        payload.update(_broadcast_tensors(state, msg.get("tensors") or {}))
        return
    # weights are mapped (ranks share the pages); what changes at every step (`changing`: the latent and
    # the timestep of a step-mode forward) is used in place in the driver's arena, which it rewrites only
    # after this job has answered - a copy into fresh memory cost more than the rest of the round trip
    # for a video latent; the rest is copied, as a job may keep it (a run's conditioning)
    in_place = set(payload.get("changing") or ())
    for name, desc in (msg.get("tensors") or {}).items():
        payload[name] = read_tensor(desc, state.shm_prefix, mapped=name.startswith(WEIGHT_PREFIX),
                                    maps=state.arena_maps, view=name in in_place)


def discipline(state: WorkerState, kind: str):
    """Strict mode (parallel/strict.py, HP_STRICT_COMM=1 on gloo): the job's tensors live on the host or on the
    rank's virtual compute device as they would beside a GPU. A model load is left out: a CPU rank keeps the mapped
    host pages as its weights, where a GPU rank copies them to its device."""
    from comfyui_hybrid_parallel.parallel import strict
    if kind == "load_model" or state.device != strict.COMPUTE:
        return contextlib.nullcontext()
    return strict.DeviceDiscipline()


def make_executor(state: WorkerState, ctx, contexts: dict | None = None):
    """The `execute(msg, run)` that serve() calls: map tensors in, run the handler, write tensors out.
    `contexts` (mesh_key -> ParallelContext, starting with `ctx`) collects the meshes this world has run."""
    contexts = {ctx.config.mesh_key(): ctx} if contexts is None else contexts

    def execute(msg: dict, run: JobRun) -> dict:
        kind = msg["kind"]
        if kind not in JOBS:
            raise ValueError(f"unknown job kind {kind!r}; known: {', '.join(JOBS)}")
        job_ctx = ctx
        if msg.get("config"):
            from comfyui_hybrid_parallel.parallel import ParallelConfig
            job_ctx = context_for(contexts, ParallelConfig.from_dict(msg["config"]))
        payload = dict(msg.get("values") or {})
        state.run = run
        try:
            # no job needs autograd, and ComfyUI runs a whole prompt under inference mode (execution.py): its
            # quantized layers compute otherwise under plain no_grad (fp8 1.5e-6, int8 5e-2 apart in ComfyUI's own
            # forward), so the ranks run as ComfyUI's executor does
            with discipline(state, kind), torch.inference_mode():
                _read_tensors(state, msg, payload)
                out = JOBS[kind](state, job_ctx, payload)
        finally:
            state.run = None
            payload.clear()
        values = {k: v for k, v in out.items() if not isinstance(v, torch.Tensor)}
        tensors = {}
        # every rank's report: the driver decides the next load and the room it makes from all of them (residency.py)
        values["residency"] = state.engine.report(state.device, measure=kind in ("load_model", "release"),
                                                  need=values.pop("need", None))
        if state.rank == 0:
            tensors = state.arena.write({k: v.cpu() for k, v in out.items() if isinstance(v, torch.Tensor)})
        return {"ok": True, "values": values, "tensors": tensors}

    return execute
