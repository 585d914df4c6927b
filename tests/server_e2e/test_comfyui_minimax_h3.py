"""MiniMax H3 in a real ComfyUI (0.33+): ComfyUI's MiniMaxH3Model on the workers, against KSampler.

The model denoises a video latent and a stereo audio latent together (ComfyUI's NestedTensor, from Empty MiniMax H3
AV Latent) in one packed stream [text, audio, video] with per-segment modulation; the stream is split where it
enters the first block, each block takes its rows of the RoPE table and its segments rebased to its shard, and the
last block's output is gathered (parallel/models/minimax_h3.py). Two sizes: 96 x 80 (a 3 x 3 patch grid after
ComfyUI pads the odd latent side: 7 text + 16 audio + 18 video = 41 rows, an odd split) and 128 x 96 (7 + 16 + 24 =
47). The saved latent is both streams, flattened in order (HPSaveLatentTensor), so the audio is compared too.
"""
import pytest

from comfy_server import PARTS, one_world, part_of
from comfy_server import FAMILIES, equal_ksampler, error_text, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "model"),
         ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "model")]


def _write(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    return tiny_unet(server, FAMILIES["minimax_h3"]["unet"], "comfy.ldm.minimax.model",
                     lambda p: tiny.write_minimax_h3(p, seed=41))


def _graph(size, tag, degrees=None, node="model", mask=False, shifts=None, steps=2):
    w, h = size
    g = workflow(None, tag, w, h, family="minimax_h3", steps=steps, mask=mask)
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    g["4"]["inputs"] = {"width": w, "height": h, "length": 5}
    if shifts is not None:  # ModelSamplingMiniMaxH3: the sampler's schedule and the model's audio timestep
        g["13"] = {"class_type": "MiniMaxH3SigmaShift", "inputs": {"model": ["1", 0], "shift_video": shifts[0],
                                                                   "shift_audio": shifts[1]}}
        g["5"]["inputs"]["model"] = ["13", 0]
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("size,part", [((96, 80), "ci"), pytest.param((96, 80), "rest", marks=pytest.mark.slow),
                                       pytest.param((128, 96), "ci", marks=pytest.mark.slow)],
                         ids=["odd", "odd-rest", "even"])
def test_minimax_h3_equals_ksampler(server, size, part):
    _write(server)
    cases = part_of(CASES, part) if size == (96, 80) else one_world(CASES)
    equal_ksampler(server, lambda *a: _graph(size, *a), f"mmh3_{size[0]}", cases)


def test_minimax_h3_tensor_parallel_is_refused_with_the_fix(server):
    _write(server)
    entry = server.run(_graph((96, 80), "mmh3_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "MiniMax H3" in msg and "ulysses/ring/cfg" in msg, msg


def test_minimax_h3_noise_mask_equals_ksampler(server):
    """A noise mask (the top-left quarter kept) makes the video rows' modulation per token (ComfyUI pools the mask to
    the patch grid: a row index per token in the segment table), which each rank must cut to its shard."""
    _write(server)
    cases = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model")]
    equal_ksampler(server, lambda *a: _graph((96, 80), *a, mask=True), "mmh3_mask", cases)


def test_minimax_h3_sigma_shifts_travel(server):
    """ModelSamplingMiniMaxH3 sets the video / audio shifts in transformer_options, from which the model derives the
    audio stream's timestep: they go with each call (FamilyAdapter.carried_options); left behind, the workers
    would use the defaults (12 / 3) - a silent wrong audio stream."""
    _write(server)
    equal_ksampler(server, lambda *a: _graph((96, 80), *a, shifts=(5.0, 1.5)), "mmh3_shift",
                   [("u2", {"ulysses_degree": 2}, "model")])


@pytest.mark.slow  # the lanes themselves: tests/engine/test_distrifusion.py (CI)
def test_minimax_h3_distrifusion(server):
    """DistriFusion: ComfyUI calls MiniMax H3 once per conditioning (its per-run payload cannot be batched), so the
    pool keeps stale K/V per conditioning (DistriFusionState.start_call lanes). All steps synchronous: exact; one
    warmup step of three: the stale error, measured."""
    from comfy_server import distrifusion_sync_and_stale
    _write(server)
    distrifusion_sync_and_stale(server, lambda *a: _graph((96, 80), *a, steps=3), "mmh3_df", steps=3)


def test_minimax_h3_cost_model_reads_the_shape(server):
    """degrees auto reads the packed stream's shape: every block a single-stream one (text in the stream)."""
    import comfy.sd
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    name = _write(server)
    dm = comfy.sd.load_diffusion_model(str(server.base / "models" / "diffusion_models" / name)).model.diffusion_model
    shape = shape_from_module(dm)
    print("MiniMax H3 shape:", shape)
    assert (shape.family, shape.blocks, shape.hidden, shape.heads, shape.cross_text) == ("minimax_h3", 2, 256, 4, False)


# No fp8 weight-dtype case: ComfyUI's own KSampler cannot run MiniMax H3 with fp8 weights on a CPU (its fused
# rms_rope_split_half_ kernel, comfy-kitchen's eager backend, takes no fp8 q_scale: NoCapableBackendError), so there
# is no reference here; the GPU suite is where that precision is compared.
