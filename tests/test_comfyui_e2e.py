"""The nodes in a real ComfyUI server: Hybrid Sampler + Patch VAE Decode against KSampler + VAEDecode."""
import pytest
import torch
from safetensors.torch import load_file

from comfy_env import setup_comfy
from comfy_server import ComfyServer

pytestmark = pytest.mark.comfy

W, H = 104, 72  # latent 13 x 9: odd on both axes (ComfyUI pads SD3 circularly)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    comfy_dir = setup_comfy()
    import tiny_checkpoints as tc

    base = tmp_path_factory.mktemp("comfy_base")
    srv = ComfyServer(comfy_dir, base)
    tc.write_sd3(base / "models" / "diffusion_models" / "tiny_sd3.safetensors", seed=3)
    tc.write_kl_vae(base / "models" / "vae" / "tiny_kl16.safetensors", style="flux", seed=4)
    srv.start()
    yield srv
    srv.stop()


def _graph(parallel: dict | None, tag: str, steps=3, cfg=4.0, sampler="euler", scheduler="normal", batch=1):
    g = {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_sd3.safetensors", "weight_dtype": "default"}},
        "2": {"class_type": "HPExampleConditioning", "inputs": {"seed": 1, "tokens": 7, "context_dim": 32,
                                                               "pooled_dim": 24, "guidance": -1.0}},
        "3": {"class_type": "HPExampleConditioning", "inputs": {"seed": 2, "tokens": 7, "context_dim": 32,
                                                               "pooled_dim": 24, "guidance": -1.0}},
        "4": {"class_type": "EmptySD3LatentImage", "inputs": {"width": W, "height": H, "batch_size": batch}},
        "6": {"class_type": "VAELoader", "inputs": {"vae_name": "tiny_kl16.safetensors"}},
    }
    common = {"model": ["1", 0], "seed": 42, "steps": steps, "cfg": cfg, "sampler_name": sampler,
              "scheduler": scheduler, "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
              "denoise": 1.0}
    if parallel is None:
        g["5"] = {"class_type": "KSampler", "inputs": common}
        g["7"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0]}}
    else:
        cfg_inputs = {"dp_degree": 1, "cfg_degree": 1, "ulysses_degree": 1, "ring_degree": 1, "pp_degree": 1,
                      "num_pipeline_patch": 0, "warmup_steps": 1, "tp_degree": 1, "method": "usp", "device": "cpu",
                      "attention": "auto", "devices": ""}
        cfg_inputs.update(parallel)
        g["9"] = {"class_type": "HybridParallelConfig", "inputs": cfg_inputs}
        g["5"] = {"class_type": "HybridSampler", "inputs": {**common, "parallel_config": ["9", 0]}}
        g["7"] = {"class_type": "HybridPatchVAEDecode", "inputs": {"samples": ["5", 0], "vae": ["6", 0],
                                                                   "parallel_config": ["9", 0]}}
    g["8"] = {"class_type": "HPSaveImageTensor", "inputs": {"images": ["7", 0], "filename": f"img_{tag}"}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g


def _ok(server, entry):
    assert "rejected" not in entry, entry
    assert entry["status"]["status_str"] == "success", (entry["status"], server.tail())


def _load(server, name, key):
    return load_file(str(server.output(f"{name}.safetensors")))[key]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module")
def reference(server):
    _ok(server, server.run(_graph(None, "ref")))
    return _load(server, "lat_ref", "images"), _load(server, "img_ref", "images")


@pytest.mark.parametrize("degrees", [{}, {"cfg_degree": 2}, {"ulysses_degree": 2}, {"ring_degree": 2}],
                         ids=["degree1", "cfg2", "ulysses2", "ring2"])
def test_hybrid_sampler_and_patch_decode_equal_ksampler(server, reference, degrees):
    tag = "_".join(f"{k}{v}" for k, v in degrees.items()) or "d1"
    _ok(server, server.run(_graph(degrees, tag)))
    lat_ref, img_ref = reference
    lat, img = _load(server, f"lat_{tag}", "images"), _load(server, f"img_{tag}", "images")
    assert lat.shape == lat_ref.shape and img.shape == img_ref.shape
    assert _rel(lat, lat_ref) <= 1e-4, _rel(lat, lat_ref)
    assert (img - img_ref).abs().max().item() <= 1e-4


def test_bad_config_is_a_clear_error_and_the_next_prompt_works(server, reference):
    entry = server.run(_graph({"tp_degree": 3}, "bad"))
    text = str(entry)
    assert "error" in text.lower() and "tp_degree=3" in text and "attention heads" in text, text[:2000]
    _ok(server, server.run(_graph({"cfg_degree": 2}, "after_bad", steps=2)))
