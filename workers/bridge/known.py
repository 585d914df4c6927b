"""What the pack knows about each thing a node can put on a MODEL or a conditioning: carried, run by ComfyUI in its own
process, or refused - per sampling mode. Everything not listed here is refused (workers/bridge/capture.py).

Why a table, and why by name: ComfyUI hands the sampler Python objects (functions, holders, hooks) that no message
can carry. Whether one of them is exact on the pool depends on *where it runs*:
- DRIVER: ComfyUI runs it in its own process around the model call - CFG functions, sampler wrappers, cond timing.
  In step mode ComfyUI's own sampler runs (the pool answers each model call), so these run exactly as under
  KSampler. The workers' own loop (sampling_mode loop, PipeFusion) never calls them: refused there.
- CARRIED: it acts inside the model call; what it does travels as data (a dtype, a list of blocks to skip, a hook's
  LoRA) and the workers apply it with ComfyUI's own code (workers/bridge/carry.py).
- REFUSED: it acts inside the diffusion model with state the workers cannot have (a closure recording attention
  maps, a module swapped in ComfyUI's process). Refused before any work, naming the node and what to do instead.
A function is known by where it was defined ("module:Class." - the node class whose code made it), a wrapper or
callback by its type and key, an object patch, option or attachment by its key. tests/driver/test_every_node.py walks
ComfyUI's node registry and checks every node that outputs a MODEL, GUIDER or CONDITIONING against this table.
"""
from __future__ import annotations

from dataclasses import dataclass

DRIVER, CARRIED, IGNORED, REFUSED = "driver", "carried", "ignored", "refused"

STEP_FIX = ("use step mode - set sampling_mode to step, and set pp_degree to 1 for PipeFusion - on Parallel Config "
            "(ComfyUI's own sampler then runs it and sends one model call at a time to the workers), or use Parallel "
            "Model")
KSAMPLER_FIX = "remove that node, or sample this MODEL without the pack (KSampler on one device)"


@dataclass(frozen=True)
class Rule:
    step: str                 # what happens in step mode (ComfyUI's sampler, each model call on the pool)
    loop: str                 # ... in the workers' loop (sampling_mode loop, PipeFusion)
    why: str = ""             # for a refusal: what would go wrong
    fix: str = KSAMPLER_FIX   # for a refusal: what to do instead
    carry: str = ""           # how it travels when CARRIED (workers/bridge/carry.py)
    nodes: tuple = ()         # node classes known to add it (names the node when no function does)

    def verdict(self, mode: str) -> str:
        return self.loop if mode == "loop" else self.step


def _driver(*nodes, loop_why: str = "the workers' own loop does not call it") -> Rule:
    return Rule(DRIVER, REFUSED, why=loop_why, fix=STEP_FIX, nodes=nodes)


def _extra_call(carry: str, *nodes) -> Rule:
    """A guidance node whose extra model call carries a patch of a known shape (carry.py SHAPES)."""
    return Rule(CARRIED, REFUSED, why="the workers' own loop makes no extra guidance call", fix=STEP_FIX, carry=carry,
                nodes=nodes)


def _refused(why: str, *nodes, fix: str = KSAMPLER_FIX) -> Rule:
    return Rule(REFUSED, REFUSED, why=why, fix=fix, nodes=nodes)


INSIDE = ("it runs inside ComfyUI's diffusion model, which runs on the workers; the pack has no way to carry this "
          "Python function there")
INSIDE_LOOP = "the workers' own loop runs their model without other nodes' patches"

# Functions by where they were defined ("module:Qualname" prefix): CFG and sampler functions ComfyUI calls around
# the model. A prefix ending in "." covers every function a node class's code defines.
FUNCTIONS = {
    "comfy_extras.nodes_model_advanced:RescaleCFG.": _driver("RescaleCFG"),
    "comfy_extras.nodes_cfg:CFGZeroStar.": _driver("CFGZeroStar"),
    "comfy_extras.nodes_cfg:CFGNorm.": _driver("CFGNorm"),
    "comfy_extras.nodes_apg:APG.": _driver("APG"),
    "comfy_extras.nodes_tcfg:TCFG.": _driver("TCFG"),
    "comfy_extras.nodes_mahiro:Mahiro.": _driver("Mahiro"),
    "comfy_extras.nodes_fresca:FreSca.": _driver("FreSca"),
    "comfy_extras.nodes_perpneg:PerpNeg.": _driver("PerpNeg"),
    "comfy_extras.nodes_eps:EpsilonScaling.": _driver("Epsilon Scaling"),
    "comfy_extras.nodes_eps:TemporalScoreRescaling.": _driver("TemporalScoreRescaling"),
    "comfy_extras.nodes_latent:LatentApplyOperationCFG.": _driver("LatentApplyOperationCFG"),
    "comfy_extras.nodes_video_model:VideoLinearCFGGuidance.": _driver("VideoLinearCFGGuidance"),
    "comfy_extras.nodes_video_model:VideoTriangleCFGGuidance.": _driver("VideoTriangleCFGGuidance"),
    "comfy_extras.nodes_lumina2:RenormCFG.": _driver("RenormCFG"),
    "comfy_extras.nodes_differential_diffusion:DifferentialDiffusion.": _driver(
        "DifferentialDiffusion", loop_why="the workers' own loop runs no noise mask"),
    # SamplerCustomAdvanced's CFGOverride: a predict-noise wrapper that changes the cfg per step
    "comfy_extras.nodes_custom_sampler:CFGOverride.": _driver("CFGOverride"),
    # KJNodes (custom_nodes/ComfyUI-KJNodes), read: CFG / denoise-mask functions on the denoised outputs only
    # (CFGZeroStarAndInit run against KSampler in tests/server_e2e/test_every_graph.py)
    "custom_nodes.kjnodes.nodes.model_optimization_nodes:CFGZeroStarAndInit.": _driver("CFGZeroStarAndInit"),
    "custom_nodes.kjnodes.nodes.model_optimization_nodes:PiDColorBiasCorrection.": _driver(
        "PiDColorBiasCorrection"),
    "custom_nodes.kjnodes.nodes.nodes:DifferentialDiffusionAdvanced.": _driver(
        "DifferentialDiffusionAdvanced", loop_why="the workers' own loop runs no noise mask"),
    # Skip Layer Guidance: its extra model call skips blocks (an identity block replacement, `patches_replace`):
    # the block list travels with that call and the workers skip the same blocks (carry.py skip_blocks)
    "comfy_extras.nodes_slg:SkipLayerGuidanceDiT.": _extra_call("skip_blocks", "SkipLayerGuidanceDiT"),
    "comfy_extras.nodes_slg:SkipLayerGuidanceDiTSimple.": _extra_call("skip_blocks", "SkipLayerGuidanceDiTSimple"),
    "comfy_extras.nodes_sd3:SkipLayerGuidanceSD3.": _extra_call("skip_blocks", "SkipLayerGuidanceSD3"),
    # Perturbed-Attention Guidance: its extra call replaces self-attention by its values (carry.py value_attention)
    "comfy_extras.nodes_pag:PerturbedAttentionGuidance.": _extra_call("value_attention", "PerturbedAttentionGuidance"),
    "comfy_extras.nodes_sag:SelfAttentionGuidance.": _refused(
        "its attention patch records the attention map inside the model call, which runs on the workers; the "
        "guidance would be computed from nothing", "SelfAttentionGuidance"),
    # FreeU: a patch of the UNet's output blocks, per sample, whose closure holds plain numbers: ComfyUI's own
    # function is rebuilt on the workers around those numbers (carry.py closures) - where every rank runs the whole
    # model on whole images (CFG / data parallel; the UNets have no sequence split anyway)
    "comfy_extras.nodes_freelunch:FreeU.": Rule(CARRIED, REFUSED, why=INSIDE_LOOP, fix=STEP_FIX, carry="closure",
                                                nodes=("FreeU",)),
    "comfy_extras.nodes_freelunch:FreeU_V2.": Rule(CARRIED, REFUSED, why=INSIDE_LOOP, fix=STEP_FIX, carry="closure",
                                                   nodes=("FreeU_V2",)),
    # Comfy-WaveSpeed's First Block Cache: its model function wrapper runs in the driver around each pool call (its
    # swap of ComfyUI's block list there is inert: that model does not run); the workers apply the node's rule to their
    # model, decided alike on every rank (workers/bridge/fbcache.py, parallel/fbcache.py)
    "custom_nodes.comfy-wavespeed.fbcache_nodes:ApplyFBCacheOnModel.": Rule(
        CARRIED, REFUSED, why="the workers' own loop makes no model call through the node's wrapper", fix=STEP_FIX,
        carry="fbcache", nodes=("ApplyFBCacheOnModel",)),
    "custom_nodes.kjnodes.nodes.model_optimization_nodes:ModelMemoryUseReportPatch.": Rule(
        DRIVER, DRIVER, nodes=("ModelMemoryUseReportPatch",)),  # logs the driver's memory use
    "custom_nodes.kjnodes.nodes.model_optimization_nodes:ModelPatchTorchSettings.": _refused(
        "it sets torch's matmul settings (fp16 accumulation) in ComfyUI's process only; the workers would compute "
        "without them", "ModelPatchTorchSettings"),
}

CACHE_DIT = ("it replaces the diffusion model's forward on ComfyUI's model object when sampling starts (cache-dit's "
             "block adapter, or its own cache of whole calls), which the workers - who build their own model - never "
             "run")
CACHE_FIX = ("use Parallel Config's step_cache (EasyCache's rule on the workers), ComfyUI's EasyCache node or "
             "Comfy-WaveSpeed's Apply First Block Cache (SD3/3.5), which the pack carries, and remove that node")

# Wrappers by (ComfyUI's WrappersMP type, key); the pack's own key is never listed here (capture skips it).
WRAPPERS = {
    ("outer_sample", "easycache"): Rule(DRIVER, DRIVER, nodes=("EasyCache",)),
    ("calc_cond_batch", "easycache"): Rule(DRIVER, CARRIED, carry="easycache", nodes=("EasyCache",)),
    # EasyCache's diffusion-model wrapper: the driver runs it around the pool call (step), the workers apply its
    # rule in their loop (parallel/stepcache.py)
    ("diffusion_model", "easycache"): Rule(DRIVER, CARRIED, carry="easycache", nodes=("EasyCache",)),
    ("outer_sample", "lazycache"): _driver("LazyCache"),
    ("predict_noise", "lazycache"): _driver("LazyCache"),
    # ComfyUI's TorchCompileModel: the workers compile their own model (nodes: compile_spec) - ComfyUI's own wrapper
    # only (WRAPPER_ORIGINS); KJNodes' TorchCompileModelAdvanced compiles chosen blocks its own way
    ("apply_model", "torch.compile"): Rule(CARRIED, REFUSED, why="the workers' own loop runs their model uncompiled",
                                           fix=STEP_FIX, carry="compile", nodes=("TorchCompileModel",
                                                                                 "TorchCompileModelWanVideoV2",
                                                                                 "TorchCompileModelFluxAdvancedV2")),
    # ComfyUI's context windows: the handler splits each model call in the driver, one window per call
    ("prepare_sampling", "ContextWindows_prepare_sampling"): _driver("ContextWindowsManual", "WanContextWindowsManual",
                                                                     "LTXVContextWindows"),
    ("sampler_sample", "ContextWindows_sampler_sample"): _driver("ContextWindowsManual", "WanContextWindowsManual",
                                                                 "LTXVContextWindows"),
    # KJNodes' preview overrides and memory-estimate override: they read the driver's objects around sampling
    ("outer_sample", "kj_preview_override"): Rule(DRIVER, DRIVER, nodes=("ModelPreviewOverrideKJ",)),
    ("outer_sample", "sampling_preview"): Rule(DRIVER, DRIVER, nodes=("LTX2SamplingPreviewOverride",)),
    ("prepare_sampling", "memory_usage_factor_adjust_prepare_sampling"): Rule(
        DRIVER, DRIVER, nodes=("ModelMemoryUsageFactorOverride",)),
    # ComfyUI-CacheDiT: its OUTER_SAMPLE wrapper replaces the diffusion model's forward (cache-dit's BlockAdapter or
    # its own whole-call cache) on ComfyUI's model object when sampling starts - which the workers never see - and its
    # DIFFUSION_MODEL wrapper may add unseeded noise to cached outputs
    ("outer_sample", "cache_dit_turbo"): _refused(CACHE_DIT, "CacheDiT_Model_Optimizer",
                                                  fix=CACHE_FIX),
    ("diffusion_model", "cache_dit_turbo"): _refused(CACHE_DIT, "CacheDiT_Model_Optimizer",
                                                     fix=CACHE_FIX),
}
# where a wrapper's function must come from for its WRAPPERS rule to hold (else: refused)
WRAPPER_ORIGINS = {("apply_model", "torch.compile"): "comfy_api.torch_helpers.torch_compile:"}

# Callbacks by (CallbacksMP type, key) - or, unkeyed, by where their function was defined (FUNCTIONS)
CALLBACKS: dict = {}

# ModelPatcher object patches by key (a dotted attribute path of the BaseModel)
OBJECT_PATCHES = {
    # the sampling schedule: ComfyUI's sampler reads it in the driver; the workers' loop checks it exactly
    # (workers/bridge/loop_mode.loop_convention refuses what it cannot compute)
    "model_sampling": Rule(DRIVER, DRIVER, nodes=(
        "ModelSamplingDiscrete", "ModelSamplingContinuousEDM", "ModelSamplingContinuousV", "ModelSamplingStableCascade",
        "ModelSamplingSD3", "ModelSamplingAuraFlow", "ModelSamplingFlux", "ModelSamplingLTXV", "ModelSamplingMiniMaxH3",
        "ModelSamplingAnima", "RescaleCFG")),
    "latent_format": Rule(DRIVER, DRIVER, nodes=("ModelSamplingDiscrete",)),
    # ModelComputeDtype: the dtype the model computes in; the workers build their ops with it (carry.py)
    "manual_cast_dtype": Rule(CARRIED, CARRIED, carry="compute_dtype", nodes=("ModelComputeDtype",)),
}
# "diffusion_model.<attribute>" set to a plain value (str / number / bool / None): set on the workers' model for
# each call, as ComfyUI sets it on its own (Flux Kontext's reference method)
PLAIN_OBJECT_PATCH = Rule(CARRIED, CARRIED, carry="object_values", nodes=("FluxKVCache",))
# any other attribute of ComfyUI's BaseModel (not its diffusion model): only the driver's BaseModel reads those (its
# extra_conds, concat keys, latent format...) - the workers run the diffusion model alone
BASE_MODEL_PATCH = Rule(DRIVER, DRIVER, nodes=("HunyuanVideoEncodeKeyframesToCond",))

# model_options entries that are not functions
MODEL_OPTIONS = {
    "transformer_options": Rule(IGNORED, IGNORED),  # enumerated entry by entry
    "disable_cfg1_optimization": _driver("SelfAttentionGuidance"),
    "torch_compile_kwargs": Rule(IGNORED, IGNORED),  # read with the torch.compile wrapper
    # set by ComfyUI's sampler itself before its OUTER_SAMPLE wrappers run (CFGGuider.sample)
    "to_load_options": Rule(IGNORED, IGNORED),
    "registered_hooks": Rule(IGNORED, IGNORED),  # enumerated with the conds' hooks
    # ComfyUI's context windows: the handler splits the model calls in the driver
    "context_handler": _driver("WanContextWindowsManual", "ContextWindowsManual"),
}
# model_options entries that hold functions ComfyUI calls (looked up in FUNCTIONS)
FUNCTION_OPTIONS = {
    "sampler_cfg_function": "a CFG function",
    "sampler_pre_cfg_function": "a pre-CFG function",
    "sampler_post_cfg_function": "a post-CFG function",
    "sampler_calc_cond_batch_function": "a cond-batch function",
    "model_function_wrapper": "a model function wrapper",
    "denoise_mask_function": "a denoise-mask function",
}

# transformer_options entries
TRANSFORMER_OPTIONS = {
    # ScaleROPE's RoPE options travel with each model call; the workers' own loop calls its model without them
    "rope_options": Rule(CARRIED, REFUSED, why="the workers' own loop calls the model without transformer options",
                         fix=STEP_FIX, carry="rope_options", nodes=("ScaleROPE",)),
    "easycache": Rule(DRIVER, CARRIED, carry="easycache", nodes=("EasyCache", "LazyCache")),
    "wrappers": Rule(IGNORED, IGNORED),   # enumerated like the ModelPatcher's
    "callbacks": Rule(IGNORED, IGNORED),
    "ar_state": _refused("a causal autoregressive sampler (ComfyUI's ar_video, for Wan 2.1 Causal AR models) keeps the "
                         "model's KV caches and its frame position in ComfyUI's process, which the workers cannot "
                         "see - without them each call would run the plain bidirectional forward on its frames alone",
                         fix="run the ar_video sampler on the MODEL without Parallel Model (one device) - KSampler "
                             "would sample it as plain Wan 2.1, another algorithm"),
    # ComfyUI's per-run / per-call bookkeeping, read in the driver
    "sample_sigmas": Rule(IGNORED, IGNORED),
    "cache_dit_turbo": _refused(CACHE_DIT, "CacheDiT_Model_Optimizer", fix=CACHE_FIX),
    "optimized_attention_override": _refused(
        "it swaps the attention function inside the model call in ComfyUI's process; the workers pick their kernel "
        "themselves", "ModelAttentionBackend", "NABLA_AttentionKJ", "PathchSageAttentionKJ",
        fix="choose the kernel with Parallel Config's attention setting (or ComfyUI's own --use-... flag), and remove "
            "that node"),
}

# ModelPatcher additional models / attachments by key
ADDITIONAL_MODELS = {
    "multigpu": _refused("ComfyUI's MultiGPU CFG Split already runs the cond / uncond batch on whole-model copies on "
                         "other GPUs", "MultiGPU_WorkUnits",
                         fix="use one of the two: remove MultiGPU CFG Split (cfg_degree 2 is the same split), or "
                             "remove the pack's node to keep ComfyUI's split"),
}
ATTACHMENTS: dict = {}

HOOK_NODES = ("CreateHookLora", "CreateHookLoraModelOnly", "CreateHookModelAsLora", "CreateHookModelAsLoraModelOnly",
              "SetHookKeyframes", "CreateHookKeyframe", "CreateHookKeyframesInterpolated",
              "CreateHookKeyframesFromFloats", "CombineHooks", "CombineHooksFour", "CombineHooksEight",
              "ConditioningSetProperties", "ConditioningSetPropertiesAndCombine", "PairConditioningSetProperties",
              "PairConditioningSetPropertiesAndCombine", "ConditioningSetDefaultCombine",
              "PairConditioningSetDefaultCombine", "PairConditioningCombine", "SetClipHooks",
              "ConditioningTimestepsRange", "SetModelHooksOnCond")
# weight hooks (hook LoRAs, keyframed strengths): each model call runs under its cond's hook group, applied by the
# workers to the weights they hold (carry.py hooks); ComfyUI's other hook kinds act in its process
HOOKS = Rule(CARRIED, REFUSED, why="the workers' own loop does not switch weights per cond", fix=STEP_FIX,
             carry="hooks", nodes=HOOK_NODES)
OTHER_HOOKS = _refused("it patches objects, adds models or transformer options from a hook in ComfyUI's process",
                       *HOOK_NODES)
BYPASS = Rule(CARRIED, CARRIED, carry="bypass", nodes=("LoraLoaderBypass", "LoraLoaderBypassModelOnly"))
INJECTIONS = _refused("its injections (LoRA bypass) change ComfyUI's modules in its own process",
                      "LoraLoaderBypass", "LoraLoaderBypassModelOnly",
                      fix="load the LoRA with LoraLoaderModelOnly / LoraLoader (its patches travel to the workers)")
WEIGHT_WRAPPERS = _refused("its weight wrappers change how ComfyUI's modules read their weights in its own process",
                           "TrainLoraNode")

# cond entries ComfyUI's sampler reads in the driver (cond timing, areas, strengths) and those the model reads
# (they travel as the model call's arguments, checked at each call); what the workers' loop cannot run
CONDS_LOOP_FIX = "the workers' own loop runs one positive and one negative conditioning, whole, and no ControlNet"
_AREA = ("ConditioningSetArea", "ConditioningSetAreaPercentage", "ConditioningSetAreaPercentageVideo",
         "ConditioningSetAreaStrength")
_MASK = ("ConditioningSetMask", "ConditioningSetMaskAndCombine", "ConditioningSetMaskAndCombine3",
         "ConditioningSetMaskAndCombine4", "ConditioningSetMaskAndCombine5", "ConditioningSetProperties",
         "ConditioningSetPropertiesAndCombine", "PairConditioningSetProperties", "PairConditioningSetPropertiesAndCombine")
COND_NODES = {  # the nodes known to set each cond entry (names the node of a refusal in the workers' loop)
    "control": ("ControlNetApply", "ControlNetApplyAdvanced", "ControlNetApplySD3", "ControlNetInpaintingAliMamaApply"),
    "area": _AREA, "strength": _AREA, "set_area_to_bounds": _AREA + _MASK, "mask": _MASK,
    "start_percent": ("ConditioningSetTimestepRange",) + _MASK, "end_percent": ("ConditioningSetTimestepRange",) + _MASK,
    "combined": ("ConditioningCombine", "ConditioningMultiCombine", "PairConditioningCombine",
                 "ConditioningSetDefaultCombine", "PairConditioningSetDefaultCombine") + _MASK,
}
GLIGEN = _refused("GLIGEN's position patch runs a model in ComfyUI's process inside the diffusion model",
                  "GLIGENTextBoxApply")

# A model changed in place, outside ModelPatcher (workers/bridge/inplace.py): the workers build their own model from
# ComfyUI's class and the weights, so a change made on ComfyUI's model object or code never reaches them
IN_PLACE_MODEL = _refused("it changes ComfyUI's diffusion model in ComfyUI's process, outside ModelPatcher (a method "
                          "or hook on the model, or ComfyUI's model code replaced); the workers build their own model "
                          "from ComfyUI's class and the weights, without the change")
IN_PLACE_STRUCTURE = _refused("it adds modules or weights to ComfyUI's diffusion model (or removes them) in ComfyUI's "
                              "process; the workers build ComfyUI's class from the model's config, without them")
IN_PLACE_ATTENTION = _refused("it swaps ComfyUI's attention function in ComfyUI's process; the workers pick their "
                              "kernel themselves",
                              fix="choose the kernel with ComfyUI's own --use-... flag (the workers run the kernel "
                                  "ComfyUI picked), and remove that node")
IN_PLACE_SAMPLER = Rule(DRIVER, REFUSED, why="it replaces ComfyUI's sampling code, which the workers' own loop stands "
                                             "in for", fix=STEP_FIX)
