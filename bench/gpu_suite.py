"""The GPU suite: everything a CPU test cannot show, in one command, on whatever GPU a session is lent.

    python bench/gpu_suite.py                 # a CUDA machine: ~8 minutes on one H100 (--plan: the prediction)
    python bench/gpu_suite.py --reduced       # CPU, tiny models: what CI runs (tests/pool/test_gpu_suite.py)
    bash scripts/device_run.sh part1|part2    # on the device tool's GPU, from the kit (docs/doctor.md)

Why one command: GPUs are lent to few sessions, so the first minutes of such a session should produce the
project's GPU evidence without reading code. Every section writes what it measured even when another fails.

Sections (--sections to pick), in the order they run - what only a GPU can answer first:
- session: a real session on the device side by side with KSampler (bench/gpu_session.py), ComfyUI imported with
  DynamicVRAM on as its main.py does on NVIDIA: the KSampler -> pool switch, Hybrid Sampler and Parallel Model vs
  KSampler's latent, a LoRA strength change, two experts alternating, ComfyUI's models freed beside a rank, Unload.
- native: degree 1 through the pool against KSampler in ComfyUI's own process at real sizes with random weights
  (Flux.1 12B bf16 and fp8, Wan 2.1 14B fp8 at 480p x 33 frames): cold first prompt, warm seconds per step,
  peak device memory of the whole machine's GPU (ComfyUI's share included), the two latents compared. Each row is
  a fresh process.
- quant: ComfyUI's quantized layouts on comfy-kitchen's kernels, pool vs KSampler (bench/gpu_quant.py).
- methods: every parallel method at world 2 through the real pool on ComfyUI's own (tiny) model, its ranks sharing
  the one GPU (parallel/staged.py: gloo through host copies - NCCL refuses two ranks per GPU), so the CUDA code of
  Ulysses, ring, CFG, DP, TP, PipeFusion, DistriFusion, loop mode and Parallel VAE Decode runs end to end.
- kernels: every attention kernel with log-sum-exp that ring attention may pick on this device, fp32/bf16/fp16,
  on contiguous and strided (after Ulysses) inputs, against float64 (doctor/kernels.py).
- cost: the cost model's compute for one forward (parallel/costmodel.py, the device's preset) against a measured
  forward of the same model in ComfyUI's process (measured inside `native`).
Results: bench/results/gpu_suite.{json,md} (reduced: gpu_suite_reduced.*, or --out DIR).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# In the order only a GPU can answer them (a run cut at its limit keeps what finished: each section's results are
# written the moment it ends): ComfyUI 0.33's DynamicVRAM session, real sizes, quantized kernels, every method on
# the one GPU, kernels; `cost` rows are measured inside `native`'s KSampler processes.
SECTIONS = ("session", "native", "quant", "methods", "kernels", "cost")

# name -> (family, builder kwargs, latent shape, conditioning (tokens, width, pooled width), steps)
# Flux: tiny_checkpoints fixes hidden 3072 / 24 heads; 19 double + 38 single blocks is Flux.1's 12B. Wan 2.1 14B:
# dim 5120, ffn 13824, 40 layers (40 heads), 480p x 33 frames = a (9, 60, 104) latent.
FULL_MODELS = {
    "flux12b": ("flux", dict(depth=19, depth_single=38), (1, 16, 128, 128), (256, 32, 24), 4),
    "wan14b": ("wan", dict(dim=5120, ffn_dim=13824, num_layers=40), (1, 16, 9, 60, 104), (512, 4096, 0), 2),
}
FULL_RUNS = (("flux12b", "bf16"), ("flux12b", "fp8_e4m3fn"), ("wan14b", "fp8_e4m3fn"))
REDUCED_MODELS = {"sd3_tiny": ("sd3", dict(depth=2, pos_embed_max_size=32), (1, 16, 24, 24), (7, 32, 24), 2)}
REDUCED_RUNS = (("sd3_tiny", "fp32"), ("sd3_tiny", "fp8_e4m3fn"))
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8_e4m3fn": "float8_e4m3fn"}


def _torch():
    import torch
    return torch


def _session():
    sys.path.insert(0, str(HERE))
    import gpu_session
    return gpu_session


def _quant():
    sys.path.insert(0, str(HERE))
    import gpu_quant
    return gpu_quant


def _comfy(cuda: bool):
    """ComfyUI as a library (its GPU when there is one), and its `nodes` module (KSampler's common_ksampler)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from comfyui_hybrid_parallel.doctor.machine import find_comfyui, import_comfyui
    comfy_dir = find_comfyui()
    if comfy_dir is None:
        raise RuntimeError("ComfyUI not found: set COMFYUI_DIR (or run scripts/setup_comfyui.sh)")
    import_comfyui(comfy_dir, cpu=not cuda, dynamic_vram=cuda)  # as ComfyUI's main.py on an NVIDIA GPU
    import importlib.util
    spec = importlib.util.spec_from_file_location("nodes", comfy_dir / "nodes.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- kernels, methods
def run_kernels(cuda: bool, reduced: bool) -> list:
    torch = _torch()
    from comfyui_hybrid_parallel.doctor.kernels import check_kernels
    devices = [torch.device("cuda", 0)] if cuda else [torch.device("cpu")]
    return check_kernels(devices, quick=reduced)


EXACT = 1e-5  # the pack's bound for exact methods; degree 1 is expected bitwise (0)
GPU_PRECISIONS = ("fp32", "bf16", "fp8_e4m3fn_fast")  # bitwise-checkable, what GPUs run, fp8 matmuls (Hopper)


def full_methods() -> tuple:
    """(meshes, precisions) the methods section runs on one GPU: every method at world 2 (its ranks share the GPU;
    larger worlds add no code path a shared GPU could show), in GPU_PRECISIONS."""
    from comfyui_hybrid_parallel.doctor.methods import MESHES
    return sum(1 for m in MESHES if m.world <= 2), len(GPU_PRECISIONS)


def session_full():
    return _session().FULL


def run_methods(cuda: bool, reduced: bool) -> list:
    torch = _torch()
    _comfy(cuda)
    from comfyui_hybrid_parallel.doctor.cli import default_precisions
    from comfyui_hybrid_parallel.doctor.methods import check_methods, meshes_for
    gpus = torch.cuda.device_count() if cuda else 0
    plan = meshes_for(gpus, 0 if cuda else 2, quick=True, share=True)
    precisions = list(GPU_PRECISIONS) if cuda else \
        default_precisions(argparse.Namespace(precisions=None, quick=True), cuda)
    if cuda and torch.cuda.get_device_capability(0) < (8, 9):
        precisions[-1] = "fp8_e4m3fn"  # no fp8 matmuls before Ada: ComfyUI's fp8 weights, cast per layer
    with tempfile.TemporaryDirectory(prefix="hp-gpu-suite-") as tmp:
        return check_methods(plan, precisions, Path(tmp), progress=print, share_devices=True)


# ---------------------------------------------------------------- native (one fresh process per row)
class _PeakMemory:
    """The device's used memory (all processes: ComfyUI, the workers), sampled every 20 ms; peak minus the start."""

    def __init__(self, cuda: bool):
        self.cuda, self.peak, self.base, self._stop = cuda, 0, 0, threading.Event()
        if cuda:
            self.base = self._used()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def _used(self) -> int:
        free, total = _torch().cuda.mem_get_info(0)
        return total - free

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._used())

    def stop(self):
        self._stop.set()
        return max(0, self.peak - self.base) if self.cuda else None


def _checkpoint(name: str, spec, precision: str, folder: Path) -> Path:
    """The model's random-weight checkpoint in ComfyUI's format (written once; fp8 runs load the bf16 file with
    UNETLoader's fp8 weight_dtype, as users do, except Wan 14B, stored fp8 as distributed)."""
    torch = _torch()
    from comfyui_hybrid_parallel.doctor import tiny_checkpoints as tc
    family, kwargs, *_ = spec
    stored = "fp8" if family == "wan" and name == "wan14b" else "bf16" if family == "flux" else "fp32"
    path = folder / f"{name}_{stored}.safetensors"
    if not path.exists():
        dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}[stored]
        writer = {"flux": tc.write_flux, "wan": tc.write_wan, "sd3": tc.write_sd3}[family]
        gpu = {"device": "cuda"} if _torch().cuda.is_available() and family != "sd3" else {}  # 12B in seconds
        writer(path, seed=3, dtype=dtype, **gpu, **kwargs)
    return path


def pool_nodes(cuda: bool, **widgets) -> tuple:
    """(runtime, hp): one Runtime shared by the pack's nodes, as its entry point wires them, and Parallel Config's
    value for `widgets` over degree 1 on this device - what each section's process samples the pool with."""
    from comfyui_hybrid_parallel.nodes.config_node import ParallelConfigNode
    from comfyui_hybrid_parallel.nodes.model_node import ParallelModel
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
    runtime = HybridSampler.runtime = ParallelConfigNode.runtime = ParallelModel.runtime = Runtime()
    degrees = dict(dp_degree=1, cfg_degree=1, ulysses_degree=1, ring_degree=1, pp_degree=1, num_pipeline_patch=0,
                   warmup_steps=1, tp_degree=1, method="usp", attention="auto", device="cuda" if cuda else "cpu")
    return runtime, ParallelConfigNode().build(**{**degrees, **widgets})["result"][0]


def rel(a, b) -> float:
    """How far latent `a` is from the reference `b`: max abs difference over b's max abs (0.0: bitwise)."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def sampler_inputs(family: str, latent_shape, conditioning) -> tuple:
    """(positive conditioning, empty latent) for a sampler call: random text tokens (tokens, width) and, where the
    family has one, a pooled vector; Flux's guidance."""
    torch = _torch()
    tokens, width, pooled = conditioning
    g = torch.Generator().manual_seed(0)
    extra = {"pooled_output": torch.randn(1, pooled, generator=g)} if pooled else {}
    if family == "flux":
        extra["guidance"] = 3.5
    return [[torch.randn(1, tokens, width, generator=g), extra]], {"samples": torch.zeros(*latent_shape)}


def native_child(args) -> dict:
    """One cold first prompt (load + sample) and a warm one, KSampler (ranks 0) or the pool at degree 1."""
    torch = _torch()
    cuda = torch.cuda.is_available() and not args.reduced
    t_start = time.perf_counter()
    comfy_nodes = _comfy(cuda)
    import comfy.sd
    family, _, latent_shape, conditioning, steps = (REDUCED_MODELS if args.reduced else FULL_MODELS)[args.model]
    cond, latent = sampler_inputs(family, latent_shape, conditioning)
    dtype = getattr(torch, DTYPES[args.precision])
    memory = _PeakMemory(cuda)
    t0 = time.perf_counter()
    model = comfy.sd.load_diffusion_model(args.ckpt, model_options={"dtype": dtype})
    load_s = time.perf_counter() - t0
    runtime = None
    if args.ranks == 0:
        def sample():
            return comfy_nodes.common_ksampler(model, 1, steps, 1.0, "euler", "simple", cond, cond, latent)[0]
    else:
        from comfyui_hybrid_parallel.nodes.sampler_node import HybridSampler
        runtime, hp = pool_nodes(cuda)

        def sample():
            return HybridSampler().sample(model, 1, steps, 1.0, "euler", "simple", cond, cond, latent, hp)[0]
    out = sample()
    first_s = time.perf_counter() - t0
    if args.save:
        from safetensors.torch import save_file
        save_file({"samples": out["samples"].float().cpu().contiguous()}, args.save)
    t1 = time.perf_counter()
    sample()
    warm_step_s = (time.perf_counter() - t1) / steps
    row = {"model": args.model, "precision": args.precision, "sampler": "KSampler" if args.ranks == 0 else
           "Hybrid d1", "steps": steps, "latent": list(latent_shape), "load_s": round(load_s, 2),
           "first_s": round(first_s, 2), "warm_step_s": round(warm_step_s, 4),
           "process_s": round(time.perf_counter() - t_start, 2), "peak_device_bytes": memory.stop(),
           "finite": bool(out["samples"].isfinite().all())}
    if args.ranks == 0:
        row["cost"] = _cost_row(model, latent_shape, cond, cuda)
    if runtime is not None:
        runtime.stop()
    print("ROW " + json.dumps(row), flush=True)
    return row


def _cost_row(patcher, latent_shape, cond, cuda: bool) -> dict:
    """One forward of the diffusion model in this process against the cost model's compute for it (degree 1), with
    the conditioning the sampler was given."""
    torch = _torch()
    from comfyui_hybrid_parallel.parallel import ParallelConfig
    from comfyui_hybrid_parallel.parallel import costmodel as cm
    import comfy.model_management as mm
    mm.load_models_gpu([patcher])
    base = patcher.model
    dm = base.diffusion_model
    device = mm.get_torch_device()
    dtype = base.manual_cast_dtype or dm.dtype
    shape = cm.shape_from_module(dm, act_bytes=2 if dtype in (torch.bfloat16, torch.float16) else 4)
    tokens = shape.tokens(latent_shape)
    context, extra = cond[0]
    text = context.shape[1]
    x = torch.randn(*latent_shape, device=device, dtype=dtype)
    kw = {"context": context.to(device, dtype)}
    if "pooled_output" in extra:
        kw["y"] = extra["pooled_output"].to(device, dtype)
    if "guidance" in extra and getattr(getattr(dm, "params", None), "guidance_embed", False):
        kw["guidance"] = torch.full((1,), float(extra["guidance"]), device=device)
    t = torch.full((1,), 0.5 if shape.family == "flux" else 500.0, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def forward():
        with torch.no_grad():
            dm(x, t, transformer_options={}, **kw)
        sync()
    forward()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        forward()
        times.append(time.perf_counter() - t0)
    measured = min(times)
    if cuda:
        name = torch.cuda.get_device_name(0)
        preset = cm.PRESETS["h100-nvlink"] if "H100" in name else None
    else:
        preset = cm.scaled_to(cm.CPU_EPYC_2, cm.probe_cpu(torch.get_num_threads())).with_cores(1)
    row = {"family": shape.family, "blocks": shape.blocks, "tokens": tokens, "text": text,
           "measured_s": round(measured, 5), "measured_per_block_s": round(measured / shape.blocks, 6)}
    if preset is not None:
        pred = cm.predict_step_s(shape, tokens, 1, ParallelConfig(), preset, text=text)
        model_s = pred["compute_s"] + pred["attention_s"] + pred["fixed_s"]
        row.update(preset=preset.name, predicted_s=round(model_s, 5), measured_over_predicted=round(measured / model_s, 3))
    else:
        row["preset"] = f"none for {torch.cuda.get_device_name(0)}"
    return row


def run_native(cuda: bool, reduced: bool, folder: Path) -> list:
    models = REDUCED_MODELS if reduced else FULL_MODELS
    _comfy(cuda)
    rows = []
    for name, precision in (REDUCED_RUNS if reduced else FULL_RUNS):
        ckpt = _checkpoint(name, models[name], precision, folder)
        for ranks in (0, 1):
            save = folder / f"out_{name}_{precision}_{ranks}.safetensors"
            cmd = [sys.executable, str(Path(__file__)), "--child", "--model", name, "--precision", precision,
                   "--ranks", str(ranks), "--ckpt", str(ckpt), "--save", str(save)] + (["--reduced"] if reduced else [])
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            got = [json.loads(line[4:]) for line in res.stdout.splitlines() if line.startswith("ROW ")]
            if res.returncode or not got:
                rows.append({"model": name, "precision": precision, "sampler": "Hybrid d1" if ranks else "KSampler",
                             "error": (res.stdout[-1500:] + res.stderr[-3000:]).strip()})
            else:
                rows.append(got[0])
                if ranks:  # degree 1 through the pool vs KSampler's latent (separate processes, same inputs)
                    rows[-1]["rel_vs_ksampler"] = _rel_files(save, folder / f"out_{name}_{precision}_0.safetensors")
            print(rows[-1], flush=True)
    return rows


def _rel_files(a: Path, b: Path):
    if not (a.exists() and b.exists()):
        return None
    from safetensors.torch import load_file
    return rel(load_file(str(a))["samples"], load_file(str(b))["samples"])


# ---------------------------------------------------------------- report
def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def markdown(report: dict) -> str:
    lines = ["# GPU suite" + (" (reduced, CPU)" if report["reduced"] else ""), "",
             f"Machine: {report['meta'].get('device')}, torch {report['meta'].get('torch')}, "
             f"{report['meta'].get('when')}; {report['seconds']:.0f} s.", ""]
    from comfyui_hybrid_parallel.doctor.kernels import kernel_table
    from comfyui_hybrid_parallel.doctor.methods import method_table
    if report.get("kernels"):
        lines += ["## Attention kernels with LSE", "", "```", kernel_table(report["kernels"]), "```", ""]
    if report.get("methods"):
        lines += ["## Every method through the pool, ranks sharing the device (staged gloo)", "", "```",
                  method_table(report["methods"]), "```", ""]
    native = report.get("native") or []
    if native:
        lines += ["## Degree 1 through the pool vs KSampler in ComfyUI's process", "",
                  "| model | weights | sampler | load s | first prompt s | warm s/step | vs KSampler | peak device GiB |",
                  "|---|---|---|---|---|---|---|---|"]
        ref = {}
        for r in native:
            if "error" in r:
                lines.append(f"| {r['model']} | {r['precision']} | {r['sampler']} | error: "
                             f"{r['error'].splitlines()[-1][:120] if r['error'] else ''} | | | | |")
                continue
            key = (r["model"], r["precision"])
            ratio = "" if r["sampler"] == "KSampler" or key not in ref else \
                f"{r['warm_step_s'] / ref[key]['warm_step_s']:.3f}x step, {r['first_s'] / ref[key]['first_s']:.2f}x " \
                f"first; latent rel {r.get('rel_vs_ksampler', float('nan')):.1e}"
            if r["sampler"] == "KSampler":
                ref[key] = r
            lines.append(f"| {r['model']} | {r['precision']} | {r['sampler']} | {r['load_s']} | {r['first_s']} | "
                         f"{r['warm_step_s']} | {ratio} | {_gib(r.get('peak_device_bytes'))} |")
        costs = [r["cost"] for r in native if r.get("cost")]
        if costs:
            lines += ["", "## Cost model: one forward measured vs predicted (degree 1)", "",
                      "| family | blocks | tokens | measured s | per block s | predicted s | measured / predicted | preset |",
                      "|---|---|---|---|---|---|---|---|"]
            for c in costs:
                lines.append(f"| {c['family']} | {c['blocks']} | {c['tokens']} | {c['measured_s']} | "
                             f"{c['measured_per_block_s']} | {c.get('predicted_s', '-')} | "
                             f"{c.get('measured_over_predicted', '-')} | {c['preset']} |")
    if report.get("session"):
        lines += [""] + _session().markdown(report["session"])
    if report.get("quant"):
        lines += [""] + _quant().markdown(report["quant"])
    for section, err in (report.get("errors") or {}).items():
        lines += ["", f"## {section}: failed", "", "```", err[-3000:], "```"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reduced", action="store_true", help="CPU, tiny models (CI)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help="results folder (default bench/results)")
    ap.add_argument("--plan", action="store_true", help="print each section's predicted seconds on an H100 and exit")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model"), ap.add_argument("--precision"), ap.add_argument("--ckpt")
    ap.add_argument("--ranks", type=int, default=0)
    ap.add_argument("--save")
    args = ap.parse_args(argv)
    if args.child:
        native_child(args)
        return 0
    if args.plan:
        sys.path.insert(0, str(HERE))
        import gpu_plan
        print(gpu_plan.table(gpu_plan.predict(sys.modules[__name__])))
        return 0
    torch = _torch()
    cuda = torch.cuda.is_available() and not args.reduced
    if not cuda and not args.reduced:
        print("no CUDA device here: run with --reduced (CPU, tiny models)", file=sys.stderr)
        return 2
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        print(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}", file=sys.stderr)
        return 2
    sys.path.insert(0, str(HERE))
    from _worlds import machine_info
    t0 = time.perf_counter()
    report = {"meta": machine_info(), "reduced": args.reduced, "errors": {}}
    folder = Path(tempfile.mkdtemp(prefix="hp-gpu-suite-ckpt-"))
    runs = {"kernels": lambda: run_kernels(cuda, args.reduced), "methods": lambda: run_methods(cuda, args.reduced),
            "native": lambda: run_native(cuda, args.reduced, folder),
            "session": lambda: _session().run_session(cuda, args.reduced, folder),
            "quant": lambda: _quant().run_quant(cuda, args.reduced, folder)}
    if "cost" in sections and "native" not in sections:
        sections.append("native")  # the cost rows are measured in the KSampler processes of `native`
    out = Path(args.out) if args.out else HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    name = "gpu_suite_reduced" if args.reduced else "gpu_suite"

    def write():
        report["seconds"] = time.perf_counter() - t0
        (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
        text = markdown(report)
        (out / f"{name}.md").write_text(text + "\n")
        return text
    report["section_seconds"] = {}
    for section in SECTIONS:
        if section in sections and section in runs:
            print(f"\n== {section} ==", flush=True)
            ts = time.perf_counter()
            try:
                report[section] = runs[section]()
            except Exception:  # noqa: BLE001 - a failing section is reported; the others still run
                report["errors"][section] = traceback.format_exc()
                print(report["errors"][section], file=sys.stderr)
            report["section_seconds"][section] = round(time.perf_counter() - ts, 1)
            write()  # a run cut at its time limit still returns every section that finished
    print(write())
    failed = [r for s in ("kernels", "methods") for r in report.get(s) or [] if not r.get("ok")]
    failed += [r for r in report.get("native") or [] if "error" in r or not r.get("finite", True)
               or (r.get("rel_vs_ksampler") or 0) > EXACT]
    failed += [r for r in report.get("session") or [] if "error" in r
               or any((r.get(k) or 0) > EXACT for k in ("hybrid_rel", "parallel_model_rel", "lora_rel"))]
    failed += [r for r in report.get("quant") or [] if "error" in r or not r.get("finite", True)
               or r["rel"] > EXACT]
    return 1 if failed or report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
