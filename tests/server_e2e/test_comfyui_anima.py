"""Anima and Cosmos Predict2 in a real ComfyUI (0.33+): ComfyUI's Anima / MiniTrainDIT on the workers, against KSampler.

Both are one DiT (parallel/models/cosmos.py): the blocks take a (B, T, H, W, D) token grid, split along its patch
rows (every frame's rows [h0, h1) on a rank), the RoPE table cut to the same tokens, the last block's output gathered
along the rows. Anima (a checked subclass: its LLM adapter runs when ComfyUI builds the conditioning) and Cosmos
Predict2 (the base class) each get their own runs. Sizes: 80 x 72 (latent 10 x 9, padded by the model to 5 x 5
patches: 25 tokens, an odd split - 3 + 2 rows, and 2 + 1 + 1 + 1 under ulysses 2 x ring 2) and 64 x 64 (4 x 4 = 16);
Cosmos Predict2 also on a 2-frame video latent (2 x 5 x 5 = 50 tokens: a rank's tokens are one run per frame).
"""
import pytest

from comfy_server import PARTS, one_world, part_of
from comfy_server import FAMILIES, equal_ksampler, error_text, on_pool, tiny_unet, workflow

pytestmark = pytest.mark.comfy

CASES = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
         ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler"),
         ("u2_sharded", {"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler")]


def _write(server, family):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    if family == "anima":
        return tiny_unet(server, FAMILIES[family]["unet"], "comfy.ldm.anima.model",
                         lambda p: tiny.write_anima(p, seed=43))
    return tiny_unet(server, FAMILIES[family]["unet"], "comfy.ldm.cosmos.predict2",
                     lambda p: tiny.write_cosmos_predict2(p, seed=47))


def _graph(family, size, tag, degrees=None, node="model", length=None):
    w, h = size
    g = workflow(None, tag, w, h, family=family, steps=2, weight_dtype="fp8_e4m3fn")
    for k in ("7", "8", "11", "6"):  # no VAE: the latent is what is compared
        g.pop(k, None)
    if length is not None:  # a video latent (16 channels, 8x, 4x in time: the Wan 2.1 format)
        g["4"] = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": w, "height": h, "length": length,
                                                                      "batch_size": 1}}
    return g if degrees is None else on_pool(g, degrees, node)


@pytest.mark.parametrize("family", ["anima", "cosmos_predict2"])
@pytest.mark.parametrize("size,part", [((80, 72), "ci"), pytest.param((80, 72), "rest", marks=pytest.mark.slow),
                                       pytest.param((64, 64), "ci", marks=pytest.mark.slow)],
                         ids=["odd", "odd-rest", "even"])
def test_equals_ksampler(server, family, size, part):
    _write(server, family)
    cases = part_of(CASES, part) if size == (80, 72) else one_world(CASES)
    equal_ksampler(server, lambda *a: _graph(family, size, *a), f"{family}_{size[0]}", cases)


@pytest.mark.slow
def test_cosmos_predict2_video_equals_ksampler(server):
    """Two latent frames: each rank holds its rows of both frames (not one run of the flattened sequence)."""
    _write(server, "cosmos_predict2")
    equal_ksampler(server, lambda *a: _graph("cosmos_predict2", (80, 72), *a, length=5), "cosmos_video",
                   CASES[:3])


def test_detection_builds_the_intended_classes(server):
    """The tiny files are what ComfyUI's own detection makes Anima and Cosmos Predict2 of, and the adapter takes
    Anima as a checked subclass, nothing else of MiniTrainDIT's."""
    import comfy.sd
    import comfy.supported_models as sm
    from comfyui_hybrid_parallel.parallel.models import adapter_for
    for family, want in (("anima", sm.Anima), ("cosmos_predict2", sm.CosmosT2IPredict2)):
        path = server.base / "models" / "diffusion_models" / _write(server, family)
        model = comfy.sd.load_diffusion_model(str(path))
        assert type(model.model.model_config) is want, type(model.model.model_config)
        assert adapter_for(model.model.diffusion_model).family == "cosmos_predict2"
    from comfy.ldm.cosmos.predict2 import MiniTrainDIT
    variant = type("MiniTrainDITVariant", (MiniTrainDIT,), {})  # an unchecked subclass does not inherit the plan
    assert adapter_for(variant.__new__(variant)) is None


def test_cost_model_reads_the_shape(server):
    """degrees auto: the blocks are the self-attention's, the text enters by cross-attention (CROSS_TEXT)."""
    from comfyui_hybrid_parallel.doctor.tiny_cosmos import cosmos_predict2_dit
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    from comfy.ldm.anima.model import Anima
    shape = shape_from_module(cosmos_predict2_dit(Anima, 256, 2))
    print("Anima shape:", shape)
    assert shape.heads == 16 and shape.hidden == 256 and shape.blocks == 2 and shape.cross_text, shape


@pytest.mark.parametrize("method,degrees,node", [("tp", {"tp_degree": 2}, "model"),
                                                 ("PipeFusion", {"pp_degree": 2, "num_pipeline_patch": 2}, "sampler")])
def test_tensor_parallel_and_pipefusion_are_refused_with_the_fix(server, method, degrees, node):
    _write(server, "anima")
    entry = server.run(_graph("anima", (64, 64), f"anima_{method}", degrees, node))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "Cosmos Predict2 / Anima" in msg and "ulysses/ring/cfg" in msg, msg


@pytest.mark.parametrize("node", ["sampler", "model"])
def test_too_few_rows_is_refused_with_the_fix(server, node):
    """A grid with fewer patch rows than sequence ranks (48 x 48: 3 rows over ulysses 2 x ring 2) is refused by the
    driver before any work (Hybrid Sampler and Parallel Model), not by the ranks at the first call."""
    _write(server, "anima")
    entry = server.run(_graph("anima", (48, 48), f"anima_rows_{node}", {"ulysses_degree": 2, "ring_degree": 2}, node))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "3 rows of patches" in msg and "smaller ulysses/ring degree" in msg, msg
    assert "remote traceback" not in msg and "Cosmos Predict2 / Anima: this latent" in msg, msg  # the driver's words


def test_anima_distrifusion(server):
    """DistriFusion on the token grid's row split: every step synchronous exact (1.1e-6 here); one warmup step of two:
    the stale error, measured (1.4e-3 here, random tiny weights)."""
    from comfy_server import distrifusion_sync_and_stale
    _write(server, "anima")
    distrifusion_sync_and_stale(server, lambda *a: _graph("anima", (80, 72), *a), "anima_df", steps=2, bound=0.1)
