"""Wan 2.1 Causal AR (ComfyUI 0.33's `CausalWanModel`) in a real ComfyUI: the ar_video sampler refused on the pool
with one message naming why and the fix, the pool usable afterwards, and KSampler on the same model exact.

The model: a Wan 2.1 T2V checkpoint (the same keys and sizes as WanModel) whose metadata says
{"config": {"transformer": {"causal_ar": true}}}; comfy/model_detection.py merges that into the detected config, so
supported_models.WAN21_CausalAR_T2V matches (it is listed before WAN21_T2V) and builds model_base.WAN21_CausalAR
around comfy.ldm.wan.ar_model.CausalWanModel. The tiny one: write_wan's layout (width 256, 2 heads, two blocks)
saved with that metadata; the fixture asserts ComfyUI's own detection of it (config, model and diffusion-model class,
FLOW), so the test cannot silently run plain Wan.

The graph a user builds (ComfyUI 0.33 has no ar_video entry in KSampler's sampler list: the nodes in
comfy_extras/nodes_ar_video.py): EmptyARVideoLatent, SamplerARVideo (num_frame_per_block 1), BasicScheduler,
RandomNoise and BasicGuider (cfg 1: ComfyUI's ar_video fails on a CFG batch by itself, its KV caches being sized
for the latent's batch) into SamplerCustomAdvanced, batch 2; checked first without the pack (ComfyUI runs it).
sample_ar_video puts the per-layer KV caches and the frame position into transformer_options["ar_state"] for every
model call, which the workers cannot see:
- through Parallel Model at ulysses 2 the prompt is refused already at the Parallel Model node: CausalWanModel is a
  WanModel subclass the Wan plan does not declare (parallel/models/wan.py comfy_module "comfy.ldm.wan.model"), so it
  runs as an unknown model, CFG / data parallel only (workers/bridge/spec.check_any_model) - before any worker starts, but
  the message is that one, not the ar_video one;
- through Parallel Model at dp 2 or cfg 2 (what that message tells the user to use) the first model call is refused by
  workers/bridge/known.TRANSFORMER_OPTIONS["ar_state"] ("causal autoregressive" ... "without Parallel Model") in the
  driver (workers/bridge/proxy.py _native_forward's carry.call_options), before the call is sent and before the model is shipped: no residency key the
  next, successful prompt puts on the workers was there after the refusals (and where no world was up, none starts).
  ComfyUI's own sample_ar_video has already allocated the KV caches for the whole video (comfy/k_diffusion/
  sampling.py, init_kv_caches) on the latent's device by then: the refusal comes at the first model call, not at
  Parallel Model or at the start of sampling.
Either way one message, no worker traceback, and the next prompt on the same server succeeds.

KSampler on that model: CausalWanModel.forward without ar_state is WanModel's bidirectional forward (its blocks'
self-attention without a KV cache), so ComfyUI samples it with KSampler like plain Wan 2.1. Through Parallel Model
it runs CFG parallel (cfg 2) exactly as KSampler (odd 13 x 9 latent, 2 latent frames: 7 x 5 x 2 = 70 tokens);
ulysses / ring are refused there for the reason above, so no sequence split is compared.
"""
import json

import pytest

from comfy_server import assert_ok, error_text, latent, on_pool, parallel_model, rel, workflow

pytestmark = pytest.mark.comfy

UNET = "tiny_wan21_causal_ar.safetensors"
W, H, FRAMES = 104, 72, 5          # KSampler: latent 2 x 9 x 13 (odd)
AR_W, AR_H, AR_FRAMES = 112, 80, 9  # ar_video: EmptyARVideoLatent's width / height step 16; 3 latent frames


@pytest.fixture(scope="module")
def causal_ar(server):
    """The tiny Causal AR checkpoint, and ComfyUI's detection of it."""
    import comfy.model_base
    import comfy.model_detection
    import comfy.utils
    from safetensors.torch import save_file

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = server.base / "models" / "diffusion_models" / UNET
    sd = tiny.write_wan(path, dim=256, ffn_dim=256, num_layers=2, seed=71)
    save_file(sd, str(path), metadata={"format": "pt", "config": json.dumps({"transformer": {"causal_ar": True}})})

    sd, metadata = comfy.utils.load_torch_file(str(path), return_metadata=True)
    config = comfy.model_detection.model_config_from_unet(sd, "", metadata=metadata)
    model = config.get_model(sd, "")
    dm = model.diffusion_model
    detected = (type(config).__name__, type(model).__name__, model.model_type, type(dm).__name__,
                type(dm).__module__, type(dm.blocks[0]).__name__)
    print(f"Causal AR detection: {detected}")
    assert detected == ("WAN21_CausalAR_T2V", "WAN21_CausalAR", comfy.model_base.ModelType.FLOW, "CausalWanModel",
                        "comfy.ldm.wan.ar_model", "CausalWanAttentionBlock")
    assert hasattr(dm, "init_kv_caches")  # what sample_ar_video requires of the model
    return UNET


def _ar_graph(tag, degrees=None, batch=2):
    """The ar_video graph (SamplerCustomAdvanced with BasicGuider: ComfyUI's sample_ar_video sizes its KV caches
    for the latent's batch, so a CFG batch of cond + uncond fails inside ComfyUI itself - the Causal Forcing models
    are distilled for cfg 1), its MODEL through Parallel Model when `degrees` is given."""
    g = workflow(None, tag, AR_W, AR_H, family="wan", length=AR_FRAMES)
    for k in ("4", "5", "6", "7", "8", "10", "11"):
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = UNET
    model = ["1", 0] if degrees is None else parallel_model(g, degrees)
    g["30"] = {"class_type": "EmptyARVideoLatent", "inputs": {"width": AR_W, "height": AR_H, "length": AR_FRAMES,
                                                              "batch_size": batch}}
    g["31"] = {"class_type": "SamplerARVideo", "inputs": {"num_frame_per_block": 1}}
    g["32"] = {"class_type": "BasicScheduler", "inputs": {"model": model, "scheduler": "simple", "steps": 2,
                                                          "denoise": 1.0}}
    g["33"] = {"class_type": "RandomNoise", "inputs": {"noise_seed": 5}}
    g["34"] = {"class_type": "BasicGuider", "inputs": {"model": model, "conditioning": ["2", 0]}}
    g["35"] = {"class_type": "SamplerCustomAdvanced", "inputs": {"noise": ["33", 0], "guider": ["34", 0],
                                                                 "sampler": ["31", 0], "sigmas": ["32", 0],
                                                                 "latent_image": ["30", 0]}}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["35", 0], "filename": f"lat_{tag}"}}
    return g


def _ks_graph(tag, degrees=None, node="model"):
    g = workflow(None, tag, W, H, family="wan", length=FRAMES, steps=2, cfg=3.0)
    for k in ("6", "7", "8", "11"):  # the latent is what is compared
        g.pop(k, None)
    g["1"]["inputs"]["unet_name"] = UNET
    return g if degrees is None else on_pool(g, degrees, node)


def _resident(server):
    """Every rank's resident model keys (empty when no world is up)."""
    return sorted(k for w in server.get("/hybrid_parallel/pool")["workers"] for k in w.get("resident") or [])


def _one_message(entry, *needles):
    assert "rejected" not in entry, entry
    assert entry["status"]["status_str"] == "error", entry["status"]
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert len(errors) == 1, errors
    msg = error_text(entry)
    print(f"  {errors[0].get('node_type')}: {errors[0].get('exception_type')}: {msg}")
    for n in needles:
        assert n in msg, (n, msg)
    # the driver's refusal, not a worker's failure (workers/pool.py WorkerError: "job N failed on rank ...")
    assert errors[0].get("exception_type", "").endswith("NotCarried"), errors[0].get("exception_type")
    assert "Traceback" not in msg and "failed on" not in msg, msg
    return errors[0]


def test_ar_video_on_the_pool_is_refused_then_the_pool_samples(server, causal_ar):
    # the graph itself runs in ComfyUI (the refusal below is the pack's, not a broken graph)
    assert_ok(server, server.run(_ar_graph("car_ar_ref")))
    assert latent(server, "car_ar_ref").shape == (2, 16, 3, AR_H // 8, AR_W // 8)

    # ulysses 2: refused at the Parallel Model node (an undeclared WanModel subclass: CFG / data parallel only)
    err = _one_message(server.run(_ar_graph("car_ar_u2", {"ulysses_degree": 2})),
                       "CausalWanModel", "cfg_degree 2")
    assert err.get("node_type") == "HybridParallelModel", err

    # what that message offers - data parallel over the batch of 2, CFG parallel (idle at cfg 1): refused at the
    # first model call, before it is sent to the workers (the model is not shipped, no output is written)
    before, after_refusals = set(_resident(server)), set()
    for name, degrees in (("dp2", {"dp_degree": 2}), ("cfg2", {"cfg_degree": 2})):
        err = _one_message(server.run(_ar_graph(f"car_ar_{name}", degrees)),
                           "causal autoregressive", "KV caches", "without Parallel Model")
        assert err.get("node_type") == "SamplerCustomAdvanced", err
        assert not server.output(f"lat_car_ar_{name}.safetensors").exists()
        pool = server.get("/hybrid_parallel/pool")
        last = ((pool["last_job"] or {}).get("error") or "")[:40]
        print(f"  after the refused {name} prompt: pool {pool['state']}, last job {last!r}")
        after_refusals |= set(_resident(server))

    # the next prompt on the same server: the same model through Parallel Model (cfg 2) with KSampler, exact
    assert_ok(server, server.run(_ks_graph("car_ks_ref")))
    ref = latent(server, "car_ks_ref")
    assert ref.shape == (1, 16, 2, 9, 13), ref.shape
    assert_ok(server, server.run(_ks_graph("car_ks_cfg2", {"cfg_degree": 2})))
    assert server.get("/hybrid_parallel/pool")["mesh"].startswith("cfg"), server.get("/hybrid_parallel/pool")
    err = rel(latent(server, "car_ks_cfg2"), ref)
    print(f"Causal AR KSampler cfg2 (Parallel Model): latent relative error vs KSampler {err:.2e}")
    assert err <= 1e-5, err
    shipped = set(_resident(server)) - before  # this time the model went to the workers: its residency key(s)
    assert shipped, "the KSampler prompt left no model resident on the workers"
    assert not shipped & after_refusals, "a refused ar_video prompt had already shipped the model to the workers"
