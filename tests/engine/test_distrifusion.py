"""DistriFusion on ComfyUI's Flux, SD3, PixArt and Wan classes (tests/tiny_models.py): exact while synchronous,
measurably stale afterwards, reset per run.

Every body runs a short Euler-like loop x <- x - dt * model(x, t) serially and
in parallel on the same fresh random inputs, so staleness (which only exists
across steps) is exercised the way a sampler exercises it.
"""
import pytest
import torch

from comfyui_hybrid_parallel.parallel import ParallelConfig, parallelize, unparallelize
from comfyui_hybrid_parallel.parallel.distrifusion import distrifusion_state, is_sync_step
from dist_harness import context_for
import tiny_models as tm

pytestmark = pytest.mark.dist

STEPS = 4
_models = {}


def _model(family):
    if family not in _models:
        _models[family] = tm.build(family)
    return _models[family]


def _loop(model, family, kw, steps=STEPS, state=None):
    """Euler-like loop; with `state`, the step index is passed explicitly (as the pool does in step mode)."""
    kw = dict(kw)
    x = kw["x"].clone()
    for i in range(steps):
        t = 1.0 - i / steps
        scale = 1.0 if family == "flux" else 1000.0
        kw["timestep"] = torch.full_like(kw["timestep"], t * scale)
        kw["x"] = x
        if state is not None:
            state.set_step(i, total_steps=steps)
        out = tm.forward(model, kw)
        x = x - (1.0 / steps) * out[:, : x.shape[1]]
    return x


def _df_body(family, n, seed, h, w, text, batch, extra=None):
    """Serial vs DistriFusion with all steps synchronous, and with warmup 1 (three stale steps)."""
    model = _model(family)
    kw = tm.inputs(family, seed, batch=batch, h=h, w=w, text=text)
    serial = _loop(model, family, kw)
    res = {}
    for warmup in (STEPS, 1):
        ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=warmup,
                                         **(extra or {})))
        parallelize(model, ctx)
        try:
            par = _loop(model, family, kw)
            hist = distrifusion_state(model).history if n > 1 else [{"mode": "-"}]
        finally:
            unparallelize(model)
        res[warmup] = dict(err=tm.rel_err(par, serial), modes=[r["mode"] for r in hist],
                           stats=ctx.stats.snapshot())
    return res


# token counts: Flux h*w tokens (its token grid), the others (h/2)*(w/2); one even, one not divisible by 2 or 4
SIZES = {"flux": [(4, 4), (5, 7)], "sd3": [(8, 8), (6, 10)], "pixart": [(32, 34), (34, 38)], "wan": [(4, 4), (6, 10)]}


@pytest.mark.parametrize("family", ["flux", "sd3", "pixart", "wan"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("size_i", [0, 1], ids=["even", "odd"])
def test_sync_exact_and_stale_bounded(dist_pools, family, n, size_i):
    h, w = SIZES[family][size_i]
    text, batch = (8, 1) if size_i == 0 else (13, 2)
    seed = 100 * n + 10 * size_i + len(family)
    res = dist_pools(n).run(_df_body, family, n, seed, h, w, text, batch)
    exact = [r[STEPS]["err"] for r in res]
    stale = [r[1]["err"] for r in res]
    print(f"\n{family} n={n} {h}x{w}: all-sync err {max(exact):.2e}, warmup=1 err {[f'{e:.3e}' for e in stale]}")
    assert max(exact) <= 1e-5, exact
    assert all(r[STEPS]["modes"] == ["sync"] * STEPS for r in res)
    assert all(r[1]["modes"] == ["sync", "stale", "stale", "stale"] for r in res)
    # staleness really happened (not silently exact) but the pipeline is not broken
    assert min(stale) > 1e-7 and max(stale) < 0.5, stale
    # the async exchange ran: the second stale step used what the first one sent
    assert all(r[1]["stats"]["distrifusion_async_kv"]["calls"] > 0 for r in res)
    assert all("distrifusion_async_kv" not in r[STEPS]["stats"] for r in res)


@pytest.mark.parametrize("n,extra,world", [(2, dict(cfg_degree=2), 4), (1, dict(cfg_degree=2), 2)],
                         ids=["cfg2-ulysses2", "cfg2-only"])
def test_composes_with_cfg(dist_pools, n, extra, world):
    """cfg splits the batch, DistriFusion the patches inside each half; sp 1 means nothing is stale."""
    res = dist_pools(world).run(_df_body, "sd3", n, 21, 6, 10, 9, 2, extra)
    exact, stale = [r[STEPS]["err"] for r in res], [r[1]["err"] for r in res]
    print(f"\ncfg2 ulysses{n}: all-sync err {max(exact):.2e}, warmup=1 err {max(stale):.3e}")
    assert max(exact) <= 1e-5
    if n > 1:
        assert 1e-7 < min(stale) and max(stale) < 0.5
    else:
        assert max(stale) <= 1e-5


def _bytes_body(family, n, h, w, layers_per_comm):
    """Bytes of one stale step vs the analytic padded patch K/V volume; group count follows layers_per_comm."""
    from comfyui_hybrid_parallel.parallel.distrifusion import apply_distrifusion
    model = tm.build(family)
    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=0))
    kw = tm.inputs(family, 7, h=h, w=w)
    apply_distrifusion(model, ctx, layers_per_comm=layers_per_comm)
    try:
        tm.forward(model, kw)           # sync
        ctx.stats.reset()
        tm.forward(model, kw)           # stale, issues the exchange for the next step
        snap = ctx.stats.snapshot()
        layers = distrifusion_state(model).history[-1]["layers"]
        tm.forward(model, kw)           # consumes it
    finally:
        unparallelize(model)
    return snap, layers


@pytest.mark.parametrize("family,layers_per_comm", [("sd3", 1), ("sd3", None), ("flux", 2)])
def test_async_bytes_match_patch_kv_volume(dist_pools, family, layers_per_comm):
    n = 2
    h, w = SIZES[family][1]
    tokens = h * w if family == "flux" else (h // 2) * (w // 2)
    res = dist_pools(n).run(_bytes_body, family, n, h, w, layers_per_comm)
    for snap, layers in res:
        P = -(-tokens // n)                                  # largest patch: every rank sends that much
        hs = tm.HEADS * 64 if family == "sd3" else tm.HEADS * 16  # (MMDiT: 64 a head)
        expected = 2 * P * hs * layers * 4 * (n - 1)         # K and V, fp32, to n-1 peers
        got = snap["distrifusion_async_kv"]
        assert got["bytes"] == expected, (got, expected)
        groups = -(-layers // (layers_per_comm or max(1, -(-layers // 4))))
        assert got["calls"] == groups, (got, layers)
        assert "distrifusion_sync_kv" not in snap and "all_to_all" not in snap


def _reset_body(family, n):
    """Two runs in a row on different inputs equal each run alone (explicit reset, set_step(0), new resolution)."""
    model = _model(family)
    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=1))
    a = tm.inputs(family, 11, h=6, w=10, text=9)
    b = tm.inputs(family, 12, h=6, w=10, text=9)
    c = tm.inputs(family, 13, h=8, w=8, text=9)    # another token count
    parallelize(model, ctx)
    try:
        st = distrifusion_state(model)
        alone_b = _loop(model, family, b)
        st.reset()
        alone_c = _loop(model, family, c)
        st.reset()
        _loop(model, family, a)
        st.reset()
        after_reset = _loop(model, family, b)             # explicit reset()
        _loop(model, family, a, state=st)
        after_step0 = _loop(model, family, b, state=st)   # set_step(0) starts a new run
        _loop(model, family, a, state=st)
        after_resize = _loop(model, family, c)            # token count changed: automatic new run
        run_ids = st.run_id
        # without a reset the counter keeps going: the 5th call is stale, using run a's buffers
        st.reset()
        _loop(model, family, a)
        leaked = _loop(model, family, b)
    finally:
        unparallelize(model)
    return (tm.rel_err(after_reset, alone_b), tm.rel_err(after_step0, alone_b),
            tm.rel_err(after_resize, alone_c), tm.rel_err(leaked, alone_b), run_ids)


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_buffers_reset_between_runs(dist_pools, family):
    for e_reset, e_step0, e_resize, e_leaked, run_ids in dist_pools(2).run(_reset_body, family, 2):
        assert e_reset == 0.0 and e_step0 == 0.0 and e_resize == 0.0, (e_reset, e_step0, e_resize)
        assert e_leaked > 1e-7, "continuing without reset should reuse stale buffers (proves the reset matters)"
        assert run_ids >= 5


def _errors_body():
    model = tm.build("flux")
    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=2))
    out = {}
    try:
        distrifusion_state(model)
    except ValueError as e:
        out["no_state"] = str(e)
    parallelize(model, ctx)
    try:
        st = distrifusion_state(model)
        for bad in (-1, 1.5, True):
            try:
                st.set_step(bad)
            except ValueError as e:
                out[f"step{bad}"] = str(e)
        kw = tm.inputs("flux", 3, h=3, w=3, text=4)
        tm.forward(model, kw)
        kw["attention_mask"] = torch.ones(1, 13, 13)     # a mask over [text, image]: refused, not ignored
        try:
            tm.forward(model, kw)
        except (NotImplementedError, ValueError, RuntimeError) as e:
            out["mask"] = type(e).__name__
        kw.pop("attention_mask")
        out["recovered"] = tm.forward(model, kw).shape   # a failed forward starts a new run, not a hang
    finally:
        unparallelize(model)
    from comfyui_hybrid_parallel.parallel.distrifusion import apply_distrifusion
    model.norm_gn = torch.nn.GroupNorm(2, 4)
    try:
        apply_distrifusion(model, ctx)
    except NotImplementedError as e:
        out["groupnorm"] = str(e)
    finally:
        del model.norm_gn
    return out


def test_bad_use_gives_clear_errors(dist_pools):
    for out in dist_pools(2).run(_errors_body):
        assert "method='distrifusion'" in out["no_state"]
        assert all(f"step{b}" in out and "non-negative integer" in out[f"step{b}"] for b in (-1, 1.5, True))
        assert "mask" in out and out["recovered"][0] == 1
        assert "GroupNorm" in out["groupnorm"]


def test_dit_transformers_have_no_groupnorm():
    """Why the async GroupNorm correction is not needed here: these transformers contain none."""
    for family in ("flux", "sd3", "pixart", "wan"):
        assert not any(isinstance(m, torch.nn.GroupNorm) for m in tm.build(family).modules()), family


def test_warmup_rule():
    assert [is_sync_step(s, 2) for s in range(4)] == [True, True, False, False]
    assert [is_sync_step(s, 1) for s in range(3)] == [True, False, False]
    assert [is_sync_step(s, 0) for s in range(3)] == [True, False, False]   # step 0 fills the buffers


def _lanes_body(family, n):
    """The pool's step mode where ComfyUI calls the model once per conditioning (cond, then uncond, each step): two
    interleaved lanes through start_call equal each run alone; through the bare call index they mix their K/V."""
    model = _model(family)
    ctx = context_for(ParallelConfig(method="distrifusion", ulysses_degree=n, warmup_steps=1))
    a = tm.inputs(family, 21, h=6, w=10, text=9)
    b = tm.inputs(family, 22, h=6, w=10, text=9)
    parallelize(model, ctx)

    def interleaved(start):
        xs = {0: dict(a), 1: dict(b)}
        xs[0]["x"], xs[1]["x"] = a["x"].clone(), b["x"].clone()
        for i in range(STEPS):
            for lane in (0, 1):
                kw = xs[lane]
                t = 1.0 - i / STEPS
                kw["timestep"] = torch.full_like(kw["timestep"], t * (1.0 if family == "flux" else 1000.0))
                start(2 * i + lane, lane)
                out = tm.forward(model, kw)
                kw["x"] = kw["x"] - (1.0 / STEPS) * out[:, : kw["x"].shape[1]]
        return xs[0]["x"], xs[1]["x"]
    try:
        st = distrifusion_state(model)
        alone_a = _loop(model, family, a, state=st)
        alone_b = _loop(model, family, b, state=st)
        la, lb = interleaved(lambda call, lane: st.start_call(call, lane=(lane,)))
        modes = [r["mode"] for r in st.history]
        ma, mb = interleaved(lambda call, lane: st.set_step(call))  # the call index as the step: lanes mixed
    finally:
        unparallelize(model)
    return (tm.rel_err(la, alone_a), tm.rel_err(lb, alone_b), modes,
            max(tm.rel_err(ma, alone_a), tm.rel_err(mb, alone_b)))


def test_lanes_keep_each_conditioning_its_own_stale_kv(dist_pools):
    for ea, eb, modes, mixed in dist_pools(2).run(_lanes_body, "flux", 2):
        assert ea == 0.0 and eb == 0.0, (ea, eb)
        assert modes == ["sync", "sync"] + ["stale"] * (2 * STEPS - 2), modes  # each lane's step 0 fills it
        assert mixed > 1e-4, mixed  # what the lanes prevent: an uncond call's K/V read by the next cond call
