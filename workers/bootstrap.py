"""How a worker process starts: the pack's root folder and the command line that imports the pack from it.

Why its own module: the pool's launcher, the spare interpreters and a cluster's torchrun entry all start workers the
same way; here, below all three, none of them imports another for it (no import circle in workers/).
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
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


@contextmanager
def imports_without_gc(freeze: bool = False):
    """Python's cyclic collector paused while a process imports torch or ComfyUI.

    Why: those imports make ~450k objects that live as long as the process, and the collector, run by allocation
    counts, walks them again and again as they pile up - 20 % of the fork server's imports here (1.72 -> 1.43 s),
    on a headless first prompt's critical path (issue 69). `freeze` (the fork server, before it forks): what was
    imported leaves the collector's sight for good, so a rank's collections never walk - nor copy-on-write - the
    pages it shares with the server (the recipe of the gc module's documentation for processes that fork)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if paused:
            gc.enable()
