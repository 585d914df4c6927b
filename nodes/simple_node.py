"""Parallel GPUs: the node most users need - which devices, and "auto" or a preset; nothing else.

Why a second config node: Parallel Config shows every degree, the method, the kernel, sharding and caching (17
widgets) for people who know xDiT; a GPU owner wants "use these GPUs". This node builds the same PARALLEL_CONFIG
through Parallel Config's own validation (workers/driver/configs.py: configure / check_placement), so both behave alike
and every sampler path (Hybrid Sampler, Parallel Model, Parallel VAE Decode) takes either.
"""
from __future__ import annotations

from ..workers.driver.configs import PRESET_HELP, PRESETS, as_gpus_node, check_hp_placement, configure_gpus, summary


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

    configure = staticmethod(configure_gpus)  # the validated config of these two widgets

    async def build_async(self, devices: str = "all", preset: str = "auto"):
        return self.build(devices, preset)

    def build(self, devices: str = "all", preset: str = "auto"):
        hp = self.configure(devices, preset)
        with as_gpus_node():
            check_hp_placement(hp)  # this machine must be able to run it: before any worker starts
        if self.runtime is not None and not hp.auto_devices:
            self.runtime.prestart(hp)
        return {"ui": {"text": summary(hp)}, "result": (hp,)}
