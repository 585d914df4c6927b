"""Parallel Config node: degrees and devices -> PARALLEL_CONFIG, validated at once (the rules and the wire type:
workers/driver/configs.py, shared with the mesh picture and the headless warm-up)."""
from __future__ import annotations

from ..parallel.config import SHARD_CHOICES
from ..workers.driver import configs
from ..workers.driver.configs import ATTENTION_CHOICES, DEGREE_CHOICES, SAMPLING_MODES, check_hp_placement, summary


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

    configure = staticmethod(configs.configure)  # the validated config of these widget values; places nothing

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
