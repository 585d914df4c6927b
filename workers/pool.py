"""WorkerPool: the driver's handle on a persistent world of workers.

The caller owns the pool (no global singleton): it starts a world for a
ParallelConfig on first use, reuses it while `config.world_key()` (world size, devices) is unchanged -
the ranks build a new mesh's process groups in place - restarts it when the world changes or after a
fault, and stops it on `stop()`,
on garbage collection and at interpreter exit (weakref.finalize).

One job at a time (a lock); `cancel()` and `health()` may be called from other
threads. Failure policy: a rank that raises, dies, hangs past the job timeout
or runs out of memory fails the job with a PoolError subclass carrying that
rank's traceback. The world is torn down (next job restarts it) unless every
rank reported back, i.e. none is stuck in a collective - then it is still
consistent and resident models are kept. A cancel stops all ranks at the same
step (the ranks agree through a collective), so the world stays up. How a job's replies are collected (and those
failures found): workers/collect.py.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import weakref

from . import forkserver, residency
from .collect import JobCollection
from .errors import (JobCancelled, JobResult, JobTimeout, PoolError, StartupError, WorkerDied, WorkerError, WorkerOOM,
                     WorkerStalled)
from .launch import World, balance_spec
from .messages import LoadJob, NativeSpec, VaeSpec, typed_native
from .platform_support import check_os, check_pool
from .protocol import model_families
from .sweep import sweep_stale
from .transport import (WEIGHT_PREFIX, Arena, cleanup_prefix, nbytes, new_prefix, shm_dir, unlink,
                        write_tensor, write_weights)

JOB_KINDS = ("health", "release", "echo", "model_bytes", "prepare", "steps", "load_model", "forward", "vae_decode", "loop",
             "pipefusion_loop")
STALL_TIMEOUT_S = float(os.environ.get("HP_STALL_TIMEOUT_S", "10"))  # no heartbeat this long: a rank is stuck


class _Holder:
    """What the finalizer needs (never the pool itself, or it would keep the pool alive)."""

    def __init__(self, tmpdir: str, prefix: str):
        self.world, self.tmpdir, self.prefix = None, tmpdir, prefix
        self.forks = None  # the pool's own fork server, if it started one (forkserver.py)


def _shutdown(holder: _Holder) -> None:
    if holder.world is not None:
        holder.world.teardown(graceful=True)
        holder.world = None
    if holder.forks is not None:
        holder.forks.close()
        holder.forks = None
    cleanup_prefix(holder.prefix)
    shutil.rmtree(holder.tmpdir, ignore_errors=True)


class WorkerPool(JobCollection):
    """Start / reuse / restart a world of workers and run jobs on it.

    fake: None for real torch.distributed workers, or a fake behaviour
    ("serve", "die", "hang", "slow", "raise", optionally ":K") - see fake_worker.py.
    device: "cpu", "cuda" or "auto" (cuda when available). max_models: resident
    models per worker before the least recently used is evicted.
    """

    def __init__(self, *, fake: str | None = None, device: str = "auto", max_models: int = 2,
                 job_timeout_s: float = 600.0, start_timeout_s: float = 120.0,
                 collective_timeout_s: float | None = None, env: dict | None = None, cluster=None,
                 stall_timeout_s: float | None = None, share_devices: bool | None = None,
                 balance: str | None = None, forks=None):
        if fake is not None:
            from .fake_worker import parse_behaviour  # lazy: an entry module (-m), kept out of the package import
            parse_behaviour(fake)
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
        if int(max_models) < 1:
            raise ValueError(f"max_models must be >= 1, got {max_models}")
        self.fake, self.device, self.max_models = fake, device, int(max_models)
        self.job_timeout_s, self.start_timeout_s = float(job_timeout_s), float(start_timeout_s)
        # None: per backend (launch.collective_timeout: NCCL's watchdog counts from enqueue)
        self.collective_timeout_s = None if collective_timeout_s is None else float(collective_timeout_s)
        self.env = env
        self.stall_timeout_s = float(STALL_TIMEOUT_S if stall_timeout_s is None else stall_timeout_s)
        if cluster is not None and fake is not None:
            raise ValueError("a cluster (workers started by torchrun) runs real workers; drop fake=")
        self.cluster = cluster  # workers/cluster.py: a world spanning launch groups on several machines
        # ranks share the GPUs over gloo with staged copies (parallel/staged.py): the GPU suite on one GPU, tests
        from ..parallel import staged  # lazy: torch (this module loads it only where a job needs it)
        self.share_devices = staged.enabled() if share_devices is None else bool(share_devices)
        # ranks of different speeds (launch.balance_spec): "auto" probes GPU worlds, "probe" any, "off" none, or
        # "1,0.5,..." one speed per rank (HP_BALANCE)
        self.balance = balance_spec(os.environ.get("HP_BALANCE", "auto") if balance is None else balance)
        # the GPUs beside ComfyUI (workers/bridge/host.comfy_gpus): {count: every GPU of the machine, driver: ComfyUI's
        # own (its ranks go last), comfy_cuda_device: its --cuda-device, undone for the workers}; {} = torch's view
        self.gpus: dict = {}
        self.last_load_bytes = 0  # bytes the latest ensure_model wrote (weights and patches)
        self.last_load: dict = {}  # rank 0's answer to the latest ensure_model (loaded, patched_in_place, ...)
        swept = sweep_stale()  # what pools of dead processes left (ComfyUI killed with its workers)
        if swept:
            import logging
            logging.getLogger(__name__).info("hybrid parallel: removed %d leftovers of dead pools", swept)
        # the pid in the folder name lets a later pool tell a dead pool's folder from a live one
        self._holder = _Holder(tempfile.mkdtemp(prefix=f"chp-pool-{os.getpid()}-"), new_prefix())
        self._arena = Arena(self._holder.prefix)  # job inputs, reused while the world lives
        self._arena_maps: dict = {}               # rank 0's result arena, mapped once
        self._finalizer = weakref.finalize(self, _shutdown, self._holder)
        self._lock = threading.RLock()
        self._cancel = threading.Event()
        self._next_job = 0
        self.generation = 0  # worlds started so far
        # ParallelConfig.world_key: False where the driver's ComfyUI uses the pytorch attention kernel anyway, so a
        # sequence-parallel and a cfg/dp config can share the workers (workers/driver/runtime.py sets it)
        self.split_kernel_worlds = True
        self.lone_worker_threads = None  # a degree-1 CPU worker's threads (launch.worker_threads); runtime sets it
        self._written: set = set()  # names of weight files written ahead of their load_model job (ensure_model)
        # the fork server the next world's workers are forked from (forkserver.py): the runtime's in ComfyUI (started
        # ahead, shared by the pools it makes), else the pool starts its own with its first world
        self.forks = forks

    # ---- lifecycle ----
    @property
    def world(self) -> World | None:
        return self._holder.world

    @property
    def tmpdir(self) -> str:
        """The pool's private 0700 directory (import symlink, control sockets, rendezvous files)."""
        return self._holder.tmpdir

    @property
    def shm_prefix(self) -> str:
        return self._holder.prefix

    def arena_files(self) -> set:
        """The shared-memory files kept between jobs: this driver's input arena and rank 0's result arena
        (every other file of a job is gone when submit() returns)."""
        return {os.path.join(shm_dir(), n) for n in (self._arena.name, *self._arena_maps) if n}

    @property
    def running(self) -> bool:
        return self.world is not None and self.world.alive()

    def runs(self, config) -> bool:
        """A live world that `config` would reuse as it is (its world key: size, devices, attention kernel)."""
        w = self.world
        return w is not None and w.world_key == config.world_key(self.split_kernel_worlds) and w.alive()

    def _device_kind(self, config) -> str:
        """"cpu" or "cuda" for `config`'s world; refuses (ValueError, with the fix) what this operating system
        cannot run - Windows, a torch without gloo or NCCL (platform_support) - before any process starts."""
        if self.fake:
            check_os()  # the fake workers use the same channel and transport
            return "cpu"
        kind = self.device
        if kind == "auto" or kind == "cuda":
            import torch
            has = torch.cuda.is_available()
            if kind == "cuda" and not has:
                check_os()  # Windows: its own message first
                raise PoolError("device='cuda' but torch sees no CUDA device; use device='cpu'")
            kind = "cuda" if has else "cpu"
        # a devices list places the ranks itself (World._devices): its kind decides the backend (World.backend)
        listed = any(str(d).startswith("cuda") for d in config.devices or ())
        check_pool("cuda" if listed else kind, world_size=config.world_size,
                   share_devices=self.share_devices and self.cluster is None)
        if kind == "cuda" and not config.devices and not self.share_devices:
            import torch
            config.check_world(self.gpus.get("count") or torch.cuda.device_count(), "GPU")
        return kind

    def ensure_world(self, config) -> World:
        """The running world for `config`'s mesh: reused if it matches, (re)started if not."""
        from ..parallel.config import ParallelConfig  # lazy: torch, as above
        if not isinstance(config, ParallelConfig):
            raise TypeError(f"config must be a ParallelConfig, got {type(config).__name__}")
        with self._lock:
            w = self.world
            if self.runs(config):
                w.config = config  # the mesh it runs now (messages); each rank builds its groups (jobs.py)
                return w
            if self.cluster is not None:
                self.cluster.check_world(config)
            if isinstance(self.balance, list) and len(self.balance) != config.world_size:
                raise ValueError(f"HP_BALANCE lists {len(self.balance)} rank speeds but {config.describe()} has "
                                 f"{config.world_size} ranks: list one speed per rank, or use auto / probe / off")
            kind = self._device_kind(config)
            self._teardown(graceful=True)
            self.generation += 1
            w = World(config, tmpdir=self._holder.tmpdir, generation=self.generation, shm_prefix=self.shm_prefix,
                      world_key=config.world_key(self.split_kernel_worlds), lone_threads=self.lone_worker_threads,
                      keep_files=lambda: set(self._written), forks=self._fork_server(),
                      fake=self.fake, device_kind=kind, max_models=self.max_models,
                      collective_timeout_s=self.collective_timeout_s, env=self.env, cluster=self.cluster,
                      share_devices=self.share_devices, balance=self.balance, gpus=self.gpus)
            w.start(self.start_timeout_s)
            self._holder.world = w
            return w

    @property
    def fork_server_pid(self) -> int | None:
        """The process the running world's workers were forked from, if they were (its memory is part of the pool's:
        the imports the workers share with it copy-on-write)."""
        w = self.world
        if w is None or w.forks is None or w.forks.gone() or not any(isinstance(p, forkserver.ForkedProcess)
                                                                      for p in w.procs):
            return None
        return w.forks.pid

    def _fork_server(self):
        """The fork server for a world of real workers on this machine: the one given, else the pool's own (the world
        starts it in its workers' environment: its imports replace the ranks' own); None for fake or
        torchrun-started workers, or where disabled."""
        if self.fake is not None or self.cluster is not None or not forkserver.enabled():
            return None
        if self.forks is not None:
            return self.forks
        if self._holder.forks is None:
            self._holder.forks = forkserver.ForkServer(self._holder.tmpdir)
        return self._holder.forks

    def _teardown(self, graceful: bool) -> None:
        self._arena.close()
        self._arena_maps.clear()
        if self._holder.world is not None:
            self._holder.world.teardown(graceful=graceful)
            self._holder.world = None

    def stop(self) -> None:
        """Stop the workers and remove every file the pool made; the pool can be used again after."""
        with self._lock:
            self._teardown(graceful=True)
            cleanup_prefix(self.shm_prefix)

    def close(self) -> None:
        """stop() for good: also remove the pool's temp dir."""
        with self._lock:
            self._finalizer()

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- jobs ----
    def cancel(self) -> None:
        """Ask the running job (if any) to stop at its next step; submit() then raises JobCancelled."""
        self._cancel.set()

    @staticmethod
    def _validate(kind: str, values: dict, tensors: dict) -> str:
        if kind not in JOB_KINDS:
            raise ValueError(f"unknown job kind {kind!r}; choose one of {', '.join(JOB_KINDS)}")
        try:
            json.dumps(values)
        except (TypeError, ValueError) as e:
            raise ValueError(f"job values must be JSON (numbers, strings, lists, dicts); pass tensors in "
                             f"`tensors`: {e}") from None
        import torch
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors[{name!r}] must be a torch.Tensor, got {type(t).__name__}")
        overlap = set(values) & set(tensors)
        if overlap:
            raise ValueError(f"names used both as values and tensors: {sorted(overlap)}")
        return kind

    def submit(self, config, kind: str, values: dict | None = None, tensors: dict | None = None, *,
               progress=None, timeout_s: float | None = None, cancel=None, preview=None,
               written: dict | None = None) -> JobResult:
        """Run one job on every rank and return rank 0's result.

        progress(step, total) is called on this thread for every step rank 0
        reports; if it raises (e.g. ComfyUI's interrupt), the job is cancelled
        and that exception propagates. `cancel` is any object with is_set().
        preview(step, total, tensor) receives the tensors a job attaches to its progress (loop mode's
        denoised latent, for ComfyUI's previews); the job is told to send them only when it is given.
        `written`: {name: descriptor} of tensors already in shared-memory files (weights written ahead); they
        travel with the job and are removed with its other files.
        """
        values, tensors = dict(values or {}), dict(tensors or {})
        self._validate(kind, values, tensors)
        if cancel is not None and cancel.is_set():
            # Already cancelled (ComfyUI's interrupt between two steps): no job at all. Sent, the job and the
            # cancel would race on every rank - the job could pass its stop point before the cancel is read,
            # run the whole step, and the next step race again (the probe's occasional 6-10 steps).
            raise JobCancelled(f"{kind} was cancelled before it started")
        if preview is not None:
            values["previews"] = True
        timeout_s = self.job_timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            world = self.ensure_world(config)
            if world.pending is not None and not self._drain(world):
                world = self.ensure_world(config)  # the old world was stuck: a fresh one
            self._cancel.clear()
            self._next_job += 1
            job_id = self._next_job
            descs = dict(written or {})
            try:
                for name, t in tensors.items():
                    if name.startswith(WEIGHT_PREFIX):  # mapped copy-on-write by every rank: a file of its own
                        descs[name] = write_tensor(t, self.shm_prefix)
                descs.update(self._arena.write({k: t for k, t in tensors.items() if k not in descs}))
                world.state = "busy"
                try:
                    world.broadcast("job", job=job_id, kind=kind, values=values, tensors=descs,
                                    config=config.to_dict(), timeout_s=timeout_s)
                except (OSError, ValueError):  # a worker died while idle
                    self._check_deaths(world, job_id, {})
                    self._teardown(graceful=False)
                    raise WorkerDied(f"a worker of {world.config.describe()} hung up before job {job_id}; "
                                     f"the world was stopped and restarts on the next job") from None
                return self._collect(world, job_id, config, timeout_s, progress, cancel, preview)
            finally:
                for d in descs.values():
                    unlink(d, self.shm_prefix)
                if world.state == "busy":
                    world.state = "idle"

    # ---- models ----
    def ensure_model(self, config, key: str, family: str, *, state_dict, native: NativeSpec | VaeSpec | None = None,
                     timeout_s: float | None = None, lineage: str | None = None, adopt=None,
                     patches: tuple | None = None) -> dict:
        """Make a model resident on every worker; a key already resident costs one small round trip.

        Weights come from `state_dict` (through shared memory); they travel only when the ranks' report says they
        must (workers/residency.py decides: touch, patch in place, rebuild from kept weights, build). `state_dict` may be a callable returning the dict, so a caller only
        converts weights when they must travel.
        `native`: the ComfyUI model spec (workers/messages.NativeSpec from workers/bridge/spec.native_spec, or a
        VaeSpec from workers/bridge/vae.native_vae_spec for a VAE family): the workers build ComfyUI's own class (or
        VAE) with ComfyUI's ops and these weights (its state dict as ComfyUI holds it); fake workers need none.
        `lineage`: what other keys of the same model (other patch versions) share; the workers drop those first.
        `adopt(name, mapped)`: called with each weight mapped back from the file just written (copy-on-write), so
        the caller can make its own tensor that mapping - one host copy for the caller and every local rank.
        `patches`: (spec, tensors) of ComfyUI's weight patches (workers/bridge/patches.py): the weights are then the
        model's base, and a resident version of the same lineage is patched in place - only the patches travel.
        Returns rank 0's {loaded, loads, resident}; `self.last_load_bytes` says how many bytes this call wrote.
        """
        if family not in model_families():
            raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(model_families())}")
        if not isinstance(key, str) or not key:
            raise ValueError("key must be a non-empty string identifying the weights and their patches")
        if state_dict is None:
            raise ValueError("give the weights: state_dict=... (a dict, or a callable returning it)")
        base = {"key": key, "family": family}
        if native is not None:
            base["native"] = typed_native(family, native, f"the load of {key!r}")  # before any weight is written
        if lineage is not None:
            base["lineage"] = lineage
        return self._load(config, base, state_dict=state_dict, timeout_s=timeout_s, lineage=lineage, adopt=adopt,
                          patches=patches)

    def _load(self, config, base: dict, *, state_dict, timeout_s, lineage, adopt, patches) -> dict:
        """Make `base["key"]` resident on every rank as workers/residency.py decides from the ranks' reports; the
        job's `base` values (key, family, native spec) travel with the decision. Weights are written before the pool
        is taken when the ranks' last report says they will travel (the copy overlaps Parallel Config's prestart),
        and only then; patches travel with a build or a patch decision. A "stale" or "short" answer is decided
        again from the ranks' own numbers. Returns rank 0's answer."""
        key = base["key"]
        request = dict(layout=config.layout_name(), lineage=lineage, patches=patches is not None,
                       whole_model=config.whole_model)
        self.last_load_bytes = 0
        written = {}

        def write() -> dict:
            sd = state_dict() if callable(state_dict) else state_dict
            self.last_load_bytes += nbytes(sd)
            # a dict made for this call (a callable's) is emptied as it is written: each tensor is let go at once
            return self._write_weights(sd if callable(state_dict) else dict(sd), adopt)

        def let_go(written: dict) -> None:
            for d in written.values():  # normally removed by the job that carried them; not if it never started
                unlink(d, self.shm_prefix)
            self._written.difference_update(d["name"] for d in written.values())

        if residency.decide(residency.ledger(self.world), key, **request).weights == "sent":
            written = write()
        try:
            with self._lock:
                for _ in range(residency.STALE_RETRIES + 1):
                    world = self.ensure_world(config)
                    decision = residency.load_decision(world, key, request=request, family=str(base.get("family", "")),
                                                       max_models=self.max_models)
                    spec, tensors = None, {}
                    if decision.action in ("build", "rebuild", "patch") and (patches is not None or decision.undo):
                        spec, tensors = patches if patches is not None else ({}, {})
                        tensors = dict(tensors)
                        self.last_load_bytes += nbytes(tensors)
                    values = LoadJob(**base, decision=decision.message(), patch_spec=spec).message()
                    if decision.weights == "sent" and not written:
                        written = write()
                    res = self.submit(config, "load_model", values, tensors, timeout_s=timeout_s,
                                      written=written if decision.weights == "sent" else None)
                    if res.values.get("short"):  # every rank answered with its numbers: decide the room again
                        let_go(written)
                        written = {}
                        continue
                    if not res.values.get("stale"):
                        self.last_load = dict(res.values)
                        return self.last_load
                why = res.values.get("stale") or res.values.get("short")
                raise RuntimeError(f"load_model {key!r}: the ranks answered {why!r} to a decision made from "
                                   f"their own report {residency.STALE_RETRIES + 1} times")
        finally:
            let_go(written)

    def _write_weights(self, sd: dict, adopt=None) -> dict:
        """The weights written for the next submit (transport.write_weights); their names are registered before each
        file exists, so a world restarting meanwhile keeps them."""
        return write_weights(sd, self.shm_prefix, self._written, adopt)

    def forward(self, config, key: str, inputs: dict, kwargs: dict | None = None, **submit_kw):
        """Step mode: the resident model `key` on the full `inputs` (tensors) and JSON `kwargs`; the output."""
        return self.submit(config, "forward", {"key": key, "kwargs": dict(kwargs or {})}, inputs,
                           **submit_kw).tensors["out"]

    def vae_decode(self, config, key: str, latent, block_size: int | None = None, **submit_kw):
        """Patch-parallel decode of `latent` by the resident VAE `key` over all ranks; the image."""
        return self.submit(config, "vae_decode", {"key": key, "block_size": block_size}, {"latent": latent},
                           **submit_kw).tensors["image"]

    def release_models(self, wait_s: float = 30.0) -> int:
        """Every rank drops its resident models and returns their memory (the processes stay, warm); 0 when no
        world runs or it is busy (a running job keeps its model).

        Waits up to `wait_s` for the pool's lock: the panel's health query (a job of its own, polled every
        second or so) holds it briefly, and an unload that gave up on it at once was lost. Callers exclude a
        node's job themselves (Runtime.release_models), so what holds the lock here is short."""
        w = self.world
        if w is None or not w.alive() or not self._lock.acquire(timeout=max(0.0, wait_s)):
            return 0
        try:
            w = self.world
            if w is None or not w.alive() or w.state != "idle":
                return 0
            res = self.submit(w.config, "release", timeout_s=60.0)
            w.slots, w.reports = [], []
            return int(res.values.get("released", 0))
        except PoolError:
            return 0
        finally:
            self._lock.release()

    # ---- health ----
    def health(self) -> list:
        """Per rank: pid, device, state, resident model keys, RSS bytes. Asks the workers when idle."""
        w = self.world
        if w is None:
            return []
        if self._lock.acquire(blocking=False):
            try:
                if w.alive() and w.state == "idle":
                    res = self.submit(w.config, "health", timeout_s=10.0)
                    return [{**v, "rank": r, "state": "idle"} for r, v in enumerate(res.per_rank)]
            except PoolError:
                pass
            finally:
                self._lock.release()
        return [{"rank": r, "pid": p.pid, "device": w.devices[r] if w.devices else None,
                 "state": w.state if p.poll() is None else f"exited({p.returncode})",
                 "resident": list(w.resident), "rss_bytes": _proc_rss(p.pid)} for r, p in enumerate(w.procs)]


def _proc_rss(pid: int):
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


__all__ = ["JobCancelled", "JobResult", "JobTimeout", "PoolError", "StartupError", "WorkerDied", "WorkerError",
           "WorkerOOM", "WorkerPool", "WorkerStalled"]
