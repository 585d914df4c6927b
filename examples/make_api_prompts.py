"""Writes examples/api/*.json: API-format prompts for each family with real ComfyUI loaders.

Sizes are multiples of 16 (what the frontend's size widgets allow), and every optional widget is
spelled out, so that the drag-and-drop workflows in examples/workflows/ turn into exactly these
prompts (tests/web/test_web_browser.py checks it in the real frontend and regenerates them with
HP_UPDATE_EXAMPLES=1).

Model file names are the usual ones from the model cards; rename them to what your
models/ folders hold. Post one with `python examples/post_prompt.py examples/api/<file>.json`.
Regenerate with `python examples/make_api_prompts.py` (tests check every node and input exists).
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

PARALLEL = {"dp_degree": 1, "cfg_degree": 2, "ulysses_degree": 2, "ring_degree": 1, "pp_degree": 1,
            "num_pipeline_patch": 0, "warmup_steps": 1, "tp_degree": 1, "method": "usp", "device": "auto",
            "attention": "auto", "devices": "", "sampling_mode": "auto", "shard_weights": "none", "step_cache": 0.0,
            "degrees": "manual"}


def prompt(unet, clip_node, latent_node, vae, steps, cfg, sampler, scheduler, prefix, parallel=None,
           positive_extra=None):
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
        "2": clip_node,
        "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0],
                                                          "text": "a lighthouse on a cliff at dawn, oil painting"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": "blurry, low quality"}},
        "5": latent_node,
        "6": {"class_type": "HybridParallelConfig", "inputs": dict(PARALLEL, **(parallel or {}))},
        "7": {"class_type": "HybridSampler", "inputs": {
            "model": ["1", 0], "seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler,
            "scheduler": scheduler, "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0],
            "parallel_config": ["6", 0], "denoise": 1.0}},
        "8": {"class_type": "VAELoader", "inputs": {"vae_name": vae}},
        "9": {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["7", 0], "vae": ["8", 0],
                                                               "parallel_config": ["6", 0], "block_size": 0}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": prefix}},
    }
    if positive_extra:
        g["11"] = positive_extra
        g["7"]["inputs"]["positive"] = ["11", 0]
    return g


def all_prompts():
    latent = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1008, "height": 1504, "batch_size": 1}}
    return {
        "flux_dev_cfg1_ulysses2": prompt(
            "flux1-dev.safetensors",
            {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
                                                        "clip_name2": "t5xxl_fp16.safetensors", "type": "flux",
                                                        "device": "default"}},
            latent, "ae.safetensors", 20, 1.0, "euler", "simple", "flux_hybrid",
            parallel={"cfg_degree": 1, "ulysses_degree": 2},
            positive_extra={"class_type": "FluxGuidance", "inputs": {"conditioning": ["3", 0], "guidance": 3.5}}),
        "sd35_cfg2_ulysses2": prompt(
            "sd3.5_medium.safetensors",
            {"class_type": "TripleCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
                                                          "clip_name2": "clip_g.safetensors",
                                                          "clip_name3": "t5xxl_fp16.safetensors"}},
            latent, "sd3.5_vae.safetensors", 28, 4.5, "euler", "sgm_uniform", "sd35_hybrid"),
        "pixart_sigma_pipefusion2": prompt(
            "PixArt-Sigma-XL-2-1024-MS.safetensors",
            {"class_type": "CLIPLoader", "inputs": {"clip_name": "t5xxl_fp16.safetensors", "type": "pixart",
                                                    "device": "default"}},
            {"class_type": "EmptyLatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
            "sdxl_vae.safetensors", 20, 4.5, "euler", "normal", "pixart_hybrid",
            parallel={"cfg_degree": 1, "ulysses_degree": 1, "pp_degree": 2, "num_pipeline_patch": 4,
                      "warmup_steps": 2}),
        "wan21_t2v_ulysses2_ring2": prompt(
            "wan2.1_t2v_1.3B_fp16.safetensors",
            {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                                    "type": "wan", "device": "default"}},
            {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 832, "height": 480, "length": 81,
                                                                 "batch_size": 1}},
            "wan_2.1_vae.safetensors", 30, 6.0, "uni_pc", "simple", "wan_hybrid",
            parallel={"cfg_degree": 2, "ulysses_degree": 2, "ring_degree": 2}),
    }


def _text(clip, text):
    return {"class_type": "CLIPTextEncode", "inputs": {"clip": clip, "text": text}}


def _parallel(**degrees):
    return {"class_type": "HybridParallelConfig", "inputs": dict(PARALLEL, **degrees)}


def wan22_i2v_two_experts():
    """Wan 2.2 14B image-to-video: the high-noise expert for the first half of the steps, the low-noise expert for
    the rest (two KSamplerAdvanced, leftover noise handed over), both through Parallel Model on one pool."""
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "UNETLoader", "inputs": {"unet_name": "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors",
                                                     "weight_dtype": "default"}},
        "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": "umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                                     "type": "wan", "device": "default"}},
        "4": _text(["3", 0], "the lighthouse beam sweeps over a stormy sea, waves crash on the cliff"),
        "5": _text(["3", 0], "static, blurry, low quality"),
        "6": {"class_type": "VAELoader", "inputs": {"vae_name": "wan_2.1_vae.safetensors"}},
        "7": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "8": {"class_type": "WanImageToVideo", "inputs": {"positive": ["4", 0], "negative": ["5", 0], "vae": ["6", 0],
                                                          "width": 832, "height": 480, "length": 81, "batch_size": 1,
                                                          "start_image": ["7", 0]}},
        "9": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "10": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "11": _parallel(cfg_degree=2, ulysses_degree=2),
        "12": {"class_type": "HybridParallelModel", "inputs": {"model": ["9", 0], "parallel_config": ["11", 0]}},
        "13": {"class_type": "HybridParallelModel", "inputs": {"model": ["10", 0], "parallel_config": ["11", 0]}},
    }
    adv = {"noise_seed": 42, "steps": 20, "cfg": 3.5, "sampler_name": "euler", "scheduler": "simple",
           "positive": ["8", 0], "negative": ["8", 1]}
    g["14"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["12", 0], "add_noise": "enable", **adv, "latent_image": ["8", 2], "start_at_step": 0,
        "end_at_step": 10, "return_with_leftover_noise": "enable"}}
    g["15"] = {"class_type": "KSamplerAdvanced", "inputs": {
        "model": ["13", 0], "add_noise": "disable", **adv, "latent_image": ["14", 0], "start_at_step": 10,
        "end_at_step": 10000, "return_with_leftover_noise": "disable"}}
    g["16"] = {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["15", 0], "vae": ["6", 0],
                                                                "parallel_config": ["11", 0], "block_size": 0}}
    g["17"] = {"class_type": "SaveImage", "inputs": {"images": ["16", 0], "filename_prefix": "wan22_i2v_hybrid"}}
    return g


def qwen_image():
    """Qwen-Image (fp8) through Hybrid Sampler with CFG parallel x Ulysses."""
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "qwen_image_fp8_e4m3fn.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "CLIPLoader", "inputs": {"clip_name": "qwen_2.5_vl_7b_fp8_scaled.safetensors",
                                                     "type": "qwen_image", "device": "default"}},
        "3": _text(["2", 0], "a lighthouse on a cliff at dawn, a sign reading \"HYBRID\" on its door"),
        "4": _text(["2", 0], ""),
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1328, "height": 1328, "batch_size": 1}},
        "6": {"class_type": "ModelSamplingAuraFlow", "inputs": {"model": ["1", 0], "shift": 3.1}},
        "7": _parallel(cfg_degree=2, ulysses_degree=2),
        "8": {"class_type": "HybridSampler", "inputs": {
            "model": ["6", 0], "seed": 42, "steps": 20, "cfg": 2.5, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["3", 0], "negative": ["4", 0], "latent_image": ["5", 0], "parallel_config": ["7", 0],
            "denoise": 1.0}},
        "9": {"class_type": "VAELoader", "inputs": {"vae_name": "qwen_image_vae.safetensors"}},
        "10": {"class_type": "VAEDecode", "inputs": {"samples": ["8", 0], "vae": ["9", 0]}},
        "11": {"class_type": "SaveImage", "inputs": {"images": ["10", 0], "filename_prefix": "qwen_image_hybrid"}},
    }
    return g


def flux_kontext_custom_advanced():
    """Flux Kontext edit with SamplerCustomAdvanced: the input image joins as a reference latent (its tokens are
    split with the image's), a BasicGuider, custom sigmas; Parallel Model puts the model on the pool."""
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "flux1-dev-kontext_fp8_scaled.safetensors",
                                                     "weight_dtype": "default"}},
        "2": {"class_type": "DualCLIPLoader", "inputs": {"clip_name1": "clip_l.safetensors",
                                                         "clip_name2": "t5xxl_fp8_e4m3fn_scaled.safetensors",
                                                         "type": "flux", "device": "default"}},
        "3": _text(["2", 0], "make it a winter scene with snow on the cliff"),
        "4": {"class_type": "VAELoader", "inputs": {"vae_name": "ae.safetensors"}},
        "5": {"class_type": "LoadImage", "inputs": {"image": "example.png"}},
        "6": {"class_type": "VAEEncode", "inputs": {"pixels": ["5", 0], "vae": ["4", 0]}},
        "7": {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["3", 0], "latent": ["6", 0]}},
        "8": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["7", 0], "guidance": 2.5}},
        "9": _parallel(cfg_degree=1, ulysses_degree=2),
        "10": {"class_type": "HybridParallelModel", "inputs": {"model": ["1", 0], "parallel_config": ["9", 0]}},
        "11": {"class_type": "BasicGuider", "inputs": {"model": ["10", 0], "conditioning": ["8", 0]}},
        "12": {"class_type": "RandomNoise", "inputs": {"noise_seed": 42}},
        "13": {"class_type": "KSamplerSelect", "inputs": {"sampler_name": "euler"}},
        "14": {"class_type": "BasicScheduler", "inputs": {"model": ["10", 0], "scheduler": "simple", "steps": 20,
                                                          "denoise": 1.0}},
        "15": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "16": {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["12", 0], "guider": ["11", 0],
                                                                 "sampler": ["13", 0], "sigmas": ["14", 0],
                                                                 "latent_image": ["15", 0]}},
        "17": {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["16", 0], "vae": ["4", 0],
                                                                "parallel_config": ["9", 0], "block_size": 0}},
        "18": {"class_type": "SaveImage", "inputs": {"images": ["17", 0], "filename_prefix": "flux_kontext_hybrid"}},
    }
    return g


def more_prompts():
    return {"wan22_i2v_14b_two_experts_cfg2_ulysses2": wan22_i2v_two_experts(),
            "qwen_image_cfg2_ulysses2": qwen_image(),
            "flux_kontext_samplercustomadvanced_ulysses2": flux_kontext_custom_advanced()}


if __name__ == "__main__":
    for name, g in {**all_prompts(), **more_prompts()}.items():
        (HERE / "api" / f"{name}.json").write_text(json.dumps(g, indent=1) + "\n")
        print("wrote", HERE / "api" / f"{name}.json")
