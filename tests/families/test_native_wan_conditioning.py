"""Wan's conditioning beside the latent (comfy/model_base.py WAN21 / WAN22 extra_conds) under the sequence split,
against ComfyUI's own forward.

- time_dim_concat (WanPhantomSubjectToVideo): subject latent frames joined to x before the patch embedding;
- reference_latent (Wan Fun Control, a model with `ref_conv`): one frame of reference tokens in front of x, dropped
  after the head (after the gather);
- with Wan 2.2's per-frame timesteps (WAN22, a noise mask) those extra tokens make a sequence the frames do not
  divide: ComfyUI's repeat_e repeats each frame's modulation by one more and cuts at the end, and each rank must take
  the rows of its own tokens in that expansion;
- denoise_mask (WAN22 passes it to the model, which ignores it) travels with the batch;
- context_latents (ComfyUI 0.33's in-context reference, Bernini): refused under ulysses/ring with the reason, run
  exactly under cfg (a batch split). On older ComfyUIs the model ignores context_latents (**kwargs); the refusal is
  the plan's, and cfg still equals ComfyUI's forward.

The tiny checkpoints get a `ref_conv` (ComfyUI's detection reads its input width: in_dim_ref_conv), so one model
serves every case; without reference_latent it is a plain Wan.
"""
import math

import pytest
import torch
from safetensors.torch import save_file

from test_native_pool import comfy, comfy_forward, rel  # noqa: F401

pytestmark = pytest.mark.comfy


def _with_ref_conv(comfy_dir, name, channels, seed, **kw):
    from comfy.sd import load_diffusion_model
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    path = comfy_dir / f"{name}.safetensors"
    sd = tiny.write_wan(path, dim=256, ffn_dim=256, seed=seed, in_dim=channels, out_dim=channels, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    sd = {**sd, "ref_conv.weight": torch.randn(256, channels, 2, 2, generator=g) * 0.05,
          "ref_conv.bias": torch.randn(256, generator=g) * 0.05}
    save_file(sd, str(path), metadata={"format": "pt"})
    base = load_diffusion_model(str(path)).model
    assert base.diffusion_model.ref_conv is not None
    return base


@pytest.fixture(scope="module")
def wan21(comfy):  # noqa: F811
    return _with_ref_conv(comfy, "wan21_ref", 16, seed=61)


@pytest.fixture(scope="module")
def wan22(comfy):  # noqa: F811
    base = _with_ref_conv(comfy, "wan22_ref", 48, seed=63)
    assert type(base).__name__ == "WAN22"  # ComfyUI's 5B class: per-frame timesteps under a noise mask
    return base


def _forward(pool, config, key, base, inp):
    """The pool's forward with the inputs as the nodes send them (nested lists as tensor paths under a JSON
    skeleton: workers/bridge/proxy.call_payload)."""
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, host_tensors, native_spec
    from comfyui_hybrid_parallel.workers.bridge.proxy import call_payload
    from comfyui_hybrid_parallel.workers.bridge.loader_types import raw
    dm = base.diffusion_model
    pool.ensure_model(config, key, family_adapter(dm).family, native=native_spec(base),
                      state_dict=lambda: {k: raw(v) for k, v in host_tensors(dm).items()})
    tensors, structure = call_payload(None, {k: v for k, v in inp.items() if k not in ("x", "timestep")})
    tensors.update(x=inp["x"], timestep=inp["timestep"])
    res = pool.submit(config, "forward", {"key": key, "structure": {"transformer_options": {}, **structure}}, tensors)
    return res.tensors["out"]


def _inputs(channels, frames, h, w, seed, per_frame=False):
    g = torch.Generator().manual_seed(seed)
    if per_frame:
        t = torch.rand(2, frames, generator=g) * 1000
        t[:, 0] = 0.0  # an image-conditioned start frame
    else:
        t = torch.rand(2, generator=g) * 1000
    return g, {"x": torch.randn(2, channels, frames, h, w, generator=g), "timestep": t,
               "context": torch.randn(2, 7, 4096, generator=g)}


SEQUENCE = ({"ulysses_degree": 2}, {"ring_degree": 2}, {"cfg_degree": 2})


def _world(degrees) -> tuple:
    """The order the cases run in: the 2-rank sequence world (u2, r2), then 4 ranks (u2r2), then cfg's own world
    (split_kernel_worlds on CPU: a cfg world and a u/r world of the same size are two worlds, each start 5-11 s)."""
    return "cfg_degree" in degrees, math.prod(degrees.values())


def _check(cpu_pool, base, checks):
    """`checks`: (tag, inputs, the inputs without the conditioning, degrees) each, against ComfyUI's forward; every
    check's cases run grouped by world (_world), not check by check, so that no world is started twice."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    refs = {}
    for tag, inp, without, _ in checks:
        refs[tag] = comfy_forward(base, inp)
        assert rel(comfy_forward(base, without), refs[tag]) > 1e-3, f"{tag}: the conditioning changed nothing"
    runs = [(tag, inp, degrees) for tag, inp, _, cases in checks for degrees in cases]
    for tag, inp, degrees in sorted(runs, key=lambda run: _world(run[2])):
        config = ParallelConfig(**degrees)
        err = rel(_forward(cpu_pool, config, f"{tag}:{config.describe()}", base, inp), refs[tag])
        print(f"Wan {tag} {config.describe()}: rel {err:.2e}")
        assert err <= 1e-5, (tag, degrees, err)


def test_time_dim_concat_and_reference_latent_equal_comfyui(wan21, cpu_pool):
    g, inp = _inputs(16, 2, 8, 12, seed=64)
    subject = {**inp, "time_dim_concat": torch.randn(2, 16, 1, 8, 12, generator=g)}
    reference = {**inp, "reference_latent": torch.randn(2, 16, 8, 12, generator=g)}
    _check(cpu_pool, wan21, [("time_dim_concat", subject, inp, SEQUENCE),
                             ("reference_latent", reference, inp, SEQUENCE)])


def test_per_frame_timesteps_over_extra_tokens_equal_comfyui(wan22, cpu_pool):
    """Wan 2.2 per-frame timesteps (3 frames) over 3 x 20 latent tokens + 20 reference tokens = 80: not a multiple
    of 3 (ComfyUI expands each frame's modulation 27 times, cut at 80), and over the subject frames of
    time_dim_concat; WAN22's denoise_mask rides along."""
    g, inp = _inputs(48, 3, 8, 10, seed=65, per_frame=True)
    inp["denoise_mask"] = torch.ones(2, 1, 3, 8, 10)
    reference = {**inp, "reference_latent": torch.randn(2, 48, 8, 10, generator=g)}
    cases = SEQUENCE + ({"ulysses_degree": 2, "ring_degree": 2},)
    subject = {**inp, "time_dim_concat": torch.randn(2, 48, 2, 8, 10, generator=g)}
    _check(cpu_pool, wan22, [("w22_reference_latent", reference, inp, cases),
                             ("w22_time_dim_concat", subject, inp, cases[:1])])


def test_context_latents_refused_under_sequence_split(wan21, cpu_pool):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    g, inp = _inputs(16, 2, 8, 12, seed=66)
    bernini = {**inp, "context_latents": [torch.randn(2, 16, 1, 8, 12, generator=g)]}
    for degrees in ({"ulysses_degree": 2}, {"ring_degree": 2}):
        config = ParallelConfig(**degrees)
        with pytest.raises(Exception, match="context_latents"):
            _forward(cpu_pool, config, f"bernini:{config.describe()}", wan21, bernini)
    config = ParallelConfig(cfg_degree=2)
    err = rel(_forward(cpu_pool, config, "bernini:cfg2", wan21, bernini), comfy_forward(wan21, bernini))
    print(f"Wan context_latents cfg2: rel {err:.2e}")
    assert err <= 1e-5, err
