"""The ComfyUI process's side of the worker pool: one pool, model residency keys, conversions.

One ComfyUI process drives one set of devices, so it owns one `WorkerPool`; the
`Runtime` object holding it is created by the pack's entry point and handed to
the nodes (class attribute), rather than living in a module global. The pool
restarts itself when a prompt asks for a different mesh.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

import torch

from ..workers.pool import JobCancelled, PoolError, WorkerPool
from .cluster_node import join_commands



class Runtime:
    MAX_MODEL_INFO = 16

    def __init__(self, make_pool=None):
        self._make_pool = make_pool or (lambda device: WorkerPool(device=device))  # tests: fake workers
        self._pool = None
        self._pool_cluster = None  # the NodeCluster the pool was made for (None: this machine only)
        self._lock = threading.Lock()
        self.model_info = {}  # weights key -> (family, {}): the panel's label of a resident model
        self._prestart = None  # the background thread of prestart(), if one runs
        self.job = None        # the node run in progress: {kind, step, total, started} (the worker panel)
        self.last_job = None   # the previous one, with ok / error / elapsed_s
        self.prestarted = None  # the last prestart: {mesh, started}
        self.last_started = {}  # node kind -> when its latest run started (the panel's timeline)
        self.driver_threads = torch.get_num_threads()  # what KSampler computes with in this process
        self._spares = None  # workers/spares.py: interpreters with torch imported, for the first world
        self.last_auto = None  # the latest degrees-"auto" choice: predicted time per step per candidate
        self.last_memory = None  # the latest Hybrid Sampler run's memory plan (nodes/native.check_memory)
        self.cost_probes = {}  # auto's measured costs: CPU throughput, ComfyUI's attention kernel per shape (auto.py)
        self._idle = None  # the idle timer (HP_IDLE_TIMEOUT_S), re-armed after every node run
        self.warm_requests = 0  # times the frontend opened a workflow holding the pack's nodes (/hybrid_parallel/warm)
        self.warm_mesh = None  # the Parallel Config the latest of them sent (its describe()), if any
        self._comfy_problem = None  # check_comfyui's finding: "" = every seam present
        self.prompt_warms = 0  # prompts holding the pack's nodes seen at queue time (routes.warm_on_prompt)
        self.prompt_warmed = None  # the latest world such a prompt started: {mesh, at (queued), began}

    def keep_spares(self, n: int) -> None:
        """Start `n` spare worker interpreters now (ComfyUI's start-up), so the first prompt's world does not wait
        for each rank's `import torch`; they are handed to the pools this runtime makes."""
        if n <= 0:
            return
        if self._spares is None:
            import shutil
            import tempfile
            import weakref
            from ..workers.spares import Spares
            cwd = tempfile.mkdtemp(prefix=f"chp-spares-{os.getpid()}-")
            self._spares = Spares(cwd)
            weakref.finalize(self, _close_spares, self._spares, cwd, shutil.rmtree)
        self._spares.fill(n)
        if self._pool is not None:
            self._pool.spares = self._spares

    def warm(self, n: int, hp=None) -> str | None:
        """A workflow holding the pack's nodes was opened (the frontend's /hybrid_parallel/warm): start `n` spare
        interpreters and, given the workflow's Parallel Config `hp`, its world too - the ranks take the spares and
        import ComfyUI while the user is still editing (prestart), so a first prompt on a model ComfyUI already holds
        pays only for its weights. Nothing starts with n = 0 (HP_SPARE_WORKERS=0: no process before a prompt).
        Returns the mesh prestarted, if any."""
        self.warm_requests += 1
        self.warm_mesh = None if hp is None else hp.describe()
        if n <= 0:
            return None
        self.keep_spares(n)
        if hp is None:
            return None
        self.prestart(hp)
        return self.warm_mesh

    def warm_for_prompt(self, n: int, hp=None, queued: float | None = None) -> str | None:
        """A prompt holding the pack's nodes was queued (nodes/routes.warm_on_prompt: headless clients that never
        open the frontend): what `warm` does, unless a node run is in progress or `hp`'s world is already up (then
        nothing is to gain, and a prepare job would queue behind the run). Returns the mesh prestarted, if any.
        `queued`: when ComfyUI's on-prompt handler saw the prompt (this runs on a thread it started then)."""
        self.prompt_warms += 1
        began = time.time()
        if n <= 0 or self.job is not None:
            return None
        pool = self._pool
        if hp is not None and pool is not None and pool.running and \
                pool.world.world_key == hp.config.world_key(pool.split_kernel_worlds):
            if cpu_workers_here(hp):
                # its world is up: spares started now (torch imported, ~4 s of CPU each) would only take cores
                # from this prompt's own CPU ranks (bench/bench_headless.py: the pool's warm prompt 1.4-2x slower)
                return None
            hp = None
        self.keep_spares(n)
        if hp is None:
            return None
        self.prestart(hp)
        self.prompt_warmed = {"mesh": hp.config.describe(), "at": began if queued is None else queued, "began": began}
        return hp.describe()

    @contextmanager
    def quiet_driver(self, hp):
        """One intra-op thread in this process while a sampling run drives CPU workers on this machine.

        Why: the workers were given every core; this process's own small ops between model calls (the sampler's
        update, CFG) would wake its thread pool, whose threads then spin beside the workers (~4.5 % of a degree-1
        step here). The ops it runs meanwhile are elementwise (same result on any thread count)."""
        if not cpu_workers_here(hp):
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def remember(self, key: str, info) -> None:
        self.model_info[key] = info
        while len(self.model_info) > self.MAX_MODEL_INFO:
            self.model_info.pop(next(iter(self.model_info)))

    def check_comfyui(self) -> None:
        """Refuse, before any worker starts, a ComfyUI that lacks a seam the pack relies on
        (workers/comfy_seams.py): one line naming what is missing and the ComfyUI versions the tests ran, instead of
        a worker traceback mid-prompt. Only where ComfyUI is loaded in this process (not under fake-worker tests)."""
        if getattr(sys.modules.get("comfy.model_management"), "__file__", None) is None:
            return  # (a test's stand-in module has no file: not a ComfyUI)
        if self._comfy_problem is None:
            from ..workers.comfy_seams import problem_line
            self._comfy_problem = problem_line() or ""
        if self._comfy_problem:
            raise RuntimeError(self._comfy_problem)

    def pool(self, hp) -> WorkerPool:
        """The pool for `hp`'s device and machines; another device or cluster replaces it."""
        self.check_comfyui()
        cluster = getattr(hp, "cluster", None)
        with self._lock:
            if self._pool is None or (self._pool.device, self._pool_cluster) != (hp.device, cluster):
                if self._pool is not None:
                    self._pool.close()
                self._pool = (self._make_pool(hp.device) if cluster is None else
                              WorkerPool(device=hp.device, cluster=cluster.cluster,
                                         start_timeout_s=cluster.join_timeout_s))
                self._pool.split_kernel_worlds = not driver_attention_is_pytorch()
                if cluster is None and hp.device != "cpu":
                    self._pool.gpus = comfy_gpus()
                self._pool.lone_worker_threads = self.driver_threads
                self._pool.spares = self._spares
                self._pool_cluster = cluster
            return self._pool

    def prestart(self, hp) -> None:
        """Start the workers for `hp` and import ComfyUI in them, in the background (Parallel Config calls this).

        Why: a cold first prompt pays the world start (one Python + torch import per rank) and ComfyUI's import
        on every rank; started here they overlap ComfyUI loading the checkpoint and encoding the prompt. Any
        failure is left for the sampler's own start to report (with its clear error), never raised here.
        """
        if self._prestart is not None and self._prestart.is_alive():
            return
        if self._pool is not None and (self._pool.device, self._pool_cluster) != (hp.device, hp.cluster):
            return  # a device or cluster change replaces the pool: leave that to the sampler, which reports errors
        try:
            from .native import comfy_runtime
            comfy = comfy_runtime()
        except Exception:  # noqa: BLE001 - no ComfyUI here: nothing to prepare
            return

        def run():
            try:
                self.pool(hp).submit(hp.config, "prepare", {"comfy": comfy}, timeout_s=300)
            except Exception as e:  # noqa: BLE001 - the sampler's own start reports it properly
                import logging
                logging.getLogger(__name__).info("hybrid parallel: prestart of %s failed: %s",
                                                 hp.config.describe(), e)

        self.prestarted = {"mesh": hp.config.describe(), "started": time.time()}
        self._prestart = threading.Thread(target=run, name="hybrid-parallel-prestart", daemon=True)
        self._prestart.start()

    def ensure_native(self, hp, key: str, spec: dict, diffusion_model, lineage: str | None = None,
                      patches: tuple | None = None, family: str | None = None, unhooked: dict | None = None) -> str:
        """Make ComfyUI's own diffusion model (or, with `family` "vae_comfy", its VAE model) resident on the workers
        under `key`; returns its family.

        The weights are the module's tensors as ComfyUI holds them now (storage dtype, patches applied),
        written once into shared memory that every local rank maps; nothing is converted or copied here.
        `unhooked`: {name: tensor} for the weights a hook group holds patched in place now (ComfyUI's own backup of
        each): those travel, and ComfyUI's hooked tensors are left as they are.
        """
        from ..workers.loader_types import raw
        from .native import family_adapter, sent_tensors, weight_bytes
        family = family or family_adapter(diffusion_model).family
        pool = self.pool(hp)
        w = pool.world
        if pool.gpus and (w is None or key not in w.resident):  # the weights will travel: beside ComfyUI's?
            pool.ensure_world(hp.config)
            free_beside_comfy(pool, hp.config, weight_bytes(diffusion_model), pool.gpus)
        # the weights as the layers hold them, in the dtype ComfyUI computes them in (native.sent_tensors); a
        # loader's tensor subclass (GGUF) as its raw bytes (spec["tensors"] says how the workers rebuild it)
        unhooked = unhooked or {}
        pool.ensure_model(hp.config, key, family, {}, native=spec, lineage=lineage,
                          adopt=adopter(diffusion_model, skip=set(unhooked)), patches=patches,
                          state_dict=lambda: {k: raw(v) for k, v in sent_tensors(diffusion_model,
                                                                                  unhooked=unhooked).items()})
        self.remember(key, (family, {}))
        return family

    def cancel(self) -> bool:
        """Stop the running node's job as ComfyUI's interrupt button would (its prompt ends as interrupted,
        not as a worker failure); False when nothing runs."""
        if self.job is None:
            return False
        try:
            import comfy.model_management
            comfy.model_management.interrupt_current_processing(True)
        except ImportError:  # the pool without ComfyUI (tests): its own cancel is enough
            pass
        pool = self._pool
        if pool is not None:
            pool.cancel()
        return True

    def stop(self):
        """Stop the workers for good (the next job starts a new pool); returns the mesh that ran, if any."""
        with self._lock:
            was = None
            if self._pool is not None:
                world = self._pool.world
                was = None if world is None else world.config.describe()
                self._pool.close()
                self._pool = None
            return was

    def health(self) -> list:
        return [] if self._pool is None else self._pool.health()

    def release_models(self) -> int:
        """ComfyUI unloaded its models ("Unload models", its /free route, an out-of-memory error): the workers drop
        theirs too and give the memory back; the processes stay warm for the next prompt."""
        pool = self._pool
        released = 0 if pool is None or self.job is not None else pool.release_models()
        self.model_info.clear()
        return released

    def follow_comfy_unload(self) -> None:
        """Make ComfyUI's own unload (comfy.model_management.unload_all_models, which its /free route, the UI's
        "Unload models" and its out-of-memory handler call) release the workers' models as well."""
        import comfy.model_management as mm
        if getattr(mm.unload_all_models, "_hp_follows", False):
            return
        original, runtime = mm.unload_all_models, self

        def unload_all_models(*args, **kwargs):
            out = original(*args, **kwargs)
            try:
                runtime.release_models()
            except Exception as e:  # noqa: BLE001 - ComfyUI's own unload must never fail because of the pack
                import logging
                logging.getLogger(__name__).warning("hybrid parallel: releasing the workers' models failed: %s", e)
            return out
        unload_all_models._hp_follows = True
        mm.unload_all_models = unload_all_models

    # ---- idle: the workers exit after HP_IDLE_TIMEOUT_S without a job (a setting; off by default) ----
    def _idle_timeout_s(self) -> float:
        value = os.environ.get("HP_IDLE_TIMEOUT_S", "").strip()
        try:
            return max(0.0, float(value)) if value else 0.0
        except ValueError:
            return 0.0

    def _arm_idle(self) -> None:
        timeout = self._idle_timeout_s()
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if timeout > 0 and self._pool is not None:
            self._idle = threading.Timer(timeout, self._on_idle)
            self._idle.daemon = True
            self._idle.start()

    def _on_idle(self) -> None:
        if self.job is None:
            import logging
            was = self.stop()
            if self._spares is not None:
                self._spares.close()
                self._spares = None  # nothing held while idle; the next world starts its own interpreters
            logging.getLogger(__name__).info("hybrid parallel: workers stopped after %.0f s idle (%s)",
                                             self._idle_timeout_s(), was)

    # ---- what the worker panel shows (nodes/routes.py); read from the server thread, written here ----
    @contextmanager
    def track(self, kind: str, total: int | None = None):
        """Mark a node run in progress so the panel can say busy / starting and which step, and keep
        its outcome: a prompt that failed on the workers shows as `failed` with the rank's message."""
        job = {"kind": kind, "step": 0, "total": total, "started": time.time()}
        if self._idle is not None:
            self._idle.cancel()
        self.job = job
        self.last_started[kind] = job["started"]
        try:
            yield job
        except BaseException as e:
            self.last_job = {**job, "ok": False, "error": f"{type(e).__name__}: {e}"[:2000],
                             "pool_error": _is_pool_error(e), "elapsed_s": time.time() - job["started"]}
            raise
        else:
            self.last_job = {**job, "ok": True, "error": None, "pool_error": False,
                             "elapsed_s": time.time() - job["started"]}
        finally:
            self.job = None
            self._arm_idle()

    def progress(self, step: int, total: int | None = None) -> None:
        job = self.job
        if job is not None:
            job["step"] = int(step)
            if total is not None:
                job["total"] = int(total)

    def status(self) -> dict:
        """Pool state (none / starting / ready / busy / stopping / failed), per-rank workers, current and last job.

        Idle workers are asked themselves (the pool's tiny health job), busy ones are seen from here.
        Blocking: call it off the server's event loop.
        """
        pool, job, last = self._pool, self.job, self.last_job
        world = None if pool is None else pool.world
        workers = [] if world is None else pool.health()
        for w in workers:
            w["models"] = [self._model_label(k) for k in w.get("resident") or []]
        failed = last is not None and not last["ok"] and last["pool_error"]
        if world is not None and world.state == "stopping":
            state = "stopping"
        elif world is not None and not world.alive() and world.state != "starting":
            state = "failed"
        elif job is not None:
            state = "starting" if world is None or world.state == "starting" else "busy"
        elif world is None:
            state = "failed" if failed else "none"
        else:
            state = "busy" if world.state in ("busy", "cancelling") else "ready"
        return {"state": state, "device": None if pool is None else pool.device,
                "mesh": None if world is None else world.config.describe(),
                "world_size": 0 if world is None else world.world_size,
                "workers": workers, "job": dict(job) if job else None, "last_job": last,
                "prestart": self.prestarted, "last_started": dict(self.last_started),
                "warm_requests": self.warm_requests, "warm_mesh": self.warm_mesh, "prompt_warms": self.prompt_warms,
                "prompt_warmed": self.prompt_warmed,
                "join_commands": None if self._pool_cluster is None else join_commands(self._pool_cluster.cluster)}

    def _model_label(self, key: str) -> str:
        info = self.model_info.get(key)
        family = info[0] if info else ("vae" if ":vae" in key else "model")
        family = "vae" if family.startswith("vae") else family  # ComfyUI's own VAE module, whatever its class
        return f"{family} {key.split(':')[0][:8]}"


TRIM_EVERY_BYTES = 256 << 20  # the adopter gives freed heap back at least this often (an eighth of a smaller model)


def trim_host_heap(collect: bool = True) -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim): ComfyUI's weights, once the mapped pages replace
    them, were freed into the heap - glibc raises its mmap threshold after large frees, so big tensors often live
    on the heap, whose free memory stays in the process until trimmed. A no-op elsewhere.
    `collect`: run the garbage collector first (what a reference cycle held); the adopter's caller frees by
    reference count alone and skips it - a full collection in a ComfyUI process costs 0.2 s."""
    import ctypes
    import ctypes.util
    import gc
    if collect:
        gc.collect()
    name = ctypes.util.find_library("c")  # (cached by ctypes: cheap enough to call every few hundred MiB)
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def adopter(module: torch.nn.Module, skip: set = frozenset()):
    """adopt(name, mapped) for pool.ensure_model: ComfyUI's own host tensor `name` of `module` takes the mapped
    pages of the file just written for the workers (copy-on-write: ComfyUI writing into it - an in-place LoRA
    patch - gets private pages, the workers never see it). ComfyUI's copy and every local rank's are then one set of
    pages, freed tensor by tensor as they are written; a tensor ComfyUI keeps on a GPU is left alone, and so is one
    ComfyUI holds as its mapping of the checkpoint file (`file_backed`: DynamicVRAM's zero-copy loader, ComfyUI 0.33) -
    those pages are the file's, which the kernel drops under memory pressure and ComfyUI reads back from the file
    itself; the workers' copy would only take their place with pages nothing can drop."""
    from ..workers.loader_types import describe, host_tensors, raw, rebuild
    targets = {k: v for k, v in host_tensors(module).items() if k not in skip}  # skip: ComfyUI's hooked tensors
    owners = dict(module.named_modules())
    lock = threading.Lock()
    freed = [0]  # bytes let go since the heap was last trimmed
    total = sum(t.numel() * t.element_size() for t in targets.values())
    every = max(32 << 20, min(TRIM_EVERY_BYTES, total // 8))

    def adopt(name: str, mapped: torch.Tensor) -> None:
        t = targets.pop(name, None)  # held here no longer: ComfyUI's old tensor is freed as soon as it is replaced
        if t is None or t.device.type != "cpu" or file_backed(t):
            return
        try:
            _adopt(name, t, mapped)
        finally:
            nbytes = t.numel() * t.element_size()
            del t
            with lock:
                freed[0] += nbytes
                trim = freed[0] >= every
                freed[0] = 0 if trim else freed[0]
            if trim:  # the old tensors went to the heap: give them back while the rest is written, not at the end
                trim_host_heap(collect=False)

    def _adopt(name: str, t: torch.Tensor, mapped: torch.Tensor) -> None:
        r = raw(t)  # a loader's tensor (GGUF) is compared by its bytes and rebuilt around the mapped ones
        if r.dtype != mapped.dtype or r.shape != mapped.shape:
            return
        if type(mapped) is not type(t):  # the loader's tensor, as ComfyUI holds it now (its patcher state included)
            mapped = rebuild(mapped, describe(t, name))
            mapped.__dict__.update({k: v for k, v in vars(t).items() if not k.startswith("_")})
        path, _, leaf = name.rpartition(".")
        owner = owners.get(path)
        if owner is None:
            return
        # a new Parameter in the module's slot, as ComfyUI's own patching does (comfy.utils.set_attr_param):
        # tensors made under inference mode - a server loads checkpoints so - cannot have their .data swapped
        with lock:
            if leaf in owner._parameters and owner._parameters[leaf] is t:
                owner._parameters[leaf] = torch.nn.Parameter(mapped, requires_grad=False)
            elif leaf in owner._buffers and owner._buffers[leaf] is t:
                owner._buffers[leaf] = mapped
    adopt.done = lambda: trim_host_heap(collect=False)  # once every tensor is adopted; nothing cyclic was freed
    return adopt


def file_backed(t: torch.Tensor) -> bool:
    """Whether ComfyUI holds `t` as its mapping of the checkpoint file: ComfyUI 0.33's loader under DynamicVRAM
    (comfy.utils.load_safetensors) marks each such storage with the file slice it maps (`_comfy_tensor_file_slice`),
    which its dynamic loader also reads the weight from directly."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without storage of its own
        return False
    return getattr(storage, "_comfy_tensor_file_slice", None) is not None


def comfy_gpus() -> dict:
    """The machine's GPUs as the workers will number them, and which one ComfyUI computes on: {} without CUDA.
    count: every GPU (with `--cuda-device N` ComfyUI hid the others from its process tree - undone for the workers,
    launch.worker_env - so they are counted with NVML); driver: ComfyUI's GPU in that numbering (the workers put
    their ranks elsewhere first); comfy_cuda_device: N."""
    if not torch.cuda.is_available():
        return {}
    try:
        import comfy.cli_args
        import comfy.model_management as mm
    except ImportError:  # the pool without ComfyUI (tests, scripts): torch's view
        return {"count": torch.cuda.device_count()}
    restricted = getattr(comfy.cli_args.args, "cuda_device", None)
    if restricted is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() == str(restricted):
        try:
            count = int(torch.cuda._raw_device_count_nvml())
        except Exception:  # noqa: BLE001 - NVML unreadable: what this process sees
            count = -1
        count = count if count > 0 else torch.cuda.device_count()
        return {"count": count, "driver": int(restricted), "comfy_cuda_device": int(restricted)}
    device = mm.get_torch_device()
    driver = device.index if getattr(device, "type", None) == "cuda" else None
    if driver is None and getattr(device, "type", None) == "cuda":
        driver = torch.cuda.current_device()
    return {"count": torch.cuda.device_count(), "driver": driver}


def free_beside_comfy(pool, config, nbytes: int, gpus: dict) -> bool:
    """When a rank of `config`'s world sits on ComfyUI's own GPU, ComfyUI's models there make room first (its model
    management unloads what it can and empties its cache) before `nbytes` of weights load beside them. True when it
    asked."""
    driver = gpus.get("driver")
    w = pool.world
    if driver is None or w is None or f"cuda:{driver}" not in (w.devices or []):
        return False
    import comfy.model_management as mm
    device = mm.get_torch_device()
    mm.free_memory(nbytes, device)
    mm.soft_empty_cache()
    return True


def take_over_from_dynamic_vram(patcher) -> int:
    """Before ComfyUI loads `patcher` - the pool's host clone of a MODEL (nodes/prepare.host_clone) - for a run,
    where ComfyUI's DynamicVRAM patcher (ModelPatcherDynamic, ComfyUI 0.33) holds the same model too: unload its loaded
    dynamic copies through ComfyUI's model management, and where no host copy of ComfyUI's stayed loaded since, have
    ComfyUI unpatch the model (ModelPatcher.unpatch_model) so that its load patches it afresh. Returns how many dynamic
    copies it unloaded; does nothing to a model no ModelPatcherDynamic ever held (ComfyUI 0.3.x,
    --disable-dynamic-vram).

    Why: ComfyUI loading the host clone drops a dynamic copy from its loaded models as a clone of the same model
    (load_models_gpu), but without unloading it (ModelPatcher.detach without unpatching): its VBAR (the weights it keeps
    on the GPU) and its force-loaded layers would stay there beside the workers, out of ComfyUI's list of loaded
    models - no later unload of ComfyUI's (free_memory, Unload models) would reach them. ComfyUI's own unload of a
    loaded model (LoadedModel.model_unload, what free_memory runs on each model it unloads) frees the VBAR and the
    pinned buffers and puts back the weights it replaced; the entry then leaves ComfyUI's loaded models, as
    free_memory removes it.
    And a dynamic load begins by putting back every weight a patcher replaced (restore_loaded_backups), while the
    layers a host load patched keep their "patched" flag (comfy_patched_weights): the next host load of the same
    patches would skip them and the workers would get unpatched weights, silently. A host copy still loaded means no
    other load came between; otherwise the unpatch clears the flags (and puts back any weight still replaced)."""
    import comfy.model_management as mm
    weights = getattr(patcher, "model", None)
    if not hasattr(weights, "dynamic_pins"):  # what every ModelPatcherDynamic sets on the model it holds
        return 0
    loaded = mm.current_loaded_models
    mine = [lm for lm in list(loaded)
            if lm.model is not None and not lm.is_dead() and getattr(lm.model, "model", None) is weights]
    dynamic = [lm for lm in mine if _held_dynamically(lm.model)]
    for lm in dynamic:
        lm.model_unload()
        for i, other in enumerate(loaded):
            if other is lm:
                loaded.pop(i)
                break
    if dynamic:
        mm.soft_empty_cache()
    if len(dynamic) == len(mine):  # no host copy of ComfyUI's is loaded: another load may have come between
        patcher.unpatch_model(patcher.offload_device, unpatch_weights=True)
    return len(dynamic)


def _held_dynamically(patcher) -> bool:
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def _close_spares(spares, cwd, rmtree) -> None:
    spares.close()
    rmtree(cwd, ignore_errors=True)


def cpu_workers_here(hp) -> bool:
    """Whether `hp` runs its workers on this machine's CPU cores (they share the cores with this process)."""
    if getattr(hp, "cluster", None) is not None:
        return False
    devices = hp.config.devices
    if devices:
        return all(str(d).startswith("cpu") for d in devices)
    return hp.device == "cpu" or (hp.device == "auto" and not torch.cuda.is_available())


def driver_attention_is_pytorch() -> bool:
    """Whether this process's ComfyUI computes attention with its pytorch kernel: then workers that intercept
    attention (sequence / pipeline parallel) import ComfyUI exactly as those that do not, and a config change
    between them keeps the workers (workers/pool.py split_kernel_worlds). False without ComfyUI."""
    import sys
    attention = sys.modules.get("comfy.ldm.modules.attention")
    kernel = getattr(attention, "optimized_attention", None)
    return kernel is not None and kernel is getattr(attention, "attention_pytorch", None)


def _is_pool_error(e: BaseException) -> bool:
    """A failure of the workers (raised, died, hung), not a cancel or a refused input."""
    return isinstance(e, PoolError) and not isinstance(e, JobCancelled)
