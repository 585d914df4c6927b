"""What every benchmark shares: worlds of processes, the device they run on, machine facts, result files.

Benchmarks run their bodies on real process groups with the tests' harness
(tests/dist_harness.DistPool), but the worlds are started here so that the same
script picks NCCL and one GPU per rank when CUDA is there and gloo on CPU
otherwise - the bench scripts never name a device themselves. Each rank uses
one CPU thread: on CPU, "2 workers x 1 thread vs 1 worker x 1 thread" is the
scaling question, and on GPU the thread count does not matter.

Every result file carries `machine_info()` so a number is never separated from
the machine (CPU model, cores, torch, device, backend) that produced it.

The models are ComfyUI's own diffusion-model classes (what the workers run): tests/tiny_models.py builds the
test sizes; `comfy_model`, `mmdit` and `flux` below build the bigger ones the benches want the same way - on
"meta" with ComfyUI's ops, then the tiny checkpoints' seeded values (doctor/tiny_weights.py), so every rank of a
world builds the same weights.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from dist_harness import DistPool as _HarnessPool, DistFailure  # noqa: E402,F401
from dist_harness import context_for as _harness_context_for  # noqa: E402
import tiny_models  # noqa: E402,F401

RESULTS = os.path.join(HERE, "results")


class DistPool(_HarnessPool):
    """The harness's pool (failures and hangs become errors with tracebacks) on the device's backend."""

    def __init__(self, world_size: int, collective_timeout_s: float = 300.0):
        super().__init__(world_size, collective_timeout_s, backend="auto")


def bench_device():
    """This process's device: its GPU under NCCL, else the CPU."""
    import torch
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if not (dist.is_available() and dist.is_initialized()) and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def context_for(config):
    """The ParallelContext for `config` in this rank, created once per mesh, on bench_device()."""
    return _harness_context_for(config, device=bench_device())


def comfy_model(make, seed: int = 0):
    """`make(ops)` (ComfyUI's class built on device "meta" with those ops) given seeded values (nothing at zero), in
    eval mode on the CPU; ComfyUI set up first (a rank of a world imports it as a worker does: tests/comfy_env)."""
    return tiny_models.seeded(make, seed)


def mmdit(depth: int, blocks: int | None = None, in_channels: int = 16, context: int = 64, pooled: int = 32,
          pos_embed_max_size: int = 32, seed: int = 0, dtype=None):
    """ComfyUI's SD3-medium-style MMDiT (OpenAISignatureMMDITWrapper: no qk norm, no image-only attn2): hidden
    64·depth in `depth` heads of 64 (ComfyUI ties them), `blocks` joint blocks (default depth), patch 2."""
    def make(ops):
        from comfy.ldm.modules.diffusionmodules.mmdit import OpenAISignatureMMDITWrapper
        return OpenAISignatureMMDITWrapper(
            in_channels=in_channels, patch_size=2, out_channels=in_channels, depth=depth, num_blocks=blocks,
            input_size=None, adm_in_channels=pooled,
            context_embedder_config={"target": "torch.nn.Linear",
                                     "params": {"in_features": context, "out_features": 64 * depth}},
            num_patches=pos_embed_max_size ** 2, pos_embed_max_size=pos_embed_max_size, operations=ops,
            device="meta", dtype=dtype)
    return comfy_model(make, seed)


def flux(heads: int, head_dim: int, double: int, single: int, axes_dim, in_channels: int = 16, context: int = 64,
         pooled: int = 32, guidance: bool = False, seed: int = 0, dtype=None):
    """ComfyUI's Flux (Flux.1 layout: patch 2 inside the model, so in_channels·4 per token; mlp ratio 4, qkv bias):
    `heads` x `head_dim` (sum(axes_dim) == head_dim), `double` double-stream and `single` single-stream blocks."""
    def make(ops):
        from comfy.ldm.flux.model import Flux, FluxParams
        from comfyui_hybrid_parallel.doctor.tiny_checkpoints import detected
        return Flux(image_model="flux", in_channels=in_channels, out_channels=in_channels, vec_in_dim=pooled,
                    context_in_dim=context, hidden_size=heads * head_dim, mlp_ratio=4.0, num_heads=heads,
                    depth=double, depth_single_blocks=single, axes_dim=list(axes_dim), theta=10000, patch_size=2,
                    qkv_bias=True, guidance_embed=guidance, operations=ops, device="meta", dtype=dtype,
                    **detected(FluxParams, txt_ids_dims=[]))
    return comfy_model(make, seed)


def sync(device) -> None:
    """Wait for the device (timings on CUDA are otherwise launch times)."""
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    try:
        import flash_attn  # noqa: F401
        flash = getattr(flash_attn, "__version__", "yes")
    except ImportError:
        flash = None
    info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "device": f"cuda: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}" if cuda else "cpu",
            "backend": "nccl" if cuda and dist.is_nccl_available() else "gloo",
            "flash_attn": flash, "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "when": datetime.datetime.now().isoformat(timespec="seconds")}
    try:
        import diffusers
        info["diffusers"] = diffusers.__version__
    except ImportError:
        pass
    info["comfyui"] = _comfyui_version()
    return info


def _comfyui_version() -> str | None:
    """The version of the ComfyUI the tests and benches use (comfy_env.comfyui_dir), read from its
    comfyui_version.py without importing ComfyUI; None when there is none."""
    from comfy_env import comfyui_dir
    from comfyui_hybrid_parallel.workers.bridge.seams import comfyui_version
    path = comfyui_dir()
    return None if path is None else comfyui_version(str(path))


def write_results(name: str, rows: list, markdown: str, extra: dict | None = None) -> str:
    """bench/results/<name>.json (machine, rows, extra) and .md; prints the Markdown; returns the json path."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}.json")
    with open(path, "w") as f:
        json.dump({"meta": machine_info(), "rows": rows, **(extra or {})}, f, indent=1, default=str)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    return path


def timed_prompt(server, graph) -> float:
    """Seconds from posting an API prompt to a real server until its history says it succeeded (client side)."""
    import time
    t = time.perf_counter()
    entry = server.run(graph)
    took = time.perf_counter() - t
    if entry["status"]["status_str"] != "success":
        raise RuntimeError(f"prompt failed: {entry['status']}\n{server.tail()}")
    return took
