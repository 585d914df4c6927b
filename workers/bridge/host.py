"""ComfyUI's process as the pool meets it: its host copy of the weights, its model management, its GPUs.

Why here (the bridge): every function below reads or changes ComfyUI's own state - the storages of the tensors it
holds, its list of loaded models, DynamicVRAM's patcher, its `--cuda-device` flag, its interrupt and unload - and
breaks first when ComfyUI moves; the pool's runtime (workers/driver/runtime.py) only calls them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import threading

import torch

from .loader_types import describe, host_tensors, raw, rebuild

TRIM_EVERY_BYTES = 256 << 20  # the adopter gives freed heap back at least this often (an eighth of a smaller model)


def trim_host_heap(collect: bool = True) -> None:
    """Give freed heap memory back to the OS (glibc's malloc_trim): ComfyUI's weights, once the mapped pages replace
    them, were freed into the heap - glibc raises its mmap threshold after large frees, so big tensors often live
    on the heap, whose free memory stays in the process until trimmed. A no-op elsewhere.
    `collect`: run the garbage collector first (what a reference cycle held); the adopter's caller frees by
    reference count alone and skips it - a full collection in a ComfyUI process costs 0.2 s."""
    if collect:
        gc.collect()
    name = ctypes.util.find_library("c")  # (cached by ctypes: cheap enough to call every few hundred MiB)
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:
        pass


def adopter(module: torch.nn.Module, skip: set = frozenset()):
    """adopt(name, mapped) for pool.ensure_model: ComfyUI's own host tensor `name` of `module` takes the mapped
    pages of the file just written for the workers (copy-on-write: ComfyUI writing into it - an in-place LoRA
    patch - gets private pages, the workers never see it). ComfyUI's copy and every local rank's are then one set of
    pages, freed tensor by tensor as they are written; a tensor ComfyUI keeps on a GPU is left alone, and so is one
    ComfyUI holds as its mapping of the checkpoint file (`file_backed`: DynamicVRAM's zero-copy loader, ComfyUI 0.33) -
    those pages are the file's, which the kernel drops under memory pressure and ComfyUI reads back from the file
    itself; the workers' copy would only take their place with pages nothing can drop."""
    targets = {k: v for k, v in host_tensors(module).items() if k not in skip}  # skip: ComfyUI's hooked tensors
    owners = dict(module.named_modules())
    lock = threading.Lock()
    freed = [0]  # bytes let go since the heap was last trimmed
    total = sum(t.numel() * t.element_size() for t in targets.values())
    every = max(32 << 20, min(TRIM_EVERY_BYTES, total // 8))

    def adopt(name: str, mapped: torch.Tensor) -> None:
        t = targets.pop(name, None)  # held here no longer: ComfyUI's old tensor is freed as soon as it is replaced
        if t is None or t.device.type != "cpu" or file_backed(t):
            return
        try:
            _adopt(name, t, mapped)
        finally:
            nbytes = t.numel() * t.element_size()
            del t
            with lock:
                freed[0] += nbytes
                trim = freed[0] >= every
                freed[0] = 0 if trim else freed[0]
            if trim:  # the old tensors went to the heap: give them back while the rest is written, not at the end
                trim_host_heap(collect=False)

    def _adopt(name: str, t: torch.Tensor, mapped: torch.Tensor) -> None:
        r = raw(t)  # a loader's tensor (GGUF) is compared by its bytes and rebuilt around the mapped ones
        if r.dtype != mapped.dtype or r.shape != mapped.shape:
            return
        if type(mapped) is not type(t):  # the loader's tensor, as ComfyUI holds it now (its patcher state included)
            mapped = rebuild(mapped, describe(t, name))
            mapped.__dict__.update({k: v for k, v in vars(t).items() if not k.startswith("_")})
        path, _, leaf = name.rpartition(".")
        owner = owners.get(path)
        if owner is None:
            return
        # a new Parameter in the module's slot, as ComfyUI's own patching does (comfy.utils.set_attr_param):
        # tensors made under inference mode - a server loads checkpoints so - cannot have their .data swapped
        with lock:
            if leaf in owner._parameters and owner._parameters[leaf] is t:
                owner._parameters[leaf] = torch.nn.Parameter(mapped, requires_grad=False)
            elif leaf in owner._buffers and owner._buffers[leaf] is t:
                owner._buffers[leaf] = mapped
    adopt.done = lambda: trim_host_heap(collect=False)  # once every tensor is adopted; nothing cyclic was freed
    return adopt


def file_backed(t: torch.Tensor) -> bool:
    """Whether ComfyUI holds `t` as its mapping of the checkpoint file: ComfyUI 0.33's loader under DynamicVRAM
    (comfy.utils.load_safetensors) marks each such storage with the file slice it maps (`_comfy_tensor_file_slice`),
    which its dynamic loader also reads the weight from directly."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):  # a wrapper subclass without storage of its own
        return False
    return getattr(storage, "_comfy_tensor_file_slice", None) is not None


def comfy_gpus() -> dict:
    """The machine's GPUs as the workers will number them, and which one ComfyUI computes on: {} without CUDA.
    count: every GPU (with `--cuda-device N` ComfyUI hid the others from its process tree - undone for the workers,
    launch.worker_env - so they are counted with NVML); driver: ComfyUI's GPU in that numbering (the workers put
    their ranks elsewhere first); comfy_cuda_device: N."""
    if not torch.cuda.is_available():
        return {}
    try:
        import comfy.cli_args
        import comfy.model_management as mm
    except ImportError:  # the pool without ComfyUI (tests, scripts): torch's view
        return {"count": torch.cuda.device_count()}
    restricted = getattr(comfy.cli_args.args, "cuda_device", None)
    if restricted is not None and os.environ.get("CUDA_VISIBLE_DEVICES", "").strip() == str(restricted):
        try:
            count = int(torch.cuda._raw_device_count_nvml())
        except Exception:  # noqa: BLE001 - NVML unreadable: what this process sees
            count = -1
        count = count if count > 0 else torch.cuda.device_count()
        return {"count": count, "driver": int(restricted), "comfy_cuda_device": int(restricted)}
    device = mm.get_torch_device()
    driver = device.index if getattr(device, "type", None) == "cuda" else None
    if driver is None and getattr(device, "type", None) == "cuda":
        driver = torch.cuda.current_device()
    return {"count": torch.cuda.device_count(), "driver": driver}


def free_beside_comfy(pool, config, nbytes: int, gpus: dict) -> bool:
    """When a rank of `config`'s world sits on ComfyUI's own GPU, ComfyUI's models there make room first (its model
    management unloads what it can and empties its cache) before `nbytes` of weights load beside them. True when it
    asked."""
    driver = gpus.get("driver")
    w = pool.world
    if driver is None or w is None or f"cuda:{driver}" not in (w.devices or []):
        return False
    import comfy.model_management as mm
    device = mm.get_torch_device()
    mm.free_memory(nbytes, device)
    mm.soft_empty_cache()
    return True


def take_over_from_dynamic_vram(patcher) -> int:
    """Before ComfyUI loads `patcher` - the pool's host clone of a MODEL (workers/bridge/prepare.host_clone) - for a run,
    where ComfyUI's DynamicVRAM patcher (ModelPatcherDynamic, ComfyUI 0.33) holds the same model too: unload its loaded
    dynamic copies through ComfyUI's model management, and where no host copy of ComfyUI's stayed loaded since, have
    ComfyUI unpatch the model (ModelPatcher.unpatch_model) so that its load patches it afresh. Returns how many dynamic
    copies it unloaded; does nothing to a model no ModelPatcherDynamic ever held (ComfyUI 0.3.x,
    --disable-dynamic-vram).

    Why: ComfyUI loading the host clone drops a dynamic copy from its loaded models as a clone of the same model
    (load_models_gpu), but without unloading it (ModelPatcher.detach without unpatching): its VBAR (the weights it keeps
    on the GPU) and its force-loaded layers would stay there beside the workers, out of ComfyUI's list of loaded
    models - no later unload of ComfyUI's (free_memory, Unload models) would reach them. ComfyUI's own unload of a
    loaded model (LoadedModel.model_unload, what free_memory runs on each model it unloads) frees the VBAR and the
    pinned buffers and puts back the weights it replaced; the entry then leaves ComfyUI's loaded models, as
    free_memory removes it.
    And a dynamic load begins by putting back every weight a patcher replaced (restore_loaded_backups), while the
    layers a host load patched keep their "patched" flag (comfy_patched_weights): the next host load of the same
    patches would skip them and the workers would get unpatched weights, silently. A host copy still loaded means no
    other load came between; otherwise the unpatch clears the flags (and puts back any weight still replaced)."""
    import comfy.model_management as mm
    weights = getattr(patcher, "model", None)
    if not hasattr(weights, "dynamic_pins"):  # what every ModelPatcherDynamic sets on the model it holds
        return 0
    loaded = mm.current_loaded_models
    mine = [lm for lm in list(loaded)
            if lm.model is not None and not lm.is_dead() and getattr(lm.model, "model", None) is weights]
    dynamic = [lm for lm in mine if _held_dynamically(lm.model)]
    for lm in dynamic:
        lm.model_unload()
        for i, other in enumerate(loaded):
            if other is lm:
                loaded.pop(i)
                break
    if dynamic:
        mm.soft_empty_cache()
    if len(dynamic) == len(mine):  # no host copy of ComfyUI's is loaded: another load may have come between
        patcher.unpatch_model(patcher.offload_device, unpatch_weights=True)
    return len(dynamic)


def _held_dynamically(patcher) -> bool:
    probe = getattr(patcher, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def interrupt_comfy() -> None:
    """ComfyUI's interrupt, as its button sends it (the running prompt ends as interrupted); nothing without ComfyUI
    (the pool in tests)."""
    try:
        import comfy.model_management
    except ImportError:
        return
    comfy.model_management.interrupt_current_processing(True)


def on_comfy_unload(release) -> None:
    """Make ComfyUI's own unload (comfy.model_management.unload_all_models, which its /free route, the UI's "Unload
    models" and its out-of-memory handler call) call `release()` after it, once however often this is called."""
    import comfy.model_management as mm
    if getattr(mm.unload_all_models, "_hp_follows", False):
        return
    original = mm.unload_all_models

    def unload_all_models(*args, **kwargs):
        out = original(*args, **kwargs)
        try:
            release()
        except Exception as e:  # noqa: BLE001 - ComfyUI's own unload must never fail because of the pack
            logging.getLogger(__name__).warning("hybrid parallel: releasing the workers' models failed: %s", e)
        return out
    unload_all_models._hp_follows = True
    mm.unload_all_models = unload_all_models
