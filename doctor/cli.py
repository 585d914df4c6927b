"""The doctor's command line: run the checks in order, print the tables, write the JSON, set the exit code."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from ..workers.bridge import seams as comfy_seams
from ..workers.platform_support import decide, read_facts
from .kernels import check_kernels, kernel_table
from .machine import environment, find_comfyui, import_comfyui, print_environment
from .methods import check_methods, meshes_for, method_table

EXIT_MISMATCH, EXIT_CANNOT_RUN = 1, 2


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m comfyui_hybrid_parallel.doctor", description="Self-check of the Hybrid Parallel pack on this machine")
    ap.add_argument("--devices", default="auto", choices=("auto", "cpu", "cuda"),
                    help="where the methods run: auto = the GPUs for meshes that fit them and CPU workers for the "
                         "rest; cpu = CPU workers only; cuda = GPUs only")
    ap.add_argument("--quick", action="store_true", help="two-rank meshes and two precisions (CI on two cores)")
    ap.add_argument("--max-cpu-world", type=int, default=None,
                    help="largest CPU world to start (default: 4 if the machine has 4+ cores, else 2)")
    ap.add_argument("--precisions", default=None,
                    help="comma list of fp32,bf16,fp16,fp8_e4m3fn,fp8_e4m3fn_fast (default: all that make sense "
                         "here; --quick: fp32,fp8_e4m3fn)")
    ap.add_argument("--share-devices", action="store_true",
                    help="ranks share the GPUs (gloo through host copies: slow, but every multi-rank method runs its "
                         "CUDA code on a machine with fewer GPUs than ranks, even one)")
    ap.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "hp-doctor.json"),
                    help="where to write the full report (default: the temp dir, not the folder you run it in, which "
                         "is often ComfyUI's own)")
    ap.add_argument("--comfyui", default=None, help="ComfyUI directory (default: found automatically)")
    ap.add_argument("--timing-runs", type=int, default=3,
                    help="timed runs per row after its checked runs (the median is reported; default 3, 1 to check "
                         "faster: the agreement is checked on the same runs either way)")
    args = ap.parse_args(argv)
    if args.timing_runs < 1:
        ap.error("--timing-runs must be 1 or more")
    return args


def default_precisions(args, cuda: bool) -> list:
    if args.precisions:
        return [p.strip() for p in args.precisions.split(",") if p.strip()]
    if args.quick:
        return ["fp32", "fp8_e4m3fn"]
    out = ["fp32", "bf16", "fp16", "fp8_e4m3fn"]
    if cuda and torch.cuda.get_device_capability(0) >= (8, 9):
        out.append("fp8_e4m3fn_fast")  # fp8 matmuls: Ada / Hopper and newer
    return out


def comfyui_check() -> dict:
    """The running ComfyUI against the pack's seam inventory (workers/bridge/seams.py) and the versions its tests ran:
    ok with a note for a version the tests never ran, not ok (with the missing seams) where the nodes would refuse."""
    version = comfy_seams.comfyui_version()
    problem = comfy_seams.problem_line()
    if problem:
        return {"ok": False, "version": version, "line": f"FAIL: {problem}"}
    note = comfy_seams.untested_note()
    tested = ", ".join(comfy_seams.TESTED)
    line = (f"ComfyUI {version}: every seam the pack uses is present; " +
            (note if note else f"a version the pack's tests ran on ({tested})"))
    return {"ok": True, "version": version, "tested": version in comfy_seams.TESTED, "line": line}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["HP_DOCTOR_TIMING_RUNS"] = str(args.timing_runs)  # (doctor/machine.median_ms; this process only)
    t0 = time.perf_counter()
    comfy_dir = find_comfyui(args.comfyui)
    cuda = torch.cuda.is_available() and args.devices != "cpu"
    if args.devices == "cuda" and not torch.cuda.is_available():
        print("--devices cuda, but torch sees no CUDA device (is this the CUDA build of torch? "
              f"torch {torch.__version__}); use --devices cpu", file=sys.stderr)
        return EXIT_CANNOT_RUN
    env = environment(comfy_dir)
    print("== machine ==")
    print_environment(env)
    report = {"environment": env, "kernels": [], "methods": [], "args": vars(args)}
    support = decide(read_facts())
    if not (support.cpu or support.cuda):  # Windows, or a torch without torch.distributed: no world can start
        print(f"the worker pool cannot run here: {support.why_not_cpu or support.why_not_cuda}", file=sys.stderr)
        return EXIT_CANNOT_RUN
    if comfy_dir is None:
        print("ComfyUI not found: pass --comfyui DIR (the folder holding comfy/ and main.py) or set COMFYUI_DIR",
              file=sys.stderr)
        return EXIT_CANNOT_RUN
    import_comfyui(comfy_dir, cpu=not cuda)
    report["comfyui"] = comfyui_check()
    print("\n== ComfyUI ==")
    print(report["comfyui"]["line"])
    if not report["comfyui"]["ok"]:
        return EXIT_CANNOT_RUN

    print("\n== attention kernels with log-sum-exp (ring attention) ==")
    devices = [torch.device("cpu")] + ([torch.device("cuda", 0)] if cuda else [])
    report["kernels"] = check_kernels(devices, quick=args.quick)
    print(kernel_table(report["kernels"]))

    print("\n== parallel methods on the embedded tiny model (ComfyUI's MMDiT) vs its serial forward ==")
    print(method_table([]))
    gpus = torch.cuda.device_count() if cuda else 0
    max_cpu = args.max_cpu_world or (4 if (os.cpu_count() or 1) >= 4 else 2)
    plan = meshes_for(gpus, max_cpu if args.devices != "cuda" else 0, quick=args.quick, share=args.share_devices)
    precisions = default_precisions(args, cuda)
    with tempfile.TemporaryDirectory(prefix="hp-doctor-") as tmp:
        try:
            report["methods"] = check_methods(plan, precisions, Path(tmp), progress=print,
                                              share_devices=args.share_devices)
        except Exception:  # noqa: BLE001 - a crash of the doctor itself is a failed check, with its traceback
            report["methods"].append({"method": "doctor", "ok": False, "error": traceback.format_exc()})
            print(traceback.format_exc(), file=sys.stderr)

    rows = report["kernels"] + report["methods"]
    failed = [r for r in rows if not r.get("ok")]
    skipped = [r for r in rows if r.get("skipped")]
    report["failed"], report["skipped"] = len(failed), len(skipped)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    if failed:
        print("\nfailed:\n" + "\n".join(method_table([r]).splitlines()[1] if "method" in r else kernel_table([r]).splitlines()[1]
                                      for r in failed))
    verdict = "OK" if not failed else f"FAILED: {len(failed)} of {len(rows)} checks"
    print(f"\n{verdict} ({len(report['kernels'])} kernel checks, {len(report['methods'])} method checks, "
          f"{len(skipped)} skipped) in {report['seconds']} s; report written to {args.json}")
    return EXIT_MISMATCH if failed else 0
