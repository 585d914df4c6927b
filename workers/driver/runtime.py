"""The ComfyUI process's side of the worker pool: one pool, model residency keys, conversions.

One ComfyUI process drives one set of devices, so it owns one `WorkerPool`; the
`Runtime` object holding it is created by the pack's entry point and handed to
the nodes (class attribute), rather than living in a module global. The pool
restarts itself when a prompt asks for a different mesh.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager

import torch

from .. import forkserver
from ..bridge.build import comfy_runtime, driver_attention_is_pytorch
from ..bridge.host import adopter, comfy_gpus, free_beside_comfy, interrupt_comfy, on_comfy_unload
from ..bridge.loader_types import raw
from ..bridge.seams import comfy_loaded, problem_line
from ..bridge.spec import family_adapter, sent_tensors, weight_bytes
from ..launch import local_env
from ..messages import NativeSpec, VaeSpec
from ..pool import JobCancelled, PoolError, WorkerPool
from ..cluster import join_commands



class Runtime:

    def __init__(self, make_pool=None):
        self._make_pool = make_pool or (lambda device: WorkerPool(device=device))  # tests: fake workers
        self._pool = None
        self._pool_cluster = None  # the NodeCluster the pool was made for (None: this machine only)
        self._lock = threading.Lock()
        self._prestart = None  # the background thread of prestart(), if one runs
        self.job = None        # the node run in progress: {kind, step, total, started} (the worker panel)
        self.last_job = None   # the previous one, with ok / error / elapsed_s
        self.prestarted = None  # the last prestart: {mesh, started}
        self.last_started = {}  # node kind -> when its latest run started (the panel's timeline)
        self.driver_threads = torch.get_num_threads()  # what KSampler computes with in this process
        self._forks = None  # workers/forkserver.py: torch imported once, every world's ranks forked from it
        self.last_auto = None  # the latest degrees-"auto" choice: predicted time per step per candidate
        self.last_memory = None  # the latest Hybrid Sampler run's memory plan (workers/bridge/spec.check_memory)
        self.cost_probes = {}  # auto's measured costs: CPU throughput, ComfyUI's attention kernel per shape (auto.py)
        self._idle = None  # the idle timer (HP_IDLE_TIMEOUT_S), re-armed after every node run
        self.warm_requests = 0  # times the frontend opened a workflow holding the pack's nodes (/hybrid_parallel/warm)
        self.warm_mesh = None  # the Parallel Config the latest of them sent (its describe()), if any
        self._comfy_problem = None  # check_comfyui's finding: "" = every seam present
        self.prompt_warms = 0  # prompts holding the pack's nodes seen at queue time (routes.warm_on_prompt)
        self.prompt_warmed = None  # the latest world such a prompt started: {mesh, at (queued), began}

    def keep_spares(self, n: int) -> None:
        """The head start (a workflow opened, a headless prompt queued, HP_PRESTART): start the fork server now, so
        the first prompt's world forks its ranks instead of waiting for each rank's imports. n = 0
        (HP_SPARE_WORKERS=0): nothing before a prompt - the first world starts the fork server itself."""
        if n > 0 and self.fork_server() is not None:
            # in the environment its workers get (on a GPU machine: a CUDA world's)
            kind = "cuda" if torch.cuda.is_available() else "cpu"
            self._forks.start(local_env(kind, comfy_gpus().get("comfy_cuda_device")))

    def fork_server(self):
        """The fork server of every pool this runtime makes (started by the first world that needs it, or ahead by
        keep_spares); None where workers are not forked (workers/forkserver.enabled)."""
        if self._forks is None and forkserver.enabled():
            cwd = tempfile.mkdtemp(prefix=f"chp-forks-{os.getpid()}-")
            self._forks = forkserver.ForkServer(cwd)
            weakref.finalize(self, _close_forks, self._forks, cwd, shutil.rmtree)
        return self._forks

    def warm(self, n: int, hp=None) -> str | None:
        """A workflow holding the pack's nodes was opened (the frontend's /hybrid_parallel/warm): start the fork server
        and, given the workflow's Parallel Config `hp`, its world too - the ranks fork from it and
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
        """A prompt holding the pack's nodes was queued (workers/driver/routes.warm_on_prompt: headless clients that never
        open the frontend): what `warm` does, unless a node run is in progress or `hp`'s world is already up (then
        nothing is to gain, and a prepare job would queue behind the run). Returns the mesh prestarted, if any.
        `queued`: when ComfyUI's on-prompt handler saw the prompt (this runs on a thread it started then)."""
        self.prompt_warms += 1
        began = time.time()
        if n <= 0 or self.job is not None:
            return None
        pool = self._pool
        if hp is not None and pool is not None and pool.runs(hp.config):
            if cpu_workers_here(hp):
                # its world is up: a prepare job now would only take cores from this prompt's own CPU ranks
                # (bench/bench_headless.py: the pool's warm prompt 1.4-2x slower)
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

    def check_comfyui(self) -> None:
        """Refuse, before any worker starts, a ComfyUI that lacks a seam the pack relies on
        (workers/bridge/seams.py): one line naming what is missing and the ComfyUI versions the tests ran, instead of
        a worker traceback mid-prompt. Only where ComfyUI is loaded in this process (not under fake-worker tests)."""
        if not comfy_loaded():
            return
        if self._comfy_problem is None:
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
                self._pool_cluster = cluster
            self._pool.forks = self.fork_server()  # (a new one after the idle timer closed the last)
            return self._pool

    def prestart(self, hp) -> None:
        """Start the workers for `hp` and import ComfyUI in them, in the background (Parallel Config calls this).

        Why: a cold first prompt pays the world start (one Python + torch import per rank) and ComfyUI's import
        on every rank; started here they overlap ComfyUI loading the checkpoint and encoding the prompt. Any
        failure is left for the sampler's own start to report (with its clear error), never raised here.
        A running world of another shape is left alone: the sampler switches it after its checks, so a prompt they
        refuse (a method the family does not declare, a patch that cannot travel) keeps the running world and its
        resident models instead of costing two world starts.
        """
        if self._prestart is not None and self._prestart.is_alive():
            return
        if self._pool is not None and (self._pool.device, self._pool_cluster) != (hp.device, hp.cluster):
            return  # a device or cluster change replaces the pool: leave that to the sampler, which reports errors
        if self._pool is not None and self._pool.running and not self._pool.runs(hp.config):
            return  # another world is up: the sampler switches it once its checks pass
        try:
            comfy = comfy_runtime().message()
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

    def ensure_native(self, hp, key: str, spec: NativeSpec | VaeSpec, diffusion_model, lineage: str | None = None,
                      patches: tuple | None = None, family: str | None = None, unhooked: dict | None = None) -> str:
        """Make ComfyUI's own diffusion model (or, with `family` "vae_comfy", its VAE model) resident on the workers
        under `key`; returns its family.

        The weights are the module's tensors as ComfyUI holds them now (storage dtype, patches applied),
        written once into shared memory that every local rank maps; nothing is converted or copied here.
        `unhooked`: {name: tensor} for the weights a hook group holds patched in place now (ComfyUI's own backup of
        each): those travel, and ComfyUI's hooked tensors are left as they are.
        """
        family = family or family_adapter(diffusion_model).family
        pool = self.pool(hp)
        w = pool.world
        if pool.gpus and (w is None or key not in w.resident):  # the weights will travel: beside ComfyUI's?
            pool.ensure_world(hp.config)
            free_beside_comfy(pool, hp.config, weight_bytes(diffusion_model), pool.gpus)
        # the weights as the layers hold them, in the dtype ComfyUI computes them in (native.sent_tensors); a
        # loader's tensor subclass (GGUF) as its raw bytes (spec.tensors says how the workers rebuild it)
        unhooked = unhooked or {}
        pool.ensure_model(hp.config, key, family, native=spec, lineage=lineage,
                          adopt=adopter(diffusion_model, skip=set(unhooked)), patches=patches,
                          state_dict=lambda: {k: raw(v) for k, v in sent_tensors(diffusion_model,
                                                                                  unhooked=unhooked).items()})
        return family

    def cancel(self) -> bool:
        """Stop the running node's job as ComfyUI's interrupt button would (its prompt ends as interrupted,
        not as a worker failure); False when nothing runs."""
        if self.job is None:
            return False
        interrupt_comfy()
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
        return released

    def follow_comfy_unload(self) -> None:
        """Make ComfyUI's own unload (its /free route, the UI's "Unload models", its out-of-memory handler) release
        the workers' models as well."""
        on_comfy_unload(self.release_models)

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
            if self._forks is not None:
                self._forks.close()
                self._forks = None  # nothing held while idle; the next world starts a fork server again
            logging.getLogger(__name__).info("hybrid parallel: workers stopped after %.0f s idle (%s)",
                                             self._idle_timeout_s(), was)

    # ---- what the worker panel shows (workers/driver/routes.py); read from the server thread, written here ----
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
        families = {} if world is None else {s.key: s.family for s in world.slots}  # the ranks' own report
        for w in workers:
            w["models"] = [_model_label(k, families.get(k)) for k in w.get("resident") or []]
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


def _model_label(key: str, family) -> str:
    family = family or ("vae" if ":vae" in key else "model")
    family = "vae" if family.startswith("vae") else family  # ComfyUI's own VAE module, whatever its class
    return f"{family} {key.split(':')[0][:8]}"


def _close_forks(forks, cwd, rmtree) -> None:
    forks.close()
    rmtree(cwd, ignore_errors=True)


def cpu_workers_here(hp) -> bool:
    """Whether `hp` runs its workers on this machine's CPU cores (they share the cores with this process)."""
    if getattr(hp, "cluster", None) is not None:
        return False
    devices = hp.config.devices
    if devices:
        return all(str(d).startswith("cpu") for d in devices)
    return hp.device == "cpu" or (hp.device == "auto" and not torch.cuda.is_available())


def _is_pool_error(e: BaseException) -> bool:
    """A failure of the workers (raised, died, hung), not a cancel or a refused input."""
    return isinstance(e, PoolError) and not isinstance(e, JobCancelled)
