"""The pack's templates (example_workflows/, API form examples/template_prompts/) run on the session's real ComfyUI
server, on tiny random-init models of each template's family written under the template's own file names.

What runs as in the template: its loaders (CheckpointLoaderSimple, UNETLoader, VAELoader, LoadImage) on its file
names, Parallel GPUs with the template's preset, Parallel Model in front of ComfyUI's own sampler nodes (KSampler,
KSamplerAdvanced, SamplerCustomAdvanced), Parallel VAE Decode / VAE Decode, the model-sampling, guidance, reference-latent, image-to-video
and video nodes, SaveImage / CreateVideo + SaveVideo.

What is substituted (no real weights here):
  - Parallel GPUs' devices become 'all' (this machine's CPU cores: 2 ranks on CI, where a template's "4" is
    refused - each template's split on 4 GPUs: tests/node_classes/test_simple_node.py);
  - every CLIPTextEncode becomes HPExampleConditioning (seeded random conditioning of the tiny model's text width,
    examples/hp_example_nodes), and the text-encoder loaders (CLIPLoader, DualCLIPLoader) are dropped; the
    checkpoints hold no text encoder (CheckpointLoaderSimple's CLIP output is then unused);
  - the model files are tiny stand-ins of the same family: Flux.1 dev fp8 checkpoint = one double + one single
    Flux block (width 3072, written bf16 under the fp8 name: a CPU casts fp8 weights at every call, on
    every rank, which doubled the three Flux templates' time; fp8 files run in test_comfyui_e2e) + a Flux KL VAE, also loaded by UNETLoader as the Kontext model; SD3.5
    Large fp8 checkpoint = a 4-block SD3 MMDiT + a 16-channel KL VAE; Qwen-Image = one block; Wan 2.2 14B
    experts = two 1-layer Wan models with the I2V 36-channel input; Wan 2.2 TI2V 5B = a 1-layer 48-channel Wan
    and the Wan 2.2 VAE (full size: ComfyUI forces it); the Wan 2.1 / Qwen VAE = a narrow Wan 2.1 VAE; the Flux
    `ae` = the session's tiny Flux KL VAE; HunyuanVideo 1.5 = hidden 256, one block of each kind, and its VAE file
    is ComfyUI's light TAE for HunyuanVideo 1.5 latents (TAEHV, 32 channels), since the real VAE architecture is
    forced to full size; Z-Image = the smallest one ComfyUI detects (width 3840, one main layer, 0.9B, caption
    width 32: tests/server_e2e/test_comfyui_lumina2.py's file); its run is `slow` (ComfyUI holds the 0.9B model in fp32 on
    the CPU: 3.4 GB to stream to the workers, ~60-90 s on 2 loaded cores; fp8 weights are slower still, cast at
    every step); the LTX-2.3 checkpoint = a one-block LTX-2.3 DiT (doctor/tiny_checkpoints.write_ltxav, v23) with a
    narrow video VAE, audio VAE and vocoder in the same file, their sizes set by the file's metadata config as the
    real checkpoint's are (LTX_VAES: ComfyUI's own detection and classes, 17 MB in all), and the distilled LoRA a
    rank-4 LoRA on one of its projections; the Gemma text-encoder loader (LTXAVTextEncoderLoader) is dropped too;
    MiniMax H3 = the session's tiny MiniMax H3 (width 256, two blocks: tests/server_e2e/test_comfyui_minimax_h3.py's file), its
    video VAE file ComfyUI's light TAE for MiniMax H3 latents (TAEHV, 24 channels; the real ViT VAE is forced to
    2.6B), its audio VAE the real architecture (ComfyUI forces it too: 151M, fp16 random weights, 300 MB; its
    decode is most of this template's run). Its text encoder has no tiny stand-in: ComfyUI detects Qwen3-VL 32B
    only by its 50th layer and builds it at full size, so MiniMax H3 Image to Video (which encodes the prompt with
    it) becomes HPExampleConditioning + Empty MiniMax H3 AV Latent of the node's size, and the CLIPLoader goes;
  - sizes: width/height 64, 5 frames (LTX: 9, its 8k + 1), 2 steps (KSampler: 2; KSamplerAdvanced pairs: steps 0-1, then
    1-end; ManualSigmas: the first, the middle and the last of the template's sigmas);
    FluxKontextImageScale (which picks a ~1 MP Kontext size) becomes ImageScale to 64 x 64.
Each template must finish successfully and write its image / video (non-constant), its workers must have served
its model calls, and the latent of each of its last samplers must equal its plain twin's (the same prompt without
Parallel GPUs / Parallel Model, ComfyUI alone) within 1e-5.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from comfy_server import assert_ok

pytestmark = pytest.mark.comfy

REPO = Path(__file__).resolve().parents[2]
API_DIR = REPO / "examples" / "template_prompts"
SIZE, FRAMES, STEPS = 64, 5, 2


def _decoded_side(server, name: str) -> int:
    """The frames' side the template's video decodes to. MiniMax H3's stand-in VAE is a 24-channel TAEHV, which
    ComfyUI reads as MiniMax's own tiny decoder (16x) in 0.33 and as a generic TAEHV (8x) in 0.30: asked of ComfyUI's
    VAE class itself, on the file, so the check holds the template's latent size and not one ComfyUI's choice."""
    if _family(name) != "minimax_h3":
        return SIZE
    import comfy.sd
    from comfy_env import setup_comfy
    from safetensors.torch import load_file
    setup_comfy()
    vae = comfy.sd.VAE(sd=load_file(str(server.base / "models" / "vae" / "minimax_h3_video_vae_fp16.safetensors")))
    return SIZE // 16 * vae.upscale_ratio[-1]
LTX_FRAMES = 9  # LTX-2's video VAE: 1 + 8k frames
TEXT = {  # family of a template -> HPExampleConditioning's shapes for its tiny model
    "flux": dict(tokens=7, context_dim=32, pooled_dim=24), "sd3": dict(tokens=7, context_dim=32, pooled_dim=24),
    "qwen": dict(tokens=7, context_dim=3584, pooled_dim=0), "wan": dict(tokens=7, context_dim=4096, pooled_dim=0),
    "hunyuan": dict(tokens=7, context_dim=32, pooled_dim=4), "lumina2": dict(tokens=7, context_dim=32, pooled_dim=0),
    "ltxav": dict(tokens=7, context_dim=288, pooled_dim=0, padded=2),  # LTX-2.3: the [video, audio] text projected
    "minimax_h3": dict(tokens=7, context_dim=32, pooled_dim=0),
}
# the LTX-2.3 stand-in's VAEs (the checkpoint's metadata "config", read by ComfyUI's VideoVAE and AudioVAE): 128
# latent channels at 32 x 32 x 8 as the real video VAE (patch 4 + three 2x2x2 steps), the audio VAE's 8 x 16 latent
# of 64 mel bins (the DiT's 128 audio channels), a 160x vocoder of 16 kHz
LTX_VAES = {
    "vae": {"dims": 3, "in_channels": 3, "out_channels": 3, "latent_channels": 128, "patch_size": 4,
            "norm_layer": "pixel_norm", "latent_log_var": "uniform", "causal_decoder": False,
            "encoder_base_channels": 8, "decoder_base_channels": 8, "encoder_blocks": [["compress_all", {}]] * 3,
            "decoder_blocks": [["compress_all", {"multiplier": 2}]] * 3 + [["res_x", {"num_layers": 1}]]},
    "audio_vae": {"model": {"params": {"sampling_rate": 16000, "ddconfig": {
        "double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
        "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 1, 1], "num_res_blocks": 1, "attn_resolutions": [],
        "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}}},
        "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}},
    "vocoder": {"resblock_kernel_sizes": [3], "upsample_rates": [5, 4, 2, 2, 2],
                "upsample_kernel_sizes": [16, 16, 8, 4, 4], "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 64, "stereo": True,
                "activation": "snake", "resblock": "1"},
}


def _family(name):
    for prefix, fam in (("flux", "flux"), ("sd35", "sd3"), ("qwen", "qwen"), ("wan", "wan"), ("hunyuan", "hunyuan"),
                        ("z_image", "lumina2"), ("ltx", "ltxav"), ("minimax_h3", "minimax_h3")):
        if name.startswith(prefix):
            return fam
    raise ValueError(name)


def _link(path: Path, target: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        os.symlink(target, path)


def _reuse_or_write(path: Path, tiny_name: str, write):
    """A file another module of the session wrote with the same writer and settings is linked, not written again."""
    if path.exists():
        return
    tiny = path.parent / tiny_name
    if tiny.exists():
        _link(path, tiny)
    else:
        write(path)


def _checkpoint(path: Path, unet: dict, vae: Path, vae_prefix: str):
    """A single-file checkpoint in ComfyUI's layout: the diffusion model and the VAE under the prefixes of the
    family's ComfyUI model config (supported_models.py: Flux 'vae.', SD3 'first_stage_model.')."""
    from safetensors.torch import load_file, save_file
    sd = {f"model.diffusion_model.{k}": v for k, v in unet.items()}
    sd.update({f"{vae_prefix}{k}": v for k, v in load_file(str(vae)).items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))


def _ltx23_checkpoint(path: Path, lora: Path):
    """The LTX-2.3 checkpoint's layout (model.diffusion_model., vae., audio_vae., vocoder.) on tiny parts, with
    their configs in the metadata; and a rank-4 LoRA on the DiT's first video query projection."""
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
    from comfy.ldm.lightricks.vae.causal_video_autoencoder import VideoVAE
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from comfyui_hybrid_parallel.doctor.tiny_weights import _random_state_dict
    dit_path = path.parent / "tiny_ltx23_template_dit.safetensors"
    dit = tiny.write_ltxav(dit_path, v23=True, seed=48)
    with safe_open(str(dit_path), "pt") as f:
        config = dict(json.loads(f.metadata()["config"]), **LTX_VAES)
    dit_path.unlink()
    with torch.device("meta"):
        video, audio = VideoVAE(config=LTX_VAES["vae"]), AudioVAE(metadata={"config": json.dumps(LTX_VAES)})
    sd = {f"model.diffusion_model.{k}": v for k, v in dit.items()}
    sd.update({f"vae.{k}": v for k, v in _random_state_dict(video, 49, torch.float32).items()})
    sd.update({(k.replace("autoencoder.", "audio_vae.", 1) if k.startswith("autoencoder.") else k): v
               for k, v in _random_state_dict(audio, 50, torch.float32).items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata={"config": json.dumps(config)})
    g, k = torch.Generator().manual_seed(51), "diffusion_model.transformer_blocks.0.attn1.to_q"
    lora.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"{k}.lora_up.weight": torch.randn(256, 4, generator=g) * 0.2,
               f"{k}.lora_down.weight": torch.randn(4, 256, generator=g) * 0.2}, str(lora))


@pytest.fixture(scope="module")
def stand_ins(server):
    """The templates' file names in the server's models/ and input/ folders, holding tiny models (see the module
    docstring). The session's server already has tiny_kl16 (Flux VAE) and tiny_wan_vae (Wan 2.1 VAE)."""
    import importlib.util
    from PIL import Image
    from comfy.taesd.taehv import TAEHV
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    m = server.base / "models"
    dm, vae, ck = m / "diffusion_models", m / "vae", m / "checkpoints"
    kl16, wan_vae = vae / "tiny_kl16.safetensors", vae / "tiny_wan_vae.safetensors"
    if not (ck / "flux1-dev-fp8.safetensors").exists():
        flux = tiny.write_flux(dm / "tiny_flux_fp8_template.safetensors", seed=41)  # bf16: see the docstring
        _checkpoint(ck / "flux1-dev-fp8.safetensors", flux, kl16, "vae.")
        del flux
        (dm / "tiny_flux_fp8_template.safetensors").unlink()
    _link(dm / "flux1-dev-kontext_fp8_scaled.safetensors", ck / "flux1-dev-fp8.safetensors")  # UNETLoader strips
    _link(vae / "ae.safetensors", kl16)
    if not (ck / "sd3.5_large_fp8_scaled.safetensors").exists():
        sd3 = tiny.write_sd3(dm / "tiny_sd35_template.safetensors", depth=4, pos_embed_max_size=48, seed=42)
        _checkpoint(ck / "sd3.5_large_fp8_scaled.safetensors", sd3, kl16, "first_stage_model.")
    _reuse_or_write(dm / "qwen_image_fp8_e4m3fn.safetensors", "tiny_qwen_image.safetensors",
                    lambda p: tiny.write_qwen_image(p, seed=19))
    _link(vae / "qwen_image_vae.safetensors", wan_vae)
    for expert, seed in (("high", 43), ("low", 44)):
        p = dm / f"wan2.2_i2v_{expert}_noise_14B_fp8_scaled.safetensors"
        if not p.exists():
            tiny.write_wan(p, dim=256, ffn_dim=256, seed=seed, in_dim=36)
    _link(vae / "wan_2.1_vae.safetensors", wan_vae)
    if not (dm / "wan2.2_ti2v_5B_fp16.safetensors").exists():
        tiny.write_wan(dm / "wan2.2_ti2v_5B_fp16.safetensors", dim=256, ffn_dim=256, seed=45, in_dim=48, out_dim=48)
    _reuse_or_write(vae / "wan2.2_vae.safetensors", "tiny_wan22_vae.safetensors",
                    lambda p: tiny.write_wan22_vae(p, seed=24))  # 1.4 GB (ComfyUI forces the full VAE)
    _reuse_or_write(dm / "hunyuanvideo1.5_720p_t2v_fp16.safetensors", "tiny_hunyuan_video15.safetensors",
                    lambda p: tiny.write_hunyuan_video(p, version="1.5", seed=29))
    if not (vae / "hunyuanvideo15_vae_fp16.safetensors").exists():
        tiny._save(lambda: TAEHV(latent_channels=32), vae / "hunyuanvideo15_vae_fp16.safetensors", 46, torch.float32)
    if not (ck / "ltx-2.3-22b-dev-fp8.safetensors").exists():
        _ltx23_checkpoint(ck / "ltx-2.3-22b-dev-fp8.safetensors", m / "loras" /
                          "ltx_2.3_22b_distilled_1.1_lora_dynamic_fro09_avg_rank_111_bf16.safetensors")
    if importlib.util.find_spec("comfy.ldm.minimax") is not None:  # ComfyUI 0.30+
        from comfy.ldm.minimax.audio_vae import MiniMaxH3AudioVAE
        _reuse_or_write(dm / "minimax_h3_fl2va_pruned_int8_convrot.safetensors", "tiny_minimax_h3.safetensors",
                        lambda p: tiny.write_minimax_h3(p, seed=41))  # as tests/server_e2e/test_comfyui_minimax_h3.py
        if not (vae / "minimax_h3_video_vae_fp16.safetensors").exists():
            tiny._save(lambda: TAEHV(latent_channels=24), vae / "minimax_h3_video_vae_fp16.safetensors", 52,
                       torch.float32)
        if not (vae / "minimax_h3_audio_vae_fp32.safetensors").exists():
            tiny._save(MiniMaxH3AudioVAE, vae / "minimax_h3_audio_vae_fp32.safetensors", 53, torch.float16,
                       meta_context=True)
    (server.base / "input").mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(47)
    Image.fromarray((torch.rand(96, 128, 3, generator=g) * 255).byte().numpy()).save(server.base / "input" /
                                                                                    "example.png")
    return server


def tiny_prompt(name: str) -> dict:
    """The template's API prompt with the substitutions of the module docstring."""
    g = json.loads((API_DIR / f"{name}.json").read_text())
    fam = _family(name)
    for nid, n in list(g.items()):
        cls, inp = n["class_type"], n["inputs"]
        if cls == "CLIPTextEncode":
            g[nid] = {"class_type": "HPExampleConditioning", "inputs": {"seed": int(nid), **TEXT[fam],
                                                                        "guidance": -1.0}}
        elif cls in ("CLIPLoader", "DualCLIPLoader", "LTXAVTextEncoderLoader"):
            del g[nid]
        elif cls == "MiniMaxH3ImageToVideo":  # the prompt's encoder has no tiny stand-in (module docstring)
            latent = str(max(int(k) for k in g) + 1)
            g[latent] = {"class_type": "EmptyMiniMaxH3LatentAV", "inputs": {"width": SIZE, "height": SIZE,
                                                                            "length": FRAMES}}
            g[nid] = {"class_type": "HPExampleConditioning", "inputs": {"seed": int(nid), **TEXT[fam],
                                                                        "guidance": -1.0}}
            for other in g.values():
                for k, v in other["inputs"].items():
                    if v == [nid, 1]:
                        other["inputs"][k] = [latent, 0]
        elif cls == "FluxKontextImageScale":
            g[nid] = {"class_type": "ImageScale", "inputs": {"image": inp["image"], "upscale_method": "nearest-exact",
                                                             "width": SIZE, "height": SIZE, "crop": "disabled"}}
        if "width" in inp and "height" in inp:
            inp.update(width=SIZE, height=SIZE)
        for key in ("length", "frames_number"):
            if key in inp:
                inp[key] = LTX_FRAMES if fam == "ltxav" else FRAMES
        if cls == "ManualSigmas":
            sigmas = inp["sigmas"].split(",")
            inp["sigmas"] = ",".join(sigmas[i] for i in (0, len(sigmas) // 2, -1))
        if cls == "HybridParallelGPUs":
            inp["devices"] = "all"
        if cls in ("HybridSampler", "KSampler"):
            inp["steps"] = STEPS
        if cls == "KSamplerAdvanced":
            inp["steps"] = STEPS
            inp["end_at_step"] = 1 if inp["end_at_step"] < 10000 else 10000
            inp["start_at_step"] = 0 if inp["start_at_step"] == 0 else 1
    return g


def _outputs(server, entry):
    """The files the prompt's save nodes wrote."""
    files = []
    for out in entry["outputs"].values():
        for item in out.get("images", []) + out.get("videos", []) + out.get("gifs", []):
            files.append(server.base / "output" / item.get("subfolder", "") / item["filename"])
    return files


NAMES = sorted(p.stem for p in API_DIR.glob("*.json"))
# z_image: see the module docstring; the Flux dev 4-GPU template is the 2-GPU one's graph with ulysses 4 (ulysses 4
# itself runs in CI: tests/engine/test_usp.py, ltx23 / minimax_h3 templates here); Qwen-Image's graph runs against
# KSampler in CI (tests/server_e2e/test_comfyui_qwen_image.py: u2 x r2, cfg2) and its VAE (Wan 2.1's) decodes in
# patches in tests/families/test_patch_vae_native.py, while its template's four ranks of a 0.38B model are the
# suite's peak of memory on a 24 GB machine
SLOW = {"z_image_cfg2_2gpu", "flux1_dev_fp8_4gpu_ulysses4", "qwen_image_shard_weights"}
LAST = ("KSampler", "KSamplerAdvanced", "SamplerCustomAdvanced", "HybridSampler")


def _last_samplers(g: dict) -> list:
    """The sampler nodes whose latent no other sampler continues (Wan 2.2's second expert, not its first)."""
    samplers = [nid for nid, n in g.items() if n["class_type"] in LAST]
    fed = {str(v[0]) for n in g.values() if n["class_type"] in LAST for v in n["inputs"].values()
           if isinstance(v, list) and len(v) == 2}
    return [nid for nid in samplers if nid not in fed]


def _save_latents(g: dict, tag: str) -> list:
    """HPSaveLatentTensor on each last sampler's latent; returns the files' tags."""
    tags = []
    for nid in _last_samplers(g):
        tags.append(f"{tag}_{nid}")
        g[f"9{nid}0"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": [nid, 0], "filename":
                                                                        f"lat_{tags[-1]}"}}
    return tags


def plain_twin(g: dict, tag: str) -> tuple[dict, list]:
    """The template's prompt without the pack: each Parallel Model's consumers take its input MODEL, Parallel GPUs
    goes, and only what the last samplers' latents need stays (no decode: the latents are compared)."""
    import copy
    g = copy.deepcopy(g)
    through = {nid: n["inputs"]["model"] for nid, n in g.items() if n["class_type"] == "HybridParallelModel"}
    for n in g.values():
        for k, v in n["inputs"].items():
            if isinstance(v, list) and len(v) == 2 and str(v[0]) in through:
                n["inputs"][k] = list(through[str(v[0])])
    tags = _save_latents(g, tag)
    keep, todo = set(), [k for k in g if g[k]["class_type"] == "HPSaveLatentTensor"]
    while todo:
        nid = todo.pop()
        if nid not in keep:
            keep.add(nid)
            todo += [str(v[0]) for v in g[nid]["inputs"].values() if isinstance(v, list) and len(v) == 2]
    assert not {g[k]["class_type"] for k in keep} & {"HybridParallelGPUs", "HybridParallelModel", "HybridSampler"}
    return {k: v for k, v in g.items() if k in keep}, tags


def test_every_template_has_a_tiny_run():
    assert len(NAMES) >= 6 and all(_family(n) for n in NAMES)
    ui = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
    assert ui == NAMES, "example_workflows/ and examples/template_prompts/ must hold the same templates"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in NAMES])
def test_template_runs_on_tiny_stand_ins(stand_ins, name):
    import numpy as np
    from PIL import Image
    server = stand_ins
    if _family(name) == "minimax_h3":
        pytest.importorskip("comfy.ldm.minimax", reason="a later ComfyUI's family")
    if _family(name) == "lumina2":  # Z-Image (0.9B: ~15 s to write), only its (slow) template reads it
        from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
        _reuse_or_write(server.base / "models" / "diffusion_models" / "z_image_bf16.safetensors",
                        "tiny_zimage.safetensors",  # as tests/server_e2e/test_comfyui_lumina2.py
                        lambda p: tiny.write_lumina2(p, z_image=True, seed=24))
    g = tiny_prompt(name)
    classes = {n["class_type"] for n in g.values()}
    assert "CLIPTextEncode" not in classes and classes & {"HybridSampler", "HybridParallelModel"}
    twin, plain_tags = plain_twin(g, f"tpl_{name}_plain")
    pool_tags = _save_latents(g, f"tpl_{name}_pool")
    entry = server.run(g)
    assert_ok(server, entry)  # (the workers served its model calls)
    assert_ok(server, server.run(twin))  # (ComfyUI alone: none)
    from comfy_server import latent, rel
    for pool, plain in zip(pool_tags, plain_tags):
        err = rel(latent(server, pool), latent(server, plain))
        print(f"template {name}: latent {pool} vs its plain twin {err:.2e}")
        assert err <= 1e-5, (name, pool, err)
    files = _outputs(server, entry)
    assert files and all(f.is_file() and f.stat().st_size > 0 for f in files), (name, entry["outputs"])
    for f in files:
        if f.suffix == ".png":
            px = np.asarray(Image.open(f))
            assert px.shape[:2] == (SIZE, SIZE) and px.std() > 0, (name, f, px.shape)
        else:
            import av
            with av.open(str(f)) as c:
                audio = len(c.streams.audio)
                frames = [fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)]
            assert audio == bool(classes & {"LTXVAudioVAEDecode", "VAEDecodeAudio"}), (name, audio)
            expected = LTX_FRAMES if _family(name) == "ltxav" else FRAMES
            side = _decoded_side(server, name)
            assert len(frames) == expected and frames[0].shape[:2] == (side, side), (name, len(frames))
            assert np.std(frames) > 0, name


def _url(url: str) -> str:
    """A download link without Hugging Face's `?download=true` (ComfyUI's templates dropped it in 2026; both
    download the same file)."""
    return url.removesuffix("?download=true")


def test_model_links_are_those_of_comfyuis_official_templates():
    """Every file name and download link of the templates is one ComfyUI's own templates use (the installed
    comfyui_workflow_templates media packages), in the same models folder: none is invented."""
    import importlib.util
    official = {}
    # where ComfyUI's templates package keeps the workflows: the media packages (0.7, ComfyUI 0.3.75), one json
    # package (0.11, ComfyUI 0.33)
    found = [spec for pkg in ("comfyui_workflow_templates_json", "comfyui_workflow_templates_media_image",
                              "comfyui_workflow_templates_media_video", "comfyui_workflow_templates_media_other")
             for spec in (importlib.util.find_spec(pkg),) if spec is not None]
    assert found, "comfyui_workflow_templates (ComfyUI's official templates, a ComfyUI requirement) is not installed"
    for spec in found:
        for f in (Path(spec.submodule_search_locations[0]) / "templates").glob("*.json"):
            wf = json.loads(f.read_text(encoding="utf-8"))
            if not isinstance(wf, dict):  # index.json and other listings
                continue
            nodes = list(wf.get("nodes", []))
            for sub in wf.get("definitions", {}).get("subgraphs", []):
                nodes += sub.get("nodes", [])
            for n in nodes:
                for m in (n.get("properties") or {}).get("models", []) or []:
                    official.setdefault(m["name"], set()).add((_url(m["url"]), m["directory"]))
    seen = 0
    for f in sorted((REPO / "example_workflows").glob("*.json")):
        for n in json.loads(f.read_text()).get("nodes", []):
            for m in n.get("properties", {}).get("models", []):
                assert m["name"] in n["widgets_values"], (f.name, n["type"], m)  # the dialog matches by widget value
                assert (_url(m["url"]), m["directory"]) in official.get(m["name"], set()), (f.name, m)
                seen += 1
    assert seen >= 20, seen
