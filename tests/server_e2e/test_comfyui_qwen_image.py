"""Qwen-Image in a real ComfyUI: ComfyUI's QwenImageTransformer2DModel on the workers, against KSampler.

ComfyUI fixes Qwen-Image's width (24 heads x 128) and its 3584-wide text input, so the smallest model it
detects has one block and 0.38B parameters (written in bf16, loaded in fp8 as most people run it, and in bf16).
The image tokens are split at the first block, every block takes its part of the [text, image] RoPE table,
the output is gathered before unpatchify. Odd 13 x 9 latent (ComfyUI pads it to the 2 x 2 patch grid).
"""
import pytest

from comfy_server import assert_ok, equal_ksampler, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 104, 72


@pytest.fixture(scope="module")
def qwen(server):
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / "tiny_qwen_image.safetensors"
    if not path.exists():
        tiny.write_qwen_image(path, seed=19)
    return path.name


def _graph(tag, degrees=None, weight_dtype="fp8_e4m3fn", node="model"):
    g = workflow(None, tag, W, H, family="qwen_image", weight_dtype=weight_dtype, steps=2)
    for k in ("7", "8", "11"):
        g.pop(k, None)
    return g if degrees is None else on_pool(g, degrees, node)


CASES = {"u2": ({"ulysses_degree": 2}, "model"), "r2": ({"ring_degree": 2}, "model"),
         "cfg2": ({"cfg_degree": 2}, "sampler"), "u2r2": ({"ulysses_degree": 2, "ring_degree": 2}, "model"),
         "u2_sharded": ({"ulysses_degree": 2, "shard_weights": "sequence"}, "sampler"),
         "cfg2u2": ({"cfg_degree": 2, "ulysses_degree": 2}, "sampler")}
# CI: in bf16 weights (ComfyUI computes them in fp32 on a CPU: 0.4 s a step here) u2 x r2 covers both sequence
# methods, cfg2 x u2 the batch split composed with it (one 4-rank world with the edit tests); fp8 weights (as most
# people run it) with the slow set - on a CPU every call casts all 0.38B fp8 weights on every rank (3 s a step) for
# the same split code. Sharded weights are the same mechanism on every family (tests/engine/test_shard.py, CI). The rest of
# the matrix runs with the slow set.
CI = {"default": ("u2r2", "cfg2u2"), "fp8_e4m3fn": ("u2",)}
REST = {"default": ("u2", "r2", "cfg2", "u2_sharded"), "fp8_e4m3fn": ("u2r2", "r2", "cfg2", "u2_sharded")}


def _matrix(server, weight_dtype, names):
    assert_ok(server, server.run(_graph(f"qwen_ref_{weight_dtype}", weight_dtype=weight_dtype)))
    ref = latent(server, f"qwen_ref_{weight_dtype}")
    for name in names:
        degrees, node = CASES[name]
        tag = f"qwen_{weight_dtype}_{name}"
        assert_ok(server, server.run(_graph(tag, degrees, weight_dtype, node)))
        err = rel(latent(server, tag), ref)
        print(f"Qwen-Image {weight_dtype} {name}: latent relative error vs KSampler {err:.2e}")
        # on CPU ComfyUI computes fp8 and bf16 weights in fp32 (manual cast): the exact bound for both
        assert err <= 1e-5, (name, err)


def test_qwen_image_equals_ksampler(server, qwen):
    _matrix(server, "default", CI["default"])


@pytest.mark.slow
@pytest.mark.parametrize("weight_dtype", ["fp8_e4m3fn", "default"])
def test_qwen_image_rest_of_the_matrix_equals_ksampler(server, qwen, weight_dtype):
    _matrix(server, weight_dtype, REST[weight_dtype])


def test_qwen_image_tensor_parallel_is_refused_with_the_fix(server, qwen):
    entry = server.run(_graph("qwen_tp", {"tp_degree": 2}))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "not available for Qwen-Image" in msg and "ulysses/ring/cfg" in msg, msg


def _edit_graph(tag, degrees=None, node="model", mode="auto"):
    """Qwen-Image edit: ReferenceLatent puts an encoded image into both conditionings (its tokens join the
    image sequence inside the model, and are split with it)."""
    g = _graph(tag, degrees, "default", node)
    g["30"] = {"class_type": "EmptyImage", "inputs": {"width": 64, "height": 48, "batch_size": 1, "color": 0x9a3c5e}}
    g["31"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["30", 0], "vae": ["6", 0]}}
    g["32"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["2", 0], "latent": ["31", 0]}}
    g["33"] = {"class_type": "ReferenceLatent", "inputs": {"conditioning": ["3", 0], "latent": ["31", 0]}}
    g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = ["32", 0], ["33", 0]
    if degrees is not None:
        g["9"]["inputs"]["sampling_mode"] = mode
    return g


# The reference cases: u2 x r2 through Parallel Model in CI (both sequence methods split the [image, references]
# sequence); the same through Hybrid Sampler and cfg 2 x u2 with the slow set (the node and the batch split are the
# same code on every family: tests/server_e2e/test_comfyui_e2e.py, test_comfyui_parallel_model.py)
REF_CI = [("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model")]
REF_REST = [("cfg2u2", {"cfg_degree": 2, "ulysses_degree": 2}, "model"),
            ("u2r2_hybrid", {"ulysses_degree": 2, "ring_degree": 2}, "sampler")]


def test_qwen_image_edit_reference_latents_equal_ksampler(server, qwen):
    ref = equal_ksampler(server, _edit_graph, "qwen_edit", REF_CI)
    if not server.output("lat_qwen_ref_default.safetensors").exists():  # run alone: the plain KSampler latent
        assert_ok(server, server.run(_graph("qwen_ref_default", weight_dtype="default")))
    plain = latent(server, "qwen_ref_default")
    assert rel(plain, ref) > 1e-3  # the reference tokens change the result: a dropped reference cannot pass
    entry = server.run(_edit_graph("qwen_edit_loop", {"ulysses_degree": 2}, "sampler", mode="loop"))
    assert entry["status"]["status_str"] == "error"
    msg = error_text(entry)
    assert "sampling_mode to step" in msg, msg


@pytest.mark.slow
def test_qwen_image_edit_rest_of_the_reference_cases(server, qwen):
    equal_ksampler(server, _edit_graph, "qwen_edit_rest", REF_REST)


@pytest.fixture(scope="module")
def qwen_2511(server):
    """Qwen-Image-Edit-2511: the same tiny weights plus the empty `__index_timestep_zero__` buffer by which ComfyUI
    0.33 detects it (its reference method is then index_timestep_zero)."""
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / "tiny_qwen_image_edit_2511.safetensors"
    if not path.exists():
        tiny.write_qwen_image(path, seed=19, ref_method="index_timestep_zero")
    return path.name


def _edit_2511(name):
    def graph(tag, degrees=None, node="model"):
        g = _edit_graph(tag, degrees, node)
        g["1"]["inputs"]["unet_name"] = name
        return g
    return graph


def _has_2511():
    import inspect

    from comfy.ldm.qwen_image.model import QwenImageTransformer2DModel
    if "index_timestep_zero" not in inspect.getsource(QwenImageTransformer2DModel):
        pytest.skip("this ComfyUI has no Qwen-Image-Edit-2511 (index_timestep_zero: ComfyUI >= 0.33)")


def test_qwen_image_edit_2511_timestep_zero_references_equal_ksampler(server, qwen, qwen_2511):
    """Qwen-Image-Edit-2511 modulates the image's tokens with the timestep and its references' tokens with t = 0,
    split at `timestep_zero_index` (a position in the whole [image, references] sequence). Under ulysses / ring
    each block gets that position in its own shard; before, every rank applied the global index to its local
    tokens (1.65e-2 from KSampler here, no error)."""
    _has_2511()
    ref = equal_ksampler(server, _edit_2511(qwen_2511), "q2511", REF_CI)
    assert_ok(server, server.run(_edit_graph("q2511_plain_edit")))
    assert rel(latent(server, "q2511_plain_edit"), ref) > 1e-4  # the t = 0 references change the result


@pytest.mark.slow
def test_qwen_image_edit_2511_rest_of_the_reference_cases(server, qwen, qwen_2511):
    _has_2511()
    equal_ksampler(server, _edit_2511(qwen_2511), "q2511_rest", REF_REST)


@pytest.mark.slow  # fp8 weights on a CPU: every call casts all 0.38B on every rank (3 s a step) for the split code
# CI runs in bf16 above; each fp8 layout's load and cast is proven on every method by families/test_native_pool.py
def test_qwen_image_fp8_equals_ksampler(server, qwen):
    """fp8 weights (as most people run it) under ulysses 2: last in the file, its 2-rank world after the 4-rank one
    of the cases above."""
    _matrix(server, "fp8_e4m3fn", CI["fp8_e4m3fn"])
