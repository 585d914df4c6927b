"""torch.compile in the workers (ComfyUI's TorchCompileModel options): the parallelized native model compiled once per
resident model and mesh, across the collectives (dynamo breaks the graph at each), equal to the uncompiled pool.

The CI test compiles with dynamo's "eager" backend (the graph capture and its guards, no code generation: seconds);
the slow one with inductor, ComfyUI's default (minutes of C++ compilation on 2 cores)."""
import pytest
import torch

from test_native_pool import comfy, inputs, load_model, rel  # noqa: F401

pytestmark = pytest.mark.comfy


def _forward(pool, config, key, base, inp, compile_spec):
    from dataclasses import replace

    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    dm = base.diffusion_model
    # ComfyUI's pytorch attention, as on GPUs: its CPU default (sub-quadratic) reads the free memory at every call,
    # which dynamo guards on - ComfyUI's own TorchCompileModel recompiles it at every step too
    native = native_spec(base)
    runtime = native.runtime
    native = replace(native, runtime=replace(runtime, attention="pytorch",
                                             comfy_args={**runtime.comfy_args, "use_pytorch_cross_attention": True}))
    pool.ensure_model(config, key, family_adapter(dm).family, native=native,
                      state_dict=lambda: dict(dm.state_dict()))
    values = {"key": key, "structure": {"transformer_options": {}}}
    if compile_spec:
        values["compile"] = compile_spec
    return pool.submit(config, "forward", values, dict(inp))


def _check(pool, tmp_path, backend, degrees):
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    config = ParallelConfig(**degrees)
    base = load_model(tmp_path, "sd3", "fp32").model
    spec = {"backend": backend, "options": None, "mode": None, "fullgraph": False, "dynamic": False}
    key = f"compile:{backend}:{config.describe()}"
    graphs = []
    # a "prompt" of three calls on one latent size, the next prompt's first call on it, then a new size: a prompt's
    # first calls may compile a variant or two (a split shard's strides), the second prompt compiles nothing (its
    # first call is where a guard would fail), the new size compiles again
    for prompt, (seeds, odd) in enumerate((((1, 2, 3), True), ((4,), True), ((7,), False))):
        for seed in seeds:
            inp = inputs("sd3", base, seed=seed, odd=odd)
            plain = _forward(pool, config, key, base, inp, None).tensors["out"]
            res = _forward(pool, config, key, base, inp, spec)
            err = rel(res.tensors["out"], plain)
            assert err <= 1e-5, (prompt, seed, err)
        graphs.append(max(r["compiled_graphs"] for r in res.per_rank))
        print(f"compiled ({backend}) {config.describe()} prompt {prompt}: rel {err:.2e} vs uncompiled, "
              f"{graphs[-1]} graphs so far")
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs[1] == graphs[0], f"the second prompt compiled again: {graphs}"
    assert graphs[2] > graphs[1], f"a new latent size did not recompile: {graphs}"
    return graphs


@pytest.mark.parametrize("degrees", [{"ulysses_degree": 2}, pytest.param({"cfg_degree": 2}, marks=pytest.mark.slow)],
                         ids=["u2", "cfg2"])
def test_compiled_model_in_the_workers_equals_uncompiled(comfy, cpu_pool, tmp_path, degrees):  # noqa: F811
    _check(cpu_pool, tmp_path, "eager", degrees)


@pytest.mark.slow
def test_inductor_compiled_model_in_the_workers(comfy, cpu_pool, tmp_path):  # noqa: F811
    _check(cpu_pool, tmp_path, "inductor", {"ulysses_degree": 2})
