"""Weight sharding (parallel/shard.py) on ComfyUI's own models through the worker pool, against ComfyUI's forward.

Each rank of the sharding axis keeps 1/N of every weight at rest; a block's weights are gathered one block
ahead and freed after it. Checked: the output equals ComfyUI's serial forward (≤ 1e-5 where ComfyUI computes
in fp32, fp8 weights included; a measured bound in bf16), composed with Ulysses, Ring and CFG, on latents
that split evenly and unevenly; per-rank resident weight bytes ≤ weights/N + two blocks (asserted from what
each worker holds), and at most the root plus two blocks gathered at once during a forward.
"""
from __future__ import annotations

import pytest
import torch

from test_native_pool import comfy, comfy_forward, inputs, load_model, pool_forward, rel, tolerance  # noqa: F401

pytestmark = pytest.mark.comfy



CASES = [
    # Flux's blocks (double, then single) sharded under u2: in CI by test_each_rank_holds_a_shard_of_the_weights[flux-
    # fp8_e4m3fn] (the same config and model, its output checked against ComfyUI's); both latents with the slow set
    ({"ulysses_degree": 2, "shard_weights": "sequence"}, [("sd3", "fp32"), ("sd3", "bf16"), ("sd3", "scaled_fp8")]),
    ({"ring_degree": 2, "shard_weights": "sequence"}, [("sd3", "fp16"), ("wan", "fp8_e4m3fn")]),
    ({"cfg_degree": 2, "shard_weights": "all"}, [("sd3", "fp32"), ("pixart", "fp8_e4m3fn")]),
    ({"cfg_degree": 2, "ulysses_degree": 2, "shard_weights": "sequence"}, [("sd3", "fp8_e4m3fn")]),
    # DistriFusion's own asynchronous K/V exchange on the same ranks (its synchronous step: equal to serial)
    ({"ulysses_degree": 2, "method": "distrifusion", "shard_weights": "sequence"}, [("sd3", "fp8_e4m3fn")]),
    # the rest of u2's precisions with the slow set: fp8_e4m3fn is cfg2u2's and distrifusion2's, Wan is r2's, Flux fp8
    # (one latent) test_each_rank_holds_a_shard_of_the_weights's (a 531M model: 2 loads and 4 fp8 forwards here)
    ({"ulysses_degree": 2, "shard_weights": "sequence"}, [("sd3", "fp8_e4m3fn"), ("wan", "fp32"),
                                                          ("flux", "fp8_e4m3fn")]),
]


@pytest.mark.parametrize("degrees, cases", CASES[:-1] + [pytest.param(*CASES[-1], marks=pytest.mark.slow)],
                         ids=["u2", "r2", "cfg2-all", "cfg2u2", "distrifusion2", "u2+"])
def test_sharded_forward_equals_comfyui(comfy, cpu_pool, degrees, cases):  # noqa: F811
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(**degrees)
    failures = []
    for i, (family, precision) in enumerate(cases):
        base = load_model(comfy, family, precision).model
        for odd in (True, False):
            inp = inputs(family, base, seed=300 + 2 * i + odd, odd=odd)
            ref = comfy_forward(base, inp)
            out = pool_forward(cpu_pool, config, f"shard:{config.describe()}:{family}:{precision}", base, inp)
            err = rel(out, ref)
            print(f"{config.describe()} {family} {precision} {'odd' if odd else 'even'}: rel {err:.2e}")
            if out.shape != ref.shape or err > tolerance(base):
                failures.append((family, precision, odd, err))
            if config.method == "distrifusion":  # a stale step too (same inputs: its stale K/V are the fresh ones)
                key = f"shard:{config.describe()}:{family}:{precision}"
                for step in (0, 1):
                    out = cpu_pool.submit(config, "forward", {"key": key, "call_index": step,
                                                              "structure": {"transformer_options": {}}},
                                          dict(inp)).tensors["out"]
                    if rel(out, ref) > tolerance(base):
                        failures.append((family, precision, odd, f"distrifusion step {step}", rel(out, ref)))
    assert not failures, failures


@pytest.mark.parametrize("family, precision", [("sd3", "fp32"), ("flux", "fp8_e4m3fn")])
def test_each_rank_holds_a_shard_of_the_weights(comfy, cpu_pool, family, precision):  # noqa: F811
    """At rest: weights/N (+ alignment padding) per rank, in raw bytes (fp8 stays 1 byte per weight); during a
    forward: the root unit plus at most two blocks gathered at once. That sharded forward equals ComfyUI's (for Flux
    the CI proof of its sharded blocks under ulysses 2)."""
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(ulysses_degree=2, shard_weights="sequence")
    base = load_model(comfy, family, precision).model
    sd = base.diffusion_model.state_dict()
    full = sum(v.numel() * v.element_size() for v in sd.values())
    blocks = {}
    for k, v in sd.items():
        head = k.split(".")
        if head[0] in ("joint_blocks", "double_blocks", "single_blocks", "blocks") and head[1].isdigit():
            blocks[(head[0], head[1])] = blocks.get((head[0], head[1]), 0) + v.numel() * v.element_size()
    two_blocks = 2 * max(blocks.values())
    key = f"shard-bytes:{family}:{precision}"
    inp = inputs(family, base, seed=9)
    out = pool_forward(cpu_pool, config, key, base, inp)
    ref = comfy_forward(base, inp)
    err = rel(out, ref)
    print(f"{family} {precision} sharded u2: rel {err:.2e}")
    assert out.shape == ref.shape and err <= tolerance(base), err
    res = cpu_pool.submit(config, "model_bytes", {"key": key})
    for r in res.per_rank:
        s = r["sharding"]
        print(f"{family} {precision} rank bytes {r['bytes']} of {full} (N=2), sharding {s}")
        assert r["bytes"] <= full / 2 + two_blocks, (r["bytes"], full, two_blocks)
        assert abs(r["bytes"] - full / 2) <= 64 * s["units"] * 2 + 64, (r["bytes"], full)  # padding only
        assert set(r["dtypes"]) == {"uint8"}  # raw shards: no weight is held whole, whatever its dtype
        assert s["peak_gathered_bytes"] <= s["root_bytes"] + 2 * s["largest_block_bytes"], s
        assert s["peak_gathered_bytes"] >= s["root_bytes"] + s["largest_block_bytes"], s  # really gathered


def test_shard_weights_is_refused_where_it_cannot_work():
    from comfyui_hybrid_parallel.parallel import ConfigError, ParallelConfig
    with pytest.raises(ConfigError, match="tensor parallel or PipeFusion"):
        ParallelConfig(tp_degree=2, shard_weights="all")
    with pytest.raises(ConfigError, match="raise ulysses_degree or ring_degree, or use shard_weights=all"):
        ParallelConfig(cfg_degree=2, shard_weights="sequence")
    with pytest.raises(ConfigError, match="shard_weights must be one of"):
        ParallelConfig(ulysses_degree=2, shard_weights="fsdp")
    assert ParallelConfig(ulysses_degree=2, shard_weights="sequence").mesh_key() != \
        ParallelConfig(ulysses_degree=2).mesh_key()  # a change restarts the world with the new layout


def test_deep_model_holds_two_blocks_at_most_and_loop_mode_equals_serial(comfy, cpu_pool, tmp_path):  # noqa: F811
    """Six joint blocks: a forward never holds more than the root and two blocks (the running one and the one
    being gathered), far below the whole model; the sampling loop run in the workers (loop mode) equals the
    serial loop."""
    import comfy.sd
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tiny
    from test_native_pipefusion import _pool_loop, _serial_loop
    path = tmp_path / "sd3_deep.safetensors"
    tiny.write_sd3(path, depth=6, pos_embed_max_size=32, seed=61)
    base = comfy.sd.load_diffusion_model(str(path), model_options={"dtype": torch.float8_e4m3fn}).model
    config = ParallelConfig(ulysses_degree=2, shard_weights="sequence")
    inp = inputs("sd3", base, seed=62, batch=2, odd=False)
    ref = comfy_forward(base, inp)
    out = pool_forward(cpu_pool, config, "shard-deep", base, inp)
    assert rel(out, ref) <= 1e-5, rel(out, ref)
    s = cpu_pool.submit(config, "model_bytes", {"key": "shard-deep"}).per_rank[0]["sharding"]
    print("six blocks:", s)
    assert s["units"] == 7
    assert s["peak_gathered_bytes"] == s["root_bytes"] + 2 * s["largest_block_bytes"], s
    assert s["peak_gathered_bytes"] < 0.6 * s["full_bytes"], s

    sigmas = torch.linspace(1.0, 0.0, 4)
    noise = torch.randn(1, *inp["x"].shape[1:], generator=torch.Generator().manual_seed(63))
    want = _serial_loop("sd3", base, inp, sigmas, noise, cfg_scale=3.0)
    got = _pool_loop(cpu_pool, config, "shard-deep", base, inp, sigmas, noise, 3.0)
    print(f"loop mode, sharded: rel {rel(got, want):.2e}")
    assert rel(got, want) <= 1e-5
