"""Every node class of ComfyUI (and of the third-party packs the tests install) that outputs a MODEL, GUIDER or
CONDITIONING, classified: what the pack does with what it adds. tests/driver/test_every_node.py runs each against this
table in a real ComfyUI; a node missing here fails that test - a new ComfyUI release arrives as a list to classify.

- PLAIN: adds nothing the capture refuses or carries beyond the model call's own inputs (loaders, text encoders,
  conditioning that becomes model inputs, sampling schedules run by ComfyUI's sampler, guiders ComfyUI runs itself).
- CARRIED: what it adds is carried exactly (a test compares it with KSampler).
- STEP: what it adds runs in ComfyUI's process (CFG functions, sampler wrappers): exact in step mode; the workers'
  own loop refuses it before any work.
- REFUSED: refused before any work, naming the node.
The verdicts are what the capture (workers/bridge/capture.py) decides from what each node puts on a MODEL; this table
only names them, and is checked against the capture node by node.
"""
from __future__ import annotations

PLAIN, CARRIED, STEP, REFUSED = "plain", "carried", "step", "refused"

OWN = ("HybridParallelGPUs", "HybridParallelConfig", "HybridSampler", "HybridPatchVAEDecode", "HybridParallelCluster",
       "HybridParallelModel")

# Nodes the probe cannot run (an input it cannot make - a checkpoint, a CLIP vision model, a MODEL_PATCH file - or
# a node that fails on every tiny family): classified by reading what they put on the MODEL / conditioning
_LOADER = "a loader: needs a checkpoint file of its kind"
_CV = "needs a CLIP vision model or its output"
_PATCH = "needs a MODEL_PATCH file"
UNPROBED = {
    **dict.fromkeys(("CheckpointLoader", "CheckpointLoaderKJ", "CheckpointLoaderSimple", "DiffusersLoader",
                     "ImageOnlyCheckpointLoader", "unCLIPCheckpointLoader", "UnetLoaderGGUF", "UnetLoaderGGUFAdvanced",
                     "GGUFLoaderKJ"), (PLAIN, _LOADER)),
    **dict.fromkeys(("Pixal3DConditioning", "SV3D_BatchSchedule", "SV3D_Conditioning", "SVD_img2vid_Conditioning",
                     "StableZero123_BatchSchedule", "StableZero123_Conditioning", "StableZero123_Conditioning_Batched",
                     "Trellis2Conditioning", "TripoSplatConditioning", "StyleModelApply", "StyleModelApplyAdvanced"),
                    (PLAIN, _CV)),
    # model patches from a MODEL_PATCH file: attention / block patches inside the model
    **dict.fromkeys(("AnimaLLLiteApply", "QwenImageDiffsynthControlnet", "SUPIRApply", "USOStyleReference",
                     "WanUni3CControlnetApply", "ZImageFunControlnet", "WanInfiniteTalkToVideo"), (REFUSED, _PATCH)),
    "HypernetworkLoader": (REFUSED, "needs a hypernetwork file; its attention patches run inside the model"),
    "GLIGENTextBoxApply": (REFUSED, "needs a GLIGEN model; its position patch runs inside the model"),
    "GLIGENTextBoxApplyBatchCoords": (REFUSED, "needs a GLIGEN model; its position patch runs inside the model"),
    "LoraLoader": (CARRIED, "needs a real CLIP; its model half is LoraLoaderModelOnly's weight patches"),
    "LoraLoaderBypass": (CARRIED, "needs a real CLIP; its model half is LoraLoaderBypassModelOnly's bypass"),
    "LoraModelLoader": (CARRIED, "needs a trained LORA_MODEL; weight patches"),
    "DiTBlockLoraLoader": (CARRIED, "needs a LoRA file of its own layout; weight patches"),
    "CheckpointPerturbWeights": (CARRIED, "fails in ComfyUI 0.33 itself (deep-copies the ModelPatcher); weight patches"),
    "TorchCompileModelFluxAdvancedV2": (CARRIED, "compiles Flux / HunyuanVideo blocks only; ComfyUI's compile wrapper"),
    "LatentApplyOperationCFG": (STEP, "needs a LATENT_OPERATION; a pre-CFG function"),
    "ContextWindowsVisualizerKJ": (STEP, "needs a model it can window; ComfyUI's context windows"),
    "LTX2SamplingPreviewOverride": (PLAIN, "an INT / FLOAT input; a preview wrapper around sampling in ComfyUI"),
    "ApplyRifleXRoPE_HunuyanVideo": (REFUSED, "HunyuanVideo 1.0 only; replaces its RoPE module in ComfyUI's process"),
    **dict.fromkeys(("LTX2MemoryEfficientSageAttentionPatch", "MiniMaxH3MemoryEfficientSageAttentionPatch",
                     "WanVideoMemoryEfficientSageAttentionPatch", "PatchFlashAttentionKJ"),
                    (REFUSED, "needs SageAttention / FlashAttention on CUDA; swaps attention forwards in ComfyUI")),
    "LTX2_NAG": (REFUSED, "LTX-2 only; patches its attention"),
    "TripoSplatSamplingPreview": (REFUSED, "TripoSplat only; a sampling wrapper the pack has not checked"),
    **dict.fromkeys(("LTXVAddGuide", "LTXVAddGuideMulti", "LTXVAddGuidesFromBatch", "LTXVImgToVideo",
                     "MiniMaxH3AddGuide", "SeedVR2Conditioning", "Trellis2ShapeStage", "Trellis2TextureStage",
                     "Trellis2UpsampleStage", "Hunyuan3Dv2ConditioningMultiView", "WanPhantomSubjectToVideo",
                     "LTXVReferenceAudio", "PhotoMakerEncode", "LoadTrainingDataset"),
                    (PLAIN, "needs its family's latent / model file; adds conditioning the model reads as inputs")),
    **dict.fromkeys(("ModelPassThrough", "VRAM_Debug"), (PLAIN, "optional model input: returns its input")),
}
# Verdicts that depend on the model's family: what the probe finds on its tiny models, and why the table says else
BY_FAMILY = {
    "MiniMaxH3SigmaShift": (REFUSED, "its sigma shifts travel to MiniMax H3 (the family reads them); on any other "
                                     "model they are an entry the pack does not know"),
}

# What tests/every_node_probe.py finds for each node on a tiny model (SD3; another family where the node acts only
# there), checked by tests/driver/test_every_node.py
NODES: dict = {
    # PLAIN (108)
    **dict.fromkeys(('BasicGuider', 'BerniniConditioning', 'CFGGuider', 'CLIPTextEncode',
                    'CLIPTextEncodeControlnet', 'CLIPTextEncodeFlux', 'CLIPTextEncodeHiDream',
                    'CLIPTextEncodeHunyuanDiT', 'CLIPTextEncodeKandinsky5', 'CLIPTextEncodeLumina2',
                    'CLIPTextEncodePixArtAlpha', 'CLIPTextEncodeSD3', 'CLIPTextEncodeSDXL',
                    'CLIPTextEncodeSDXLRefiner', 'ChromaRadianceOptions', 'CondPassThrough', 'ConditioningAverage',
                    'ConditioningConcat', 'ConditioningMultiply', 'ConditioningSetAreaStrength',
                    'ConditioningSetProperties', 'ConditioningStableAudio', 'ConditioningZeroOut',
                    'DiffusionModelLoaderKJ', 'DualCFGGuider', 'DualModelGuider', 'FluxDisableGuidance',
                    'FluxGuidance', 'FluxKontextMultiReferenceLatentMethod', 'HiDreamO1ReferenceImages',
                    'Hunyuan3Dv2Conditioning', 'HunyuanImageToVideo', 'HunyuanRefinerLatent',
                    'HunyuanVideo15ImageToVideo', 'HunyuanVideo15SuperResolution',
                    'HunyuanVideoEncodeKeyframesToCond', 'Ideogram4OptimizationsKJ', 'InpaintModelConditioning',
                    'InstructPixToPixConditioning', 'Kandinsky5ImageToVideo', 'Krea2PromptWeight',
                    'LTXVConditioning', 'LTXVCropGuides', 'LTXVDualCFGGuider', 'LotusConditioning',
                    'MakeTrainingDataset', 'MiniMaxChunkFeedForward', 'MiniMaxH3ImageToVideo',
                    'MiniMaxH3ReferenceToVideo', 'MiniMaxH3TokenCounter', 'MiniMaxLowVRAMAttention',
                    'MiniMaxMusic3TextEncode', 'ModelMemoryUsageFactorOverride', 'ModelMemoryUseReportPatch',
                    'ModelNoiseScale', 'ModelPreviewOverrideKJ', 'ModelSamplingAuraFlow',
                    'ModelSamplingContinuousEDM', 'ModelSamplingContinuousV', 'ModelSamplingDiscrete',
                    'ModelSamplingFlux', 'ModelSamplingLTXV', 'ModelSamplingSD3', 'ModelSamplingStableCascade',
                    'MultiGPU_WorkUnits', 'PairConditioningSetProperties', 'PatchModelPatcherOrder',
                    'PathchSageAttentionKJ', 'PerpNegGuider', 'PiDConditioning', 'ReferenceLatent',
                    'ReferenceTimbreAudio', 'ResolutionBucket', 'SD_4XUpscale_Conditioning', 'ScheduledCFGGuidance',
                    'SelectModelDevice', 'StableCascade_StageB_Conditioning', 'TextEncodeAceStepAudio',
                    'TextEncodeAceStepAudio1.5', 'TextEncodeBooguEdit', 'TextEncodeHunyuanVideo_ImageToVideo',
                    'TextEncodeJoyImageEdit', 'TextEncodeMageFlowEdit', 'TextEncodeQwenImageEdit',
                    'TextEncodeQwenImageEditPlus', 'TextEncodeZImageOmni', 'UNETLoader', 'VOIDInpaintConditioning',
                    'Wan22FunControlToVideo', 'WanAnimate2ToVideo', 'WanAnimateToVideo', 'WanCameraImageToVideo',
                    'WanDancerVideo', 'WanFirstLastFrameToVideo', 'WanFunControlToVideo', 'WanFunInpaintToVideo',
                    'WanHuMoImageToVideo', 'WanImageToVideo', 'WanImageToVideoSVIPro', 'WanMoveTrackToVideo',
                    'WanSCAILToVideo', 'WanSoundImageToVideo', 'WanSoundImageToVideoExtend', 'WanTrackToVideo',
                    'WanVaceToVideo', 'WanVideoTeaCacheKJ', 'unCLIPConditioning', 'wanBlockSwap'), PLAIN),
    # STEP (41)
    **dict.fromkeys(('APG', 'CFGNorm', 'CFGOverride', 'CFGZeroStar', 'CFGZeroStarAndInit', 'ConditioningCombine',
                    'ConditioningMultiCombine', 'ConditioningSetArea', 'ConditioningSetAreaPercentage',
                    'ConditioningSetAreaPercentageVideo', 'ConditioningSetDefaultCombine', 'ConditioningSetMask',
                    'ConditioningSetMaskAndCombine', 'ConditioningSetMaskAndCombine3',
                    'ConditioningSetMaskAndCombine4', 'ConditioningSetMaskAndCombine5',
                    'ConditioningSetPropertiesAndCombine', 'ConditioningSetTimestepRange', 'ContextWindowsManual',
                    'ControlNetApply', 'ControlNetApplyAdvanced', 'ControlNetApplySD3',
                    'ControlNetInpaintingAliMamaApply', 'DifferentialDiffusion', 'DifferentialDiffusionAdvanced',
                    'Epsilon Scaling', 'FreSca', 'LTXVContextWindows', 'Mahiro', 'PairConditioningCombine',
                    'PairConditioningSetDefaultCombine', 'PairConditioningSetPropertiesAndCombine', 'PerpNeg',
                    'PiDColorBiasCorrection', 'RenormCFG', 'RescaleCFG', 'TCFG', 'TemporalScoreRescaling',
                    'VideoLinearCFGGuidance', 'VideoTriangleCFGGuidance', 'WanContextWindowsManual'), STEP),
    # CARRIED (38)
    **dict.fromkeys(('EasyCache', 'FreeU', 'FreeU_V2', 'LTX2LoraLoaderAdvanced', 'LazyCache', 'LoraLoaderBypassModelOnly',
                    'LoraLoaderModelOnly', 'ModelComputeDtype', 'ModelMergeAdd', 'ModelMergeAuraflow',
                    'ModelMergeBlocks', 'ModelMergeCosmos14B', 'ModelMergeCosmos7B', 'ModelMergeCosmosPredict2_14B',
                    'ModelMergeCosmosPredict2_2B', 'ModelMergeFlux1', 'ModelMergeKrea2', 'ModelMergeLTXV',
                    'ModelMergeMochiPreview', 'ModelMergeQwenImage', 'ModelMergeSD1', 'ModelMergeSD2',
                    'ModelMergeSD35_Large', 'ModelMergeSD3_2B', 'ModelMergeSDXL', 'ModelMergeSimple',
                    'ModelMergeSubtract', 'ModelMergeWAN2_1', 'PerturbedAttentionGuidance', 'ScaleROPE',
                    'SkipLayerGuidanceDiT', 'SkipLayerGuidanceDiTSimple', 'SkipLayerGuidanceSD3',
                    'TorchCompileModel', 'TorchCompileModelWanVideoV2', 'UNetCrossAttentionMultiply',
                    'UNetSelfAttentionMultiply', 'UNetTemporalAttentionMultiply'), CARRIED),
    # REFUSED (27)
    **dict.fromkeys(('ARVideoI2V', 'ApplyRifleXRoPE_WanVideo', 'FluxKVCache', 
                    'HiDreamO1PatchSeamSmoothing', 'HyperTile', 'LTX2AttentionTunerPatch',
                    'LTX2AudioLatentNormalizingSampling', 'LTXVChunkFeedForward', 'LTXVEnhanceAVideoKJ',
                    'LTXVModalityGuidance', 'LTXVSpatioTemporalGuidance', 'LatentInpaintTTM',
                    'LeapfusionHunyuanI2VPatcher', 'MiniMaxH3SigmaShift', 'ModelAttentionBackend',
                    'ModelPatchTorchSettings', 'NABLA_AttentionKJ', 'NAGuidance', 'PatchModelAddDownscale',
                    'SelfAttentionGuidance', 'SkipLayerGuidanceWanVideo', 'TomePatchModel',
                    'TorchCompileModelAdvanced', 'WanAnimate2Cache', 'WanChunkFeedForward',
                    'WanVideoEnhanceAVideoKJ', 'WanVideoNAG'), REFUSED),
    # packs the tests stand in for (tests/standins; their mechanisms read in the real packs' code)
    "ApplyFBCacheOnModel": CARRIED,       # Comfy-WaveSpeed: the workers apply First Block Cache's rule (SD3/3.5)
    "CacheDiT_Model_Optimizer": REFUSED,  # ComfyUI-CacheDiT: replaces the model's forward when sampling starts
    "UNETLoaderMultiGPU": PLAIN,          # ComfyUI-MultiGPU: ComfyUI's loader on a chosen device
    **{k: CARRIED for k in BY_FAMILY},
    # not probed (UNPROBED says why): classified from their code
    **{k: v for k, (v, _) in UNPROBED.items()},
}


def unclassified(class_types) -> list:
    """The classes among `class_types` that may have put something on a MODEL or conditioning (not PLAIN, not the
    pack's own): the nodes a refusal names when nothing else tells which one it was."""
    return [c for c in class_types if c not in OWN and NODES.get(c) != PLAIN]


def refused_in(prompt: dict, loop: bool) -> list:
    """The node classes of an API prompt that the pack refuses (in the workers' loop also the STEP ones): a prompt
    holding one is refused when its sampler runs, so queueing it starts no workers (workers/driver/routes.warm_on_prompt)."""
    bad = (REFUSED, STEP) if loop else (REFUSED,)
    return sorted({n.get("class_type") for n in prompt.values() if isinstance(n, dict) and
                   NODES.get(n.get("class_type")) in bad})
