"""Entry point of the driver's fork server: `python -m comfyui_hybrid_parallel.workers.forkserver_main --driver-pid P
--reply-fd F` (forkserver.ForkServer starts it). Its own module, imported by nothing: runpy then runs the one copy of
it (forkserver.py itself is imported by the workers package, and worker_main - what the forks run - must not import
the server back: that was an import circle)."""
from __future__ import annotations

import os
import sys

from .forkserver import main

if __name__ == "__main__":
    code = main(sys.argv[1:])
    # as a worker does (worker_main): skip the interpreter's finalisation, which only tears down what the forks used
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
