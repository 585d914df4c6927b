"""diffusers is no dependency: no module of the pack imports it.

Why: the pack runs ComfyUI's own modules everywhere (the library API on diffusers models is retired:
docs/development.md), and a ComfyUI install without diffusers - or with a version nobody tried - must run every node.
The check runs in a subprocess whose `diffusers` is a package that raises ImportError (first on PYTHONPATH): it
imports every product module (nodes, engine, workers, doctor) and finds diffusers neither imported nor importable.
What the workers compute is proven on ComfyUI's own models by tests/families (none of which imports diffusers).
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
    import comfyui_hybrid_parallel  # noqa: F401
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
    print("ok without diffusers")
''')


def test_no_module_of_the_pack_imports_diffusers(tmp_path):
    shadow = tmp_path / "shadow" / "diffusers"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text('raise ImportError("diffusers is not installed (blocked by the test)")\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")])}
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = subprocess.run([sys.executable, "-c", SCRIPT, tests, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env=env)
    print(res.stdout[-3000:])
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    assert "ok without diffusers" in res.stdout
