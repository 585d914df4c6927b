"""ControlNet end to end in a real ComfyUI: a checkpoint loaded by ComfyUI's ControlNetLoader, applied with
ControlNetApplyAdvanced, sampled by KSampler, against the same graph with the diffusion model on the pool.

Why: the pack never runs the ControlNet itself. ComfyUI computes the residuals in the driver for the whole
batch and image sequence and hands them to the diffusion model as `control`; the proxy sends them nested to
the workers, the CFG / data split slices them and each sequence rank adds the part that lands on its own
tokens (parallel/plan.py _ShardedResiduals). tests/families/test_native_refs.py checks that with hand-made residuals;
here the residuals are the ones a real ControlNet file produces through ComfyUI's own loader, hint
preprocessing (SD3: VAE encode; Flux XLabs: pixel-space hint convs) and strength merge.

The tiny ControlNets come from doctor/tiny_controlnets.py; ComfyUI loads them bit for bit (checked here, so a
missing key cannot leave uninitialised weights behind). The hint is a PNG with gradients and a disc, loaded
by LoadImage and rescaled by the ControlNet itself. A strength-0 run (ControlNetApplyAdvanced then returns the
conditioning untouched) must differ clearly from the controlled one, so a test that ignored the residuals
would fail.

- SD3 (fast): odd 13 x 9 latent (7 x 5 = 35 tokens: no degree divides it); Parallel Model + KSampler with
  ulysses 2 x ring 2 and cfg 2 x ulysses 2, and Hybrid Sampler ulysses 2 x ring 2 (each alone: slow); loop mode and PipeFusion refuse
  ControlNet, naming step mode.
- Flux.1-dev (slow: ComfyUI forces width 3072, a 0.53B model plus a 0.38B ControlNet): XLabs needs an even
  latent, 14 x 10 gives 7 x 5 = 35 tokens, again uneven; ulysses 2 (Parallel Model) and ring 2 (Hybrid Sampler).
"""
import pytest

from comfy_server import (PARTS, assert_ok, error_text, latent, parallel_config_node, parallel_model, rel, workflow,
                          write_flux_checkpoint)

pytestmark = pytest.mark.comfy

SD3_W, SD3_H = 104, 72  # latent 13 x 9
FLUX_W, FLUX_H = 112, 80  # latent 14 x 10
HINT = "hp_controlnet_hint.png"
SD3_CN, FLUX_CN = "tiny_sd3_controlnet.safetensors", "tiny_flux_controlnet.safetensors"
STRENGTH = 0.8
BOUND = 1e-4  # the pool vs KSampler, latent relative error (fp32; measured ~1e-7)
MATTERS = 1e-2  # the ControlNet's effect on the latent must be at least this (relative)


def _write_hint(path):
    """A 96 x 88 RGB hint (neither the latent's size nor its aspect: ComfyUI crops and rescales it): a
    horizontal red ramp, a vertical green ramp and a blue disc off centre."""
    import numpy as np
    from PIL import Image
    h, w = 88, 96
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    disc = ((x - 0.35 * w) ** 2 + (y - 0.6 * h) ** 2 < (0.25 * h) ** 2).astype(np.float32)
    rgb = np.stack([x / (w - 1), y / (h - 1), disc], axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray((rgb * 255).round().astype(np.uint8)).save(path)


def _check_loads_exactly(path, written):
    """ComfyUI's own loader detects the file and rebuilds every tensor we drew (its load is not strict: a
    missing key would leave uninitialised memory and still 'work')."""
    import comfy.controlnet
    net = comfy.controlnet.load_controlnet(str(path))
    assert net is not None, f"ComfyUI did not detect {path.name} as a ControlNet"
    got = net.control_model.state_dict()
    assert set(got) == set(written), sorted(set(got) ^ set(written))[:10]
    worst = max((got[k].float() - written[k].float()).abs().max().item() for k in written)
    assert worst == 0.0, worst


@pytest.fixture(scope="module")
def sd3_controlnet(server):
    from comfyui_hybrid_parallel.doctor import tiny_controlnets as tcn
    _write_hint(server.base / "input" / HINT)
    path = server.base / "models" / "controlnet" / SD3_CN
    # the tiny SD3 of comfy_server.write_checkpoints: depth 4 (hidden 256), pos_embed_max_size 48
    written = tcn.write_sd3_controlnet(path, depth=4, num_blocks=2, pos_embed_max_size=48, seed=31)
    _check_loads_exactly(path, written)
    return SD3_CN


def _graph(family, tag, degrees=None, node="model", strength=STRENGTH, size=(SD3_W, SD3_H)):
    """family's tiny model -> [Parallel Model] -> KSampler (or Parallel Config -> Hybrid Sampler), both
    conditionings through ControlNetApplyAdvanced with the LoadImage hint; the latent is saved as lat_<tag>.
    `size`: SD3's image size (Flux's is fixed)."""
    if family == "sd3":
        g = workflow(None, tag, *size, steps=3, cfg=4.0)
        control_net, apply_extra = SD3_CN, {"vae": ["6", 0]}  # SD3 ControlNets VAE-encode their hint
    else:
        g = workflow(None, tag, FLUX_W, FLUX_H, family="flux", steps=2, cfg=1.0, scheduler="simple")
        control_net, apply_extra = FLUX_CN, {}  # XLabs: pixel-space hint, no VAE
    common = dict(g["5"]["inputs"], positive=["32", 0], negative=["32", 1])
    for k in ("5", "7", "8", "10", "11"):
        g.pop(k, None)
    g["30"] = {"class_type": "LoadImage", "inputs": {"image": HINT}}
    g["31"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": control_net}}
    g["32"] = {"class_type": "ControlNetApplyAdvanced", "inputs": {
        "positive": ["2", 0], "negative": ["3", 0], "control_net": ["31", 0], "image": ["30", 0],
        "strength": strength, "start_percent": 0.0, "end_percent": 1.0, **apply_extra}}
    if degrees is not None and node == "sampler":
        g["9"] = parallel_config_node(degrees)
        g["5"] = {"class_type": "HybridSampler", "inputs": {**common, "parallel_config": ["9", 0]}}
    else:
        if degrees is not None:
            common["model"] = parallel_model(g, degrees)
        g["5"] = {"class_type": "KSampler", "inputs": common}
    g["10"] = {"class_type": "HPSaveLatentTensor", "inputs": {"samples": ["5", 0], "filename": f"lat_{tag}"}}
    return g


def _reference(server, family):
    """KSampler with the ControlNet, and its effect: the relative change from the strength-0 graph."""
    tag = f"cn_{family}_ref"
    assert_ok(server, server.run(_graph(family, tag)))
    assert_ok(server, server.run(_graph(family, f"cn_{family}_off", strength=0.0)))
    ref = latent(server, tag)
    effect = rel(latent(server, f"cn_{family}_off"), ref)
    print(f"ControlNet {family}: strength {STRENGTH} vs 0 changes the latent by {effect:.2e} (relative)")
    assert effect > MATTERS, effect
    return ref


def _compare(server, family, ref, cases):
    for name, degrees, node in cases:
        tag = f"cn_{family}_{name}"
        assert_ok(server, server.run(_graph(family, tag, degrees, node)))
        err = rel(latent(server, tag), ref)
        print(f"ControlNet {family} {name}: latent relative error vs KSampler {err:.2e}")
        assert err <= BOUND, (name, err)


SD3_CASES = [("u2r2", {"ulysses_degree": 2, "ring_degree": 2}, "model"),
             ("u2r2_hybrid", {"ulysses_degree": 2, "ring_degree": 2}, "sampler"),
             ("cfg2u2", {"cfg_degree": 2, "ulysses_degree": 2}, "model"),
             ("u2", {"ulysses_degree": 2}, "model"), ("u2_hybrid", {"ulysses_degree": 2}, "sampler"),
             ("r2", {"ring_degree": 2}, "model"), ("cfg2", {"cfg_degree": 2}, "model")]


@pytest.mark.parametrize("part", PARTS)
def test_sd3_controlnet_equals_ksampler(server, sd3_controlnet, part):
    """CI: both sequence methods at once through both nodes and the batch split composed with ulysses - one 4-rank
    world (a new world restarts the pool's processes); ulysses, ring and cfg alone with the slow set."""
    ref = _reference(server, "sd3")
    _compare(server, "sd3", ref, SD3_CASES[:3] if part == "ci" else SD3_CASES[3:])


def test_loop_mode_refuses_controlnet_naming_step_mode(server, sd3_controlnet):
    """Loop mode (asked for, or PipeFusion's) captures one call's conditioning and runs the whole loop in the
    workers, where no ControlNet runs: the prompt must fail, saying how to get step mode, never sample without
    the control. PipeFusion's advice is pp_degree 1 (sampling_mode step alone is refused with pp_degree 2);
    PipeFusion needs an even latent, hence 14 x 10 there."""
    cases = [("loop", {"ulysses_degree": 2, "sampling_mode": "loop"}, (SD3_W, SD3_H), "set sampling_mode to step"),
             ("pp2", {"pp_degree": 2, "num_pipeline_patch": 2}, (112, 80), "set pp_degree to 1")]
    for name, degrees, size, advice in cases:
        tag = f"cn_sd3_{name}"
        entry = server.run(_graph("sd3", tag, degrees, "sampler", size=size))
        assert "rejected" not in entry, entry
        assert entry["status"]["status_str"] == "error", (name, entry["status"])
        msg = error_text(entry)
        assert "ControlNet" in msg and "step mode" in msg and advice in msg, (name, msg)
        assert not server.output(f"lat_{tag}.safetensors").exists()


@pytest.mark.slow
def test_flux_controlnet_equals_ksampler(server):
    from comfyui_hybrid_parallel.doctor import tiny_controlnets as tcn
    _write_hint(server.base / "input" / HINT)
    write_flux_checkpoint(server.base)
    path = server.base / "models" / "controlnet" / FLUX_CN
    _check_loads_exactly(path, tcn.write_flux_controlnet(path, guidance=True, seed=33))
    ref = _reference(server, "flux")
    _compare(server, "flux", ref, [("u2", {"ulysses_degree": 2}, "model"),
                                   ("r2_hybrid", {"ring_degree": 2}, "sampler")])
