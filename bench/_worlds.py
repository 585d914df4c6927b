"""Benchmarks run their bodies on real gloo worlds with the same harness as the tests."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from dist_harness import DistPool, context_for  # noqa: E402,F401
import tiny_models  # noqa: E402,F401

RESULTS = os.path.join(HERE, "results")


def write_results(name: str, rows: list, markdown: str) -> None:
    import json
    import platform

    import torch

    os.makedirs(RESULTS, exist_ok=True)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "device": "cuda:" + torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
