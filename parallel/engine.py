"""The engine facade: what one rank does with its resident models — load, forward, loop, decode.

Why a facade: the worker (workers/jobs.py) only carries messages — it turns a job's payload into
these calls and their results back into a reply, and keeps transport concerns (shared memory,
progress messages, the cancel agreement) to itself. Everything that *computes* lives here, so it can
be driven by the pool, by tests in one process, or by a benchmark the same way. The engine never
imports ComfyUI: a ComfyUI-native model arrives built (workers/bridge/build.py) together with the
function that calls it with ComfyUI's signature.
"""
from __future__ import annotations

import collections
import gc
import json
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from . import parallelize
from .comm import any_rank
from .context import world_axis
from .distrifusion import distrifusion_state
from .fbcache import FirstBlockRule, FirstBlockState, first_block_cache
from .loop import run_loop
from .models import ADAPTERS, ANY, plan_for
from .pipefusion import eps, flow, run_pipefusion_loop
from .pipefusion.plans import keep_stage_blocks
from .shard import apply_weight_sharding
from .stepcache import StepCacheSpec
from .strict import lenient, opaque_to_dynamo
from .vae.comfy_vaes import comfy_vae_for
from .vae.native import native_patch_decode


@dataclass
class Resident:
    family: str
    model: torch.nn.Module
    parallelized: bool = False
    native_call: Optional[Callable] = None      # (model, inputs) -> output: ComfyUI's diffusion model (None: a VAE)
    compute_dtype: Optional[torch.dtype] = None  # the dtype ComfyUI hands that model its latent in
    source: Optional[dict] = None               # the weights it was built from, where another mesh may reuse them
    lineage: Optional[str] = None               # the driver's model object: other patch versions share it
    base: Optional[dict] = None                 # its unpatched weights (host), where patches are applied here
    patched: frozenset = frozenset()            # the keys the current patches changed (restored from `base` next)
    compiled: dict = field(default_factory=dict)  # torch.compile options (JSON) -> the compiled model, built once
    patch_pages: dict = field(default_factory=dict)  # workers/bridge/patches.apply's record: keys the ranks map shared
    hooks: Optional[object] = None              # the per-call hook weights the worker applies (workers/bridge/carry.py)
    first_block: Optional[tuple] = None         # (run, FirstBlockState): First Block Cache's state of the running run
    bytes: int = 0                              # what it took of the device's memory when it moved there (its report)

    def first_block_state(self, run) -> FirstBlockState:
        """This run's First Block Cache state (a new run starts a new one: nothing of another prompt's cache)."""
        if self.first_block is None or self.first_block[0] != run:
            self.first_block = (run, FirstBlockState())
        return self.first_block[1]

    def callable_for(self, compile_spec: Optional[dict]):
        """The model to call: itself, or - with ComfyUI's TorchCompileModel options - its torch.compile'd module,
        built on first use and kept while the model is resident (a new latent size recompiles as dynamo guards
        decide, as in ComfyUI). It wraps the parallelized model, hooks and collectives included: dynamo traces the
        model's own code and breaks the graph at each collective."""
        if not compile_spec:
            return self.model
        key = json.dumps(compile_spec, sort_keys=True)
        if key not in self.compiled:
            opaque_to_dynamo()  # tests' strict mode: its collective checks run as they are, not traced
            kw = {k: compile_spec.get(k) for k in ("backend", "options", "mode", "fullgraph", "dynamic")}
            self.compiled[key] = torch.compile(self.model, **{k: v for k, v in kw.items() if v is not None})
        return self.compiled[key]

    @property
    def is_vae(self) -> bool:
        return self.family.startswith("vae")

    def device_bytes(self) -> int:
        """Bytes of this rank's parameters and buffers on an accelerator (0 for a host model)."""
        return _tensor_bytes(self.model, on_device=True)


def _joining_concat(native_call):
    """ComfyUI's model call in loop mode: a `c_concat` input (ComfyUI's concat conditioning, Wan image to video) is
    joined to the latent's channels before the call, as ComfyUI's BaseModel does before its diffusion model."""
    def call(model, kw):
        concat = kw.get("c_concat")
        if concat is not None:
            kw = {k: v for k, v in kw.items() if k != "c_concat"}
            kw["x"] = torch.cat([kw["x"], concat.to(kw["x"].dtype)], dim=1)
        return native_call(model, kw)
    return call


def _convention(spec: dict, sigmas: torch.Tensor):
    if spec["kind"] == "flow":
        return flow(float(spec["timestep_scale"]))
    table = {float(s): float(t) for s, t in zip(sigmas.tolist(), spec["timesteps"])}
    return eps(lambda sigma: table[float(sigma)])


def _agree_compute(want: bool, ctx) -> bool:
    """A step cache's decision, common to the whole world: compute when any rank wants to (every rank holds the
    same latent in loop mode, so they agree anyway - this makes it certain)."""
    return any_rank(want, (world_axis(ctx),), ctx.device)


def to_device(model: torch.nn.Module, device: torch.device) -> None:
    """Move a model to `device` tensor by tensor, after sharding: a rank copies only its shard (TP) or stage
    (PipeFusion) and drops the host mapping as it goes, so no full copy ever lands on one GPU."""
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if not p.is_meta:
                setattr(mod, name, torch.nn.Parameter(p.data.to(device), requires_grad=False))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and not b.is_meta:
                mod._buffers[name] = b.to(device)


def held_tensors(model: torch.nn.Module, weights: dict) -> dict:
    """`weights` (name -> tensor a model was built from) as the model holds them now: on its device after
    `to_device`, the same tensors on the host. A config change that keeps the world rebuilds the model for the new
    mesh from these (no transfer, no second copy on the device); a name the model does not hold keeps its tensor."""
    held = {n: t for n, t in model.named_parameters(remove_duplicate=False)}
    held.update((n, t) for n, t in model.named_buffers(remove_duplicate=False) if t is not None)

    def now(k, v):
        t = held.get(k)
        if t is None or (t.device == v.device and t.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()):
            return v  # still the very tensor it was built from (a host rank: the mapped pages)
        return t.data
    return {k: now(k, v) for k, v in weights.items()}


MESH_SEP = "@mesh="


def _tensor_bytes(model: torch.nn.Module, on_device: bool = False) -> int:
    """Bytes of a model's parameters and buffers (each counted once, meta ones not): all of them - what this rank
    will move to its device after TP / stage / sharding - or, `on_device`, those already on an accelerator."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen or t.is_meta or (on_device and t.device.type == "cpu"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    return total


class RoomShort(Exception):
    """Some rank has no room for the model the driver decided to build (Engine.check_room): every rank raises it, with
    its own numbers, and answers "short" (workers/load_job.py) - nothing is built, no rank evicts on its own."""

    def __init__(self, key: str, need: int, free: int):
        super().__init__(f"{key}: {need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free on this rank")
        self.key, self.need, self.free = key, need, free


def _free_device_memory(device: torch.device) -> int:
    """Free bytes on `device` after the caching allocator has given back what it holds unused."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    return free


class Engine:
    """One rank's resident models and the operations on them.

    Residency: the models are kept least-recently-used (the ledger's order), and which of them go before a model
    is built is the driver's decision from every rank's report (workers/residency.room: older patch versions, the
    count, and on an accelerator the bytes - `free_memory`: device -> free bytes, measured after the allocator's
    cache is emptied); this rank executes it and, before moving a model to its device, checks with every other rank
    that there is room (check_room). A model evicted is released at once (gc: a parallelized model is a reference
    cycle through its hooks; the allocator's cache emptied). `max_models` is the driver's count, kept for the
    health job."""

    def __init__(self, max_models: int = 2, free_memory=None):
        self.max_models = max(1, int(max_models))
        self.models: collections.OrderedDict = collections.OrderedDict()  # key -> Resident
        self.loads = 0
        self.evicted: list = []  # keys evicted so far, in order (tests and the health job read them)
        self.free_memory = free_memory or _free_device_memory

    # ---- residency ----
    # A DiT is parallelized for one mesh and method (its hooks hold that mesh's groups, TP / PipeFusion / sharding
    # cut its weights, DistriFusion keeps stale K/V), and a world outlives a config change that keeps its size: such
    # a model is kept under its key scoped by the layout (ParallelConfig.layout_key). The same weights under another
    # layout are dropped when it loads (one copy per rank).
    @staticmethod
    def _scoped(key: str, ctx) -> str:
        return f"{key}{MESH_SEP}{ctx.config.layout_name()}"

    def _slot(self, key: str, ctx) -> str:
        if ctx is not None and self._scoped(key, ctx) in self.models:
            return self._scoped(key, ctx)
        return key

    def first_block_hits(self) -> int:
        """Model calls whose other blocks First Block Cache skipped, over the resident models' running runs."""
        return sum(r.first_block[1].skipped for r in self.models.values() if r.first_block is not None)

    def resident(self) -> list:
        """The keys of the resident models (as the driver named them, whatever mesh they were built for)."""
        return list(dict.fromkeys(k.partition(MESH_SEP)[0] for k in self.models))

    def ledger(self) -> list:
        """What this rank holds, as the driver decides loads from it (workers/residency.Slot): per slot its key, the
        layout it was parallelized for, its lineage, and whether its base and its source weights are kept."""
        out = []
        for slot, r in self.models.items():
            key, _, layout = slot.partition(MESH_SEP)
            out.append({"slot": slot, "key": key, "family": r.family, "layout": layout or None, "lineage": r.lineage,
                        "base": r.base is not None, "source": r.source is not None, "bytes": r.bytes})
        return out

    def touch(self, key: str, ctx=None) -> bool:
        slot = self._slot(key, ctx)
        if slot in self.models:
            self.models.move_to_end(slot)
            return True
        return False

    def slot(self, slot: str) -> Optional[Resident]:
        """The resident filed as `slot` (a name from the ledger), or None."""
        return self.models.get(slot)

    def _layouts(self, key: str) -> list:
        """The slots of `key`, one per mesh it was built for."""
        return [k for k in self.models if k.partition(MESH_SEP)[0] == key]

    def rekey(self, slot: str, key: str, ctx) -> None:
        """The resident in `slot` is now the version `key` (patched in place), most recently used."""
        r = self.models.pop(slot)
        new = self._scoped(key, ctx) if r.parallelized else key
        self.models[new] = r
        self.loads += 1

    def release(self) -> int:
        """Drop every resident model and give its memory back (ComfyUI's "Unload models" / its /free route);
        returns how many layouts were dropped."""
        n = len(self.models)
        self._evict(list(self.models), why="released")
        return n

    def discard(self, name: str, ctx, why: str) -> None:
        """Drop `name` (a slot, or a key's slot for this layout) at once: its weights can no longer be trusted (a
        patch version that failed half way), so nothing may run it - the next load builds it again."""
        self._evict([name if name in self.models else self._slot(name, ctx)], why=why)

    def drop_other_meshes(self, key: str) -> None:
        """Forget `key` built for other meshes (called before building it for this one)."""
        self._evict(self._layouts(key), why=None)

    def _evict(self, slots: list, why: Optional[str] = "lru", device: Optional[torch.device] = None) -> None:
        """Release `slots` now: a parallelized model is a reference cycle (its hooks), so its weights would otherwise
        live until the next gc; on an accelerator the allocator's cache is emptied too."""
        if not slots:
            return
        on_device = any(self.models[k].device_bytes() for k in slots if k in self.models)
        for k in slots:
            self.models.pop(k, None)
            if why is not None:
                self.evicted.append(k)
        gc.collect()
        if on_device or (device is not None and device.type == "cuda"):
            torch.cuda.empty_cache()

    def measured(self, device: Optional[torch.device]) -> bool:
        """Whether this rank's device memory is a budget the driver makes room in: an accelerator (or a reader of
        free bytes given to the engine: tests); a host rank's models are counted, not measured."""
        return device is not None and (device.type == "cuda" or self.free_memory is not _free_device_memory)

    def report(self, device: Optional[torch.device], *, measure: bool = False, need: Optional[int] = None) -> dict:
        """This rank's Report (workers/residency.py) as a message: its ledger, and where measured its free device
        bytes (`measure`: after a load - reading them empties the allocator's cache) and a short build's need."""
        free = self.free_memory(device) if measure and self.measured(device) else None
        return {"slots": self.ledger(), "free": free, "need": need}

    def evict(self, slots, device: Optional[torch.device] = None) -> None:
        """Drop the slots the driver decided (workers/residency.room) - this rank never picks its own: ranks that
        evicted by their own free memory diverged (one dropped what rank 0 kept)."""
        self._evict([k for k in slots if k in self.models], device=device)

    def check_room(self, key: str, incoming_bytes: int, device: Optional[torch.device], ctx) -> None:
        """Before `key`'s `incoming_bytes` move to `device`: does every rank have room? One all-reduce over the world,
        so that all ranks agree (never one building while another cannot); any short, each raises RoomShort with its
        own numbers and the driver decides the room again from them."""
        if not self.measured(device):
            return
        free = self.free_memory(device)
        short = free < incoming_bytes
        if ctx is not None and ctx.world_size > 1:
            short = any_rank(short, (world_axis(ctx),), ctx.device)
        if short:
            raise RoomShort(key, incoming_bytes, free)

    def get(self, key: str, ctx=None, rank: int = 0) -> Resident:
        slot = self._slot(key, ctx)
        if slot not in self.models:
            raise KeyError(f"model {key!r} is not resident on rank {rank} for this mesh (resident: "
                           f"{list(self.models)}); call ensure_model first")
        self.models.move_to_end(slot)
        return self.models[slot]

    def add(self, key: str, family: str, model: torch.nn.Module, ctx, *, native_call=None,
            compute_dtype=None, device: Optional[torch.device] = None, source: Optional[dict] = None,
            attention_kernel=None, lineage: Optional[str] = None, evict=()) -> Resident:
        """Make a built host model resident: drop the slots the driver decided (`evict`), parallelize it for ctx
        (DiT families), keep a PipeFusion stage's own blocks only, then - every rank having room (check_room) - move
        what this rank holds to `device`."""
        parallelized = family in ADAPTERS or family == ANY.family
        base_key = key
        device = torch.device(device) if device is not None else None
        self.evict(evict, device)
        self.drop_other_meshes(key)
        if parallelized:
            key = self._scoped(key, ctx)
            plan = ANY.comfy_plan if family == ANY.family else None  # no class to match: the batch split only
            model = parallelize(model, ctx, attention_kernel, plan=plan) or model
            if ctx.config.pp_degree > 1 and plan_for(model).pipeline is not None:
                keep_stage_blocks(model, ctx)  # a stage holds only its own blocks' weights
            apply_weight_sharding(model, ctx)  # a rank keeps 1/N of every weight (shard_weights)
        # (a model rebuilt for another mesh from the tensors this rank already holds brings nothing new)
        incoming = _tensor_bytes(model) - _tensor_bytes(model, on_device=True) if self.measured(device) else 0
        self.check_room(base_key, incoming, device, ctx)
        if device is not None and device.type != "cpu":
            to_device(model, device)
        if source is not None:
            source = held_tensors(model, source)
        r = Resident(family, model, parallelized, native_call, compute_dtype, source, lineage, bytes=incoming)
        self.models[key] = r
        self.loads += 1
        return r

    def _diffusion_model(self, key: str, ctx) -> Resident:
        """The resident diffusion model `key` (with the call ComfyUI's class takes), not a VAE."""
        r = self.get(key, ctx)
        if r.native_call is None:
            raise ValueError(f"{key!r} is a {r.family} model: it decodes (job 'decode'), it has no forward or loop")
        return r

    def weight_bytes(self, key: str, ctx=None) -> dict:
        """Bytes (total and per dtype) of a resident model's parameters and buffers on this rank."""
        r = self.get(key, ctx)
        seen, total, dtypes = set(), 0, {}
        for t in list(r.model.parameters()) + list(r.model.buffers()):
            if id(t) in seen or t.is_meta:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            if n == 0:  # a sharded weight's placeholder between uses (parallel/shard.py)
                continue
            total += n
            name = str(t.dtype).removeprefix("torch.")
            dtypes[name] = dtypes.get(name, 0) + n
        sharding = getattr(r.model, "_hp_sharding", None)
        return {"bytes": total, "dtypes": dtypes, "sharding": sharding.stats() if sharding is not None else None}

    # ---- compute ----
    def forward(self, key: str, ctx, kwargs: dict, *, call_index=None, conds=None,
                before: Optional[Callable] = None, compile_spec: Optional[dict] = None,
                first_block: Optional[dict] = None) -> torch.Tensor:
        """Step mode: the model on the full inputs; every rank returns the full output. `compile_spec`: ComfyUI's
        TorchCompileModel options (the native model runs compiled: Resident.callable_for). `first_block`: First
        Block Cache's rule, the call's sigma and its run ({"rule", "sigma", "run"}: parallel/fbcache.py)."""
        r = self._diffusion_model(key, ctx)
        if ctx.config.pp_degree > 1:
            raise ValueError("PipeFusion (pp_degree > 1) runs the whole denoising loop in the workers "
                             "(job 'loop'), not one forward per step")
        if call_index is not None and ctx.config.method == "distrifusion" and ctx.world_size > 1:
            # step mode: the sampler's call index 0 starts a new run; the calls of one conditioning set (`conds`,
            # ComfyUI's cond_or_uncond) are one lane of steps with their own stale K/V - ComfyUI calls the model
            # once per conditioning where it cannot batch them (MiniMax H3 always; prompts of different shapes)
            distrifusion_state(r.model).start_call(int(call_index), lane=tuple(conds or ()))
        if before is not None:
            before()
        rule, state, sigma = None, None, None
        if first_block:
            rule, sigma = FirstBlockRule.from_message(first_block["rule"]), float(first_block["sigma"])
            state = r.first_block_state(first_block.get("run"))
            state.begin(kwargs["x"], sigma)
        reduce = (lambda t: dist.all_reduce(t)) if ctx.world_size > 1 else None
        with torch.no_grad(), first_block_cache(r.model, rule, state, reduce):
            if compile_spec:
                with lenient():  # tests' strict mode: dynamo cannot trace its bookkeeping
                    out = r.native_call(r.callable_for(compile_spec), kwargs)
            else:
                out = r.native_call(r.model, kwargs)
        if state is not None:
            state.end(kwargs["x"], sigma)
        return out

    def loop(self, key: str, ctx, inputs: dict, sigmas, noise, *, convention: dict, sampler: str, cfg_scale=None,
             before_step: Optional[Callable] = None,
             callback: Optional[Callable] = None, cancel: Optional[Callable] = None,
             step_cache: Optional[dict] = None, cache_report: Optional[dict] = None) -> torch.Tensor:
        """Loop mode: the whole denoising loop; every rank returns the final latent.

        pp_degree > 1: PipeFusion's patch pipeline. Otherwise one parallel forward per step. Either way ComfyUI's
        model takes ComfyUI's latent as it is, in its compute dtype, with an fp32 timestep. callback(i, n, denoised)
        after each step; before_step(i, n) before each forward; cancel() polled by PipeFusion.
        step_cache: ComfyUI's EasyCache rule (StepCacheSpec fields), decided alike on every rank; cache_report
        gets how many steps (PipeFusion: patch steps) it skipped.
        """
        cache_spec = StepCacheSpec.from_json(step_cache)
        cache_kw = {} if cache_spec is None else dict(step_cache=cache_spec, cache_report=cache_report)
        r = self._diffusion_model(key, ctx)
        sigmas = sigmas.float().cpu()
        conv = _convention(convention, sigmas)
        call = _joining_concat(r.native_call)
        if ctx.config.pp_degree > 1:
            with torch.no_grad():
                return run_pipefusion_loop(r.model, ctx, inputs, sigmas, noise, convention=conv, sampler=sampler,
                                           cfg_scale=cfg_scale, callback=lambda i, n: callback(i, n, None),
                                           cancel=cancel, native_call=call, dtype=r.compute_dtype,
                                           timestep_dtype=torch.float32, **cache_kw)
        distri = None
        if ctx.config.method == "distrifusion" and ctx.world_size > 1:
            distri = distrifusion_state(r.model)

        def step_start(i, n):
            if before_step is not None:
                before_step(i, n)  # the caller's cancel agreement comes before the step's first collective
            if distri is not None:
                distri.set_step(i, total_steps=n)  # step 0 starts a new run: fresh buffers, synchronous warmup

        if cache_spec is not None:
            cache_kw["agree"] = lambda want: _agree_compute(want, ctx)
        with torch.no_grad():
            return run_loop(r.model, inputs, sigmas, noise, convention=conv, sampler=sampler, cfg_scale=cfg_scale,
                            before_step=step_start, callback=callback,
                            forward=lambda h, t, kw: call(r.model, {**kw, "x": h, "timestep": t}),
                            dtype=r.compute_dtype, timestep_dtype=torch.float32, **cache_kw)

    def decode(self, key: str, ctx, latent: torch.Tensor, *, axis: str = "world", block_size=None,
               before: Optional[Callable] = None) -> torch.Tensor:
        """Patch-parallel VAE decode over `axis` (every rank of the world by default); the full image on the axis'
        first rank (the one whose result the job returns), None on the others."""
        r = self.get(key, ctx)
        ax = world_axis(ctx) if axis == "world" else ctx.axis(axis)
        if before is not None:
            before()
        if r.family != "vae_comfy":
            raise ValueError(f"{key!r} is a {r.family} model, not a VAE: decode runs ComfyUI's VAE modules")
        # ComfyUI's own VAE module, split by its declaration (vae/comfy_vaes.py); the image on rank 0
        return native_patch_decode(r.model, comfy_vae_for(r.model), latent, ax, block_size=block_size)
