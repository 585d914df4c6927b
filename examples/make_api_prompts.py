"""Writes examples/api/*.json: API-format prompts for each family with real ComfyUI loaders.

Sizes are multiples of 16 (what the frontend's size widgets allow), and every optional widget is
spelled out, so that the drag-and-drop workflows in examples/workflows/ turn into exactly these
prompts (tests/test_web_browser.py checks it in the real frontend and regenerates them with
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
            "attention": "auto", "devices": "", "sampling_mode": "auto"}


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


if __name__ == "__main__":
    for name, g in all_prompts().items():
        (HERE / "api" / f"{name}.json").write_text(json.dumps(g, indent=1) + "\n")
        print("wrote", HERE / "api" / f"{name}.json")
