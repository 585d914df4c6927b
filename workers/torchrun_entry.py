"""Script torchrun runs for each worker of a cluster launch group (see cluster.py).

A script path rather than `-m`: on another machine, or inside ComfyUI's
custom_nodes/<any folder>, the pack is not installed as `comfyui_hybrid_parallel`,
so this registers the pack root under that name (without running the pack's
ComfyUI __init__) and runs the worker in torchrun mode.
"""
import runpy
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "workers"]  # no module shadowing
pkg = types.ModuleType("comfyui_hybrid_parallel")
pkg.__path__ = [str(ROOT)]
sys.modules["comfyui_hybrid_parallel"] = pkg
sys.argv = [sys.argv[0], "--torchrun", *sys.argv[1:]]
runpy.run_module("comfyui_hybrid_parallel.workers.worker_main", run_name="__main__", alter_sys=True)
