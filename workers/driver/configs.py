"""The PARALLEL_CONFIG world, apart from the nodes that show it: the wire type, the rules that validate the widget
values and that place a world on this machine, and the node text.

Why here and not in nodes/: the mesh picture, the headless warm-up and HP_PRESTART (routes.py) build a config from
widget values exactly as the nodes do - same defaults, same refusals, same words - and the driver room imports no
node. Parallel Config and Parallel GPUs (nodes/config_node.py, nodes/simple_node.py) keep their widgets and call
`configure` / `configure_gpus`; both build the same HybridParallelConfig.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ...parallel import staged
from ...parallel.config import SHARD_CHOICES, ConfigError, ParallelConfig, normalize_devices
from ...parallel.mesh import rank_groups
from ..bridge.host import comfy_gpus
from ..platform_support import check_pool

SAMPLING_MODES = ["auto", "step", "loop"]
MAX_LISTED_RANKS = 256  # larger worlds are described by their degrees only (listing them costs seconds)
ATTENTION_CHOICES = ["auto", "cpu_flash", "cuda_flash", "cuda_efficient", "flash_attn", "math"]
DEGREE_CHOICES = ["manual", "auto"]


@dataclass(frozen=True)
class HybridParallelConfig:
    """What flows along a PARALLEL_CONFIG wire: the engine config plus where and how to run it."""
    config: ParallelConfig
    device: str = "auto"          # "auto" | "cpu" | "cuda"
    attention: str = "auto"
    mode: str = "auto"            # "auto" (loop for PipeFusion, else step) | "step" | "loop"
    cluster: object = None        # a NodeCluster (cluster_node.py): the world spans machines
    step_cache: float = 0.0       # EasyCache's threshold for the workers' loop (loop mode, PipeFusion); 0 = off
    # degrees "auto": how many devices Hybrid Sampler may use (0 = off: the config's degrees are the user's), and
    # the listed devices it places the chosen ranks on (empty: the first world_size); workers/driver/auto.py resolves it
    auto_devices: int = 0
    device_list: tuple = ()

    def __post_init__(self) -> None:
        if isinstance(self.auto_devices, bool) or not isinstance(self.auto_devices, int) or self.auto_devices < 0:
            raise ConfigError(f"auto_devices must be an integer >= 0 (0 = degrees set by hand), got {self.auto_devices!r}")
        if not self.auto_devices:
            if self.device_list:
                raise ConfigError("device_list is for degrees 'auto' only; list the devices in the ParallelConfig")
            return
        c = self.config
        if c.world_size > 1:
            raise ConfigError(f"degrees 'auto' picks the dp, cfg, ulysses and ring degrees itself, but this config sets "
                              f"{c.describe()}: set every degree to 1, or set degrees to 'manual'")
        if c.method != "usp" or c.shard_weights != "none":
            raise ConfigError("degrees 'auto' chooses among ulysses / ring / cfg / dp with method 'usp' and no weight "
                              "sharding: set method to 'usp' and shard_weights to 'none', or set degrees to 'manual'")
        if self.cluster is not None:
            raise ConfigError("degrees 'auto' places ranks on this machine only; with a cluster the world is fixed by "
                              "its machines: set degrees to 'manual' and give the degrees")
        if self.device_list and len(self.device_list) != self.auto_devices:
            raise ConfigError(f"auto_devices is {self.auto_devices} but {len(self.device_list)} devices are listed")

    def describe(self) -> str:
        mode = "loop" if self.config.pp_degree > 1 or self.mode == "loop" else "step"
        where = f" over {self.cluster.cluster.nnodes} machines" if self.cluster is not None else ""
        cache = f", step cache {self.step_cache:g}" if self.step_cache else ""
        if self.auto_devices:
            return (f"auto degrees (up to {self.auto_devices} {self.device} worker(s), chosen at the sampler from "
                    f"the model, latent and cfg), {mode} mode{cache}")
        return (f"{self.config.describe()} on {self.config.world_size} {self.device} worker(s){where}, {mode} mode"
                f"{cache}")


def max_cpu_workers() -> int:
    """The largest CPU world Parallel Config accepts: HP_MAX_CPU_WORKERS, else twice the cores (more CPU
    processes than that only oversubscribe the machine; a typo such as 64 x 64 would start thousands)."""
    value = os.environ.get("HP_MAX_CPU_WORKERS", "").strip()
    if value:
        try:
            return max(1, int(value))
        except ValueError:
            raise ValueError(f"HP_MAX_CPU_WORKERS must be an integer, got {value!r}") from None
    return 2 * (os.cpu_count() or 1)


def check_placement(config: ParallelConfig, device: str, cluster=None) -> None:
    """Refuse a world this machine cannot place - before any worker starts and without touching a running pool:
    a CUDA device that does not exist, more GPU ranks than GPUs, a CPU world beyond max_cpu_workers(). In a
    cluster this machine holds one launch group (nproc_per_node ranks); the others are checked by their torchrun."""
    _check_devices(config, device, cluster)  # the devices first: "no CUDA device here" is the more precise message
    try:  # Windows (no pool), macOS (CPU ranks only), a torch without NCCL / gloo: said with the fix, here
        check_pool(device if device in ("auto", "cpu", "cuda") else "auto", world_size=config.world_size,
                   share_devices=staged.enabled())
    except ValueError as e:
        raise ValueError(f"Parallel Config: {e}") from None


def check_hp_placement(hp: HybridParallelConfig) -> None:
    """check_placement for a PARALLEL_CONFIG: its world, and for degrees "auto" the devices listed for it (the
    world is chosen later, at the sampler, but a device that does not exist is refused now)."""
    check_placement(hp.config, hp.device, hp.cluster)
    if hp.device_list:
        check_placement(ParallelConfig(dp_degree=len(hp.device_list), devices=hp.device_list), hp.device)


def _check_devices(config: ParallelConfig, device: str, cluster=None) -> None:
    n = config.world_size
    gpus = comfy_gpus().get("count", 0)  # every GPU, also those ComfyUI's --cuda-device hid from itself
    if cluster is not None:
        if config.devices:
            raise ValueError("Parallel Config: a devices list cannot be combined with a cluster (each machine's "
                             "torchrun places its own workers, one per GPU); leave devices empty")
        n = cluster.cluster.nproc_per_node
    if config.devices:
        for d in config.devices:
            kind, _, index = d.partition(":")
            if kind == "cuda" and (gpus == 0 or (index and (not index.isdigit() or int(index) >= gpus))):
                raise ValueError(f"Parallel Config: device {d!r} does not exist here ({gpus} CUDA device(s) visible "
                                 f"to torch); use {', '.join(f'cuda:{i}' for i in range(gpus)) or 'cpu'}")
            if kind not in ("cuda", "cpu"):
                raise ValueError(f"Parallel Config: device {d!r} is neither cpu nor cuda:<index>")
        return
    if device == "cuda" and gpus == 0:
        raise ValueError("Parallel Config: device is 'cuda' but torch sees no CUDA device on this machine; "
                         "use device 'cpu' or 'auto'")
    if device in ("cuda", "auto") and gpus:
        if n > gpus and not staged.enabled():  # HP_SHARE_DEVICES: ranks share GPUs (the GPU suite, tests)
            raise ValueError(f"Parallel Config: {config.describe()} needs {n} GPUs but {gpus} are visible; "
                             f"lower the degrees so their product is at most {gpus}")
        return
    limit = max_cpu_workers()
    if n > limit:
        raise ValueError(f"Parallel Config: {config.describe()} is {n} CPU worker processes, more than this "
                         f"machine's limit of {limit} ({os.cpu_count()} cores x 2); lower the degrees, or set "
                         f"HP_MAX_CPU_WORKERS to raise the limit")


def auto_device_count(device: str) -> int:
    """The devices degrees 'auto' may use on this machine: the visible GPUs (device cuda / auto with CUDA), else the
    CPU cores - more CPU ranks than cores only share them (workers/launch.worker_threads)."""
    gpus = comfy_gpus().get("count", 0)  # every GPU, also those ComfyUI's --cuda-device hid from itself
    if device == "cuda" or (device == "auto" and gpus):
        return max(1, gpus)
    return max(1, min(os.cpu_count() or 1, max_cpu_workers()))


def configure(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
              warmup_steps=1, tp_degree=1, method="usp", device="auto", attention="auto", devices="",
              sampling_mode="auto", cluster=None, shard_weights="none", step_cache=0.0,
              degrees="manual") -> HybridParallelConfig:
    """Parallel Config's result for these widget values (ValueError naming the fix); places nothing. The defaults
    are the node's widget defaults (a test keeps them equal): the routes fill a missing widget from them."""
    if degrees not in DEGREE_CHOICES:
        raise ValueError(f"Parallel Config: degrees must be one of {DEGREE_CHOICES}, got {degrees!r}")
    auto = degrees == "auto"
    try:
        listed = normalize_devices(d for d in devices.split(",") if d.strip())
        config = ParallelConfig(
            dp_degree=dp_degree, cfg_degree=cfg_degree, ulysses_degree=ulysses_degree, ring_degree=ring_degree,
            pp_degree=pp_degree, num_pipeline_patch=num_pipeline_patch or None, tp_degree=tp_degree,
            warmup_steps=warmup_steps, method=method, shard_weights=shard_weights, devices=() if auto else listed)
        auto_fields = dict(auto_devices=len(listed) or auto_device_count(device), device_list=listed) if auto else {}
        HybridParallelConfig(config, cluster=cluster, **auto_fields)  # auto's refusals, before anything else
    except ConfigError as e:
        raise ValueError(f"Parallel Config: {e}") from None
    if sampling_mode == "step" and pp_degree > 1:
        raise ValueError(f"Parallel Config: PipeFusion (pp_degree={pp_degree}) runs the denoising loop in the "
                         "workers; set sampling_mode to auto or loop, or pp_degree to 1")
    if sampling_mode not in SAMPLING_MODES:
        raise ValueError(f"Parallel Config: sampling_mode must be one of {SAMPLING_MODES}, got {sampling_mode!r}")
    if cluster is not None:
        try:
            cluster.cluster.check_world(config)
        except ValueError as e:
            raise ValueError(f"Parallel Config: {e}") from None
    step_cache = float(step_cache or 0.0)
    if not 0.0 <= step_cache <= 3.0:
        raise ValueError(f"Parallel Config: step_cache is EasyCache's threshold, 0 (off) to 3; got {step_cache}")
    if step_cache and pp_degree == 1 and sampling_mode != "loop":
        raise ValueError("Parallel Config: step_cache applies where the denoising loop runs in the workers; set "
                         "sampling_mode to loop (or use PipeFusion), or set step_cache to 0 and put ComfyUI's "
                         "EasyCache node on the MODEL (step mode runs it)")
    return HybridParallelConfig(config, device=device, attention=attention, mode=sampling_mode, cluster=cluster,
                                step_cache=step_cache, **auto_fields)


# preset -> (what it sets, given n devices); "auto" is Parallel Config's degrees "auto"
PRESETS = ("auto", "split the image", "cfg + split the image", "large model (shard weights)")
PRESET_HELP = {
    "auto": "the cost model picks data / CFG / Ulysses / Ring degrees from the model, the image size and the cfg, "
            "and stays on one device unless more are predicted >= 10 % faster",
    "split the image": "every device takes a share of the image tokens (Ulysses): exact, the usual choice for "
                       "Flux, Qwen-Image, Wan, HunyuanVideo",
    "cfg + split the image": "half the devices run the positive prompt, half the negative (cfg > 1: SD3.5, "
                             "Qwen-Image, Wan with cfg), each half splitting the image; needs an even device count",
    "large model (shard weights)": "split the image and keep 1/N of the weights on each device, gathering a block "
                                   "ahead of use: for models larger than one GPU (Wan 2.2 14B on 24 GB cards)",
}


def preset_degrees(preset: str, n: int) -> dict:
    """Parallel Config widget values for `preset` on `n` devices (ValueError naming the fix)."""
    if preset == "auto":
        return {"degrees": "auto"}
    if preset == "split the image":
        return {"ulysses_degree": n}
    if preset == "cfg + split the image":
        if n % 2:
            raise ValueError(f"Parallel GPUs: 'cfg + split the image' needs an even number of devices, got {n}; "
                             f"list one more or one fewer, or use 'split the image'")
        return {"cfg_degree": 2, "ulysses_degree": n // 2}
    if preset == "large model (shard weights)":
        return {"ulysses_degree": n, "shard_weights": "sequence"}
    raise ValueError(f"Parallel GPUs: preset must be one of {', '.join(PRESETS)}; got {preset!r}")


def parse_devices(devices: str) -> tuple[int, tuple]:
    """(device count, explicit device list) of the `devices` widget: "all" (every visible GPU, else the CPU
    cores), a count ("4": the first four), or a list ("cuda:0,cuda:2")."""
    text = (devices or "").strip().lower()
    if text in ("", "all"):
        return auto_device_count("auto"), ()
    if text.isdigit():
        n = int(text)
        available = auto_device_count("auto")
        if not 1 <= n <= available:
            raise ValueError(f"Parallel GPUs: {n} device(s) asked, {available} available here; give a number from 1 "
                             f"to {available}, 'all', or a list such as cuda:0,cuda:1")
        return n, ()
    try:
        listed = normalize_devices(d for d in text.split(",") if d.strip())
    except ValueError as e:
        raise ValueError(f"Parallel GPUs: {e}") from None
    return len(listed), tuple(listed)


@contextmanager
def as_gpus_node():
    """Parallel Config's own refusals, said in Parallel GPUs' name (the node the user sees)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(str(e).replace("Parallel Config:", "Parallel GPUs:", 1)) from None


def configure_gpus(devices: str = "all", preset: str = "auto"):
    """The validated PARALLEL_CONFIG of these two widgets, built by Parallel Config's own rules."""
    n, listed = parse_devices(devices)
    degrees = preset_degrees(preset, n)
    with as_gpus_node():
        hp = configure(devices=",".join(listed), **degrees)  # every other widget at Parallel Config's default
    if hp.auto_devices and not listed and hp.auto_devices != n:
        hp = replace(hp, auto_devices=n)  # "4": auto chooses among the first four devices
    return hp


def summary(hp: HybridParallelConfig) -> list:
    """The node's text: the config and its communication groups (for worlds small enough to list)."""
    text = [hp.describe()]
    if hp.auto_devices:
        return text + [f"auto: {len(hp.device_list) or hp.auto_devices} device(s) "
                       f"{', '.join(hp.device_list)}".rstrip()]
    if hp.config.world_size <= MAX_LISTED_RANKS:
        groups = {k: v for k, v in rank_groups(hp.config).items() if len(v[0]) > 1}
        text += [f"{k}: {v}" for k, v in groups.items()]
    if hp.cluster is not None:
        text += hp.cluster.describe()[2:]  # the join commands, where the user looks
    return text
