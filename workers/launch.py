"""Starting and tearing down one world of worker processes (driver side).

Workers are forks of the pack's fork server (forkserver.py: torch already
imported), else plain subprocesses running a module of the pack (multiprocessing
spawn would re-run ComfyUI's main.py in every child). The pack may live in
custom_nodes/<any folder name>/ without being installed, so a two-line
bootstrap (BOOTSTRAP) registers the pack root as `comfyui_hybrid_parallel` and
runs the worker module with runpy: the child imports exactly the code the
driver runs, and skips the pack's __init__ (ComfyUI node registrations).

The control channel is a unix socket in that 0700 temp dir (0600 itself) plus
the stdlib HMAC challenge with a random 32-byte key handed to each child on
stdin. Each accepted connection is authenticated in its own thread with a
deadline, so a peer that connects and stays silent can neither stall startup
nor get a message unpickled (messages are JSON; see protocol.py). The listener
is closed as soon as every rank has connected.
"""
from __future__ import annotations

import logging
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import wait as wait_conns

from .bootstrap import BOOTSTRAP, PACKAGE, pack_root
from .cluster import PeerHandle, bind_control
from .forkserver import ForkServerError
from .protocol import Channel, ProtocolError, authenticate_server, encode, new_authkey
from .transport import cleanup_prefix

STOP_GRACE_S = 3.0


class PoolError(RuntimeError):
    """Base class of everything the pool raises about its workers."""


class StartupError(PoolError):
    """The world could not be started; the message carries the failing rank's reason."""


REAP_INTERVAL_S = 0.5
UNIX_PATH_MAX = 100  # bytes of a unix socket path, under macOS's 104 (sun_path) and Linux's 108


GLOO_COLLECTIVE_TIMEOUT_S = 120.0
NCCL_COLLECTIVE_TIMEOUT_S = 1800.0


def collective_timeout(backend: str, requested: float | None = None) -> float:
    """The process-group timeout of a world: `requested` (the pool's collective_timeout_s, or HP_COLLECTIVE_TIMEOUT_S),
    else per backend. NCCL's watchdog counts from the moment a collective is *enqueued*, and the host queues a
    whole forward's kernels ahead of the GPU: on a slow GPU a long video forward can keep a collective queued for
    minutes without anything being wrong, so NCCL worlds get 30 minutes. That is only the backstop: a rank that
    raised fails the job at once, and a rank whose heartbeat stops is named within the pool's stall timeout."""
    if requested is None:
        value = os.environ.get("HP_COLLECTIVE_TIMEOUT_S", "").strip()
        if value:
            try:
                requested = float(value)
            except ValueError:
                raise ValueError(f"HP_COLLECTIVE_TIMEOUT_S must be a number of seconds, got {value!r}") from None
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"the collective timeout must be > 0 s, got {requested}")
        return float(requested)
    return NCCL_COLLECTIVE_TIMEOUT_S if backend == "nccl" else GLOO_COLLECTIVE_TIMEOUT_S


def gpu_order(world_size: int, gpus: int, driver_gpu: int | None) -> list:
    """The GPUs a world's ranks take, in rank order: ComfyUI's own GPU (`driver_gpu`, where it keeps the text
    encoders and the VAE) last, so a world smaller than the machine leaves it to ComfyUI."""
    order = [i for i in range(gpus) if i != driver_gpu] + ([driver_gpu] if driver_gpu is not None and
                                                           driver_gpu < gpus else [])
    return [f"cuda:{order[r % len(order)]}" for r in range(world_size)] if order else \
        [f"cuda:{r}" for r in range(world_size)]


def worker_env(env: dict, comfy_cuda_device: int | None = None) -> dict:
    """A CUDA worker's environment from ComfyUI's: what ComfyUI set for itself is undone.
    - `--cuda-device N` makes ComfyUI set CUDA_VISIBLE_DEVICES=N for its process tree: the workers would see that
      one GPU only. Dropped when it is exactly ComfyUI's own setting, so the ranks see (and number) every GPU.
    - ComfyUI turns on torch's cudaMallocAsync backend by default; the workers use torch's caching allocator, whose
      memory NCCL and the pool's accounting (empty_cache, mem_get_info after it) are made for."""
    env = dict(env)
    if comfy_cuda_device is not None and env.get("CUDA_VISIBLE_DEVICES", "").strip() == str(comfy_cuda_device):
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.pop("HIP_VISIBLE_DEVICES", None)
    conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if conf is not None:
        kept = [p for p in conf.split(",") if p.strip() and p.strip().replace(" ", "") != "backend:cudaMallocAsync"]
        if kept:
            env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
        else:
            env.pop("PYTORCH_CUDA_ALLOC_CONF")
    return env


def local_env(device_kind: str, comfy_cuda_device: int | None = None) -> dict:
    """This process's environment as the workers of a world on this machine get it (before their thread count and
    the pool's own variables): a CUDA world's with ComfyUI's settings for itself undone (worker_env). The fork
    server starts in it too, so what torch reads when imported is what the workers would have read."""
    env = dict(os.environ)
    return worker_env(env, comfy_cuda_device) if device_kind == "cuda" else env


def balance_spec(value):
    """HP_BALANCE / WorkerPool(balance=): "auto" (probe the ranks' speeds on GPU worlds), "probe" (on any world),
    "off" (even split), or one relative speed per rank ("1,0.5"); the workers split the sequence accordingly."""
    if isinstance(value, (list, tuple)):
        speeds = [float(v) for v in value]
    else:
        text = str(value).strip().lower()
        if text in ("auto", "probe", "off"):
            return text
        try:
            speeds = [float(v) for v in text.split(",") if v.strip()]
        except ValueError:
            speeds = []
        if not speeds:
            raise ValueError(f"HP_BALANCE must be auto, probe, off or one speed per rank (e.g. 1,0.5), got {value!r}")
    if min(speeds) <= 0:
        raise ValueError(f"rank speeds must be positive, got {speeds}")
    return speeds


def worker_threads(per_machine: int, lone: int | None = None) -> int:
    """Intra-op threads per worker: the cores shared out over this machine's workers - except a lone worker,
    which takes the driver's own count (`lone`: that count as the driver's runtime recorded it, since the driver
    drops to one thread while a pool run is in flight; else the current one). CPU kernels (GEMM splits) round
    differently with another thread count, so only then is degree 1 bitwise equal to KSampler in ComfyUI's process
    (a batch-1 forward on 1 vs 2 threads differed by 1e-6 here)."""
    if per_machine == 1:
        import torch
        return max(1, int(lone) if lone else torch.get_num_threads())
    return max(1, (os.cpu_count() or 1) // per_machine)


class World:
    """N worker processes, their authenticated channels, and how to stop them."""

    def __init__(self, config, *, tmpdir: str, generation: int, shm_prefix: str, fake: str | None,
                 device_kind: str, max_models: int, collective_timeout_s: float | None = None,
                 env: dict | None = None,
                 cluster=None, world_key: tuple | None = None, lone_threads: int | None = None,
                 keep_files=None, forks=None, share_devices: bool = False, balance="auto", gpus: dict | None = None):
        self.config = config  # the config of the latest job (the pool updates it when a job reuses the world)
        self.world_key = config.world_key() if world_key is None else world_key
        self.lone_threads = lone_threads
        self.keep_files = keep_files or (lambda: ())  # the pool's files written for its next job (kept at teardown)
        self.forks = forks  # forkserver.ForkServer: forks this world's workers where it serves their environment
        self.world_size = config.world_size
        self.tmpdir, self.generation, self.shm_prefix = tmpdir, generation, shm_prefix
        self.fake, self.device_kind, self.max_models = fake, device_kind, max_models
        self.collective_timeout_s = collective_timeout_s
        self.share_devices = share_devices and cluster is None and fake is None  # parallel/staged.py
        self.balance = balance  # balance_spec: how the ranks learn each other's speed
        # the machine's GPUs as ComfyUI's process sees them (workers/bridge/host.comfy_gpus): {count, driver, comfy_cuda_device}
        self.gpus = dict(gpus or {})
        self.extra_env = dict(env or {})
        self.procs: list = []
        self.channels: list = []
        self.devices: list = []
        self.address = os.path.join(tmpdir, f"ctl-{generation}.sock")
        self.state = "starting"
        self.pending = None  # a job answered as cancelled whose ranks have not all finished (pool._drain)
        self.seen: dict = {}  # rank -> monotonic time of its last message during the latest job
        self.slots: list = []  # what rank 0 holds, slot by slot (workers/residency.Slot)
        self.reports: list = []  # every rank's latest Report (workers/residency.py): loads and room are decided on them
        self.needs: dict = {}  # key -> {rank: device bytes it needed there} (from "short" answers)
        self.cluster = cluster  # a Cluster (cluster.py): workers started by torchrun, maybe on other machines
        self.agent = None       # then: the torchrun agent of this machine's launch group

    @property
    def resident(self) -> list:
        """The keys rank 0 holds (its latest report), each once whatever layouts it was built for."""
        return list(dict.fromkeys(s.key for s in self.slots))

    # ---- start ----
    def _devices(self) -> list:
        if self.cluster is not None:
            return ["local"] * self.world_size  # each worker takes its LOCAL_RANK's device
        if self.fake:
            return ["fake"] * self.world_size
        if self.config.devices:
            return list(self.config.devices)
        if self.device_kind == "cuda":
            import torch
            count = self.gpus.get("count") or torch.cuda.device_count()
            # ComfyUI's GPU last; sharing (staged gloo, never NCCL): round robin over them
            return gpu_order(self.world_size, max(1, count), self.gpus.get("driver"))
        return ["cpu"] * self.world_size

    def _command(self, rank: int, parent_pid: int | None = None) -> list:
        """`python -c BOOTSTRAP <pack root> <module> args`: a plain subprocess, never multiprocessing spawn.
        `parent_pid`: the process whose exit tells the worker the driver is gone (the fork server, for its forks)."""
        common = ["--rank", str(rank), "--world-size", str(self.world_size), "--address", self.address,
                  "--driver-pid", str(parent_pid or os.getpid())]
        module = f"{PACKAGE}.workers.{'fake_worker' if self.fake else 'worker_main'}"
        extra = ["--behaviour", self.fake] if self.fake else []
        return [sys.executable, "-c", BOOTSTRAP, str(pack_root()), module, *common, *extra]

    def _env(self, threads: int) -> dict:
        env = local_env(self.device_kind, self.gpus.get("comfy_cuda_device")) if self.cluster is None \
            else dict(os.environ)
        env["OMP_NUM_THREADS"] = str(threads)
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float) -> None:
        self.devices = self._devices()
        per_machine = self.cluster.nproc_per_node if self.cluster is not None else self.world_size
        threads = worker_threads(per_machine, self.lone_threads)
        authkey = self.cluster.authkey() if self.cluster is not None else new_authkey()
        listener = self._listen()
        try:
            self._spawn(threads, authkey, timeout_s)
            self.channels = self._accept(listener, authkey, time.monotonic() + timeout_s)
        except BaseException:
            self.teardown(graceful=False)
            raise
        finally:
            unix = listener.family == getattr(socket, "AF_UNIX", None)
            listener.close()
            if unix:
                try:
                    os.unlink(self.address)
                except FileNotFoundError:
                    pass
        try:
            self._init(threads, time.monotonic() + timeout_s)
        except BaseException:
            self.teardown(graceful=False)
            raise
        self.state = "idle"
        if self.cluster is None:
            threading.Thread(target=self._reap, name="hybrid-parallel-reaper", daemon=True).start()

    def _reap(self) -> None:
        """Collect a worker that exits while the world is idle at once, so it never lingers as a zombie
        until the next job looks (Popen.poll waits for it); ends with the world."""
        while self.state != "dead":
            for p in list(self.procs):  # local Popen handles only: a cluster world has no reaper
                if p is not None:
                    p.poll()
            time.sleep(REAP_INTERVAL_S)

    def _listen(self) -> socket.socket:
        """The control listener: a 0600 unix socket; loopback TCP without unix sockets or where the socket's path is
        too long for one; the cluster's TCP address. The HMAC challenge gates every peer on all of them. (Windows
        never gets here: platform_support refuses it before a world starts.)"""
        if self.cluster is not None:
            listener = bind_control(self.cluster)
            host = self.cluster.control.rpartition(":")[0]
            host = self.cluster.master_addr if host in ("0.0.0.0", "") else host
            self.address = f"{host}:{listener.getsockname()[1]}"
            return listener
        # a path longer than sun_path holds (104 bytes on macOS, 108 on Linux; a long TMPDIR) cannot be bound
        unix = hasattr(socket, "AF_UNIX") and len(os.fsencode(self.address)) <= UNIX_PATH_MAX
        listener = socket.socket(socket.AF_UNIX if unix else socket.AF_INET, socket.SOCK_STREAM)
        try:
            if unix:
                listener.bind(self.address)
                os.chmod(self.address, 0o600)
            else:
                listener.bind(("127.0.0.1", 0))
                self.address = f"127.0.0.1:{listener.getsockname()[1]}"
            listener.listen(128)
        except BaseException:
            listener.close()
            raise
        return listener

    def _spawn(self, threads: int, authkey: bytes, timeout_s: float) -> None:
        env = self._env(threads)
        if self.cluster is not None:  # launch group 0 by torchrun; the others join with Cluster.join_command
            self.procs = [None] * self.world_size
            self.agent = subprocess.Popen(self.cluster.join_command(0, control=self.address), env=env,
                                          stdin=subprocess.DEVNULL, close_fds=True, cwd=self.tmpdir)
            return
        forks = self.forks if not self.fake else None
        if forks is not None:
            forks.start(env)  # (running already, in the head start's environment: nothing)
            forks = forks if forks.serves(env) else None
        for rank in range(self.world_size):
            if forks is not None:  # torch already imported: a fork with this rank's argv, environment and key
                try:
                    self.procs.append(forks.spawn(self._command(rank, forks.pid)[5:], env, authkey, self.tmpdir,
                                                  timeout_s=timeout_s))
                    continue
                except ForkServerError as e:
                    logging.getLogger(__name__).warning("hybrid parallel: %s; starting fresh interpreters", e)
                    forks = None
            # cwd = the private dir: `python -m` puts the cwd first on sys.path, and ComfyUI's cwd
            # holds modules (nodes.py, ...) that must not shadow anything in the worker.
            p = subprocess.Popen(self._command(rank), stdin=subprocess.PIPE, env=env, close_fds=True,
                                 cwd=self.tmpdir)
            self.procs.append(p)
            p.stdin.write(authkey.hex().encode() + b"\n")
            p.stdin.close()

    def _check_procs(self, phase: str) -> None:
        if self.agent is not None and self.agent.poll() is not None:
            raise StartupError(f"this machine's launch group (torchrun) exited with code {self.agent.returncode} "
                               f"while {phase} (its output is on the driver's stderr)")
        for rank, p in enumerate(self.procs):
            if p is not None and p.poll() is not None:
                raise StartupError(f"worker rank {rank} exited with code {p.returncode} while {phase} "
                                   f"(its traceback is on the driver's stderr)")

    def _accept(self, listener: socket.socket, authkey: bytes, deadline: float) -> list:
        shaken: queue.Queue = queue.Queue()
        channels = self.channels = [None] * self.world_size
        pending = 0
        while any(c is None for c in channels):
            self._check_procs("connecting")
            if time.monotonic() > deadline:
                missing = [r for r, c in enumerate(channels) if c is None]
                hint = ""
                if self.cluster is not None:
                    hint = "; start the other launch groups with:\n" + "\n".join(
                        " ".join(self.cluster.join_command(n, control=self.address))
                        for n in range(1, self.cluster.nnodes))
                raise StartupError(f"workers did not connect in time (missing ranks: {missing}){hint}")
            for _ in range(64):  # drain the backlog (peers may crowd it), but keep checking the deadline
                if not select.select([listener], [], [], 0.02)[0]:
                    break
                sock, _ = listener.accept()
                pending += 1
                threading.Thread(target=lambda s=sock: shaken.put(authenticate_server(s, authkey)),
                                 daemon=True, name="pool-handshake").start()
            while pending:
                try:
                    conn = shaken.get_nowait()
                except queue.Empty:
                    break
                pending -= 1
                if conn is None:
                    continue  # refused: wrong key or not our protocol; nothing of it was unpickled
                ch = Channel(conn)
                try:
                    hello = ch.recv(expect={"hello"}, timeout=5.0)
                    rank, pid = int(hello["rank"]), int(hello["pid"])
                except ProtocolError as e:
                    # It knows our key, so it is one of our workers running other code (the pack was
                    # updated on disk while this process kept the old one): say so instead of timing out.
                    ch.close()
                    raise StartupError(f"a worker speaks another protocol: {e}") from None
                except (TimeoutError, EOFError, OSError, KeyError, ValueError):
                    ch.close()
                    continue
                if not (0 <= rank < self.world_size) or channels[rank] is not None or (
                        self.cluster is None and pid != self.procs[rank].pid):
                    ch.close()  # authenticated but not the process we started for that rank
                    continue
                if self.cluster is not None:
                    self.procs[rank] = PeerHandle(pid, local=hello.get("host") == socket.gethostname())
                channels[rank] = ch
        return channels

    def backend(self) -> str:
        """NCCL between GPUs, gloo between CPU processes (a devices list never mixes them: config.normalize_devices);
        gloo with staged copies where ranks share GPUs."""
        if self.share_devices:
            return "gloo"
        cuda = any(d.startswith("cuda") for d in self.devices) or (self.cluster is not None and self.device_kind == "cuda")
        return "nccl" if cuda else "gloo"

    def _init(self, threads: int, deadline: float) -> None:
        backend = self.backend()
        store = os.path.join(self.tmpdir, f"store-{self.generation}")
        init_method = "env://" if self.cluster is not None else f"file://{store}"  # torchrun's MASTER_ADDR/PORT
        timeout_s = collective_timeout(backend, self.collective_timeout_s)
        for rank, ch in enumerate(self.channels):
            ch.send("init", config=self.config.to_dict(), backend=backend, init_method=init_method,
                    device=self.devices[rank], threads=threads, timeout_s=timeout_s,
                    shm_prefix=self.shm_prefix, max_models=self.max_models,
                    broadcast_tensors=self.cluster is not None,
                    # staged: device tensors through host copies; on CPU every tensor, so the copies are exercised
                    staged=("device" if self.device_kind == "cuda" else "all") if self.share_devices else None,
                    balance=self.balance if isinstance(self.balance, str) else "given",
                    speeds=self.balance if isinstance(self.balance, list) else None)
        ready = set()
        while len(ready) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartupError(f"ranks {sorted(set(range(self.world_size)) - ready)} did not join the "
                                   f"{self.config.describe()} world in time")
            for conn in wait_conns([c.conn for r, c in enumerate(self.channels) if r not in ready],
                                   timeout=min(remaining, 0.5)):
                rank = next(r for r, c in enumerate(self.channels) if c.conn is conn)
                try:
                    msg = self.channels[rank].recv(expect={"ready"})
                except (EOFError, OSError):
                    self._check_procs("joining the world")
                    raise StartupError(f"worker rank {rank} hung up while joining the world") from None
                if not msg.get("ok"):
                    raise StartupError(f"worker rank {rank} could not join the {self.config.describe()} "
                                       f"world:\n{msg.get('error')}")
                ready.add(rank)
            self._check_procs("joining the world")

    # ---- state ----
    def alive(self) -> bool:
        if self.agent is not None and self.agent.poll() is not None:
            return False
        return (bool(self.procs) and all(p is not None and p.poll() is None for p in self.procs)
                and self.state not in ("stopping", "dead"))

    def broadcast(self, t: str, **fields) -> None:
        """The same message to every rank, encoded once (a step's job carries the call's JSON structure)."""
        data = encode(t, **fields)
        for ch in self.channels:
            ch.send_encoded(data)

    # ---- stop ----
    def teardown(self, graceful: bool = True) -> None:
        """Stop every worker (politely first if `graceful`), then kill what is left; never raises. While it
        runs the world is "stopping" (the panel says so instead of "failed"), then "dead"."""
        self.state = "stopping"
        if graceful:
            for ch in self.channels:
                try:
                    if ch is not None:
                        ch.send("stop")
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + STOP_GRACE_S
            for p in [*self.procs, self.agent]:
                try:
                    if p is not None:
                        p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        if self.agent is not None and self.agent.poll() is None:
            self.agent.terminate()  # torchrun passes it on to its workers
            try:
                self.agent.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for p in [*self.procs, self.agent]:
            if p is not None and p.poll() is None:
                p.kill()
        for p in [*self.procs, self.agent]:
            try:
                if p is not None:
                    p.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        for ch in self.channels:
            if ch is not None:
                ch.close()
        self.channels = []
        self.state = "dead"
        cleanup_prefix(self.shm_prefix, keep=self.keep_files)  # asked after the listing (transport.cleanup_prefix)
        try:
            os.unlink(os.path.join(self.tmpdir, f"store-{self.generation}"))
        except FileNotFoundError:
            pass
