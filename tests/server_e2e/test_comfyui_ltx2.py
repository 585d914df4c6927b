"""LTX-2 in a real ComfyUI (0.33+): ComfyUI's LTXAVModel on the workers, against KSampler.

A tiny LTX-2 checkpoint (doctor/tiny_checkpoints.write_ltxav: 32 video heads x 8, an audio stream of 2 heads x 16
set by the file's metadata config, one block) that ComfyUI's detection builds as LTXAV. The AV latent is LTX-Video's
empty video latent joined to an audio latent (LTXVConcatAVLatent; the audio latent (B, 8, T, 16) is ACE-Step's empty
audio latent cropped to T rows and 16 bins - LTXVEmptyLatentAudio would need an audio VAE), so ComfyUI runs both
streams as a NestedTensor. Sizes:

* odd: 160 x 96 x 17 frames = 5 x 3 x 3 = 45 video tokens and 9 audio tokens (uneven shards of both),
* even: 160 x 128 x 9 frames = 5 x 4 x 2 = 40 video tokens and 8 audio tokens,
* video only: the odd video with no audio latent (ComfyUI's video-only LTX-2: the audio stream is empty).

The video tokens are split and gathered, the audio stays whole on every rank, video-to-audio attention gathers the
video keys (parallel/models/ltxav.py). Noise masks make the video modulation per frame (a uniform mask: ComfyUI
compresses it to a row per latent frame) or per token (a spatial mask).
"""
import pytest

from comfy_server import PARTS, one_world, part_of
from comfy_server import FAMILIES, equal_ksampler, error_text, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

SIZES = {"odd": (160, 96, 17, 9), "even": (160, 128, 9, 8), "video_only": (160, 96, 17, None)}
CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler"),
         ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "model")]


V23 = "tiny_ltxav23.safetensors"  # LTX-2.3's layout: text projected before the connectors, prompt AdaLN, gated attention


def _write(server, v23=False):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, V23 if v23 else FAMILIES["ltxav"]["unet"], "comfy.ldm.lightricks.av_model",
                     lambda p: tiny.write_ltxav(p, v23=v23, seed=43))


def _graph(size, tag, degrees=None, node="model", mask=None, v23=False, weight_dtype="default"):
    w, h, frames, audio = SIZES[size]
    g = workflow(None, tag, w, h, family="ltxav", length=frames, steps=2, mask=mask == "spatial",
                 weight_dtype=weight_dtype)
    if v23:  # its text is the projected [video, audio] widths side by side: 256 + 32
        g["1"]["inputs"]["unet_name"] = V23
        for k in ("2", "3"):
            g[k]["inputs"]["context_dim"] = 288
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    for k in ("2", "3"):  # a T5-style text attention mask, LTX's frame rate on both conditionings (as LTX-Video's test)
        g[k]["inputs"]["padded"] = 2
        g[f"5{k}"] = {"class_type": "LTXVConditioning", "inputs": {"positive": [k, 0], "negative": [k, 0],
                                                                  "frame_rate": 24.0}}
    g["5"]["inputs"].update(positive=["52", 0], negative=["53", 1])
    if mask == "uniform":  # the same denoise strength on every token: one timestep row per latent frame
        g["20"] = {"class_type": "SolidMask", "inputs": {"value": 0.6, "width": w, "height": h}}
        g["23"] = {"class_type": "SetLatentNoiseMask", "inputs": {"samples": ["4", 0], "mask": ["20", 0]}}
        g["5"]["inputs"]["latent_image"] = ["23", 0]
    if audio is not None:
        g["30"] = {"class_type": "EmptyAceStepLatentAudio", "inputs": {"seconds": 2.0, "batch_size": 1}}
        g["31"] = {"class_type": "LatentCrop", "inputs": {"samples": ["30", 0], "width": 128, "height": 8 * audio,
                                                          "x": 0, "y": 0}}
        g["32"] = {"class_type": "LTXVConcatAVLatent", "inputs": {"video_latent": g["5"]["inputs"]["latent_image"],
                                                                  "audio_latent": ["31", 0]}}
        g["5"]["inputs"]["latent_image"] = ["32", 0]
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("size,part", [("odd", "ci"), pytest.param("odd", "rest", marks=pytest.mark.slow),
                                       ("even", "ci"), ("video_only", "ci"),
                                       pytest.param("video_only", "rest", marks=pytest.mark.slow)],
                         ids=["odd", "odd-rest", "even", "video_only", "video_only-rest"])
def test_ltx2_equals_ksampler(server, size, part):
    _write(server)
    cases = {"odd": part_of(CASES, part), "even": one_world(CASES), "video_only": part_of(CASES[:4], part)}[size]
    equal_ksampler(server, lambda *a: _graph(size, *a), f"ltx2_{size}", cases)


@pytest.mark.parametrize("part", PARTS)
def test_ltx23_equals_ksampler(server, part):
    """LTX-2.3: cross-attention AdaLN (a per-sample prompt modulation) and per-head gates (per token) change nothing
    the split has to know; the text arrives already projected to each stream's width."""
    _write(server, v23=True)
    equal_ksampler(server, lambda *a: _graph("odd", *a, v23=True), "ltx23_odd",
                   part_of(CASES[:4], part))


@pytest.mark.parametrize("mask", ["uniform", "spatial"])
def test_ltx2_noise_mask_equals_ksampler(server, mask):
    """A noise mask makes the video timestep per token: ComfyUI keeps one modulation row per latent frame where the
    mask is the same over each frame (uniform), one per token where it is not (spatial); each rank takes its rows
    (of both sequence methods at once: ulysses 2 x ring 2)."""
    _write(server)
    equal_ksampler(server, lambda *a: _graph("odd", *a, mask=mask), f"ltx2_mask_{mask}", CASES[2:3])


@pytest.mark.parametrize("degrees, words", [({"tp_degree": 2}, "tensor parallel"),
                                            ({"pp_degree": 2, "num_pipeline_patch": 2}, "PipeFusion")])
def test_ltx2_tensor_parallel_and_pipefusion_are_refused(server, degrees, words):
    _write(server)
    entry = server.run(_graph("odd", f"ltx2_refused_{next(iter(degrees))}", degrees, "sampler"))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "LTX-2" in msg and words in msg and "ulysses/ring/cfg" in msg, msg


def test_ltx2_timestep_rows_match_comfyui_expansion():
    """`_timestep_rows` against ComfyUI's own CompressedTimestep.expand_for_computation, cut to each shard: one row
    per frame (12 tokens a frame, 5 frames, shards of 60 over 1 / 2 / 4 ranks, uneven), one per token, one for all."""
    import torch

    from comfy_env import setup_comfy
    setup_comfy()
    from comfy.ldm.lightricks.av_model import CompressedTimestep

    from comfyui_hybrid_parallel.parallel.comm import split_sizes
    from comfyui_hybrid_parallel.parallel.models.ltxav import _timestep_rows
    torch.manual_seed(0)
    table = torch.randn(6, 8)
    forms = {"per_frame": CompressedTimestep(torch.randn(2, 5, 48), 12, per_frame=True),
             "per_token": CompressedTimestep(torch.randn(2, 60, 48), None),
             "one_row": CompressedTimestep(torch.randn(2, 1, 48), 12)}
    for name, ts in forms.items():
        whole = [t.expand(2, 60, 8) for t in ts.expand_for_computation(table, 2, slice(0, 6))]
        for ranks in (1, 2, 4):
            sizes, start = split_sizes(60, ranks) if ranks > 1 else [60], 0
            for n in sizes:
                mine = _timestep_rows(ts, start, start + n, 60)
                if isinstance(mine, torch.Tensor):
                    got = (table.unsqueeze(0).unsqueeze(0) + mine.reshape(2, n, 6, -1)).unbind(dim=2)
                else:
                    got = mine.expand_for_computation(table, 2, slice(0, 6))
                for g, w in zip(got, whole):
                    assert torch.equal(g.expand(2, n, 8), w[:, start:start + n]), (name, ranks, start)
                start += n


def test_ltx2_cost_model_reads_the_shape(server):
    """degrees auto reads LTX-2's shape from the adapter's attention modules (the video self-attention's blocks; text
    by cross-attention: CROSS_TEXT)."""
    import comfy.sd
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    name = _write(server)
    dm = comfy.sd.load_diffusion_model(str(server.base / "models" / "diffusion_models" / name)).model.diffusion_model
    shape = shape_from_module(dm)
    print("LTX-2 shape:", shape)
    assert shape.family == "ltxav" and shape.blocks >= 1 and shape.heads >= 1 and shape.cross_text, shape


def test_ltx2_distrifusion(server):
    """DistriFusion on LTX-2: the video self-attention's stale K/V are the split's; the video-to-audio attention gathers
    fresh video K/V every step (Attention(gather_kv=True)). Every step synchronous: exact (5.5e-7 here); one warmup
    step of two: the stale error, measured (1.6e-4 here, random tiny weights)."""
    from comfy_server import distrifusion_sync_and_stale
    _write(server)
    distrifusion_sync_and_stale(server, lambda *a: _graph("odd", *a), "ltx2_df", steps=2, bound=0.1)


@pytest.mark.slow
def test_ltx2_fp8_weights_equal_ksampler(server):
    """UNETLoader's fp8_e4m3fn weight dtype: fp8 storage, computed in fp32 on CPU (manual cast) - the exact bound."""
    _write(server)
    equal_ksampler(server, lambda *a: _graph("odd", *a, weight_dtype="fp8_e4m3fn"), "ltx2_fp8", [CASES[0], CASES[3]])
