"""The model files of the pack's templates: each file's download link and models/ folder, as ComfyUI's official
templates give them (package comfyui_workflow_templates 0.7.25 and 0.11), and the `properties.models` list a loader
node of a template carries (examples/make_templates.py; the frontend shows them in its missing-models dialog)."""

HF = "https://huggingface.co/"
FLUX_TE = HF + "comfyanonymous/flux_text_encoders/resolve/main/"
WAN21 = HF + "Comfy-Org/Wan_2.1_ComfyUI_repackaged/resolve/main/split_files/"
WAN22 = HF + "Comfy-Org/Wan_2.2_ComfyUI_Repackaged/resolve/main/split_files/"
QWEN = HF + "Comfy-Org/Qwen-Image_ComfyUI/resolve/main/split_files/"
HYV15 = HF + "Comfy-Org/HunyuanVideo_1.5_repackaged/resolve/main/split_files/"
ZIMAGE = HF + "Comfy-Org/z_image/resolve/main/split_files/"
ZIMAGE_TURBO = HF + "Comfy-Org/z_image_turbo/resolve/main/split_files/"
LTX23 = "ltx-2.3-22b-dev-fp8.safetensors"
LTX23_LORA = "ltx_2.3_22b_distilled_1.1_lora_dynamic_fro09_avg_rank_111_bf16.safetensors"
GEMMA3 = "gemma_3_12B_it_fp4_mixed.safetensors"
MMH3 = HF + "Comfy-Org/MiniMax-H3/resolve/main/"  # video_minimax_h3_t2v's links (comfyui_workflow_templates 0.11)
MMH3_DIT = "minimax_h3_fl2va_pruned_int8_convrot.safetensors"
MMH3_TE = "qwen3vl_32b_minimax_h3_nvfp4_awq.safetensors"
MMH3_VAE = "minimax_h3_video_vae_fp16.safetensors"
MMH3_AUDIO_VAE = "minimax_h3_audio_vae_fp32.safetensors"

# file name -> (download URL, models/ folder), as ComfyUI's official templates give them
MODELS = {
    "flux1-dev-fp8.safetensors": (HF + "Comfy-Org/flux1-dev/resolve/main/flux1-dev-fp8.safetensors?download=true",
                                  "checkpoints"),
    "sd3.5_large_fp8_scaled.safetensors": (
        HF + "Comfy-Org/stable-diffusion-3.5-fp8/resolve/main/sd3.5_large_fp8_scaled.safetensors?download=true",
        "checkpoints"),
    "qwen_image_fp8_e4m3fn.safetensors": (QWEN + "diffusion_models/qwen_image_fp8_e4m3fn.safetensors",
                                          "diffusion_models"),
    "qwen_image_vae.safetensors": (QWEN + "vae/qwen_image_vae.safetensors", "vae"),
    "wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors": (
        WAN22 + "diffusion_models/wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", "diffusion_models"),
    "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors": (
        WAN22 + "diffusion_models/wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors", "diffusion_models"),
    "umt5_xxl_fp8_e4m3fn_scaled.safetensors": (WAN21 + "text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors",
                                               "text_encoders"),
    "wan_2.1_vae.safetensors": (WAN22 + "vae/wan_2.1_vae.safetensors", "vae"),
    "wan2.2_ti2v_5B_fp16.safetensors": (WAN22 + "diffusion_models/wan2.2_ti2v_5B_fp16.safetensors",
                                        "diffusion_models"),
    "wan2.2_vae.safetensors": (WAN22 + "vae/wan2.2_vae.safetensors", "vae"),
    "hunyuanvideo1.5_720p_t2v_fp16.safetensors": (
        HYV15 + "diffusion_models/hunyuanvideo1.5_720p_t2v_fp16.safetensors", "diffusion_models"),
    "byt5_small_glyphxl_fp16.safetensors": (HYV15 + "text_encoders/byt5_small_glyphxl_fp16.safetensors",
                                            "text_encoders"),
    "hunyuanvideo15_vae_fp16.safetensors": (HYV15 + "vae/hunyuanvideo15_vae_fp16.safetensors", "vae"),
    "flux1-dev-kontext_fp8_scaled.safetensors": (
        HF + "Comfy-Org/flux1-kontext-dev_ComfyUI/resolve/main/split_files/diffusion_models/"
        "flux1-dev-kontext_fp8_scaled.safetensors", "diffusion_models"),
    "clip_l.safetensors": (FLUX_TE + "clip_l.safetensors", "text_encoders"),
    "t5xxl_fp8_e4m3fn_scaled.safetensors": (FLUX_TE + "t5xxl_fp8_e4m3fn_scaled.safetensors", "text_encoders"),
    "ae.safetensors": (HF + "Comfy-Org/Lumina_Image_2.0_Repackaged/resolve/main/split_files/vae/ae.safetensors",
                       "vae"),
    "z_image_bf16.safetensors": (ZIMAGE + "diffusion_models/z_image_bf16.safetensors", "diffusion_models"),
    "qwen_3_4b.safetensors": (ZIMAGE_TURBO + "text_encoders/qwen_3_4b.safetensors", "text_encoders"),
    LTX23: (HF + "Lightricks/LTX-2.3-fp8/resolve/main/" + LTX23, "checkpoints"),
    LTX23_LORA: (HF + "Comfy-Org/ltx-2.3/resolve/main/split_files/loras/" + LTX23_LORA, "loras"),
    GEMMA3: (HF + "Comfy-Org/ltx-2/resolve/main/split_files/text_encoders/" + GEMMA3, "text_encoders"),
    MMH3_DIT: (MMH3 + "diffusion_models/" + MMH3_DIT, "diffusion_models"),
    MMH3_TE: (MMH3 + "text_encoders/" + MMH3_TE, "text_encoders"),
    MMH3_VAE: (MMH3 + "vae/" + MMH3_VAE, "vae"),
    MMH3_AUDIO_VAE: (MMH3 + "vae/" + MMH3_AUDIO_VAE, "vae"),
}
# the Qwen 2.5 VL text encoder is the same file in two repackaged repos; each template links its own model's
QWEN_VL = "qwen_2.5_vl_7b_fp8_scaled.safetensors"
QWEN_VL_URL = {"qwen_image": QWEN + "text_encoders/" + QWEN_VL, "hunyuan": HYV15 + "text_encoders/" + QWEN_VL}
# a file some official template links from its own model's repo instead of MODELS' URL: (source, file) -> URL
# (image_z_image links the Flux `ae` from the Z-Image Turbo repo; the same file)
SOURCE_URL = {("z_image", "ae.safetensors"): ZIMAGE_TURBO + "vae/ae.safetensors"}

# widgets that name model files, per loader: these get `properties.models`
LOADER_FILES = {"CheckpointLoaderSimple": ("ckpt_name",), "UNETLoader": ("unet_name",), "VAELoader": ("vae_name",),
                "CLIPLoader": ("clip_name",), "DualCLIPLoader": ("clip_name1", "clip_name2"),
                "LTXAVTextEncoderLoader": ("text_encoder", "ckpt_name"), "LTXVAudioVAELoader": ("ckpt_name",),
                "LoraLoaderModelOnly": ("lora_name",)}


def where(*files) -> str:
    """The lines of a Note that say where each file goes (models/<folder>/<file>)."""
    lines = []
    for f in files:
        folder = MODELS[f][1] if f in MODELS else "text_encoders"
        lines.append(f"  models/{folder}/{f}")
    return "\n".join(lines)


def model_links(prompt: dict, source: str = None) -> dict:
    """node id -> ComfyUI's `properties.models` list ({name, url, directory}) for each loader of `prompt`; `source`
    (templates()' third element) picks the Qwen 2.5 VL link and any SOURCE_URL override."""
    out = {}
    for nid, n in prompt.items():
        keys = LOADER_FILES.get(n["class_type"], ())
        files = [n["inputs"][k] for k in keys]
        links = []
        for f in files:
            if f == QWEN_VL:
                links.append({"name": f, "url": QWEN_VL_URL[source], "directory": "text_encoders"})
            elif (source, f) in SOURCE_URL:
                links.append({"name": f, "url": SOURCE_URL[source, f], "directory": MODELS[f][1]})
            else:
                url, directory = MODELS[f]
                links.append({"name": f, "url": url, "directory": directory})
        if links:
            out[nid] = links
    return out
