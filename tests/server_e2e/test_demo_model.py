"""The shipped demo model (examples/demo_model) draws what it is asked, in a real ComfyUI, under KSampler and
under the pack's nodes; ComfyUI's own loaders read its files, and its VAE decodes as training assumed."""
import pytest
import torch

from comfy_server import assert_ok, latent, rel  # puts examples/ on sys.path
from demo_model import DIT_FILE, VAE_FILE, WEIGHTS, shapes
from demo_model.check import Checker
from demo_model.workflow import prompt
from hp_example_nodes import demo_text

pytestmark = pytest.mark.comfy
PSNR_MIN = 20.0  # dB, the shipped VAE's reconstruction of unseen pictures (train_log.json: vae_recon_psnr)


def test_comfyui_loaders_read_the_demo_model_and_its_vae_reconstructs_a_picture():
    """UNETLoader's path gives ComfyUI's SD3 model (3 heads: uneven over 2 Ulysses ranks; shift 3); VAELoader's
    gives ComfyUI's TAESD with 16 channels, whose encoder computes the colour mosaic (nets.mosaic) through its own
    layers, whose latents after SD3's process_in are about unit-variance (what the model learnt on), and whose
    decoder draws a fresh picture of the demo world (one it never saw) back recognisably (the checker agrees)."""
    import random

    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.latent_formats
    import comfy.sd
    import comfy.utils
    from demo_model import nets

    patcher = comfy.sd.load_diffusion_model(str(WEIGHTS / DIT_FILE))
    dit = patcher.model.diffusion_model
    assert type(patcher.model).__name__ == "SD3" and type(dit).__name__ == "OpenAISignatureMMDITWrapper"
    assert dit.joint_blocks[0].x_block.attn.num_heads == 3 and dit.hidden_size == 192
    assert patcher.model.model_sampling.shift == 3.0
    vae = comfy.sd.VAE(sd=comfy.utils.load_torch_file(str(WEIGHTS / VAE_FILE)))
    first = vae.first_stage_model
    assert type(first).__name__ == "TAESD" and vae.latent_channels == 16
    pics, scenes = shapes.batch(32, random.Random(12345))
    images = pics.movedim(1, -1)  # ComfyUI IMAGE layout (B, H, W, 3)
    latent = vae.encode(images)
    assert latent.shape == (32, 16, 8, 8)
    expected = nets.mosaic(pics) / first.vae_scale.item() + first.vae_shift.item()
    assert rel(latent, expected) < 1e-3  # fp16 weights: the mosaic's taps are exact, its scale/shift rounded
    processed = comfy.latent_formats.SD3().process_in(latent)
    assert 0.8 < processed.std().item() < 1.25 and abs(processed.mean().item()) < 0.2
    drawn = vae.decode(latent)
    psnr = (10 * torch.log10(1 / (drawn - images).pow(2).mean())).item()
    seen = Checker().scenes(drawn)
    assert psnr > PSNR_MIN and sum(a == b for a, b in zip(seen, scenes)) >= 31, (psnr, seen, scenes)


def test_demo_text_encoder_is_deterministic_and_pads():
    c1, p1 = demo_text.encode("a red circle on a gray background")
    c2, p2 = demo_text.encode("A red circle, on a gray background")
    assert c1.shape == (1, demo_text.TOKENS, demo_text.DIM) and p1.shape == (1, demo_text.DIM)
    assert torch.equal(c1, c2) and torch.equal(p1, p2)
    ce, pe = demo_text.encode("")
    assert torch.count_nonzero(pe) == 0 and not torch.equal(ce, c1)
    assert not torch.equal(demo_text.encode("a blue circle on a gray background")[0], c1)


def test_demo_model_draws_the_eight_captions_under_ksampler_and_ulysses2(server):
    """Eight captions (every shape, colour and background): the classifier trained with the model must name the
    asked shape, colour and background in >= 7 of the 8 pictures from KSampler; Hybrid Sampler ulysses 2 + Parallel
    VAE Decode draws the first four (every shape and background once), its latent equal to KSampler's to 1e-5 and its
    picture named as KSampler's is (the same latent decodes to the same picture: the other four would repeat it)."""
    from safetensors.torch import load_file

    checker = Checker()
    right = {"ksampler": 0, "ulysses2": 0}
    seen = {"ksampler": [], "ulysses2": []}
    for i, scene in enumerate(shapes.TEST_SCENES):
        sides = (("ksampler", None),) + ((("ulysses2", {"ulysses_degree": 2}),) if i < 4 else ())
        for tag, degrees in sides:
            name = f"demo{i}_{tag}"
            assert_ok(server, server.run(prompt(scene.caption, name, degrees, seed=100 + i)))
            image = load_file(str(server.output(f"img_{name}.safetensors")))["images"]
            right[tag] += checker.right(scene.caption, image)
            seen[tag].append(checker.scenes(image)[0].caption)
        if len(sides) == 2:
            assert rel(latent(server, f"demo{i}_ulysses2"), latent(server, f"demo{i}_ksampler")) < 1e-5
            assert seen["ulysses2"][-1] == seen["ksampler"][-1], seen
    assert right["ksampler"] >= 7 and len(seen["ulysses2"]) == 4, (right, seen)
