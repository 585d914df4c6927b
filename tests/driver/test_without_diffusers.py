"""diffusers is optional: the nodes, the workers and ComfyUI's own modules on the pool never import it.

Why: the pack runs ComfyUI's own modules everywhere (the ComfyUI -> diffusers converters live in tests/converters as
test references only); a ComfyUI install without diffusers, or with a version the library API does not know, must
run every node. The check runs in a subprocess whose `diffusers` is a package that raises ImportError (first on
PYTHONPATH, so the workers inherit it): it imports every product module, runs ComfyUI's tiny SD3 MMDiT (fp32; Flux's
531M, whose width ComfyUI fixes, made this one of the slowest tests in CI) with PipeFusion and with Ulysses on a
2-rank pool, each compared to ComfyUI's own model in that process (the loop run in-process). Patch VAE Decode's
native path imports no diffusers either: its modules are among those imported here (the library API's VAE plan and
decode, listed in `library`, are the only modules left out).
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.comfy

SCRIPT = textwrap.dedent('''
    import importlib, pkgutil, sys, torch
    sys.path.insert(0, sys.argv[1])  # tests/: comfy_env
    from comfy_env import setup_comfy
    setup_comfy()
    import comfy.sd
    import comfyui_hybrid_parallel as pack
    scripts = ("__main__", "worker_main", "torchrun_entry", "fake_worker")  # they run when imported
    for sub in ("nodes", "parallel", "workers", "doctor"):
        top = importlib.import_module(f"comfyui_hybrid_parallel.{sub}")
        for m in pkgutil.walk_packages(top.__path__, f"comfyui_hybrid_parallel.{sub}."):
            if not m.name.endswith(scripts):
                importlib.import_module(m.name)
    assert "diffusers" not in sys.modules, "a product module imported diffusers"
    try:
        import diffusers  # noqa: F401
        raise SystemExit("diffusers was not blocked")
    except ImportError:
        pass

    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    from comfyui_hybrid_parallel.workers.bridge.spec import family_adapter, native_spec
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel.pipefusion import flow
    from comfyui_hybrid_parallel.parallel.loop import run_loop
    from comfyui_hybrid_parallel.workers.pool import WorkerPool
    path = sys.argv[2] + "/sd3.safetensors"
    tc.write_sd3(path, depth=2, seed=5)
    base = comfy.sd.load_diffusion_model(path).model
    dm = base.diffusion_model
    g = torch.Generator().manual_seed(7)
    dtype = base.manual_cast_dtype or dm.dtype
    cond = {"context": torch.randn(2, 7, tc.TINY_CONTEXT_DIM, generator=g).to(dtype),
            "y": torch.randn(2, tc.TINY_POOLED_DIM, generator=g).to(dtype)}
    noise = torch.randn(1, 16, 8, 12, generator=g)
    sigmas = torch.linspace(1.0, 0.0, 3)
    ref = run_loop(dm, cond, sigmas, noise, convention=flow(1.0), sampler="euler", cfg_scale=2.0,
                   forward=lambda h, t, kw: dm(h, t, transformer_options={}, **kw), dtype=dtype,
                   timestep_dtype=torch.float32)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    pool = WorkerPool(device="cpu")
    try:
        for degrees in ({"pp_degree": 2, "num_pipeline_patch": 2, "warmup_steps": 2}, {"ulysses_degree": 2}):
            config = ParallelConfig(**degrees)
            key = f"sd3:{config.describe()}"
            pool.ensure_model(config, key, family_adapter(dm).family, {}, native=native_spec(base),
                              state_dict=lambda: dict(dm.state_dict()))
            values = {"key": key, "structure": {"transformer_options": {}}, "sampler": "euler", "cfg_scale": 2.0,
                      "convention": {"kind": "flow", "timestep_scale": 1.0}}
            out = pool.submit(config, "loop", values, {**cond, "noise": noise, "sigmas": sigmas}).tensors["out"]
            print(config.describe(), "rel", rel(out, ref))
            assert rel(out, ref) <= 1e-5, (config.describe(), rel(out, ref))
    finally:
        pool.close()
    print("ok without diffusers")
''')


def test_nodes_and_workers_run_without_diffusers(tmp_path):
    shadow = tmp_path / "shadow" / "diffusers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("diffusers is not installed (blocked by the test)")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", SCRIPT, tests, str(tmp_path)], capture_output=True, text=True,
                         timeout=600, env=env)
    print(res.stdout[-3000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "ok without diffusers" in res.stdout
