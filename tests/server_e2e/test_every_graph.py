"""The graphs users build around the pack's nodes, in a real ComfyUI: carried exactly, or refused before any work
naming the node (workers/bridge/capture.py).

Each carried graph is compared with KSampler on the same graph (≤ 1e-5; fp32 on CPU) through Parallel Model and / or
Hybrid Sampler; each refusal is checked to come from the pack's node before any worker computes anything (no new
resident model, no world started for it), with the node's name and the fix in its one message. The prompts run on one
server in a row, so a pool that ran a patched prompt must serve the next prompt as a fresh pool would (the hook LoRA
prompt is followed by the plain one: before the residency key said what is in the weights, that plain prompt got the
hooked weights, 4.9e-2 from KSampler).
"""
import pytest

from comfy_server import assert_ok, error_text, latent, on_pool, rel, workflow

pytestmark = pytest.mark.comfy

W, H = 88, 72  # an 11 x 9 latent: odd, so Ulysses / ring split the 5 x 5 patch rows (+ text) unevenly
STEPS = 3
LORA = "tiny_lora.safetensors"


def _graph(tag, degrees=None, node="model", model_nodes=None, cond_nodes=None, steps=STEPS, family="sd3"):
    """The tiny SD3 KSampler graph (latent saved, no decode) with `model_nodes` (id -> node, chained from the loader
    "1"; the last feeds the sampler) and `cond_nodes` (a function adding nodes to the graph and returning the
    positive / negative links); on the pool when `degrees` is given ("model": Parallel Model, "sampler": Hybrid
    Sampler)."""
    g = workflow(None, tag, W, H, steps=steps, family=family, length=5)
    for k in ("6", "7", "8", "11"):
        g.pop(k, None)
    g["5"]["inputs"]["sampler_name"] = "euler"
    model = ["1", 0]
    for nid, n in (model_nodes or {}).items():
        n = {"class_type": n["class_type"], "inputs": {**n["inputs"], "model": list(model)}}
        g[nid] = n
        model = [nid, 0]
    g["5"]["inputs"]["model"] = model
    if cond_nodes is not None:
        pos, neg = cond_nodes(g)
        g["5"]["inputs"]["positive"], g["5"]["inputs"]["negative"] = pos, neg
    return g if degrees is None else on_pool(g, degrees, node)


def _equal(server, tag, cases, bound=1e-5, **kw):
    assert_ok(server, server.run(_graph(f"{tag}_ref", **kw)))
    ref = latent(server, f"{tag}_ref")
    for name, degrees, node in cases:
        assert_ok(server, server.run(_graph(f"{tag}_{name}", degrees, node, **kw)))
        err = rel(latent(server, f"{tag}_{name}"), ref)
        print(f"{tag} {name}: {err:.2e} from KSampler")
        assert err <= bound, (tag, name, err)
    return ref


def _resident(server):
    return sorted(k for w in server.get("/hybrid_parallel/pool")["workers"] for k in w.get("resident") or [])


def _refused(server, g, *needles, node_type=None):
    """The prompt fails with one NotCarried from the pack's node naming `needles`, and no model was made resident."""
    before = _resident(server)
    entry = server.run(g)
    assert entry["status"]["status_str"] == "error", entry["status"]
    errors = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert len(errors) == 1 and errors[0].get("exception_type", "").endswith("NotCarried"), errors
    msg = error_text(entry)
    print(f"  refused by {errors[0].get('node_type')}: {msg}")
    for n in needles:
        assert n in msg, (n, msg)
    if node_type:
        assert errors[0].get("node_type") == node_type, errors[0]
    assert set(_resident(server)) <= set(before), "a refused prompt made a model resident"
    return msg


def _hooked_positive(keyframes: bool):
    """Positive conditioning with a hook LoRA (CreateHookLoraModelOnly on the tiny LoRA, optionally keyframed from
    strength 1.0 to 0.2 over the steps), the negative without: each model call runs under its cond's hook group."""
    def add(g):
        g["30"] = {"class_type": "CreateHookLoraModelOnly", "inputs": {"lora_name": LORA, "strength_model": 0.8}}
        hooks = ["30", 0]
        if keyframes:
            g["31"] = {"class_type": "CreateHookKeyframesInterpolated", "inputs": {
                "strength_start": 1.0, "strength_end": 0.2, "interpolation": "linear", "start_percent": 0.0,
                "end_percent": 1.0, "keyframes_count": 3, "print_keyframes": False}}
            g["32"] = {"class_type": "SetHookKeyframes", "inputs": {"hooks": hooks, "hook_kf": ["31", 0]}}
            hooks = ["32", 0]
        g["33"] = {"class_type": "ConditioningSetProperties", "inputs": {
            "cond_NEW": ["2", 0], "strength": 1.0, "set_cond_area": "default", "hooks": hooks}}
        return ["33", 0], ["3", 0]
    return add


def test_hook_loras_per_cond_then_a_plain_prompt(server):
    """A hook LoRA on the positive only, keyframed: ComfyUI switches the weights per cond batch and per keyframe; the
    workers do the same. Then the plain graph on the same loader: served the weights without the hook."""
    _equal(server, "hook", [("pm_u2", {"ulysses_degree": 2}, "model"), ("hs_cfg2", {"cfg_degree": 2}, "sampler")],
           cond_nodes=_hooked_positive(keyframes=True))
    _equal(server, "hookplain", [("pm_u2", {"ulysses_degree": 2}, "model"), ("hs_cfg2", {"cfg_degree": 2}, "sampler")])


def test_hook_loras_refused_in_the_workers_loop(server):
    g = _graph("hook_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler",
               cond_nodes=_hooked_positive(keyframes=False))
    _refused(server, g, "CreateHookLoraModelOnly", "sampling_mode to step", node_type="HybridSampler")


SLG = {"class_type": "SkipLayerGuidanceDiT", "inputs": {"double_layers": "1, 2", "single_layers": "", "scale": 3.0,
                                                        "start_percent": 0.01, "end_percent": 0.9,
                                                        "rescaling_scale": 0.0}}


def test_skip_layer_guidance_is_carried(server):
    """SLG's extra guidance call skips blocks 1 and 2: the block list travels with that call."""
    _equal(server, "slg", [("pm_u2", {"ulysses_degree": 2}, "model"), ("hs_r2", {"ring_degree": 2}, "sampler")],
           model_nodes={"20": SLG})
    simple = {"class_type": "SkipLayerGuidanceDiTSimple", "inputs": {"double_layers": "2", "single_layers": "",
                                                                      "start_percent": 0.0, "end_percent": 1.0}}
    _equal(server, "slgs", [("pm_u2", {"ulysses_degree": 2}, "model")], model_nodes={"20": simple})


def test_skip_layer_guidance_on_the_split_block_is_refused(server):
    slg0 = {"class_type": SLG["class_type"], "inputs": {**SLG["inputs"], "double_layers": "0"}}
    _refused(server, _graph("slg0", {"ulysses_degree": 2}, "model", model_nodes={"20": slg0}),
             "SkipLayerGuidanceDiT (node 20)", "skips block 0", "choose layers from 1")


def test_compute_dtype_is_carried(server):
    """ModelComputeDtype bf16 on fp32 weights: every layer casts its weights to bf16 at each call, on the workers as
    in ComfyUI - bitwise at degree 1 (left out, the ranks computed fp32 weights on bf16 inputs: 1.5e-4)."""
    _equal(server, "mcd", [("pm_d1", {}, "model"), ("hs_d1", {}, "sampler")], bound=0.0,
           model_nodes={"20": {"class_type": "ModelComputeDtype", "inputs": {"dtype": "bf16"}}})


def test_cfg_functions_run_in_step_mode_and_are_refused_in_the_loop(server):
    rescale = {"class_type": "RescaleCFG", "inputs": {"multiplier": 0.7}}
    _equal(server, "rescale", [("hs_u2", {"ulysses_degree": 2}, "sampler")], model_nodes={"20": rescale})
    _refused(server, _graph("rescale_loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler",
                            model_nodes={"20": rescale}),
             'RescaleCFG (node 20)', "sampling_mode to step", node_type="HybridSampler")


def test_lora_bypass_is_carried(server):
    """LoraLoaderBypassModelOnly: the LoRA runs beside each layer's forward (not merged into the weights); its
    adapters travel and the workers inject ComfyUI's own bypass hooks around each call - step mode and the loop."""
    bypass = {"class_type": "LoraLoaderBypassModelOnly", "inputs": {"lora_name": LORA, "strength_model": 0.8}}
    _equal(server, "bypass", [("pm_u2", {"ulysses_degree": 2}, "model"),
                              ("hs_loop_u2", {"ulysses_degree": 2, "sampling_mode": "loop"}, "sampler")],
           model_nodes={"20": bypass})


def test_a_patch_inside_the_model_is_refused_naming_the_node(server):
    tome = {"class_type": "TomePatchModel", "inputs": {"ratio": 0.3}}
    _refused(server, _graph("tome", {"ulysses_degree": 2}, "model", model_nodes={"20": tome}),
             "TomePatchModel (node 20)", "inside ComfyUI's diffusion model", node_type="HybridParallelModel")


# Every MODEL -> MODEL node the table carries or runs in the driver (workers/bridge/classified.py) that acts on the tiny
# SD3, against KSampler through Parallel Model at ulysses 2 - its widgets at their defaults, except where a default
# leaves the graph unchanged (each node must change KSampler's own latent, or the comparison would prove nothing).
# CI runs one of each kind (a pre-CFG / post-CFG function, a KJNodes CFG function, a carried extra call, a carried
# option, a carried closure); the slow set runs all. (EasyCache: a no-op on SD3 in ComfyUI itself - tests/server_e2e/test_comfyui_easycache.py.)
SWEEP_CI = ("APG", "CFGZeroStar", "CFGZeroStarAndInit", "PerturbedAttentionGuidance", "ScaleROPE", "FreeU_V2")
SWEEP = ("CFGNorm", "Epsilon Scaling", "FreSca", "LazyCache", "Mahiro", "RenormCFG", "RescaleCFG", "TCFG",
         "TemporalScoreRescaling", "VideoLinearCFGGuidance", "VideoTriangleCFGGuidance",
         "SkipLayerGuidanceSD3", "FreeU")
NOT_DEFAULT = {"ScaleROPE": {"scale_x": 1.5, "shift_y": 2.0}, "SkipLayerGuidanceSD3": {"layers": "1, 3",
                                                                                        "end_percent": 0.9},
               "LazyCache": {"reuse_threshold": 3.0, "start_percent": 0.0}}
# where the tiny SD3 is not a model the node acts on in ComfyUI itself (SD3 has no RoPE and no UNet self-attention),
# the family it runs on, and the split that family runs (SD1.5 has no adapter: CFG parallel)
ON = {"ScaleROPE": ("wan", {"ulysses_degree": 2}), "PerturbedAttentionGuidance": ("sd15", {"cfg_degree": 2}),
      "FreeU": ("sd15_2l", {"cfg_degree": 2}), "FreeU_V2": ("sd15_2l", {"cfg_degree": 2}),
      "LazyCache": ("sd3", {"ulysses_degree": 2}, 8)}


def _family(server, family: str) -> None:
    """The tiny SD1.5 UNets in the server's models when a test needs them (the other families are there)."""
    from comfy_server import FAMILIES
    path = server.base / "models" / "diffusion_models" / FAMILIES[family]["unet"]
    if family in ("sd15", "sd15_2l") and not path.exists():
        from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
        tc.write_unet(path, xl=False, seed=41, levels=2 if family == "sd15_2l" else None)


def _defaults(server, class_type: str) -> dict:
    """The node's required widget values at their defaults (ComfyUI's /object_info); its MODEL input left to link."""
    info = server.get(f"/object_info/{class_type.replace(' ', '%20')}")[class_type]["input"]
    out = {}
    for name, spec in (info.get("required") or {}).items():
        kind, opts = spec[0], (spec[1] if len(spec) > 1 else {}) or {}
        if isinstance(kind, list):
            out[name] = kind[0]
        elif kind == "COMBO":
            out[name] = opts.get("options", [None])[0]
        elif kind in ("INT", "FLOAT", "BOOLEAN", "STRING"):
            out[name] = opts.get("default", opts.get("min", 0))
        elif kind != "MODEL":
            raise AssertionError(f"{class_type}: input {name} ({kind}) is not a widget")
    return out


@pytest.mark.parametrize("class_type", [pytest.param(c, marks=() if c in SWEEP_CI else pytest.mark.slow)
                                        for c in SWEEP_CI + SWEEP])
def test_a_carried_or_driver_node_equals_ksampler(server, class_type):
    from comfyui_hybrid_parallel.workers.bridge.classified import CARRIED, NODES, STEP
    assert NODES[class_type] in (CARRIED, STEP), NODES[class_type]
    node = {"class_type": class_type, "inputs": {**_defaults(server, class_type), **NOT_DEFAULT.get(class_type, {})}}
    family, degrees, steps = (ON.get(class_type, ("sd3", {"ulysses_degree": 2})) + (STEPS,))[:3]
    _family(server, family)
    tag = f"sweep_{class_type.replace(' ', '_')}"
    ref = _equal(server, tag, [("pm", degrees, "model")], model_nodes={"20": node}, family=family, steps=steps)
    assert_ok(server, server.run(_graph(f"{tag}_plain", family=family, steps=steps)))
    effect = rel(ref, latent(server, f"{tag}_plain"))
    print(f"{class_type} changes KSampler's latent by {effect:.2e}")
    assert effect > 1e-4, f"{class_type} leaves this graph unchanged: the comparison would prove nothing"


def test_a_plain_prompt_after_every_patched_one(server):
    """Last in this module: after every graph above ran on this server's pool (hooks, skips, bypass, compute dtype,
    CFG functions, refusals), the plain graph on the same loader is KSampler's - nothing of another prompt's state."""
    _equal(server, "after_all", [("pm_u2", {"ulysses_degree": 2}, "model"), ("hs_r2", {"ring_degree": 2}, "sampler"),
                                 ("pm_d1", {}, "model")])
