"""The workers' step cache (ComfyUI's EasyCache rule) on ComfyUI's own model: loop mode and PipeFusion.

SD3's MMDiT (PipeFusion's family through the nodes) does not run ComfyUI's EasyCache wrapper, so these drive the
workers' loop job directly with a step cache, against the same rule on one device in this process:
- loop mode ulysses 2 and PipeFusion pp2 with warmup = all steps (full steps: one cache over the latent): equal to
  the serial loop with the cache (<= 1e-5), the same number of skipped steps;
- PipeFusion pp2 x 2 patches with stale patch steps (one cache per patch, decided by the last stage and sent back
  with the rows, a skipped patch runs no block on any stage): equal to the one-device emulation of that schedule
  with the same caches (<= 1e-5), the same skips, and patch steps really skipped.
Fresh random inputs; a 12-step schedule with a sigma window inside it.
"""
import pytest
import torch

from test_native_pipefusion import _convention
from test_native_pool import comfy, inputs, load_model, pool, rel  # noqa: F401

pytestmark = pytest.mark.comfy

STEPS = 12


def _spec(**kw):
    from comfyui_hybrid_parallel.parallel.stepcache import StepCacheSpec
    return StepCacheSpec(**{"threshold": 1.5, "start_sigma": 0.9, "end_sigma": 0.1, "subsample": 2, "channels": 16,
                            "first": 0, "chunks": 2, **kw})


def _serial(base, inp, sigmas, noise, spec):
    from comfyui_hybrid_parallel.parallel.loop import run_loop
    dm = base.diffusion_model
    cond = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
    report = {}
    out = run_loop(dm, cond, sigmas, noise, convention=_convention("sd3", sigmas)[0], sampler="euler", cfg_scale=3.0,
                   forward=lambda h, t, kw: dm(h, t, transformer_options={}, **kw), dtype=dm.dtype,
                   timestep_dtype=torch.float32, step_cache=spec, cache_report=report)
    return out, report


def _emulated(base, inp, sigmas, noise, spec, patches, warmup, monkeypatch):
    import comfy.ldm.modules.attention as attention
    import comfy.ldm.modules.diffusionmodules.mmdit as mmdit
    from comfyui_hybrid_parallel.parallel.pipefusion import run_pipefusion_loop
    monkeypatch.setattr(mmdit, "optimized_attention", attention.attention_pytorch)
    dm = base.diffusion_model
    cond = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
    call = lambda m, kw: m(kw.pop("x"), kw.pop("timestep"), transformer_options={}, **kw)  # noqa: E731
    report = {}
    try:
        out = run_pipefusion_loop(dm, None, cond, sigmas, noise, convention=_convention("sd3", sigmas)[0],
                                  sampler="euler", cfg_scale=3.0, num_patches=patches, warmup_steps=warmup,
                                  native_call=call, dtype=dm.dtype, timestep_dtype=torch.float32,
                                  step_cache=spec, cache_report=report)
    finally:
        monkeypatch.undo()
    return out, report


def _pool(pool, config, key, base, inp, sigmas, noise, spec):  # noqa: F811
    from dataclasses import asdict
    from comfyui_hybrid_parallel.workers.bridge.spec import native_spec
    dm = base.diffusion_model
    pool.ensure_model(config, key, "sd3", native=native_spec(base), state_dict=lambda: dict(dm.state_dict()))
    cond = {k: v for k, v in inp.items() if k not in ("x", "timestep")}
    values = {"key": key, "structure": {"transformer_options": {}}, "sampler": "euler", "cfg_scale": 3.0,
              "convention": _convention("sd3", sigmas)[1], "step_cache": asdict(spec)}
    res = pool.submit(config, "loop", values, {**cond, "noise": noise, "sigmas": sigmas})
    reports = [v["step_cache"] for v in res.per_rank if v.get("step_cache")]
    assert reports and all(r == reports[0] for r in reports), reports  # every reporting rank made the same skips
    return res.tensors["out"], reports[0]


def test_step_cache_in_loop_mode_and_pipefusion(comfy, pool, monkeypatch):  # noqa: F811
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    base = load_model(comfy, "sd3", "fp32").model
    g = torch.Generator().manual_seed(606)
    inp = inputs("sd3", base, seed=607, batch=2, odd=False)  # [cond, uncond]
    noise = torch.randn(1, *inp["x"].shape[1:], generator=g)
    sigmas = torch.linspace(1.0, 0.0, STEPS + 1)
    spec = _spec()
    ref, ref_report = _serial(base, inp, sigmas, noise, spec)
    plain, _ = _serial(base, inp, sigmas, noise, None)
    print(f"serial with the cache: {ref_report}, rel vs uncached {rel(ref, plain):.2e}")
    assert ref_report["skipped"] > 0 and rel(ref, plain) > 1e-4
    for name, degrees in (("loop u2", {"ulysses_degree": 2}),
                          ("pp2 sync", {"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": STEPS})):
        config = ParallelConfig(**degrees)
        out, report = _pool(pool, config, f"sc:{name}", base, inp, sigmas, noise, spec)
        print(f"{name}: {report}, rel vs serial with the cache {rel(out, ref):.2e}")
        assert rel(out, ref) <= 1e-5, name
        patches = report.get("patches", 1)
        assert report["skipped"] == ref_report["skipped"] * patches, (name, report, ref_report)
    emu, emu_report = _emulated(base, inp, sigmas, noise, spec, 2, 2, monkeypatch)
    for name, degrees in (("pp2 stale", {}), ("pp2 u2 stale", {"ulysses_degree": 2})):  # u2: the sp ranks agree
        config = ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=2, **degrees)
        out, report = _pool(pool, config, f"sc:{name}", base, inp, sigmas, noise, spec)
        print(f"{name}: {report} (emulation {emu_report}), rel vs emulation {rel(out, emu):.2e}, vs serial with "
              f"the cache {rel(out, ref):.2e}")
        assert report == emu_report and report["skipped"] > 0, (report, emu_report)
        assert rel(out, emu) <= 1e-5
