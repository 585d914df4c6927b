"""Wan 2.1 FlowRVS (ComfyUI 0.33) in a real ComfyUI: the Wan family's plan on a variant it was not declared for,
checked on its own against KSampler.

FlowRVS (referring video segmentation) is a Wan 2.1 1.3B T2V-layout WanModel - the same keys and sizes - told apart
only by the file's metadata ({"config": {"transformer": {"model_type": "flow_rvs"}}}, read by
comfy/model_detection.py): ComfyUI then picks supported_models.WAN21_FlowRVS, whose model_base.WAN21_FlowRVS builds a
plain WanModel ("t2v") with image_to_video=True under model type IMG_TO_IMG_FLOW - model sampling
ModelSamplingDiscrete x IMG_TO_IMG_FLOW: the discrete 1000-step schedule (first sigma 14.61, timestep 999), the
sampler starting from the input latent itself (noise_scaling returns latent_image: the seed does nothing), the
model's output taken as the denoised latent, and the result 1 - latent. ComfyUI 0.33 has no FlowRVS node: a user
encodes the video with VAE Encode and samples it with KSampler and a text prompt (a single step, as the ComfyUI pull
request that added it says). With the real model's 16 input channels WAN21.concat_cond returns None (no extra
channels): no concat latent reaches the model, image_to_video changes nothing there.

The tiny checkpoint: write_wan's T2V layout (width 256, 2 heads, two blocks) saved with that metadata; the test
asserts that ComfyUI's own detection builds WAN21_FlowRVS with that model sampling around a WanModel, and that the
server sampled it that way (two seeds, one latent). The video: a 9-frame animated PNG of noise through LoadImage and
VAE Encode (tiny Wan 2.1 VAE) - latent 3 frames x 9 x 13, padded by the model to 5 x 7 patches: 105 tokens, odd.
Compared with KSampler (2 steps, cfg 3), on the latent and on 1 - latent: Parallel Model + KSampler under ulysses 2
and ring 2, Hybrid Sampler under cfg 2 and ulysses 2 with shard_weights; the single step at cfg 1 under Hybrid
Sampler ulysses 2; a 5-frame 96 x 64 video (2 x 4 x 6 = 48 tokens, even) under ulysses 2. Slow: ulysses 2 x ring 2.
Loop mode and PipeFusion, which run the sampler in the workers, are refused before any work (they took it for
flow sampling: 2e1 from KSampler before).
"""
import json

import pytest

from comfy_server import assert_ok, equal_ksampler, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

UNET = "tiny_wan_flowrvs.safetensors"
ODD = ("hp_flowrvs_odd.png", 104, 72, 9)   # latent 3 x 9 x 13 -> 3 x 5 x 7 = 105 tokens
EVEN = ("hp_flowrvs_even.png", 96, 64, 5)  # latent 2 x 8 x 12 -> 2 x 4 x 6 = 48 tokens


def _write_video(path, w, h, frames, seed):
    """An animated PNG of `frames` noise frames (LoadImage returns every frame: a video batch)."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(seed)
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for _ in range(frames)]
    imgs[0].save(path, save_all=True, append_images=imgs[1:], duration=100, loop=0)


@pytest.fixture(scope="module")
def flowrvs(server):
    """The tiny FlowRVS checkpoint and input videos, and ComfyUI's detection of the checkpoint."""
    import comfy.model_base
    import comfy.model_detection
    import comfy.utils
    from safetensors.torch import save_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / UNET
    sd = tiny.write_wan(path, dim=256, ffn_dim=256, num_layers=2, seed=53)
    save_file(sd, str(path), metadata={"format": "pt",
                                       "config": json.dumps({"transformer": {"model_type": "flow_rvs"}})})
    for i, (name, w, h, frames) in enumerate((ODD, EVEN)):
        _write_video(server.base / "input" / name, w, h, frames, seed=60 + i)

    sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    config = comfy.model_detection.model_config_from_unet(sd, "", metadata=metadata)
    model = config.get_model(sd, "")
    detected = (type(config).__name__, type(model).__name__, model.model_type, type(model.diffusion_model).__name__)
    print(f"FlowRVS detection: {detected}")
    assert detected == ("WAN21_FlowRVS", "WAN21_FlowRVS", comfy.model_base.ModelType.IMG_TO_IMG_FLOW, "WanModel")
    assert model.image_to_video and model.diffusion_model.patch_embedding.weight.shape[1] == 16  # no concat channels
    import comfy.model_sampling as ms
    assert isinstance(model.model_sampling, ms.ModelSamplingDiscrete)
    assert isinstance(model.model_sampling, ms.IMG_TO_IMG_FLOW)
    return UNET


def _graph(video, tag, degrees=None, node="model", steps=2, cfg=3.0, seed=5):
    name, w, h, frames = video
    g = workflow(None, tag, w, h, family="wan", length=frames)
    for k in ("4", "5", "7", "8", "11"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = UNET
    g["20"] = {"class_type": "LoadImage", "inputs": {"image": name}}
    g["21"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["20", 0], "vae": ["6", 0]}}
    g["5"] = {"class_type": "KSampler", "inputs": {
        "model": ["1", 0], "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["21", 0], "denoise": 1.0}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g if degrees is None else on_pool(g, degrees, node)


def _equal_ksampler(server, video, tag, cases, **sampling):
    """comfy_server.equal_ksampler on `video` (each case within 1e-5 of KSampler's latent), and the same bound on the
    sampler's own result (1 - latent: IMG_TO_IMG_FLOW's inverse_noise_scaling adds the constant 1, which would make
    the first relative error smaller than the model's). Returns KSampler's latent."""
    ref = equal_ksampler(server, lambda t, degrees=None, node="model": _graph(video, t, degrees, node, **sampling),
                         tag, cases)
    for name, _, _ in cases:
        err_x = rel(1 - latent(server, f"{tag}_{name}").double(), 1 - ref.double())
        print(f"{tag} {name}: relative error vs KSampler {err_x:.2e} on 1 - latent")
        assert err_x <= 1e-5, (tag, name, err_x)
    return ref


def test_flowrvs_equals_ksampler(server, flowrvs):
    ref = _equal_ksampler(server, ODD, "flowrvs", [
        ("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
        ("cfg2_hybrid", {"cfg_degree": 2}, "sampler"),
        ("u2_sharded_hybrid", {"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler")])
    assert ref.shape == (1, 16, 3, 9, 13), ref.shape
    # sampled as IMG_TO_IMG_FLOW, not as plain Wan: the seed does nothing (the sampler starts from the encoded video)
    assert_ok(server, server.run(_graph(ODD, "flowrvs_seed", seed=6)))
    assert rel(latent(server, "flowrvs_seed"), ref) == 0.0
    assert "model_type IMG_TO_IMG_FLOW" in open(server.base / "comfyui.log").read()


def test_flowrvs_single_step_and_even_tokens(server, flowrvs):
    """A single step at cfg 1 (the model's output is the mask latent) on the odd video, and the
    2-step cfg 3 graph on the even one, under Hybrid Sampler ulysses 2."""
    _equal_ksampler(server, ODD, "flowrvs_1step", [("u2_hybrid", {"ulysses_degree": 2}, "sampler")], steps=1, cfg=1.0)
    _equal_ksampler(server, EVEN, "flowrvs_even", [("u2_hybrid", {"ulysses_degree": 2}, "sampler")])


@pytest.mark.slow
def test_flowrvs_usp_mesh(server, flowrvs):
    _equal_ksampler(server, ODD, "flowrvs", [("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model")])


@pytest.mark.parametrize("video, name, degrees", [
    (ODD, "u2_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}),
    (EVEN, "pp2", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2})])
def test_flowrvs_loop_mode_and_pipefusion_are_refused_before_work(server, flowrvs, video, name, degrees):
    """Hybrid Sampler's loop mode and PipeFusion run the sampler in the workers, which compute ComfyUI's flow (CONST)
    and eps sampling only. They took FlowRVS (ModelSamplingDiscrete x IMG_TO_IMG_FLOW: first step timestep 999 and
    denoised = out) for flow - timestep sigma x 354 and denoised x - out x sigma: 2.1e1 / 2.2e1 from KSampler, no
    error. Now the sampling is read from ComfyUI's model sampling (workers/bridge/loop_mode.loop_convention) and this one is
    refused before any work, naming step mode; the next prompt runs."""
    from comfy_server import error_text
    tag = f"flowrvs_refused_{name}"
    entry = server.run(_graph(video, tag, degrees, "sampler"))
    assert entry["status"]["status_str"] == "error", entry["status"]
    msg = error_text(entry)
    assert "IMG_TO_IMG_FLOW" in msg and "step mode" in msg and "remote traceback" not in msg, msg
    _equal_ksampler(server, video, "flowrvs_after" if video is ODD else "flowrvs_even_after",
                    [("u2_hybrid", {"ulysses_degree": 2}, "sampler")])
