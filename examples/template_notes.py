"""The Note of each template (examples/make_templates.py): which GPUs and how much system RAM it is for, the files and
where they go, what to change for other GPU counts."""
try:
    from template_models import (GEMMA3, LTX23, LTX23_LORA, MMH3_AUDIO_VAE, MMH3_DIT, MMH3_TE, MMH3_VAE, QWEN_VL,
                                 where)
except ImportError:  # imported as examples.template_notes
    from .template_models import (GEMMA3, LTX23, LTX23_LORA, MMH3_AUDIO_VAE, MMH3_DIT, MMH3_TE, MMH3_VAE, QWEN_VL,
                                  where)

COMMON = ("Parallel GPUs: 'devices' is how many GPUs (a number: the first N; 'all': every GPU; or a list such as "
          "cuda:0,cuda:2) - more than you have is refused with the count you have; the preset is how they share "
          "the work, 'auto' lets the pack choose from the model, the size and the cfg. Every degree, the attention "
          "kernel, the sharding mode: swap in Parallel Config (advanced).\n"
          "Missing files: ComfyUI's 'missing models' dialog offers each download (links are on the loader nodes).\n"
          "The first run starts the workers (a minute); later runs reuse them. The picture equals one GPU's.")

NOTES = {
    "flux1_dev_fp8_2gpu_ulysses2": f"""Flux.1 dev fp8 on 2 GPUs (split the image: Ulysses 2)

Flux dev is guidance-distilled: cfg stays 1 (FluxGuidance 3.5 steers it), so there is no CFG half to split; both GPUs
split the image tokens (Parallel GPUs: devices 2, 'split the image'), through Parallel Model in front of KSampler.
Memory: each GPU holds the whole fp8 diffusion model (12 GB) plus half the activations: 16 GB cards work, 24 GB
comfortable at 1024x1024. Less than 16 GB: preset 'large model (shard weights)' (6 GB of weights per GPU).
System RAM: about 32 GB (ComfyUI keeps its own copy of the checkpoint on the host).
Files (one checkpoint holding the model, CLIP-L, T5-XXL fp8 and the VAE):
{where("flux1-dev-fp8.safetensors")}
More GPUs: devices 'all' or their number (Flux has 24 heads: 2, 3, 4, 6 or 8 divide them; others work too).
{COMMON}""",
    "flux1_dev_fp8_4gpu_ulysses4": f"""Flux.1 dev fp8 on 4 GPUs (split the image: Ulysses 4)

As the 2-GPU template with devices 4: each GPU computes a quarter of the image tokens. cfg stays 1 (Flux dev uses
guidance, not CFG), so nothing is gained from a CFG split. 2 machines x 2 GPUs: Parallel Config with a Parallel
Cluster node.
Memory: 12 GB of fp8 weights per GPU plus a quarter of the activations: 16 GB cards; with the preset 'large model
(shard weights)' each GPU keeps 3 GB of weights (12 GB cards), at the cost of gathering each block before use.
System RAM: about 32 GB.
Files:
{where("flux1-dev-fp8.safetensors")}
{COMMON}""",
    "sd35_large_fp8_cfg2_ulysses2": f"""SD3.5 Large fp8 with CFG on 4 GPUs (cfg + split the image: cfg 2 x ulysses 2)

cfg 4 > 1: the conditional and unconditional passes run side by side, and each half splits its image tokens over
2 GPUs (Parallel GPUs: devices 4, 'cfg + split the image').
2 GPUs: devices 2 (CFG split only). 8 GPUs: devices 8 (cfg 2 x ulysses 4; SD3.5 Large has 38 heads, uneven
shares are exact too).
Memory: the 8B diffusion model in fp8 is 8 GB per GPU plus activations: 12-16 GB cards at 1024x1024.
System RAM: about 32 GB.
Files (one checkpoint with CLIP-L, CLIP-G, T5-XXL fp8 and the VAE):
{where("sd3.5_large_fp8_scaled.safetensors")}
{COMMON}""",
    "qwen_image_shard_weights": f"""Qwen-Image fp8 on 24 GB GPUs (large model: the image and the weights split over every GPU)

The fp8 model is 20 GB: Parallel GPUs 'large model (shard weights)' on devices 'all' splits the image tokens over
every GPU and keeps 1/N of the weights on each (5 GB on 4 GPUs), gathering each block just before use, so 24 GB
cards have room for the 1328x1328 activations. cfg 2.5.
48 GB cards or more: preset 'cfg + split the image' (no gathering: faster; needs an even GPU count).
System RAM: about 48 GB (the model and the 9 GB text encoder stay on the host).
Files:
{where("qwen_image_fp8_e4m3fn.safetensors", QWEN_VL, "qwen_image_vae.safetensors")}
{COMMON}""",
    "wan22_i2v_14b_two_experts_24gb": f"""Wan 2.2 14B image-to-video, two experts, on 24 GB GPUs (large model: shard weights)

The high-noise expert samples steps 0-10, the low-noise expert 10-20 (two KSamplerAdvanced, each model through
Parallel Model onto the same workers). Each expert is 14.3 GB in fp8: replicated, the pair (28.6 GB) fits no
24 GB card. Parallel GPUs 'large model (shard weights)' on devices 'all' splits the video tokens over every GPU
and keeps 1/N of each expert on each (7.2 GB for both on 4 GPUs; 14.3 GB on 2), gathering a block's weights one
block ahead of use.
48 GB+ cards: preset 'cfg + split the image' is faster (no gathering).
Pick your start image in Load Image; 640x640, 81 frames (5 s at 16 fps).
System RAM: about 64 GB (both experts and the text encoder stay on the host).
Files:
{where("wan2.2_i2v_high_noise_14B_fp8_scaled.safetensors", "wan2.2_i2v_low_noise_14B_fp8_scaled.safetensors",
        "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan_2.1_vae.safetensors")}
{COMMON}""",
    "wan22_ti2v_5b_cfg2_ulysses2": f"""Wan 2.2 TI2V 5B, text/image to video on 4 GPUs (cfg + split the image: cfg 2 x ulysses 2)

cfg 5: the CFG halves side by side x the video tokens over 2 GPUs each (Parallel GPUs: devices 4, 'cfg + split the
image'). The start image is optional: disconnect Load Image for text-to-video. 1280x704, 121 frames (5 s at 24 fps).
2 GPUs: devices 2. 8 GPUs: devices 8.
Memory: 10 GB of fp16 weights per GPU plus activations: 16-24 GB cards. Less: preset 'large model (shard weights)'.
Parallel VAE Decode splits the Wan 2.2 VAE decode over the same GPUs.
System RAM: about 32 GB.
Files:
{where("wan2.2_ti2v_5B_fp16.safetensors", "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "wan2.2_vae.safetensors")}
{COMMON}""",
    "hunyuan_video15_720p_t2v_shard_weights": f"""HunyuanVideo 1.5 720p text-to-video on 24 GB GPUs (large model: shard weights)

The 8.3B model is 16.7 GB in fp16: Parallel GPUs 'large model (shard weights)' on devices 'all' splits the video
tokens over every GPU and keeps 1/N of the weights on each (4.2 GB on 4 GPUs), leaving room for the 1280x720x121
activations on 24 GB cards. cfg 6: with 48 GB+ cards the preset 'cfg + split the image' is faster.
The VAE decode runs in ComfyUI (VAE Decode), as in ComfyUI's own template.
System RAM: about 48 GB.
Files:
{where("hunyuanvideo1.5_720p_t2v_fp16.safetensors", QWEN_VL, "byt5_small_glyphxl_fp16.safetensors",
        "hunyuanvideo15_vae_fp16.safetensors")}
{COMMON}""",
    "flux1_kontext_dev_edit_ulysses2": f"""Flux.1 Kontext dev fp8, image edit on 2 GPUs (split the image: Ulysses 2)

Load your image and describe the change. The image joins as a reference latent: its tokens are split over the
GPUs with the generated image's. cfg stays 1 (guidance 2.5): Parallel GPUs devices 2, 'split the image'.
4 GPUs: devices 4.
Memory: 12 GB of fp8 weights per GPU plus half the activations: 16 GB cards, 24 GB comfortable.
Less: preset 'large model (shard weights)'.
System RAM: about 32 GB.
Files:
{where("flux1-dev-kontext_fp8_scaled.safetensors", "clip_l.safetensors", "t5xxl_fp8_e4m3fn_scaled.safetensors",
        "ae.safetensors")}
{COMMON}""",
    "z_image_cfg2_2gpu": f"""Z-Image bf16 with CFG on 2 x 24 GB GPUs (cfg + split the image on 2: cfg 2)

cfg 4: the conditional and unconditional passes run side by side, one on each GPU (Parallel GPUs: devices 2,
'cfg + split the image').
4 GPUs: devices 4 (cfg 2 x ulysses 2). 8 GPUs: devices 8.
Memory: the 6B model is 12 GB in bf16 on each GPU plus the activations: 24 GB cards at 1024x1024. 16 GB cards:
set weight_dtype fp8_e4m3fn on Load Diffusion Model (6 GB), or the preset 'large model (shard weights)'.
Parallel VAE Decode splits the VAE decode over the same GPUs.
System RAM: about 32 GB (the model and the 8 GB text encoder stay on the host).
Files:
{where("z_image_bf16.safetensors", "qwen_3_4b.safetensors", "ae.safetensors")}
{COMMON}""",
    "ltx23_t2v_audio_ulysses4": f"""LTX-2.3 22B fp8, text to video with audio on 4 x 48/80 GB GPUs (split the image: Ulysses 4)

ComfyUI's LTX-2.3 text-to-video template, flattened to its essential path: the dev checkpoint with the distilled
LoRA (strength 0.5), cfg 1, the template's 8 manual sigmas. Left out: the half-size pass + latent upscaler +
3 refining steps (one pass at the full size here) and the prompt-enhancer LLM.
cfg 1: no CFG half to split; the video tokens go over 4 GPUs (Parallel GPUs: devices 4, 'split the image', through
Parallel Model before the template's own sampler nodes); the audio tokens stay whole on every GPU.
2 GPUs: devices 2. 8 GPUs: devices 8 (32 heads). Without the LoRA (cfg 3-4, 30+ steps): 'cfg + split the image'.
Memory: 22 GB of fp8 weights on each GPU plus a quarter of the 1280x704x121 activations: 48 GB cards, 80 GB with
room for longer videos. 24 GB cards: preset 'large model (shard weights)' (5.5 GB of weights per GPU on 4).
The video decode (VAE Decode (Tiled)) and the audio decode run in ComfyUI, as in ComfyUI's template.
System RAM: about 64 GB (the checkpoint and the Gemma 3 12B text encoder stay on the host).
Files (one checkpoint holding the model, the video VAE and the audio VAE):
{where(LTX23, LTX23_LORA, GEMMA3)}
{COMMON}""",
    "minimax_h3_t2v_audio_ulysses4": f"""MiniMax H3 int8, text to video with audio on 4 x 48/80 GB GPUs (split the image: Ulysses 4)

ComfyUI's MiniMax H3 text-to-video template, flattened (its subgraph opened up), with its defaults: 864x480
(16:9, 0.4 MP), 124 frames (5 s at 24 fps; lengths are 17k + 5), 20 steps res_multistep, no CFG (BasicGuider).
Left out: the template's switch to the 8-step turbo LoRA (off there too) and its duration / resolution helpers
(set width, height and length on MiniMax H3 Image to Video: its native canvas is 1344x768).
No CFG half to split: the model's one packed stream (text, audio and video tokens together) goes over 4 GPUs
(Parallel GPUs: devices 4, 'split the image', through Parallel Model before the template's own sampler nodes).
2 GPUs: devices 2. 8 GPUs: devices 8 (56 heads).
Memory: the 33B model is ~33 GB in int8 on each GPU plus a quarter of the activations: 48 GB cards at 864x480,
80 GB for 1344x768 or longer videos. 24 GB cards: preset 'large model (shard weights)' (~8 GB of weights per GPU
on 4 GPUs; ~17 GB on 2: tight).
The video decode (VAE Decode) and the audio decode run in ComfyUI, as in ComfyUI's template (Parallel VAE Decode
does not split MiniMax H3's ViT video decoder).
System RAM: about 96 GB (the model, the Qwen3-VL 32B text encoder and the VAEs stay on the host).
Files:
{where(MMH3_DIT, MMH3_TE, MMH3_VAE, MMH3_AUDIO_VAE)}
{COMMON}""",
}
