"""`python -m comfyui_hybrid_parallel.doctor`, or `python <pack folder>/doctor` where the pack is not installed
(a folder in ComfyUI's custom_nodes, whatever its name): see the package docstring."""
import sys

if not __package__:  # run as a folder: register the pack root as `comfyui_hybrid_parallel`, as the workers do
    import os
    import types
    here = os.path.dirname(os.path.abspath(__file__))
    if sys.path and os.path.abspath(sys.path[0] or ".") == here:
        sys.path.pop(0)  # this folder's module names (cli, machine, ...) must not shadow top-level modules
    if "comfyui_hybrid_parallel" not in sys.modules:
        pkg = types.ModuleType("comfyui_hybrid_parallel")
        pkg.__path__ = [os.path.dirname(here)]
        sys.modules["comfyui_hybrid_parallel"] = pkg
    from comfyui_hybrid_parallel.doctor.cli import main
else:
    from .cli import main

sys.exit(main())
