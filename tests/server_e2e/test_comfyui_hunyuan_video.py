"""HunyuanVideo 1.5 in a real ComfyUI: ComfyUI's HunyuanVideo15 model on the workers, against KSampler.

Detection reads heads = hidden / 128 and the text width from the weights, so the model is small (hidden 256,
one double and one single block, the 1152-wide vision input that selects the 1.5 class, 65 input channels: ComfyUI
joins an all-zero start-image latent and mask for text-to-video). Latent 5 x 7 x 2 frames = 70 tokens (uneven over
4 ranks): Parallel Model + KSampler with ulysses 2, ring 2, ulysses 2 x ring 2, Hybrid Sampler with cfg 2.
"""
import pytest

from comfy_server import assert_ok, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H, FRAMES = 112, 80, 5


@pytest.fixture(scope="module")
def hunyuan(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / "tiny_hunyuan_video15.safetensors"
    if not path.exists():
        tiny.write_hunyuan_video(path, version="1.5", seed=29)
    return path.name


def _graph(tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="hunyuan_video15", length=FRAMES, steps=3)
    for k in ("6", "7", "8", "11"):
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


def test_hunyuan_video15_equals_ksampler(server, hunyuan):
    assert_ok(server, server.run(_graph("hyv15_ref")))
    ref = latent(server, "hyv15_ref")
    assert tuple(ref.shape) == (1, 32, 2, H // 16, W // 16)
    cases = [("u2", {"ulysses_degree": 2}, "model"), ("r2", {"ring_degree": 2}, "model"),
             ("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "sampler")]
    for name, degrees, node in cases:
        assert_ok(server, server.run(_graph(f"hyv15_{name}", degrees, node)))
        err = rel(latent(server, f"hyv15_{name}"), ref)
        print(f"HunyuanVideo 1.5 {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= 1e-5, (name, err)


def test_hunyuan_video15_pipefusion_is_refused_with_the_fix(server, hunyuan):
    entry = server.run(_graph("hyv15_pp", {"pp_degree": 2, "num_pipeline_patch": 2}, node="sampler"))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "HunyuanVideo" in msg and "ulysses/ring/cfg" in msg, msg
