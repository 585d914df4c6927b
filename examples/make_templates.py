"""The pack's ComfyUI templates: example_workflows/<name>.json (what ComfyUI's Templates browser lists for a custom
node pack) and their API form examples/template_prompts/<name>.json.

One template per common case of a GPU owner, on the simple path README starts a user on - Parallel GPUs (the GPUs
and a preset) -> Parallel Model in front of ComfyUI's own sampler nodes - and on ComfyUI's own loaders and file names (those of ComfyUI's official
templates, package comfyui_workflow_templates 0.7.25, whose `properties.models` download links are copied here).
`python examples/make_templates.py` writes the API prompts; the drag-and-drop UI files are made from them by the
real frontend (tests/web/test_web_browser_templates.py with HP_UPDATE_TEMPLATES=1: loadApiJson, then the Note node and
the model links added, then the frontend's own serialize) together with a screenshot of each as its Templates-browser
thumbnail (<name>.jpg). docs/templates.md describes them. The files' links: template_models.py; the Notes:
template_notes.py.
"""
import json
from pathlib import Path

try:
    from template_models import (GEMMA3, LTX23, LTX23_LORA, MMH3_AUDIO_VAE, MMH3_DIT, MMH3_TE, MMH3_VAE,  # noqa: F401
                                 QWEN_VL, model_links)  # (model_links: re-exported for the frontend's UI files)
    from template_notes import NOTES
except ImportError:  # imported as examples.make_templates
    from .template_models import (GEMMA3, LTX23, LTX23_LORA, MMH3_AUDIO_VAE, MMH3_DIT, MMH3_TE, MMH3_VAE,  # noqa: F401
                                  QWEN_VL, model_links)
    from .template_notes import NOTES

HERE = Path(__file__).resolve().parent
UI_DIR = HERE.parent / "example_workflows"
API_DIR = HERE / "template_prompts"

WAN_NEGATIVE = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，"
                "多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，"
                "倒着走")  # the official Wan templates' negative prompt


def node(cls, **inputs):
    return {"class_type": cls, "inputs": inputs}


def gpus(devices="all", preset="split the image"):
    """Parallel GPUs, the simple node: which GPUs and how they split the work (the Note says when to change it)."""
    return node("HybridParallelGPUs", devices=devices, preset=preset)


def on_gpus(model, config):
    """Parallel Model: the MODEL on the pool, for ComfyUI's own sampler nodes."""
    return node("HybridParallelModel", model=model, parallel_config=config)


def text(clip, prompt):
    return node("CLIPTextEncode", text=prompt, clip=clip)


def ksampler(model, positive, negative, latent, steps, cfg, sampler="euler", scheduler="simple"):
    return node("KSampler", model=model, seed=42, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
                positive=positive, negative=negative, latent_image=latent, denoise=1.0)


def patch_decode(samples, vae, config):
    return node("HybridPatchVAEDecode", samples=samples, vae=vae, parallel_config=config, block_size=0)


def flux_dev(ulysses):
    """Flux.1 dev fp8 (the single-file checkpoint of ComfyUI's flux_dev_checkpoint_example): no CFG, guidance 3.5."""
    return {
        "1": node("CheckpointLoaderSimple", ckpt_name="flux1-dev-fp8.safetensors"),
        "2": text(["1", 1], "a lighthouse on a cliff at dawn, waves below, warm light, detailed oil painting"),
        "3": node("FluxGuidance", conditioning=["2", 0], guidance=3.5),
        "4": node("ConditioningZeroOut", conditioning=["2", 0]),
        "5": node("EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
        "6": gpus(devices=str(ulysses), preset="split the image"),
        "10": on_gpus(["1", 0], ["6", 0]),
        "7": ksampler(["10", 0], ["3", 0], ["4", 0], ["5", 0], 20, 1.0),
        "8": patch_decode(["7", 0], ["1", 2], ["6", 0]),
        "9": node("SaveImage", images=["8", 0], filename_prefix="hybrid/flux_dev"),
    }


def sd35_large():
    """SD3.5 Large fp8 (ComfyUI's sd3.5_simple_example): CFG 4, 'cfg + split the image' on 4 GPUs (cfg 2 x
    ulysses 2)."""
    return {
        "1": node("CheckpointLoaderSimple", ckpt_name="sd3.5_large_fp8_scaled.safetensors"),
        "2": text(["1", 1], "a bottle with a pink and red galaxy inside it on a wooden table in a modern kitchen, "
                            "window to a mountain range, bright sun"),
        "3": text(["1", 1], "blurry, low quality"),
        "4": node("EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
        "5": gpus(devices="4", preset="cfg + split the image"),
        "9": on_gpus(["1", 0], ["5", 0]),
        "6": ksampler(["9", 0], ["2", 0], ["3", 0], ["4", 0], 20, 4.0, scheduler="sgm_uniform"),
        "7": patch_decode(["6", 0], ["1", 2], ["5", 0]),
        "8": node("SaveImage", images=["7", 0], filename_prefix="hybrid/sd35_large"),
    }


def qwen_image():
    """Qwen-Image fp8 (ComfyUI's image_qwen_image, without the Lightning LoRA): cfg 2.5; 'large model (shard weights)'
    on every GPU: the image tokens split over all of them and the 20 GB of fp8 weights too (5 GB per GPU on 4), so
    24 GB cards have room for the 1328x1328 activations."""
    return {
        "1": node("UNETLoader", unet_name="qwen_image_fp8_e4m3fn.safetensors", weight_dtype="default"),
        "2": node("CLIPLoader", clip_name=QWEN_VL, type="qwen_image", device="default"),
        "3": node("VAELoader", vae_name="qwen_image_vae.safetensors"),
        "4": text(["2", 0], "a lighthouse on a cliff at dawn, a wooden sign on its door reading \"HYBRID PARALLEL\""),
        "5": text(["2", 0], ""),
        "6": node("ModelSamplingAuraFlow", model=["1", 0], shift=3.1),
        "7": node("EmptySD3LatentImage", width=1328, height=1328, batch_size=1),
        "8": gpus(devices="all", preset="large model (shard weights)"),
        "12": on_gpus(["6", 0], ["8", 0]),
        "9": ksampler(["12", 0], ["4", 0], ["5", 0], ["7", 0], 20, 2.5),
        "10": patch_decode(["9", 0], ["3", 0], ["8", 0]),
        "11": node("SaveImage", images=["10", 0], filename_prefix="hybrid/qwen_image"),
    }


def wan22_i2v_14b():
    """Wan 2.2 14B image-to-video (ComfyUI's video_wan2_2_14B_i2v, its 20-step pair): high-noise expert for steps
    0-10, low-noise expert for 10-20, both on one pool through Parallel Model; 'large model (shard weights)' keeps 1/N
    of each expert per GPU (2 x 14.3 GB fp8 / 4 = 7.2 GB on 4), so both fit a 24 GB card with the activations."""
    adv = dict(noise_seed=42, steps=20, cfg=3.5, sampler_name="euler", scheduler="simple", positive=["9", 0],
               negative=["9", 1])
    return {
        "1": node("UNETLoader", unet_name="wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", weight_dtype="default"),
        "2": node("UNETLoader", unet_name="wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors", weight_dtype="default"),
        "3": node("CLIPLoader", clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan", device="default"),
        "4": node("VAELoader", vae_name="wan_2.1_vae.safetensors"),
        "5": node("LoadImage", image="example.png"),
        "6": text(["3", 0], "the camera slowly circles the subject, soft wind moves the hair, cinematic light"),
        "7": text(["3", 0], WAN_NEGATIVE),
        "8": gpus(devices="all", preset="large model (shard weights)"),
        "9": node("WanImageToVideo", positive=["6", 0], negative=["7", 0], vae=["4", 0], width=640, height=640,
                  length=81, batch_size=1, start_image=["5", 0]),
        "10": node("ModelSamplingSD3", model=["1", 0], shift=8.0),
        "11": node("ModelSamplingSD3", model=["2", 0], shift=8.0),
        "12": on_gpus(["10", 0], ["8", 0]),
        "13": on_gpus(["11", 0], ["8", 0]),
        "14": node("KSamplerAdvanced", model=["12", 0], add_noise="enable", **adv, latent_image=["9", 2],
                   start_at_step=0, end_at_step=10, return_with_leftover_noise="enable"),
        "15": node("KSamplerAdvanced", model=["13", 0], add_noise="disable", **adv, latent_image=["14", 0],
                   start_at_step=10, end_at_step=10000, return_with_leftover_noise="disable"),
        "16": patch_decode(["15", 0], ["4", 0], ["8", 0]),
        "17": node("CreateVideo", images=["16", 0], fps=16.0),
        "18": node("SaveVideo", video=["17", 0], filename_prefix="hybrid/wan22_i2v", format="auto", codec="auto"),
    }


def wan22_ti2v_5b():
    """Wan 2.2 TI2V 5B (ComfyUI's video_wan2_2_5B_ti2v): 1280x704, 121 frames, CFG 5: 'cfg + split
    the image' on 4 GPUs (cfg 2 x ulysses 2)."""
    return {
        "1": node("UNETLoader", unet_name="wan2.2_ti2v_5B_fp16.safetensors", weight_dtype="default"),
        "2": node("CLIPLoader", clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan", device="default"),
        "3": node("VAELoader", vae_name="wan2.2_vae.safetensors"),
        "4": node("LoadImage", image="example.png"),
        "5": text(["2", 0], "a street musician plays guitar in a retro subway station, commuters pass by, the camera "
                            "slowly moves right"),
        "6": text(["2", 0], WAN_NEGATIVE),
        "7": node("Wan22ImageToVideoLatent", vae=["3", 0], width=1280, height=704, length=121, batch_size=1,
                  start_image=["4", 0]),
        "8": node("ModelSamplingSD3", model=["1", 0], shift=8.0),
        "9": gpus(devices="4", preset="cfg + split the image"),
        "14": on_gpus(["8", 0], ["9", 0]),
        "10": ksampler(["14", 0], ["5", 0], ["6", 0], ["7", 0], 20, 5.0, sampler="uni_pc"),
        "11": patch_decode(["10", 0], ["3", 0], ["9", 0]),
        "12": node("CreateVideo", images=["11", 0], fps=24.0),
        "13": node("SaveVideo", video=["12", 0], filename_prefix="hybrid/wan22_ti2v", format="auto", codec="auto"),
    }


def hunyuan_video15():
    """HunyuanVideo 1.5 720p text-to-video (ComfyUI's video_hunyuan_video_1.5_720p_t2v, base pass): cfg 6;
    'large model (shard weights)' on every GPU (the 16.7 GB fp16 model: 4.2 GB per GPU on 4). Its VAE is not one Patch VAE Decode
    splits: VAE Decode, as in the official template."""
    return {
        "1": node("UNETLoader", unet_name="hunyuanvideo1.5_720p_t2v_fp16.safetensors", weight_dtype="default"),
        "2": node("DualCLIPLoader", clip_name1=QWEN_VL, clip_name2="byt5_small_glyphxl_fp16.safetensors",
                  type="hunyuan_video_15", device="default"),
        "3": node("VAELoader", vae_name="hunyuanvideo15_vae_fp16.safetensors"),
        "4": text(["2", 0], "a paper airplane glides between skyscrapers at sunset, the camera follows it, "
                            "golden light"),
        "5": text(["2", 0], ""),
        "6": node("ModelSamplingSD3", model=["1", 0], shift=7.0),
        "7": node("EmptyHunyuanVideo15Latent", width=1280, height=720, length=121, batch_size=1),
        "8": gpus(devices="all", preset="large model (shard weights)"),
        "13": on_gpus(["6", 0], ["8", 0]),
        "9": ksampler(["13", 0], ["4", 0], ["5", 0], ["7", 0], 20, 6.0),
        "10": node("VAEDecode", samples=["9", 0], vae=["3", 0]),
        "11": node("CreateVideo", images=["10", 0], fps=24.0),
        "12": node("SaveVideo", video=["11", 0], filename_prefix="hybrid/hunyuan_video15", format="auto",
                   codec="auto"),
    }


def flux_kontext():
    """Flux.1 Kontext dev fp8 image edit (ComfyUI's flux_kontext_dev_basic, one input image): the scaled input is
    the reference latent and the start latent; guidance 2.5, no CFG; 'split the image' on
    2 GPUs."""
    return {
        "1": node("UNETLoader", unet_name="flux1-dev-kontext_fp8_scaled.safetensors", weight_dtype="default"),
        "2": node("DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="t5xxl_fp8_e4m3fn_scaled.safetensors",
                  type="flux", device="default"),
        "3": node("VAELoader", vae_name="ae.safetensors"),
        "4": node("LoadImage", image="example.png"),
        "5": node("FluxKontextImageScale", image=["4", 0]),
        "6": node("VAEEncode", pixels=["5", 0], vae=["3", 0]),
        "7": text(["2", 0], "make it a winter scene with snow on the ground, keep everything else the same"),
        "8": node("ReferenceLatent", conditioning=["7", 0], latent=["6", 0]),
        "9": node("FluxGuidance", conditioning=["8", 0], guidance=2.5),
        "10": node("ConditioningZeroOut", conditioning=["7", 0]),
        "11": gpus(devices="2", preset="split the image"),
        "15": on_gpus(["1", 0], ["11", 0]),
        "12": ksampler(["15", 0], ["9", 0], ["10", 0], ["6", 0], 20, 1.0),
        "13": patch_decode(["12", 0], ["3", 0], ["11", 0]),
        "14": node("SaveImage", images=["13", 0], filename_prefix="hybrid/flux_kontext"),
    }


def z_image():
    """Z-Image base bf16 (ComfyUI's image_z_image): 1024x1024, 25 steps, cfg 4 res_multistep, shift 3; the CFG
    halves on 2 GPUs ('cfg + split the image' on 2: cfg 2), Parallel VAE Decode splits the Flux `ae` decode over them."""
    return {
        "1": node("UNETLoader", unet_name="z_image_bf16.safetensors", weight_dtype="default"),
        "2": node("CLIPLoader", clip_name="qwen_3_4b.safetensors", type="lumina2", device="default"),
        "3": node("VAELoader", vae_name="ae.safetensors"),
        "4": text(["2", 0], "a fashion photograph in a dreamlike forest of blue trees under a clear light blue sky, "
                            "a model in a yellow and white striped dress walking on the sand, low angle, noon sun"),
        "5": text(["2", 0], ""),
        "6": node("ModelSamplingAuraFlow", model=["1", 0], shift=3.0),
        "7": node("EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
        "8": gpus(devices="2", preset="cfg + split the image"),
        "12": on_gpus(["6", 0], ["8", 0]),
        "9": ksampler(["12", 0], ["4", 0], ["5", 0], ["7", 0], 25, 4.0, sampler="res_multistep"),
        "10": patch_decode(["9", 0], ["3", 0], ["8", 0]),
        "11": node("SaveImage", images=["10", 0], filename_prefix="hybrid/z_image"),
    }


def ltx23_t2v():
    """LTX-2.3 22B fp8 text-to-video with audio (ComfyUI's video_ltx2_3_t2v, its subgraph flattened to the
    essential path): the dev checkpoint (DiT + video VAE + audio VAE in one file) with the distilled LoRA at 0.5,
    cfg 1, the template's 8 manual sigmas, euler; one pass at the full size instead of the template's half-size
    pass + latent upscaler + 3 refining steps, and no prompt-enhancer LLM. cfg 1: no CFG half to split, so the
    video tokens go over 4 GPUs (ulysses 4) through Parallel Model before the template's own sampler nodes; the
    audio tokens stay whole on every GPU. VAE decode (tiled) and the audio decode run in ComfyUI, as in the
    template."""
    return {
        "1": node("CheckpointLoaderSimple", ckpt_name=LTX23),
        "2": node("LTXAVTextEncoderLoader", text_encoder=GEMMA3, ckpt_name=LTX23, device="default"),
        "3": node("LTXVAudioVAELoader", ckpt_name=LTX23),
        "4": node("LoraLoaderModelOnly", model=["1", 0], lora_name=LTX23_LORA, strength_model=0.5),
        "5": text(["2", 0], "a close-up of a vintage radio on a wooden table, its dial glowing warm orange as it "
                            "plays a soft jazz tune, dust drifting in a beam of sunlight, the camera slowly pushes in"),
        "6": text(["2", 0], "pc game, console game, video game, cartoon, childish, ugly"),
        "7": node("LTXVConditioning", positive=["5", 0], negative=["6", 0], frame_rate=25.0),
        "8": node("EmptyLTXVLatentVideo", width=1280, height=704, length=121, batch_size=1),
        "9": node("LTXVEmptyLatentAudio", frames_number=121, frame_rate=25, batch_size=1, audio_vae=["3", 0]),
        "10": node("LTXVConcatAVLatent", video_latent=["8", 0], audio_latent=["9", 0]),
        "11": gpus(devices="4", preset="split the image"),
        "12": on_gpus(["4", 0], ["11", 0]),
        "13": node("CFGGuider", model=["12", 0], positive=["7", 0], negative=["7", 1], cfg=1.0),
        "14": node("RandomNoise", noise_seed=42),
        "15": node("KSamplerSelect", sampler_name="euler"),
        "16": node("ManualSigmas", sigmas="1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875, 0.0"),
        "17": node("SamplerCustomAdvanced", noise=["14", 0], guider=["13", 0], sampler=["15", 0], sigmas=["16", 0],
                   latent_image=["10", 0]),
        "18": node("LTXVSeparateAVLatent", av_latent=["17", 0]),
        "19": node("VAEDecodeTiled", samples=["18", 0], vae=["1", 2], tile_size=768, overlap=64, temporal_size=4096,
                   temporal_overlap=4),
        "20": node("LTXVAudioVAEDecode", samples=["18", 1], audio_vae=["3", 0]),
        "21": node("CreateVideo", images=["19", 0], audio=["20", 0], fps=25.0),
        "22": node("SaveVideo", video=["21", 0], filename_prefix="hybrid/ltx23_t2v", format="auto", codec="auto"),
    }


def minimax_h3_t2v():
    """MiniMax H3 text-to-video with audio (ComfyUI's video_minimax_h3_t2v, its subgraph flattened): the int8
    convrot DiT, the Qwen3-VL 32B text encoder through MiniMax H3 Image to Video (no frames: text to video; it gives
    the conditioning and the empty video + audio latent), the template's defaults: 864x480 (its Resolution Selector:
    16:9, 0.4 MP), 124 frames (its 5 s snapped to the 17k + 5 grid), 20 steps res_multistep / simple, BasicGuider
    (no CFG), no turbo LoRA (off in the template). No CFG half to split: the packed [text, audio, video] stream goes
    over 4 GPUs (ulysses 4) through Parallel Model before the template's own sampler nodes. Its video VAE is one Patch
    VAE Decode refuses (a ViT decoder): VAE Decode and VAE Decode Audio run in ComfyUI, as in the template."""
    return {
        "1": node("UNETLoader", unet_name=MMH3_DIT, weight_dtype="default"),
        "2": node("CLIPLoader", clip_name=MMH3_TE, type="minimax", device="default"),
        "3": node("VAELoader", vae_name=MMH3_VAE),
        "4": node("VAELoader", vae_name=MMH3_AUDIO_VAE),
        "5": node("MiniMaxH3ImageToVideo", clip=["2", 0], vae=["3", 0], prompt=(
            "Realistic live-action cinematic look, a post-rain dusk metropolis, anamorphic lens, film grain, "
            "volumetric fog.\n\n[0s-2s] A runner sprints along a rooftop edge, wind catching his coat.\n[2s-4s] He "
            "leaps the gap to the next building, flying-car light trails behind him.\n[4s-5s] He lands, rolls and "
            "keeps running, low angle.\n\nAudio: wind, rapid footsteps, city ambience, a low score with an accent "
            "hit on the leap.\n\nNo text, subtitles or watermarks."), width=864, height=480, length=124),
        "6": gpus(devices="4", preset="split the image"),
        "7": on_gpus(["1", 0], ["6", 0]),
        "8": node("BasicGuider", model=["7", 0], conditioning=["5", 0]),
        "9": node("RandomNoise", noise_seed=42),
        "10": node("KSamplerSelect", sampler_name="res_multistep"),
        "11": node("BasicScheduler", model=["7", 0], scheduler="simple", steps=20, denoise=1.0),
        "12": node("SamplerCustomAdvanced", noise=["9", 0], guider=["8", 0], sampler=["10", 0], sigmas=["11", 0],
                   latent_image=["5", 1]),
        "13": node("VAEDecode", samples=["12", 0], vae=["3", 0]),
        "14": node("VAEDecodeAudio", samples=["12", 0], vae=["4", 0]),
        "15": node("CreateVideo", images=["13", 0], audio=["14", 0], fps=24.0),
        "16": node("SaveVideo", video=["15", 0], filename_prefix="hybrid/minimax_h3_t2v", format="auto",
                   codec="auto"),
    }


def templates():
    """name -> (API prompt, note text, the source of its links: the Qwen 2.5 VL link to use, SOURCE_URL's, or
    None)."""
    graphs = {
        "flux1_dev_fp8_2gpu_ulysses2": (flux_dev(2), None),
        "flux1_dev_fp8_4gpu_ulysses4": (flux_dev(4), None),
        "sd35_large_fp8_cfg2_ulysses2": (sd35_large(), None),
        "qwen_image_shard_weights": (qwen_image(), "qwen_image"),
        "wan22_i2v_14b_two_experts_24gb": (wan22_i2v_14b(), None),
        "wan22_ti2v_5b_cfg2_ulysses2": (wan22_ti2v_5b(), None),
        "hunyuan_video15_720p_t2v_shard_weights": (hunyuan_video15(), "hunyuan"),
        "flux1_kontext_dev_edit_ulysses2": (flux_kontext(), None),
        "z_image_cfg2_2gpu": (z_image(), "z_image"),
        "ltx23_t2v_audio_ulysses4": (ltx23_t2v(), None),
        "minimax_h3_t2v_audio_ulysses4": (minimax_h3_t2v(), None),
    }
    return {name: (g, NOTES[name], vl) for name, (g, vl) in graphs.items()}


def write_api_prompts():
    API_DIR.mkdir(exist_ok=True)
    for name, (g, _, _) in templates().items():
        (API_DIR / f"{name}.json").write_text(json.dumps(g, indent=1, ensure_ascii=False) + "\n")
        print("wrote", API_DIR / f"{name}.json")


if __name__ == "__main__":
    write_api_prompts()
