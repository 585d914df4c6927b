"""Parallel Config node: degrees and devices -> PARALLEL_CONFIG, validated at once."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..parallel import staged
from ..parallel.config import SHARD_CHOICES, ConfigError, ParallelConfig, normalize_devices
from ..parallel.mesh import rank_groups
from ..workers.bridge.host import comfy_gpus
from ..workers.platform_support import check_pool

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


# Tooltips say when to use a setting, not only what it is.
DEGREE_TIPS = {
    "dp_degree": "Data parallel: the latent batch is split over this many replicas. Use it for batches of several "
                 "images / videos (batch >= degree); 1 otherwise.",
    "cfg_degree": "2 = the positive and negative prompts run on different devices. Use it when cfg > 1 (SD3.5, Qwen-"
                  "Image, Wan with cfg); with cfg 1 (Flux dev, distilled models) it only repeats work: keep 1.",
    "ulysses_degree": "Ulysses sequence parallel: the image tokens are split and attention heads exchanged. The usual "
                      "choice for one large image or video on GPUs with NVLink; heads need not divide.",
    "ring_degree": "Ring attention: the image tokens are split and K/V blocks passed around. Sends less than Ulysses per"
                   " step: prefer it over PCIe, or combine (ulysses x ring) for 8 GPUs.",
    "pp_degree": "PipeFusion: layers split across devices, the image into patches, with one-step-stale K/V "
                 "(approximate). For models too large for one device when sharding is too slow; Hybrid Sampler only.",
    "num_pipeline_patch": "PipeFusion patches (0 = pp_degree). Leave at 0 unless tuning PipeFusion.",
    "warmup_steps": "Exact steps before PipeFusion / DistriFusion switch to stale K/V. More = closer to one device, "
                    "slower. Ignored by the exact methods.",
    "tp_degree": "Tensor parallel: each layer's weights split across devices (less memory per device, more "
                 "communication). Prefer shard_weights for memory; TP for NVLink GPUs only.",
}


def _int(default, lo, hi, tip):
    return ("INT", {"default": default, "min": lo, "max": hi, "tooltip": tip})


class ParallelConfigNode:
    DESCRIPTION = ("How one generation is split across devices: data parallel (dp) splits the batch, CFG "
                   "parallel runs the conditional and unconditional halves side by side, Ulysses and Ring split "
                   "the image tokens, PipeFusion splits the layers and the image into patches, tensor parallel "
                   "splits the weights. The world size is the product of the degrees.")
    CATEGORY = "Hybrid Parallel/advanced"
    RETURN_TYPES = ("PARALLEL_CONFIG",)
    RETURN_NAMES = ("parallel_config",)
    OUTPUT_TOOLTIPS = ("Connect to Hybrid Sampler or Parallel Model, and to Parallel VAE Decode.",)
    runtime = None  # set by the pack's entry point inside a ComfyUI server (then the workers start early)
    # Not an output node: a workflow whose sampler or decoder fails ComfyUI's validation must be rejected like
    # KSampler's (an output node without inputs would let the prompt run and report success with no image).
    # `build_async` is a coroutine, which ComfyUI executes first among the nodes that are ready
    # (comfy_execution/graph.py: ux_friendly_pick_node), so the workers still start while the model loads.
    FUNCTION = "build_async"
    OUTPUT_NODE = False

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "dp_degree": _int(1, 1, 64, DEGREE_TIPS["dp_degree"]),
            "cfg_degree": _int(1, 1, 2, DEGREE_TIPS["cfg_degree"]),
            "ulysses_degree": _int(1, 1, 64, DEGREE_TIPS["ulysses_degree"]),
            "ring_degree": _int(1, 1, 64, DEGREE_TIPS["ring_degree"]),
            "pp_degree": _int(1, 1, 16, DEGREE_TIPS["pp_degree"]),
            "num_pipeline_patch": _int(0, 0, 64, DEGREE_TIPS["num_pipeline_patch"]),
            "warmup_steps": _int(1, 0, 1000, DEGREE_TIPS["warmup_steps"]),
            "tp_degree": _int(1, 1, 16, DEGREE_TIPS["tp_degree"]),
            "method": (["usp", "distrifusion"], {"tooltip": "What the sequence ranks do: exact USP attention, "
                                                 "or DistriFusion's displaced patches (stale activations)."}),
            "device": (["auto", "cpu", "cuda"], {"tooltip": "auto = CUDA when available, else CPU processes."}),
            "attention": (ATTENTION_CHOICES, {"tooltip": "Attention kernel for ring attention. auto: the best for "
                                              "the device and dtype, and Ulysses runs the kernel ComfyUI "
                                              "picked (sage, flash, pytorch...) as one device does; any other "
                                              "choice: Ulysses runs that kernel too."}),
        }, "optional": {
            "devices": ("STRING", {"default": "", "tooltip": "Optional comma-separated device list, one per "
                                   "rank (e.g. cuda:0,cuda:1); empty = the first world_size devices."}),
            "cluster": ("HP_CLUSTER", {"tooltip": "From a Hybrid Parallel Cluster node: the world spans several "
                        "machines (the product of the degrees = machines x workers per machine)."}),
            "sampling_mode": (SAMPLING_MODES, {"default": "auto", "tooltip": "step: ComfyUI runs the sampler and "
                              "each model call goes to the workers (every sampler). loop: the whole denoising loop "
                              "runs in the workers (euler / dpmpp_2m; DistriFusion overlaps better). auto: loop for "
                              "PipeFusion (which needs it), step otherwise."}),
            # new widgets go last: saved workflows store widget values by position
            "shard_weights": (list(SHARD_CHOICES), {"default": "none", "tooltip": "Weight sharding: each rank keeps 1/N "
                              "of the weights and gathers a block's weights one block ahead of use (fits models "
                              "larger than one device). sequence = over the ulysses x ring ranks; all = over every "
                              "rank. Not with tensor parallel or PipeFusion."}),
            "step_cache": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 3.0, "step": 0.01, "tooltip": "Step "
                           "caching where the denoising loop runs in the workers (loop mode, PipeFusion): EasyCache's "
                           "rule with this threshold (0 = off; 0.2 is EasyCache's default), decided alike on every "
                           "rank; PipeFusion keeps one cache per patch. In step mode use ComfyUI's EasyCache node."}),
            "degrees": (DEGREE_CHOICES, {"default": "manual", "tooltip": "manual: the degrees above. auto: Hybrid "
                        "Sampler picks dp / cfg / ulysses / ring from the model, the latent size, whether CFG is on and "
                        "the devices (this machine's GPUs, or CPU cores; the devices list if given), with a cost model "
                        "(parallel/costmodel.py), and stays at one rank unless more are predicted >= 10 % faster. "
                        "Leave every degree at 1."}),
        }}

    @staticmethod
    def configure(dp_degree, cfg_degree, ulysses_degree, ring_degree, pp_degree, num_pipeline_patch, warmup_steps,
                  tp_degree, method, device, attention, devices="", sampling_mode="auto",
                  cluster=None, shard_weights="none", step_cache=0.0, degrees="manual") -> HybridParallelConfig:
        """The validated config of these widget values (ValueError naming the fix); places nothing."""
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

    async def build_async(self, **widgets):
        return self.build(**widgets)

    def build(self, dp_degree, cfg_degree, ulysses_degree, ring_degree, pp_degree, num_pipeline_patch,
              warmup_steps, tp_degree, method, device, attention, devices="", sampling_mode="auto", cluster=None,
              shard_weights="none", step_cache=0.0, degrees="manual"):
        hp = self.configure(dp_degree, cfg_degree, ulysses_degree, ring_degree, pp_degree, num_pipeline_patch,
                            warmup_steps, tp_degree, method, device, attention, devices, sampling_mode, cluster,
                            shard_weights, step_cache, degrees)
        check_hp_placement(hp)  # this machine must be able to run it: before any worker starts
        # in a ComfyUI server: start the workers while the model loads (auto: the world is chosen at the sampler)
        if self.runtime is not None and not hp.auto_devices:
            self.runtime.prestart(hp)
        return {"ui": {"text": summary(hp)}, "result": (hp,)}


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
