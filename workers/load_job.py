"""The load_model job: a rank executes the driver's load decision (workers/residency.py) straight through - touch,
patch in place, rebuild from kept weights, or build ComfyUI's model or VAE (workers/bridge/build.py) from the weights
that travelled - and applies weight patches where its layout keeps the base weights.
Its own file because it is the one path that builds models; workers/jobs.py carries every other job."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .bridge.build import (attention_kernel, build_native, build_native_vae, call_native, compute_dtype, import_comfy,
                           loader_weights)
from .bridge.loader_types import operations
from .bridge.patches import PREFIX, apply, decode
from ..parallel.engine import RoomShort
from .messages import LoadJob, NativeSpec, VaeSpec
from .residency import LoadDecision
from .transport import WEIGHT_PREFIX


def _patches(job: LoadJob, payload: dict):
    """The job's ComfyUI weight patches (workers/bridge/patches.py), or None when it carries none."""
    if job.patch_spec is None:
        return None
    return decode(job.patch_spec, {k: v for k, v in payload.items() if k.startswith(PREFIX)})


def _share(state, ctx, key: str):
    """How CPU ranks of one machine split patching and share its result (comfy_patches.apply), or None: GPU ranks
    each patch their own device's copy; a cluster's ranks do not share a /dev/shm."""
    if state.device.type != "cpu" or ctx.world_size == 1 or state.broadcast_tensors:
        return None
    return ctx.rank, ctx.world_size, state.shm_prefix, dist.barrier, key


def unhook_all(engine) -> None:
    """Every resident model back to the weights it holds without a hook group (carry.HookWeights): before anything
    reads or patches those weights other than a hooked call."""
    for r in list(engine.models.values()):
        if r.hooks is not None:
            r.hooks.restore(r.model)


def job_load_model(state, ctx, payload: dict) -> dict:
    """Execute the driver's load decision (workers/residency.py) straight through: touch the resident model, patch
    the version it names in place (only the patches travelled), rebuild it for this layout from the weights a slot
    kept, or build it from the weights that travelled. A decision this rank's state does not match (a job failed
    since the driver's report) is answered "stale", with this rank's report: the driver decides again."""
    job = LoadJob.from_message({k: v for k, v in payload.items() if not isinstance(v, torch.Tensor)})
    decision = LoadDecision.from_message(job.decision)
    engine = state.engine
    unhook_all(engine)
    _loader_settings(ctx, job.native)
    kept = engine.slot(decision.slot) if decision.slot else None
    if decision.action == "touch":
        return _loaded(engine, loaded=False) if engine.touch(decision.key, ctx) else _stale(engine, decision)
    if decision.action in ("patch", "rebuild") and (kept is None or (kept.base if decision.action == "patch"
                                                                      else kept.source) is None):
        return _stale(engine, decision)
    if job.patch_spec is not None and job.native is not None:
        import_comfy(job.native.runtime, ctx.config.intercepts_attention)
    patches = _patches(job, payload)
    if decision.action == "patch":
        if patches is None:
            raise ValueError(f"load_model {decision.key!r}: a patch decision without its patches (an empty set undoes)")
        return _patch_in_place(state, ctx, job, patches, decision.slot, kept)
    weights = kept.source if decision.action == "rebuild" else _sent_weights(job, payload)
    try:
        return _build_resident(state, ctx, job, weights, patches, decision.evict)
    except RoomShort as short:  # every rank agreed some rank has no room: nothing built, the driver decides again
        return _loaded(engine, need=short.need)


def _loaded(engine, **values) -> dict:
    return {**values, "loads": engine.loads, "resident": engine.resident()}


def _stale(engine, decision: LoadDecision) -> dict:
    return _loaded(engine, stale=f"{decision.action} {decision.slot or decision.key}: not what this rank holds")


def _loader_settings(ctx, native: NativeSpec | VaeSpec | None) -> None:
    """A custom loader's layer settings are class attributes (ComfyUI-GGUF's dequant_dtype): the driver's class holds
    them for every model it loaded, so each run sets them here as they are there now."""
    if isinstance(native, NativeSpec) and native.ops.custom:
        import_comfy(native.runtime, ctx.config.intercepts_attention)
        operations(native.ops.custom)


def _patcher(native: NativeSpec | VaeSpec | None) -> dict | None:
    """The loader's ModelPatcher that patches weights its own way (GGUF), where the model's spec names one."""
    return native.patcher if isinstance(native, NativeSpec) else None


def _patch_in_place(state, ctx, job: LoadJob, patches, slot, r) -> dict:
    """Another patch version of this lineage is resident: its previous patches undone, these applied, re-keyed."""
    engine, key = state.engine, job.key
    try:
        r.patched = frozenset(apply(r.model, r.base, patches, r.patched, state.device, _share(state, ctx, key),
                                    patcher=_patcher(job.native), held=r.patch_pages))
    except BaseException:
        engine.discard(slot, ctx, why="patch failed")  # half patched: nothing may run it
        raise
    engine.rekey(slot, key, ctx)
    return _loaded(engine, loaded=True, patched_in_place=True, pages_rewritten=r.patch_pages.get("rewritten", 0))


def _sent_weights(job: LoadJob, payload: dict) -> dict:
    """The weights that travelled with a build decision, in shared memory."""
    weights = {k[len(WEIGHT_PREFIX):]: v for k, v in payload.items() if k.startswith(WEIGHT_PREFIX)}
    if not weights:
        raise ValueError(f"load_model {job.key!r}: the decision was to build, but no weights travelled")
    return weights


def _build_resident(state, ctx, job: LoadJob, weights: dict, patches, evict=()) -> dict:
    """Build the model (ComfyUI's VAE, or ComfyUI's own class with its ops) from `weights`, make it resident, and
    apply `patches` to it (the weights are then its base, kept for the next version)."""
    key, engine, native = job.key, state.engine, job.native
    if isinstance(native, VaeSpec):  # ComfyUI's own VAE, for Patch VAE Decode
        model, extra, kernel_name = build_native_vae(native, weights), {}, None
    elif isinstance(native, NativeSpec):  # ComfyUI's own class, ops and weights (workers/bridge/build.py)
        import_comfy(native.runtime, ctx.config.intercepts_attention)  # (before a custom loader's modules import it)
        weights = loader_weights(native, weights)  # GGUF's quantized tensors around their raw bytes
        # sequence or pipeline parallel: attention must be interceptable (ComfyUI's pytorch kernel)
        model = build_native(native, weights, state.device, sequence_parallel=ctx.config.intercepts_attention)
        kernel, kernel_name = attention_kernel(native.runtime)  # the driver's kernel, for the Ulysses ranks
        extra = dict(native_call=call_native, compute_dtype=compute_dtype(native), attention_kernel=kernel)
    else:
        raise ValueError(f"load_model {key!r}: no ComfyUI model spec travelled (pool.ensure_model(native=...))")
    # What a later mesh can rebuild from (ComfyUI's model, a layout that leaves the weights whole): the model's own
    # tensors (engine.add keeps them as the model holds them, on its device), so keeping them costs nothing. On an
    # accelerator only unpatched weights: there the patches are applied to the model's own tensors in place
    keep = ctx.config.whole_model and (state.device.type == "cpu" or patches is None)
    r = engine.add(key, job.family, model, ctx, device=state.device, source=weights if keep else None,
                   lineage=job.lineage, evict=evict, **extra)
    if patches is not None:  # base weights + patches: kept (host, shared by the local ranks) for the next version
        if not ctx.config.whole_model:
            raise ValueError("weight patches travel only to ranks that hold the whole model (no tp / pp / "
                             "shard_weights): the driver sends patched weights there")
        r.base = weights
        try:
            r.patched = frozenset(apply(r.model, weights, patches, set(), state.device, _share(state, ctx, key),
                                        patcher=_patcher(native), held=r.patch_pages))
        except BaseException:
            engine.discard(key, ctx, why="patch failed")  # its base with some patches: unusable
            raise
    return _loaded(engine, loaded=True, attention=kernel_name)
