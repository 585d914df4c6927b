"""The pack's templates (example_workflows/, API form examples/template_prompts/) run on the session's real ComfyUI
server, on tiny random-init models of each template's family written under the template's own file names.

What runs as in the template: its loaders (CheckpointLoaderSimple, UNETLoader, VAELoader, LoadImage) on its file
names, Parallel Config with the template's degrees and shard_weights, Hybrid Sampler / Parallel Model +
KSamplerAdvanced, Patch VAE Decode / VAE Decode, the model-sampling, guidance, reference-latent, image-to-video
and video nodes, SaveImage / CreateVideo + SaveVideo.

What is substituted (no real weights here):
  - every CLIPTextEncode becomes HPExampleConditioning (seeded random conditioning of the tiny model's text width,
    examples/hp_example_nodes), and the text-encoder loaders (CLIPLoader, DualCLIPLoader) are dropped; the
    checkpoints hold no text encoder (CheckpointLoaderSimple's CLIP output is then unused);
  - the model files are tiny stand-ins of the same family: Flux.1 dev fp8 checkpoint = one double + one single
    Flux block (width 3072, fp8 e4m3fn) + a Flux KL VAE, also loaded by UNETLoader as the Kontext model; SD3.5
    Large fp8 checkpoint = a 4-block SD3 MMDiT + a 16-channel KL VAE; Qwen-Image = one block; Wan 2.2 14B
    experts = two 1-layer Wan models with the I2V 36-channel input; Wan 2.2 TI2V 5B = a 1-layer 48-channel Wan
    and the Wan 2.2 VAE (full size: ComfyUI forces it); the Wan 2.1 / Qwen VAE = a narrow Wan 2.1 VAE; the Flux
    `ae` = the session's tiny Flux KL VAE; HunyuanVideo 1.5 = hidden 256, one block of each kind, and its VAE file
    is ComfyUI's light TAE for HunyuanVideo 1.5 latents (TAEHV, 32 channels), since the real VAE architecture is
    forced to full size;
  - sizes: width/height 64, 5 frames, 2 steps (KSamplerAdvanced pairs: steps 0-1, then 1-end);
    FluxKontextImageScale (which picks a ~1 MP Kontext size) becomes ImageScale to 64 x 64.
Each template must finish successfully and write its image / video (non-constant).
"""
import json
import os
from pathlib import Path

import pytest
import torch

from comfy_server import assert_ok

pytestmark = pytest.mark.comfy

REPO = Path(__file__).resolve().parents[1]
API_DIR = REPO / "examples" / "template_prompts"
SIZE, FRAMES, STEPS = 64, 5, 2
TEXT = {  # family of a template -> HPExampleConditioning's shapes for its tiny model
    "flux": dict(tokens=7, context_dim=32, pooled_dim=24), "sd3": dict(tokens=7, context_dim=32, pooled_dim=24),
    "qwen": dict(tokens=7, context_dim=3584, pooled_dim=0), "wan": dict(tokens=7, context_dim=4096, pooled_dim=0),
    "hunyuan": dict(tokens=7, context_dim=32, pooled_dim=4),
}


def _family(name):
    for prefix, fam in (("flux", "flux"), ("sd35", "sd3"), ("qwen", "qwen"), ("wan", "wan"), ("hunyuan", "hunyuan")):
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


@pytest.fixture(scope="module")
def stand_ins(server):
    """The templates' file names in the server's models/ and input/ folders, holding tiny models (see the module
    docstring). The session's server already has tiny_kl16 (Flux VAE) and tiny_wan_vae (Wan 2.1 VAE)."""
    from PIL import Image
    from comfy.taesd.taehv import TAEHV
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    m = server.base / "models"
    dm, vae, ck = m / "diffusion_models", m / "vae", m / "checkpoints"
    kl16, wan_vae = vae / "tiny_kl16.safetensors", vae / "tiny_wan_vae.safetensors"
    if not (ck / "flux1-dev-fp8.safetensors").exists():
        flux = tiny.write_flux(dm / "tiny_flux_fp8_template.safetensors", seed=41, dtype=torch.float8_e4m3fn)
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
        elif cls in ("CLIPLoader", "DualCLIPLoader"):
            del g[nid]
        elif cls == "FluxKontextImageScale":
            g[nid] = {"class_type": "ImageScale", "inputs": {"image": inp["image"], "upscale_method": "nearest-exact",
                                                             "width": SIZE, "height": SIZE, "crop": "disabled"}}
        if "width" in inp and "height" in inp:
            inp.update(width=SIZE, height=SIZE)
        if "length" in inp:
            inp["length"] = FRAMES
        if cls == "HybridSampler":
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


def test_every_template_has_a_tiny_run():
    assert len(NAMES) >= 6 and all(_family(n) for n in NAMES)
    ui = sorted(p.stem for p in (REPO / "example_workflows").glob("*.json"))
    assert ui == NAMES, "example_workflows/ and examples/template_prompts/ must hold the same templates"


@pytest.mark.parametrize("name", NAMES)
def test_template_runs_on_tiny_stand_ins(stand_ins, name):
    import numpy as np
    from PIL import Image
    server = stand_ins
    g = tiny_prompt(name)
    classes = {n["class_type"] for n in g.values()}
    assert "CLIPTextEncode" not in classes and classes & {"HybridSampler", "HybridParallelModel"}
    entry = server.run(g)
    assert_ok(server, entry)
    files = _outputs(server, entry)
    assert files and all(f.is_file() and f.stat().st_size > 0 for f in files), (name, entry["outputs"])
    for f in files:
        if f.suffix == ".png":
            px = np.asarray(Image.open(f))
            assert px.shape[:2] == (SIZE, SIZE) and px.std() > 0, (name, f, px.shape)
        else:
            import av
            with av.open(str(f)) as c:
                frames = [fr.to_ndarray(format="rgb24") for fr in c.decode(video=0)]
            assert len(frames) == FRAMES and frames[0].shape[:2] == (SIZE, SIZE), (name, len(frames))
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
