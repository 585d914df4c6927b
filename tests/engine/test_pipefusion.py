"""PipeFusion loop mode (gloo, CPU) on ComfyUI's own classes (tests/tiny_models.py, called as the workers call
them): exact when every step is a warmup step, the exact stale-KV schedule otherwise (equal to its one-process
emulation, measurably different from serial), samplers bit-identical to ComfyUI, clear errors for what cannot run,
and a cancel that stops every stage at the same step."""
import copy

import pytest
import torch

from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.loop import run_loop
from comfyui_hybrid_parallel.parallel.pipefusion import PipelineCancelled, eps, flow, run_pipefusion_loop, stage_ranges
from comfyui_hybrid_parallel.parallel.sampling import get_sampler
from dist_harness import context_for
import tiny_models as tm

pytestmark = pytest.mark.dist

_models = {}


def build_deep(family: str, dtype=torch.float32):
    """Tiny ComfyUI models with 4 blocks (Flux: 2 double + 2 single; SD3: the image-only attn2 in blocks 0
    and 2) so that pp=4 has a block per stage."""
    key = (family, dtype)
    if key not in _models:
        _models[key] = tm.build(family, heads=2, seed=1, dtype=dtype, blocks=4)
    return _models[key]


def serial_loop(model, kw, sigmas, noise, *, convention, sampler="euler", cfg_scale=None, dtype=None):
    """The plain loop on one device, ComfyUI's model called as the workers call it: what PipeFusion with
    warmup_steps >= steps must reproduce."""
    return run_loop(model, kw, sigmas, noise, convention=convention, sampler=sampler, cfg_scale=cfg_scale,
                    forward=lambda x, t, cond: tm.call(model, dict(cond, x=x, timestep=t)), dtype=dtype,
                    timestep_dtype=torch.float32)


def pipefusion(model, ctx, kw, sigmas, noise, **options):
    """run_pipefusion_loop on ComfyUI's model, as the workers run it (fp32 timesteps)."""
    return run_pipefusion_loop(model, ctx, kw, sigmas, noise, native_call=tm.call, timestep_dtype=torch.float32,
                               **options)


CONVENTIONS = {"pixart": lambda: eps(lambda s: s * 60.0), "sd3": lambda: flow(1000.0), "flux": lambda: flow(1.0)}


def problem(family, seed, h, w, steps, batch=1):
    """Conditioning kwargs, initial sample and sigmas; h x w latent (Flux: token grid)."""
    kw = tm.inputs(family, seed, batch=batch, h=h, w=w, text=5)
    noise = kw.pop("x")
    kw.pop("timestep")
    if family == "pixart":
        sigmas = torch.cat([torch.logspace(1.0, -1.0, steps), torch.zeros(1)])
    else:
        sigmas = torch.linspace(1.0, 0.0, steps + 1)
    return kw, noise, sigmas


def _pp_body(family, pp, patches, warmup, seed, h, w, steps, sampler, layers=None, cfg_scale=None, batch=1,
             bf16=False, dp=1, cfg=1, ulysses=1, ring=1):
    ctx = context_for(ParallelConfig(pp_degree=pp, num_pipeline_patch=patches, warmup_steps=warmup,
                                     attn_layer_num_for_pp=layers, dp_degree=dp, cfg_degree=cfg,
                                     ulysses_degree=ulysses, ring_degree=ring))
    dtype = torch.bfloat16 if bf16 else None  # bf16 weights and messages (the latent and sampler stay fp32)
    model = build_deep(family, dtype or torch.float32)
    kw, noise, sigmas = problem(family, seed, h, w, steps, batch=batch)
    kw = {k: v.to(torch.bfloat16) if bf16 and isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    if cfg_scale is not None:  # [cond, uncond] conditioning for a latent batch of half the size
        noise = noise[: batch // 2]
    conv = CONVENTIONS[family]()
    seen = []
    out = pipefusion(model, ctx, kw, sigmas, noise, convention=conv, sampler=sampler, cfg_scale=cfg_scale,
                     callback=lambda i, n: seen.append(i), dtype=dtype)
    assert seen == list(range(steps)), seen
    serial = serial_loop(model, kw, sigmas, noise, convention=conv, sampler=sampler, cfg_scale=cfg_scale, dtype=dtype)
    emulated = pipefusion(model, None, kw, sigmas, noise, convention=conv, sampler=sampler, num_patches=patches,
                          warmup_steps=warmup, cfg_scale=cfg_scale, dtype=dtype)
    return tm.rel_err(out, serial), tm.rel_err(out, emulated), ctx.stats.snapshot()


# (family, latent h, w): one size that splits evenly into the patch bands, one that does not
# (PixArt: ComfyUI's needs (h + w) / 2 >= 33; 24 token rows split into 2, 3 and 4 bands, 17 into none)
SIZES = {"pixart": [(48, 32), (34, 32)], "sd3": [(12, 8), (10, 6)], "flux": [(6, 4), (7, 3)]}


@pytest.mark.parametrize("family", ["pixart", "sd3", "flux"])
@pytest.mark.parametrize("pp,patches", [(2, 2), (2, 3), (4, 4)])
@pytest.mark.parametrize("size_i", [0, 1], ids=["even", "odd"])
def test_all_warmup_equals_serial(dist_pools, family, pp, patches, size_i):
    h, w = SIZES[family][size_i]
    steps = 3
    res = dist_pools(pp).run(_pp_body, family, pp, patches, steps, 10 * pp + patches + size_i, h, w, steps,
                             "euler")
    errs = [r[0] for r in res]
    print(f"\n{family} pp{pp} patches{patches} all-warmup: max rel err vs serial {max(errs):.2e}")
    assert max(errs) <= 1e-5, errs
    assert res[0][2]["pp_activations"]["bytes"] > 0 and res[-1][2]["pp_latent"]["bytes"] > 0


@pytest.mark.parametrize("family", ["pixart", "sd3", "flux"])
@pytest.mark.parametrize("pp,patches,sampler", [(2, 2, "euler"), (2, 3, "dpmpp_2m"), (4, 4, "euler")])
def test_stale_kv_schedule(dist_pools, family, pp, patches, sampler):
    """warmup 1: the parallel run is exactly the stale-KV schedule (its one-process emulation), and differs
    from serial by a small, measured amount."""
    h, w = SIZES[family][1]
    steps = 4
    res = dist_pools(pp).run(_pp_body, family, pp, patches, 1, 7 * pp + patches, h, w, steps, sampler)
    vs_serial = max(r[0] for r in res)
    vs_emulation = max(r[1] for r in res)
    print(f"\n{family} pp{pp} patches{patches} warmup1 {sampler}: rel err vs serial {vs_serial:.3e}, "
          f"vs stale-KV emulation {vs_emulation:.2e}")
    assert vs_emulation <= 1e-5, res
    assert 0 < vs_serial < 0.5, vs_serial
    assert all(r[0] == res[0][0] for r in res), "ranks returned different latents"


def test_bf16_model(dist_pools):
    """bf16 weights and messages (the latent and sampler stay fp32, as in ComfyUI)."""
    res = dist_pools(2).run(_pp_body, "sd3", 2, 2, 3, 8, 10, 6, 3, "euler", bf16=True)
    assert max(r[0] for r in res) <= 1e-5
    res = dist_pools(2).run(_pp_body, "flux", 2, 3, 1, 8, 7, 3, 3, "euler", bf16=True)
    assert max(r[1] for r in res) <= 1e-5 and 0 < max(r[0] for r in res) < 0.5


def test_uneven_layer_split(dist_pools):
    res = dist_pools(2).run(_pp_body, "sd3", 2, 3, 1, 5, 10, 6, 3, "euler", layers=(1, 3))
    assert max(r[1] for r in res) <= 1e-5 and 0 < max(r[0] for r in res) < 0.5


@pytest.mark.parametrize("family", ["sd3", "flux"])
@pytest.mark.parametrize("warmup", [3, 1])
def test_cfg_and_batch_inside_the_pipeline(dist_pools, family, warmup):
    """CFG in loop mode: [cond, uncond] (here 2 samples each) go through the stages as one batch."""
    res = dist_pools(2).run(_pp_body, family, 2, 3, warmup, 13, *SIZES[family][1], 3, "euler", cfg_scale=3.5,
                            batch=4)
    vs_serial, vs_emulation = max(r[0] for r in res), max(r[1] for r in res)
    print(f"\n{family} cfg 3.5 batch 2 warmup{warmup}: vs serial {vs_serial:.2e}, vs emulation {vs_emulation:.2e}")
    assert vs_emulation <= 1e-5
    assert vs_serial <= 1e-5 if warmup == 3 else 0 < vs_serial < 0.5


@pytest.mark.parametrize("family", ["pixart", "sd3"])
@pytest.mark.parametrize("mesh", [dict(dp=2, batch=3), dict(dp=2, batch=1), dict(cfg=2, batch=4, cfg_scale=4.0)],
                         ids=["dp2-batch3", "dp2-batch1", "cfg2"])
@pytest.mark.parametrize("warmup", [3, 1])
def test_cfg_dp_around_the_pipeline(dist_pools, family, mesh, warmup):
    h, w = SIZES[family][1]
    res = dist_pools(4).run(_pp_body, family, 2, 3, warmup, 17, h, w, 3, "euler", **mesh)
    vs_serial, vs_emulation = max(r[0] for r in res), max(r[1] for r in res)
    print(f"\n{family} pp2 {mesh} warmup{warmup}: vs serial {vs_serial:.2e}, vs emulation {vs_emulation:.2e}")
    assert vs_emulation <= 1e-5
    assert vs_serial <= 1e-5 if warmup == 3 else 0 < vs_serial < 0.5
    assert all(torch.equal(torch.tensor(r[0]), torch.tensor(res[0][0])) for r in res)


def _cancel_body(at_step, warmup):
    ctx = context_for(ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=warmup))
    model = build_deep("pixart")
    kw, noise, sigmas = problem("pixart", 3, 48, 32, 5)
    seen = []
    try:
        pipefusion(model, ctx, kw, sigmas, noise, convention=CONVENTIONS["pixart"](),
                   callback=lambda i, n: seen.append(i), cancel=lambda: len(seen) >= at_step)
    except PipelineCancelled:
        return "cancelled", seen
    return "finished", seen


@pytest.mark.parametrize("warmup,at_step", [(3, 1), (1, 1), (1, 3)], ids=["in-warmup", "first-patch-step", "later"])
def test_cancel_stops_every_stage_at_the_same_step(dist_pools, warmup, at_step):
    res = dist_pools(2).run(_cancel_body, at_step, warmup, timeout=60)
    assert [r[0] for r in res] == ["cancelled", "cancelled"], res
    assert all(r[1] == list(range(at_step)) for r in res), res
    # the pool is still usable afterwards (nothing left in flight)
    res = dist_pools(2).run(_pp_body, "pixart", 2, 2, 3, 1, 48, 32, 3, "euler")
    assert max(r[0] for r in res) <= 1e-5


# ---- one process ----

def test_degree_one_euler_is_the_formula():
    model = build_deep("sd3")
    kw, noise, sigmas = problem("sd3", 11, 6, 8, 4)
    out = pipefusion(model, None, kw, sigmas, noise, convention=flow(1000.0), sampler="euler")
    x = noise.clone()
    for i in range(4):
        v = tm.forward(model, dict(kw, x=x, timestep=(sigmas[i] * 1000).reshape(1)))
        denoised = x - v * sigmas[i]
        x = x + (sigmas[i + 1] - sigmas[i]) * (x - denoised) / sigmas[i]
    assert tm.rel_err(out, x) <= 1e-6


@pytest.mark.comfy
@pytest.mark.parametrize("name", ["euler", "dpmpp_2m"])
def test_samplers_bit_identical_to_comfyui(name):
    from comfy_env import setup_comfy

    setup_comfy()
    from comfy.k_diffusion import sampling as ks
    from comfy.samplers import calculate_sigmas
    import comfy.model_sampling as ms

    g = torch.Generator().manual_seed(4)
    x0 = torch.randn(2, 4, 6, 5, generator=g)
    w = torch.randn(4, 4, generator=g)

    def denoise(x, sigma):  # any deterministic, nonlinear denoiser
        return torch.tanh(torch.einsum("bchw,cd->bdhw", x, w)) * sigma.reshape(-1, 1, 1, 1) + 0.1 * x

    sampling = ms.ModelSamplingDiscreteFlow(None) if hasattr(ms, "ModelSamplingDiscreteFlow") else None
    sigmas = calculate_sigmas(sampling, "simple", 6) if sampling is not None else torch.linspace(1, 0, 7)
    ref = getattr(ks, f"sample_{name}")(lambda x, s, **k: denoise(x, s), x0.clone(), sigmas, disable=True)
    samp = get_sampler(name)
    x = x0.clone()
    state = {k: torch.zeros_like(x) for k in samp.state_keys}
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        x = samp.step(i, sigmas, x, denoise(x, sigmas[i] * s_in), state)
    assert torch.equal(x, ref)


def test_bad_inputs_fail_before_any_work():
    model = build_deep("sd3")
    kw, noise, sigmas = problem("sd3", 2, 6, 6, 3)  # 3 token rows
    conv = CONVENTIONS["sd3"]()
    kw_probe = dict(kw)

    def run(**over):
        args = dict(convention=conv, num_patches=2, warmup_steps=1)
        args.update(over)
        n = args.pop("noise", noise)
        return pipefusion(model, None, kw_probe, args.pop("sigmas", sigmas), n, **args)

    with pytest.raises(ConfigError, match="num_pipeline_patch=4 .* only 3 token rows"):
        run(num_patches=4)
    with pytest.raises(ConfigError, match="multiple of the patch size 2"):
        run(noise=torch.randn(1, 4, 7, 6))
    with pytest.raises(ConfigError, match="warmup_steps >= 1"):
        run(warmup_steps=0)
    with pytest.raises(ConfigError, match="dpmpp_2m"):
        run(sampler="heun")
    with pytest.raises(ConfigError, match="sigma"):
        run(sigmas=torch.tensor([1.0, 0.0, 0.0]))
    with pytest.raises(ConfigError, match=r"\[cond, uncond\]"):
        run(cfg_scale=2.0)
    with pytest.raises(ConfigError, match="pp_degree=5 .* only 4"):
        stage_ranges(4, 5)
    with pytest.raises(ConfigError, match="sums to 3 .* 4 transformer blocks"):
        stage_ranges(4, 2, (1, 2))
    assert stage_ranges(5, 2) == [(0, 3), (3, 5)] and stage_ranges(4, 2, (1, 3)) == [(0, 1), (1, 4)]
    assert "forward" not in model.__dict__, "a refused run left hooks behind"


def _refuse_body(degrees, h=8, w=6):
    ctx = context_for(ParallelConfig(pp_degree=2, **degrees))
    kw, noise, sigmas = problem("sd3", 1, h, w, 2)
    try:
        pipefusion(build_deep("sd3"), ctx, kw, sigmas, noise, convention=CONVENTIONS["sd3"]())
    except ConfigError as e:
        return str(e)
    return "no error"


def test_refused_before_work(dist_pools):
    # a 4x4 latent = 2x2 tokens; 2 patches of one 2-token row cannot be split over 4 sp ranks
    msgs = dist_pools(8).run(_refuse_body, dict(ulysses_degree=4, num_pipeline_patch=2), 4, 4)
    assert all("sp_degree=4" in m and "num_pipeline_patch" in m for m in msgs), msgs
    msgs = dist_pools(4).run(_refuse_body, dict(cfg_degree=2))
    assert all("pass cfg_scale" in m for m in msgs), msgs


def _cancel_one_replica_body():
    """Only global rank 0 (stage 0 of dp replica 0) is asked to cancel: both replicas must stop."""
    ctx = context_for(ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=1, dp_degree=2))
    kw, noise, sigmas = problem("pixart", 3, 48, 32, 5, batch=2)
    seen = []
    try:
        pipefusion(build_deep("pixart"), ctx, kw, sigmas, noise, convention=CONVENTIONS["pixart"](),
                   callback=lambda i, n: seen.append(i), cancel=lambda: ctx.rank == 0 and len(seen) >= 2)
    except PipelineCancelled:
        return "cancelled", seen
    return "finished", seen


def test_cancel_reaches_every_replica(dist_pools):
    res = dist_pools(4).run(_cancel_one_replica_body, timeout=60)
    assert res == [("cancelled", [0, 1])] * 4, res


# pp x sp (seed 002): pieces = patches x sp ranks, uneven where the sizes say so
PP_SP = [("sd3", dict(ulysses=2), 2, (10, 6)), ("flux", dict(ring=2), 3, (7, 3)),
         ("pixart", dict(ulysses=2), 2, (48, 32)), ("sd3", dict(cfg=2, ulysses=2), 2, (10, 6))]


@pytest.mark.parametrize("family,sp,patches,size", PP_SP,
                         ids=["sd3-pp2u2", "flux-pp2r2", "pixart-pp2u2", "sd3-cfg2pp2u2"])
def test_pipefusion_with_sequence_parallel(dist_pools, family, sp, patches, size):
    world = 2 * sp.get("ulysses", 1) * sp.get("ring", 1) * sp.get("cfg", 1)
    cfg_scale, batch = (3.0, 2) if "cfg" in sp else (None, 1)
    steps = 3
    exact = dist_pools(world).run(_pp_body, family, 2, patches, steps, 31, *size, steps, "euler",
                                  cfg_scale=cfg_scale, batch=batch, **sp)
    stale = dist_pools(world).run(_pp_body, family, 2, patches, 1, 32, *size, steps, "dpmpp_2m",
                                  cfg_scale=cfg_scale, batch=batch, **sp)
    print(f"\n{family} pp2 {sp} patches {patches}: all-warmup vs serial {max(r[0] for r in exact):.2e}; warmup 1 "
          f"vs serial {max(r[0] for r in stale):.3e}, vs 1-process stale-KV emulation {max(r[1] for r in stale):.2e}")
    assert max(r[0] for r in exact) <= 1e-5
    assert 0 < max(r[0] for r in stale) < 0.5
    assert max(r[1] for r in stale) <= 1e-5  # the same stale-KV schedule as without sp
    assert exact[0][2]["all_gather"]["bytes"] > 0  # the sp group exchanged K/V pieces


def _keep_body(family):
    from comfyui_hybrid_parallel.parallel.pipefusion.plans import keep_stage_blocks
    from comfyui_hybrid_parallel.parallel.tp import local_param_bytes
    model = copy.deepcopy(build_deep(family))
    before = local_param_bytes(model)
    ctx = context_for(ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=3))
    freed = keep_stage_blocks(model, ctx)
    kw, noise, sigmas = problem(family, 5, *SIZES[family][1], 3)
    conv = CONVENTIONS[family]()
    out = pipefusion(model, ctx, kw, sigmas, noise, convention=conv)
    serial = serial_loop(build_deep(family), kw, sigmas, noise, convention=conv)
    other = context_for(ParallelConfig(pp_degree=2, num_pipeline_patch=2, warmup_steps=3, attn_layer_num_for_pp=(1, 3)))
    try:
        pipefusion(model, other, kw, sigmas, noise, convention=conv)
        refused = ""
    except ConfigError as e:
        refused = str(e)
    return tm.rel_err(out, serial), local_param_bytes(model) / before, freed, refused


@pytest.mark.parametrize("family", ["sd3", "flux"])
def test_a_stage_keeps_only_its_blocks(dist_pools, family):
    """The workers free the other stages' block weights at load: same result, about half the parameters."""
    res = dist_pools(2).run(_keep_body, family)
    print(f"\n{family} pp2: parameters held per stage / whole model {[round(r[1], 3) for r in res]}")
    assert all(r[0] <= 1e-5 and r[2] > 0 and 0.2 < r[1] < 0.8 for r in res), res
    assert all("load it again" in r[3] for r in res), res
