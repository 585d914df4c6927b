"""How a worker process starts: the pack's root folder and the command line that imports the pack from it.

Why its own module: the pool's launcher, the spare interpreters and a cluster's torchrun entry all start workers the
same way; here, below all three, none of them imports another for it (no import circle in workers/).
"""
from __future__ import annotations

from pathlib import Path

PACKAGE = "comfyui_hybrid_parallel"


def pack_root() -> Path:
    return Path(__file__).resolve().parents[1]


# Runs a worker module with the pack imported as `comfyui_hybrid_parallel` from its root, whatever the
# folder is called, *without* executing the pack's own __init__ (the ComfyUI node registrations, which
# import the node layer and may need ComfyUI itself; a worker never needs them).
BOOTSTRAP = ("import runpy, sys, types; root = sys.argv.pop(1); module = sys.argv.pop(1); "
             f"pkg = types.ModuleType({PACKAGE!r}); pkg.__path__ = [root]; sys.modules[{PACKAGE!r}] = pkg; "
             "runpy.run_module(module, run_name='__main__', alter_sys=True)")
