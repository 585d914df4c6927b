"""The workers' own loop (PipeFusion, loop mode) computes the model's input, timestep and `denoised` itself: the
convention it is handed must be what ComfyUI's model sampling computes, read from that object's behaviour - never
assumed from the family (Wan 2.1 FlowRVS, Wan's WanModel on IMG_TO_IMG_FLOW with discrete timesteps, was taken for
flow and came out 2.1e1 from KSampler in loop mode, no error: tests/server_e2e/test_comfyui_wan_flowrvs.py)."""
import types

import pytest
import torch

pytestmark = pytest.mark.comfy

ACCEPTED = {"EPS": "eps", "FLOW": "flow", "FLUX": "flow"}


@pytest.fixture(scope="module")
def comfy():
    from comfy_env import setup_comfy
    setup_comfy()


def _sampling(model_type):
    import comfy.model_base
    return comfy.model_base.model_sampling(types.SimpleNamespace(sampling_settings={}), model_type)


def test_every_comfyui_sampling_is_computed_as_comfyui_does_or_refused(comfy):
    """Each ComfyUI model type: the convention chosen reproduces ComfyUI's input, timestep and denoised on fresh
    values (flow: SD3 / Wan's FLOW, Flux's FLUX; eps: PixArt's EPS), every other type refused with the fix."""
    import comfy.model_base

    from comfyui_hybrid_parallel.workers.bridge.loop_mode import loop_convention
    from comfyui_hybrid_parallel.parallel.engine import _convention
    g = torch.Generator().manual_seed(31)
    seen = {}
    for model_type in comfy.model_base.ModelType:
        ms = _sampling(model_type)
        sigmas = (float(ms.sigma_max) * torch.rand(4, generator=g).sort(descending=True)[0]).clamp(
            min=float(ms.sigma_min))
        try:
            spec = loop_convention(ms, sigmas)
        except ValueError as e:
            assert "step mode" in str(e) and model_type.name not in ACCEPTED, (model_type, e)
            seen[model_type.name] = "refused"
            continue
        seen[model_type.name] = spec["kind"]
        conv = _convention(spec, sigmas)
        for sigma in sigmas:
            x, out = torch.randn(2, 4, 3, generator=g), torch.randn(2, 4, 3, generator=g)
            sig = sigma.reshape(1).expand(2)
            assert torch.allclose(conv.model_input(x, sigma), ms.calculate_input(sig, x), rtol=1e-5), model_type
            assert torch.allclose(conv.denoised(x, sigma, out, 1), ms.calculate_denoised(sig, out, x), rtol=1e-5)
            assert torch.allclose(conv.timestep(sigma, 2, torch.float32), ms.timestep(sig).float(), rtol=1e-5)
    for name, kind in ACCEPTED.items():
        assert seen[name] == kind, seen
    assert seen["IMG_TO_IMG_FLOW"] == seen["FLOW_COSMOS"] == seen["V_PREDICTION"] == "refused", seen
    print(seen)
