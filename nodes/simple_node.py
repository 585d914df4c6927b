"""Parallel GPUs: the node most users need - which devices, and "auto" or a preset; nothing else.

Why a second config node: Parallel Config shows every degree, the method, the kernel, sharding and caching (17
widgets) for people who know xDiT; a GPU owner wants "use these GPUs". This node builds the same PARALLEL_CONFIG
through Parallel Config's own validation (ParallelConfigNode.configure / check_placement), so both behave alike
and every sampler path (Hybrid Sampler, Parallel Model, Parallel VAE Decode) takes either.
"""
from __future__ import annotations

from contextlib import contextmanager

from .config_node import ParallelConfigNode, auto_device_count, check_hp_placement, summary
from ..parallel.config import normalize_devices

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
def _as_this_node():
    """Parallel Config's own refusals, said in this node's name (the one the user sees)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(str(e).replace("Parallel Config:", "Parallel GPUs:", 1)) from None


class ParallelGPUsNode:
    DESCRIPTION = ("Use several GPUs for one generation: pick the GPUs and 'auto' (or a preset). Connect it where a "
                   "Parallel Config goes (Hybrid Sampler, Parallel Model, Parallel VAE Decode). The result equals one "
                   "GPU's. For every degree, the kernel or sharding, use Parallel Config (advanced) instead.")
    CATEGORY = "Hybrid Parallel"
    RETURN_TYPES = ("PARALLEL_CONFIG",)
    RETURN_NAMES = ("parallel_config",)
    OUTPUT_TOOLTIPS = ("Connect to Hybrid Sampler or Parallel Model, and to Parallel VAE Decode.",)
    FUNCTION = "build_async"  # a coroutine: ComfyUI runs it first, so the workers start while the model loads
    runtime = None  # set by the pack's entry point inside a ComfyUI server

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "devices": ("STRING", {"default": "all", "tooltip": "all = every GPU this machine has (CPU cores without "
                                   "one); a number = the first N; or a list, e.g. cuda:0,cuda:1. Leave at 'all' "
                                   "unless other programs use some GPUs."}),
            "preset": (list(PRESETS), {"default": "auto", "tooltip": "auto: " + PRESET_HELP["auto"] + ". " + " ".join(
                f"{k}: {v}." for k, v in PRESET_HELP.items() if k != "auto")}),
        }}

    @staticmethod
    def configure(devices: str = "all", preset: str = "auto"):
        """The validated PARALLEL_CONFIG of these two widgets, built by Parallel Config's own rules."""
        n, listed = parse_devices(devices)
        degrees = preset_degrees(preset, n)
        widgets = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
                       warmup_steps=1, tp_degree=1, method="usp", device="auto", attention="auto",
                       devices=",".join(listed), sampling_mode="auto", cluster=None, shard_weights="none",
                       step_cache=0.0, degrees="manual")
        widgets.update(degrees)
        with _as_this_node():
            hp = ParallelConfigNode.configure(**widgets)
        if hp.auto_devices and not listed and hp.auto_devices != n:
            from dataclasses import replace
            hp = replace(hp, auto_devices=n)  # "4": auto chooses among the first four devices
        return hp

    async def build_async(self, devices: str = "all", preset: str = "auto"):
        return self.build(devices, preset)

    def build(self, devices: str = "all", preset: str = "auto"):
        hp = self.configure(devices, preset)
        with _as_this_node():
            check_hp_placement(hp)  # this machine must be able to run it: before any worker starts
        if self.runtime is not None and not hp.auto_devices:
            self.runtime.prestart(hp)
        return {"ui": {"text": summary(hp)}, "result": (hp,)}
