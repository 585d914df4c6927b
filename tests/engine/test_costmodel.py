"""The cost model (parallel/costmodel.py) and Parallel Config's degrees "auto" (workers/driver/auto.py).

Why these checks: auto's promise is "never slower than degree 1", so the model must at least be sane (more work
costs more, more ranks split the compute), its communication must be the bytes this implementation really sends
(bench/comm_volume.py's exact analytic volume, itself asserted equal to the counters), and `choose` must stay at
one rank where the measurements on this machine say a second one loses (tiny models, ~70 tokens).
"""
from __future__ import annotations

import itertools
import os
import sys

import pytest
import torch

from comfyui_hybrid_parallel.parallel.config import ConfigError, ParallelConfig
from comfyui_hybrid_parallel.parallel.costmodel import (CPU_EPYC_2, H100_NVLINK, H100_PCIE, ModelShape, batch_bytes,
                                                        candidates, choose, format_table, predict_step_s, rank_bytes)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

FLUX = ModelShape.dit("flux", blocks=19, single_blocks=38, hidden=3072, heads=24)
WAN = ModelShape.dit("wan", blocks=40, hidden=5120, heads=40, mlp_ratio=13824 / 5120)
MEDIUM_SD3 = ModelShape(family="sd3", blocks=4, text_blocks=4, hidden=256, heads=4, img_params=3145728,
                        txt_params=2555904, out_per_token=64, act_bytes=4)
TINY_FLUX = ModelShape.dit("flux", blocks=1, single_blocks=1, hidden=64, heads=4, act_bytes=4)


def test_flux_shape_matches_its_published_size():
    """Flux.1-dev: 19 double + 38 single blocks at 3072 wide are ~11.9B parameters with modulation; the matmul
    weights a token sees (no modulation) are 684 * 3072^2 = 6.5B."""
    assert FLUX.img_params == FLUX.txt_params == 684 * 3072 ** 2
    assert FLUX.blocks == FLUX.text_blocks == 57 and FLUX.head_dim == 128


def test_predictions_are_sane():
    cpu = CPU_EPYC_2
    serial = [predict_step_s(MEDIUM_SD3, p, 1, ParallelConfig(), cpu)["total_s"] for p in (64, 256, 1024, 4096)]
    assert serial == sorted(serial) and serial[0] > 0
    one, two = (predict_step_s(MEDIUM_SD3, 1024, b, ParallelConfig(), cpu)["total_s"] for b in (1, 2))
    assert 1.8 < two / one < 2.05  # compute doubles, the fixed costs do not
    # more sequence ranks: less compute per rank; Ring sends 2·p·hs·(N-1)/N per rank and layer (grows with N),
    # Ulysses 4·p·hs·(N-1)/N² (falls per rank, grows over the world)
    rows = [predict_step_s(FLUX, 4608, 1, ParallelConfig(ring_degree=n), H100_PCIE) for n in (1, 2, 4, 8)]
    assert [r["compute_s"] for r in rows] == sorted((r["compute_s"] for r in rows), reverse=True)
    assert [sum(r["bytes"].values()) for r in rows] == sorted(sum(r["bytes"].values()) for r in rows)
    uly = [predict_step_s(FLUX, 4608, 1, ParallelConfig(ulysses_degree=n), H100_NVLINK) for n in (2, 4, 8)]
    per_rank = [r["bytes"]["all_to_all"] for r in uly]
    assert per_rank == sorted(per_rank, reverse=True)
    assert [b * n for b, n in zip(per_rank, (2, 4, 8))] == sorted(b * n for b, n in zip(per_rank, (2, 4, 8)))
    # a slower link costs more for the same bytes
    nv, pcie = (predict_step_s(FLUX, 4608, 1, ParallelConfig(ulysses_degree=4), c)["comm_s"] for c in (H100_NVLINK, H100_PCIE))
    assert pcie > 5 * nv
    # a CPU world splits the cores: degree 1 gets both threads, each of two ranks one
    assert predict_step_s(MEDIUM_SD3, 1024, 1, ParallelConfig(), cpu)["threads"] == 2
    assert predict_step_s(MEDIUM_SD3, 1024, 1, ParallelConfig(ring_degree=2), cpu)["threads"] == 1


@pytest.mark.parametrize("p,text,heads,degrees", [
    (64, 8, 4, dict(ulysses_degree=2)), (255, 8, 4, dict(ulysses_degree=4)), (99, 77, 3, dict(ulysses_degree=2)),
    (64, 8, 4, dict(ring_degree=2)), (255, 8, 4, dict(ring_degree=4)), (99, 7, 6, dict(ulysses_degree=2, ring_degree=3)),
    (1001, 333, 5, dict(ulysses_degree=4, ring_degree=2)), (70, 0, 4, dict(ulysses_degree=2)),
    (99, 3, 4, dict(ulysses_degree=4)), (64, 1, 4, dict(ulysses_degree=2))])  # text shorter than the degree: whole
@pytest.mark.parametrize("joint", [True, False])
def test_comm_bytes_equal_comm_volume_analytic(p, text, heads, degrees, joint):
    """Every rank's bytes per op = bench/comm_volume.py's exact analytic volume (uneven tokens and heads too; joint
    text split with the image, or whole where it is shorter than the degree)."""
    import comm_volume
    shape = ModelShape(family="sd3" if joint else "pixart", blocks=3, text_blocks=3 if joint else 0,
                       hidden=heads * 8, heads=heads, img_params=1, txt_params=1, out_per_token=16, act_bytes=4,
                       cross_text=not joint)
    config = ParallelConfig(**degrees)
    f = shape.facts(p, text)
    method = "usp" if len(degrees) == 2 else ("ulysses" if "ulysses_degree" in degrees else "ring")
    for u, r in itertools.product(range(config.ulysses_degree), range(config.ring_degree)):
        coords = {"ulysses": u, "ring": r}
        for batch in (1, 2):
            want = {k: v for k, v in comm_volume.analytic(method, degrees, f, batch, coords).items() if v}
            assert rank_bytes(shape, p, text, batch, config, coords) == want, (u, r, batch)


@pytest.mark.parametrize("batch,degrees", [(2, dict(cfg_degree=2)), (3, dict(dp_degree=2)), (1, dict(dp_degree=2)),
                                           (4, dict(cfg_degree=2, dp_degree=2))])
def test_batch_gather_equals_comm_volume_analytic(batch, degrees):
    import comm_volume
    shape = ModelShape(family="pixart", blocks=2, text_blocks=0, hidden=32, heads=4, img_params=1, txt_params=1,
                       out_per_token=32, act_bytes=4, cross_text=True)
    f = shape.facts(64, 8)
    want = comm_volume.analytic("cfg", degrees, f, batch, {})["all_gather"]
    assert batch_bytes(shape, 64, batch, ParallelConfig(**degrees).world_size) == want


def test_choose_stays_at_one_rank_for_a_tiny_model():
    """Measured here: a tiny Flux-like model at ~70 tokens loses with a second CPU rank (collectives and the
    per-rank dispatch cost more than its half of a millisecond of compute)."""
    for cfg_on in (False, True):
        config, table = choose(TINY_FLUX, 70, 2 if cfg_on else 1, cfg_on, 2, CPU_EPYC_2, text=8)
        assert config.world_size == 1, format_table(table)
        assert sum(r["chosen"] for r in table) == 1


def test_choose_takes_cfg_when_compute_dominates():
    """Flux at 1024^2 with CFG on 2 GPUs: cfg 2 splits the batch with one output gather, no per-layer traffic."""
    config, table = choose(FLUX, 4096, 2, True, 2, H100_PCIE, text=512)
    assert (config.cfg_degree, config.world_size) == (2, 2), format_table(table)
    assert table[0]["chosen"] and table[0]["speedup"] > 1.8
    config, _ = choose(FLUX, 4096, 1, False, 8, H100_NVLINK, text=512)  # no CFG: sequence parallel on 8
    assert config.cfg_degree == 1 and config.sp_degree == 8


def test_kernel_speed_applies_to_ranks_without_ring():
    """ComfyUI's attention kernel runs on every rank of a world without ring attention (degree 1, cfg, dp,
    Ulysses); ring runs SDPA. A kernel 4x slower than SDPA scales those ranks' attention time by 4 - asked at
    each rank's shape - leaves ring's alone, and can make ring the faster choice where SDPA kept degree 1."""
    asked = []

    def slow(b, h, n, threads):
        asked.append((b, h, n, threads))
        return 0.25
    for config in (ParallelConfig(), ParallelConfig(ulysses_degree=2), ParallelConfig(cfg_degree=2),
                   ParallelConfig(ring_degree=2), ParallelConfig(ulysses_degree=2, ring_degree=2)):
        base = predict_step_s(MEDIUM_SD3, 1024, 2, config, CPU_EPYC_2, text=77)
        asked.clear()
        got = predict_step_s(MEDIUM_SD3, 1024, 2, config, CPU_EPYC_2, text=77, kernel_speed=slow)
        if config.ring_degree == 1:
            assert got["attention_s"] == pytest.approx(4 * base["attention_s"]) and got["kernel_speed"] == 0.25
            b = 1 if config.cfg_degree == 2 else 2
            assert asked == [(b, 4 // config.ulysses_degree, 1024 + 77, CPU_EPYC_2.threads(config.world_size))]
        else:
            assert got["attention_s"] == base["attention_s"] and asked == [] and got["kernel_speed"] == 1.0
    # SDPA everywhere: degree 1 here; a kernel 5x slower than SDPA on the one-rank configs: ring 2 wins
    assert choose(MEDIUM_SD3, 1024, 1, False, 2, CPU_EPYC_2, text=77)[0].world_size == 1
    config, table = choose(MEDIUM_SD3, 1024, 1, False, 2, CPU_EPYC_2, text=77, kernel_speed=lambda *a: 0.2)
    assert config.ring_degree == 2, format_table(table)


def test_cpu_probe_moves_the_preset_to_this_machine():
    from comfyui_hybrid_parallel.parallel.costmodel import CPU_MATMUL_1T, CPU_SDPA_1T, probe_cpu, scaled_to
    threads = torch.get_num_threads()
    rates = probe_cpu(reps=1, calls=1)
    assert torch.get_num_threads() == threads  # restored
    assert 1e8 < rates["matmul_flops"] < 1e13 and 1e8 < rates["sdpa_flops"] < 1e13, rates
    moved = scaled_to(CPU_EPYC_2, {"matmul_flops": 2 * CPU_MATMUL_1T, "sdpa_flops": 3 * CPU_SDPA_1T})
    assert moved.flops == pytest.approx(2 * CPU_EPYC_2.flops) and moved.attn_flops == pytest.approx(
        3 * CPU_EPYC_2.attn_flops)
    assert (moved.link, moved.thread_speedup, moved.step_s) == (CPU_EPYC_2.link, CPU_EPYC_2.thread_speedup,
                                                                CPU_EPYC_2.step_s)
    assert "probed" in moved.name


def test_choose_never_exceeds_the_devices_and_needs_a_margin():
    for n in range(1, 9):
        for shape, tokens, cost in ((FLUX, 4096, H100_NVLINK), (MEDIUM_SD3, 1024, CPU_EPYC_2), (WAN, 32760, H100_PCIE)):
            config, table = choose(shape, tokens, 2, True, n, cost, text=512)
            assert config.world_size <= n and all(r["world"] <= n for r in table)
            assert config.ulysses_degree <= shape.heads
    # a margin no config can meet keeps degree 1
    config, _ = choose(FLUX, 4096, 2, True, 8, H100_NVLINK, text=512, margin=100.0)
    assert config.world_size == 1
    assert all(c.cfg_degree == 1 for c in candidates(FLUX, 4096, 2, False, 8))  # cfg 2 only with CFG on
    with pytest.raises(ConfigError, match="at least one device"):
        choose(FLUX, 4096, 1, False, 0, H100_NVLINK)


def test_shape_validation_names_the_field():
    with pytest.raises(ValueError, match="heads"):
        ModelShape(family="x", blocks=1, text_blocks=0, hidden=10, heads=3, img_params=1, txt_params=1, out_per_token=1)
    with pytest.raises(ValueError, match="text_blocks"):
        ModelShape(family="x", blocks=1, text_blocks=2, hidden=8, heads=2, img_params=1, txt_params=1, out_per_token=1)


# ---------------------------------------------------------------- ComfyUI's models and the nodes
@pytest.fixture(scope="module")
def comfy_models(tmp_path_factory):
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    tmp = tmp_path_factory.mktemp("costmodel")
    out = {}
    for name, write, kw in (("sd3", tc.write_sd3, dict(depth=4, pos_embed_max_size=32)), ("pixart", tc.write_pixart, {}),
                            ("wan", tc.write_wan, {}), ("hunyuan_video", tc.write_hunyuan_video, {})):
        write(tmp / f"{name}.safetensors", **kw)
        out[name] = comfy.sd.load_diffusion_model(str(tmp / f"{name}.safetensors"))
    return out


@pytest.mark.comfy
def test_shape_from_comfyui_models(comfy_models):
    from comfyui_hybrid_parallel.parallel.costmodel import shape_from_module
    got = {k: shape_from_module(m.model.diffusion_model) for k, m in comfy_models.items()}
    sd3 = got["sd3"]
    assert (sd3.blocks, sd3.text_blocks, sd3.hidden, sd3.heads, sd3.patch) == (4, 4, 256, 4, (1, 2, 2))
    assert sd3.img_params == 4 * 12 * 256 ** 2  # q, k, v, out + 4x MLP per block, image stream
    assert sd3.txt_params < sd3.img_params      # the last block's context stream is pre-only
    pixart = got["pixart"]
    assert (pixart.blocks, pixart.text_blocks, pixart.hidden, pixart.heads, pixart.cross_text) == (1, 0, 1152, 16, True)
    assert pixart.txt_params == 2 * 1152 ** 2   # the cross-attention's k, v
    wan = got["wan"]
    assert (wan.blocks, wan.hidden, wan.heads, wan.cross_text, wan.out_per_token) == (1, 128, 1, True, 64)
    hv = got["hunyuan_video"]
    assert (hv.blocks, hv.text_blocks, hv.heads, hv.patch) == (2, 2, 2, (1, 1, 1))
    assert hv.img_params == hv.txt_params  # one double block (a stream each) + one single block (both)
    assert sd3.tokens((1, 16, 9, 13)) == 5 * 7 and wan.tokens((1, 16, 5, 9, 13)) == 5 * 5 * 7


def _node(**widgets):
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    kw = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
              warmup_steps=1, tp_degree=1, method="usp", device="cpu", attention="auto")
    kw.update(widgets)
    return ParallelConfigNode().build(**kw)


def test_config_node_auto_widget_and_refusals():
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    from comfyui_hybrid_parallel.workers.driver.configs import HybridParallelConfig
    optional = list(ParallelConfigNode.INPUT_TYPES()["optional"])
    assert optional[-1] == "degrees"  # last: saved workflows keep their widget positions
    hp = _node(degrees="auto")["result"][0]
    assert hp.auto_devices == (os.cpu_count() or 1) and hp.config.world_size == 1 and "auto" in hp.describe()
    hp2 = _node(degrees="auto", devices="cpu,cpu")["result"][0]
    assert hp2.auto_devices == 2 and hp2.device_list == ("cpu", "cpu")
    assert _node()["result"][0].auto_devices == 0
    with pytest.raises(ValueError, match="set every degree to 1, or set degrees to 'manual'"):
        _node(degrees="auto", ulysses_degree=2)
    with pytest.raises(ValueError, match="method to 'usp'"):
        _node(degrees="auto", method="distrifusion")
    with pytest.raises(ValueError, match="degrees must be one of"):
        _node(degrees="sometimes")
    with pytest.raises(ConfigError, match="auto_devices"):
        HybridParallelConfig(ParallelConfig(), auto_devices=-1)


@pytest.mark.comfy
def test_resolve_auto(comfy_models, monkeypatch):
    from comfyui_hybrid_parallel.workers.driver import auto
    from comfyui_hybrid_parallel.workers.driver.configs import HybridParallelConfig
    model = comfy_models["sd3"]
    manual = HybridParallelConfig(ParallelConfig(ulysses_degree=2), device="cpu")
    assert auto.resolve_auto(manual, model, (1, 16, 8, 8), 4.0, None) is manual
    hp = HybridParallelConfig(ParallelConfig(), device="cpu", auto_devices=2, device_list=("cpu", "cpu"))
    cond = [[torch.zeros(1, 7, 32), {}]]
    out = auto.resolve_auto(hp, model, (1, 16, 8, 8), 4.0, cond, cond)  # 16 tokens: one rank
    assert out.config.world_size == 1 and out.auto_devices == 0 and out.config.devices == ("cpu",)
    assert auto.cfg_active(1.0, cond) is False and auto.cfg_active(4.0, None) is False
    assert auto.text_tokens(cond, [[torch.zeros(1, 77, 32), {}]]) == 77
    seen = {}

    def fake_choose(shape, tokens, batch, active, n, cost, text, kernel_speed):
        seen.update(tokens=tokens, batch=batch, active=active, n=n, text=text)
        seen["cost"], seen["kernel_speed"] = cost.name, kernel_speed and kernel_speed(2, 4, 1101, 1)
        return ParallelConfig(cfg_degree=2), [dict(config="cfg2", world=2, threads=1, compute_s=0, fixed_s=0,
                                                   attention_s=0, comm_s=0, overhead_s=0, total_s=1, speedup=1.5,
                                                   chosen=True)]
    monkeypatch.setattr(auto, "choose", fake_choose)
    probes = {}
    out = auto.resolve_auto(hp, model, (1, 16, 64, 64), 4.0, cond, cond, probes=probes)
    assert out.config.cfg_degree == 2 and out.config.devices == ("cpu", "cpu")
    cost, speed = seen.pop("cost"), seen.pop("kernel_speed")
    assert seen == dict(tokens=1024, batch=2, active=True, n=2, text=7)
    # measured once and kept: this CPU's throughput, and ComfyUI's kernel (sub-quadratic: no flags, CPU) per shape
    from comfyui_hybrid_parallel.workers.bridge.build import picked_attention
    assert "probed" in cost and set(probes["cpu_rates"]) == {"matmul_flops", "sdpa_flops"}
    if picked_attention() == "pytorch":
        assert speed is None
    else:
        assert 0.05 <= speed <= 20 and len(probes) == 2, probes
        auto.resolve_auto(hp, model, (1, 16, 64, 64), 4.0, cond, cond, probes=probes)
        assert len(probes) == 2  # nothing measured again

    class Unknown(torch.nn.Module):  # no adapter: only its batch splits (cfg when on, then dp over the batch)
        pass
    patcher = type("P", (), {"model": type("M", (), {"diffusion_model": Unknown()})()})()
    out = auto.resolve_auto(hp, patcher, (1, 16, 64, 64), 4.0, cond, cond)
    assert out.config.describe() == "cfg2" and out.auto_devices == 0
    assert auto.resolve_auto(hp, patcher, (3, 16, 64, 64), 1.0, cond, cond).config.describe() == "dp2"
    assert auto.resolve_auto(hp, patcher, (1, 16, 64, 64), 1.0, cond, cond).config.world_size == 1


@pytest.mark.comfy
def test_hybrid_sampler_auto_end_to_end(comfy_models):
    """Through the real nodes and pool: auto on a tiny SD3 (one rank here, usually) equals KSampler - bitwise on one
    rank."""
    from comfy_env import comfy_nodes as load_comfy_nodes, setup_comfy
    comfy_nodes = load_comfy_nodes(setup_comfy())
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler

    g = torch.Generator().manual_seed(3)
    pos = [[torch.randn(1, 7, 32, generator=g), {"pooled_output": torch.randn(1, 24, generator=g)}]]
    neg = [[torch.randn(1, 7, 32, generator=g), {"pooled_output": torch.randn(1, 24, generator=g)}]]
    latent = {"samples": torch.zeros(1, 16, 9, 13)}
    model = comfy_models["sd3"]
    ref = comfy_nodes.common_ksampler(model, 3, 2, 4.0, "euler", "normal", pos, neg, latent)[0]["samples"]
    runtime = Runtime()
    HybridSampler.runtime = runtime
    try:
        hp = _node(degrees="auto")["result"][0]
        out = HybridSampler().sample(model, 3, 2, 4.0, "euler", "normal", pos, neg, latent, hp)[0]["samples"]
    finally:
        runtime.stop()
        HybridSampler.runtime = None
    # what the mesh picture shows for degrees auto: this run's predicted time per step per choice. The choice rests
    # on this machine's measured throughputs (one rank here unless a loaded CPU tips the tiny model to cfg 2):
    # degree 1 equals KSampler bitwise, any split within 1e-5
    from comfyui_hybrid_parallel.workers.driver.routes import mesh_payload
    auto = mesh_payload({"degrees": "auto"}, runtime)["auto"]
    assert auto["model"] == "sd3" and auto["tokens"] == 35 and auto["cfg"] is True
    rows = {c["config"]: c for c in auto["candidates"]}
    assert rows[auto["chosen"]]["chosen"] and rows["serial"]["speedup"] == 1.0 and "cfg2" in rows and \
        all(c["ms"] > 0 for c in rows.values()), rows
    if auto["chosen"] == "serial":
        assert torch.equal(out, ref), (out - ref).abs().max()
    else:
        assert ((out - ref).norm() / ref.norm()).item() <= 1e-5, auto
    assert "auto" not in mesh_payload({"degrees": "manual"}, runtime)
    assert mesh_payload({"degrees": "auto"}, None)["auto"] is None  # before any run: the picture says so
