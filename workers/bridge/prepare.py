"""ComfyUI's side of preparing a run, before any worker starts: the MODEL the pool's runs sample (`host_clone`:
ComfyUI's copy stays on the host), the reads and refusals of what is on it (its patcher, MultiGPU CFG Split,
TorchCompileModel, a guider's inputs, the latent's shape, Skip Layer Guidance's layers) and the weight patches that
travel as patches (`portable_patches`, `patches_on_workers`). The driver room sequences them into a run's plan
(workers/driver/plan.py)."""
from __future__ import annotations

import math
import uuid
from contextlib import contextmanager

from ...parallel.models import adapter_for
from .fbcache import first_block_rule
from .loader_types import NotCarriable, describe_patcher
from .patches import NotPortable, encode
from .residency import weights_key
from .sampling import APPLY_MODEL, wrappers_of
from .spec import (NotCarried, check_any_model, check_attention_requests, check_declared, check_loader_methods,
                   check_native_grid, check_native_pipefusion, check_native_tp, check_weights)

WRAPPER_KEY = "comfyui_hybrid_parallel"  # the pack's own wrappers on a MODEL (capture.OWN_KEY says the same)


def is_dynamic(model) -> bool:
    """Whether ComfyUI holds this MODEL with its DynamicVRAM patcher (ComfyUI 0.33's ModelPatcherDynamic, the default
    on NVIDIA with torch >= 2.8); False on a ComfyUI without it."""
    probe = getattr(model, "is_dynamic", None)
    return bool(probe()) if callable(probe) else False


def host_clone(model):
    """A clone of `model` that ComfyUI loads to its offload device (the host) only: the MODEL the pool's runs sample.

    Why: ComfyUI's sampling calls load_models_gpu on the MODEL it samples, which would otherwise put a second copy of
    the diffusion model on cuda:0 beside rank 0's. Loaded to the offload device, ComfyUI still applies the weight
    patches (LoRA) there where they cannot travel as patches (portable_patches), and those patched weights travel.

    ComfyUI 0.33's DynamicVRAM patcher (ModelPatcherDynamic) cannot be loaded to the host: it keeps per-device state
    (`dynamic_pins`) for its own load device only - ComfyUI's prompt bookkeeping (PromptModelTracker) and its loader
    read it under the patcher's load_device, a KeyError for the host - it reroutes a CPU patcher to the plain one
    itself, and it never writes weight patches into the weights (they are applied as each layer is cast on the GPU),
    so host weights read after its load would be unpatched. ComfyUI's own way to put such a model on the CPU
    (comfy_extras/nodes_multigpu.py) is a non-dynamic clone, `clone(disable_dynamic=True)`. It is made over the same
    model object (`model_override`, as get_non_dynamic_delegate passes its own): otherwise ComfyUI would load the
    checkpoint a second time (and fail for a loader that records no cached_patcher_init), and the pool identifies the
    weights by that object - a LoRA strength change then moves only the patch. ComfyUI treats the two patchers as
    clones of one model (ModelPatcher.is_clone): loading either unloads the other, and they share the weights'
    backups, so each puts back what the other patched."""
    check_clonable(model)
    if not is_dynamic(model):
        m = model.clone()
    else:
        import inspect
        try:
            params = inspect.signature(model.clone).parameters
        except (TypeError, ValueError):
            params = {}
        if not ({"disable_dynamic", "model_override"} <= set(params) and
                callable(getattr(model, "get_clone_model_override", None))):
            raise NotCarried(f"this MODEL's patcher ({type(model).__name__}) loads its weights dynamically "
                             f"(DynamicVRAM) and offers no non-dynamic clone to keep ComfyUI's copy on the host; "
                             f"start ComfyUI with --disable-dynamic-vram")
        m = model.clone(disable_dynamic=True, model_override=model.get_clone_model_override())
    m.load_device = m.offload_device
    return m


def check_clonable(model, base=None) -> None:
    """Refuse, before any work, a loader's patcher that this ComfyUI cannot clone: ComfyUI after 0.33 builds the
    clone as `type(model)(..., fast_disk=...)` (read in its model_patcher.py), which a subclass keeping the older
    `__init__` (ComfyUI-GGUF's patcher, before it followed) rejects with a TypeError mid-prompt. `base`: ComfyUI's
    ModelPatcher (a test's stand-in of the newer one)."""
    import inspect
    if base is None:
        import comfy.model_patcher as mp
        base = mp.ModelPatcher
    cls = type(model)
    if base not in cls.__mro__ or not any("__init__" in vars(c) for c in cls.__mro__[:cls.__mro__.index(base)]):
        return  # ComfyUI's own patcher, or a subclass that keeps ComfyUI's __init__

    def takes(fn) -> bool:
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            return True
        return "fast_disk" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    if takes(base.__init__) and not takes(cls.__init__):
        raise NotCarried(f"this MODEL's patcher {cls.__name__} (from {cls.__module__}) cannot be cloned on this ComfyUI: "
                         f"ComfyUI's clone() builds it with fast_disk=, which its __init__ does not take. Update the "
                         f"pack of the loader that made it (ComfyUI itself fails to clone it in any node)")


def check_not_on_pool(model, who: str) -> None:
    """A MODEL that already runs on the pool (Parallel Model) must not be wrapped again: each model call would
    go to the workers twice over."""
    if wrappers_of(model.wrappers, APPLY_MODEL).get(WRAPPER_KEY):
        raise ValueError(f"{who}: this MODEL already runs on the workers (it comes from a Parallel Model node); "
                         f"sample it with KSampler or any sampler node, or remove the Parallel Model node")


def check_not_multigpu(model, who: str) -> None:
    """ComfyUI's own MultiGPU CFG Split (node MultiGPU_WorkUnits, ComfyUI >= 0.23) gives the MODEL whole-model copies
    on other GPUs (additional models under "multigpu") and runs the cond / uncond batches on them in threads. The pack
    splits that same work over its workers: on one MODEL the two would send each model call to the pool from several
    threads at once, each on part of the batch. Refused before any work, saying which to keep."""
    getter = getattr(model, "get_additional_models_with_key", None)  # ComfyUI's seam (workers/bridge/seams.py)
    if getter is not None and getter("multigpu"):
        raise ValueError(
            f"{who}: this MODEL went through ComfyUI's MultiGPU CFG Split node, which already runs the cond / uncond "
            f"batch on whole-model copies on other GPUs. Use one of the two: remove MultiGPU CFG Split and keep "
            f"{who} (cfg_degree 2 is the same split; the pack also splits one image - cfg 1 and distilled models - "
            f"shards weights and runs video), or remove {who} to keep ComfyUI's split")


COMPILE_KEY = "torch.compile"  # ComfyUI's TorchCompileModel wrapper (comfy_api/torch_helpers/torch_compile.py)


def compile_spec(model, hp) -> dict | None:
    """ComfyUI's TorchCompileModel options on this MODEL, for the workers to compile their model with (None: not
    compiled). ComfyUI's own wrapper would swap in a compiled copy of the driver's model around each call: the nodes
    take it out (without_compile_wrapper) and the workers compile theirs instead, once per resident model and mesh.
    Refused, before any worker starts: a backend that is not a name (a callable cannot travel), and loop mode /
    PipeFusion, which run the model from the workers' own loop."""
    if not wrappers_of(model.wrappers, APPLY_MODEL).get(COMPILE_KEY):
        return None
    kw = dict(model.model_options.get("torch_compile_kwargs") or {})
    if not isinstance(kw.get("backend"), str):
        raise NotCarried(f"this MODEL is compiled with a torch.compile backend that is not a name "
                         f"({kw.get('backend')!r:.60}); the workers compile by name (inductor, cudagraphs...): use "
                         f"TorchCompileModel's own backends")
    if hp.config.pp_degree > 1 or hp.mode == "loop":
        raise NotCarried("a MODEL compiled by TorchCompileModel runs compiled in step mode only: set sampling_mode to "
                         "auto or step and pp_degree to 1, or remove the TorchCompileModel node")
    options = kw.get("options")
    if options is not None and not (isinstance(options, dict) and all(
            isinstance(k, str) and isinstance(v, (str, int, float, bool)) for k, v in options.items())):
        raise NotCarried(f"TorchCompileModel options {options!r:.80} cannot travel to the workers (plain values only)")
    return {"backend": kw["backend"], "options": options, "mode": kw.get("mode"),
            "fullgraph": bool(kw.get("fullgraph")), "dynamic": kw.get("dynamic")}


def without_compile_wrapper(patcher=None, model_options: dict | None = None) -> None:
    """Take ComfyUI's TorchCompileModel wrapper out of `patcher`'s wrappers (the pool's clone) or a run's
    `model_options` (a guider's): the workers compile their own model; the driver's compiled copy must never stand in
    for the pool's proxy."""
    wrappers = patcher.wrappers if patcher is not None else \
        (model_options or {}).get("transformer_options", {}).get("wrappers") or {}
    wrappers_of(wrappers, APPLY_MODEL).pop(COMPILE_KEY, None)


def guider_of(executor):
    """ComfyUI's guider (CFGGuider and its kin) an OUTER_SAMPLE wrapper's executor runs."""
    return executor.class_obj


def guider_run(guider) -> tuple:
    """(the patcher sampling now, its conds, the run's model options) of ComfyUI's guider in an OUTER_SAMPLE wrapper:
    maybe LoRA'd or patched after Parallel Model, so the run's capture is made from these."""
    return guider.model_patcher, guider.conds, guider.model_options


def guider_inputs(guider, args: tuple, kwargs: dict):
    """(latent shape, cfg, negative, positive) of a CFGGuider about to run outer_sample(noise, latent_image, ...):
    what degrees "auto" needs, read where a model patch sees them (Parallel Model). The conds are ComfyUI's
    converted lists of dicts; they go back to CONDITIONING form ([tensor, dict]) for text_tokens. DualCFGGuider
    keeps cfg1 / cfg2; BasicGuider has no negative."""
    latent = args[1] if len(args) > 1 else kwargs.get("latent_image")
    conds = getattr(guider, "conds", None) or getattr(guider, "original_conds", {}) or {}

    def as_conditioning(k):
        return [[c["cross_attn"], c] for c in conds.get(k) or [] if "cross_attn" in c] or None
    scales = [getattr(guider, n) for n in ("cfg", "cfg1", "cfg2") if isinstance(getattr(guider, n, None), (int, float))]
    cfg = next((c for c in scales if not math.isclose(float(c), 1.0)), 1.0)
    negative = as_conditioning("negative") or (conds.get("negative") and [[None, {}]]) or None
    return tuple(latent.shape), float(cfg), negative, as_conditioning("positive")


def check_latent(patcher, config, latent_shape) -> None:
    """What the latent's shape decides, for the MODEL's diffusion model (before any worker starts): PipeFusion's
    patches and stages, and a grid split's patch rows."""
    check_native_pipefusion(patcher.model.diffusion_model, config, latent_shape)
    check_native_grid(patcher.model.diffusion_model, config, latent_shape)


def adapter_of(model):
    """The family adapter (parallel/models) that declares this MODEL's diffusion model, or None."""
    return adapter_for(model.model.diffusion_model)


def check_family(model, hp) -> None:
    """What the family declares, refused before any worker starts: a model no adapter declares runs cfg / dp only,
    and tp / pp only where its family declares them."""
    check_any_model(model.model.diffusion_model, hp)
    check_declared(model.model.diffusion_model, hp.config)


def check_model_weights(model, config) -> None:
    """What this MODEL's weights allow, refused before any worker starts: a layout the workers cannot build, a
    checkpoint asking for its own attention kernel (newer ComfyUI), tp degrees the weights cannot be sharded by, a
    loader's weights (GGUF) under a method that cannot run them."""
    dm = model.model.diffusion_model
    check_weights(dm)
    check_attention_requests(dm)
    check_native_tp(dm, config)
    check_loader_methods(dm, config, patched=bool(model.patches))


def residency_names(model, extra: str, method: str) -> tuple:
    """(key, lineage) of this MODEL on the workers: the key names what the weights hold (base model, patches digest,
    `extra`: the compute dtype) under `method`; the lineage names this model under any patches (another version of
    it is replaced on the workers, not kept beside)."""
    return (f"native:{weights_key(model.model, model.patches, extra)}|{method}",
            f"{model.model._hp_uid}|{method}")


def first_block(model, hp, cap, compiled) -> dict | None:
    """First Block Cache's rule for the workers (workers/bridge/fbcache.py), refused before any worker starts where
    they cannot apply it exactly; None without the node. `cap`: the run's capture."""
    found = cap.carried("fbcache")
    if not found:
        return None
    try:
        return first_block_rule(found[-1].detail["function"], model.model.diffusion_model, hp.config,
                                compiled=bool(compiled)).message()
    except NotCarried as e:
        raise NotCarried(f"{cap.creator(found[-1])}: {e}") from None


def split_blocks(adapter) -> set:
    """The block indices the family's sequence plan hooks into ("blocks.0" splits the tokens): a block a replacement
    skips never runs its hooks."""
    found = set()
    for path in adapter.comfy_plan.sequence:
        last = path.rsplit(".", 1)[-1]
        if last.isdigit():
            found.add(int(last))
    return found


def skip_layers(fn) -> set:
    """The layer indices Skip Layer Guidance's function skips (its closure's double_layers / single_layers)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return set()
    found = set()
    for name, cell in zip(code.co_freevars, cells):
        if name in ("double_layers", "single_layers", "layers"):
            try:
                found |= {int(i) for i in cell.cell_contents}
            except (TypeError, ValueError):
                pass
    return found


def portable_patches(model, config):
    """(spec, tensors) of the MODEL's weight patches (LoRA, LoHa, LoKr, OFT, diffs) when they can travel to the
    workers and be applied there to the base weights (workers/bridge/patches.py): the ranks must hold the whole model
    (no tp / pp / weight sharding, which cut the weights before any patch could apply). None: no patches, or
    ComfyUI patches its own copy and the patched weights travel, as before."""
    if not model.patches or not config.whole_model:
        return None
    try:
        return encode(model.patches)
    except NotPortable:
        return None


def loader_patcher(model):
    """The MODEL's ModelPatcher class when a custom loader patches weights its own way (workers/bridge/loader_types.py),
    refused before any worker starts where the workers could not import it; None for ComfyUI's own."""
    try:
        return describe_patcher(model)
    except NotCarriable as e:
        raise NotCarried(f"this MODEL's patcher cannot be rebuilt on the workers: {e}") from None


@contextmanager
def patches_on_workers(patcher, on_workers: bool):
    """While ComfyUI samples `patcher`, leave its weights unpatched when the workers apply the patches themselves
    (`on_workers`: the run's plan sends them): no patched copy (and backup) on the host, and the base weights are what
    travels. A new patches_uuid makes
    ComfyUI restore the base weights if another sampler left them patched, and re-patch them for the next one."""
    if not on_workers:
        yield
        return
    saved = patcher.patches, patcher.patches_uuid
    patcher.patches, patcher.patches_uuid = {}, uuid.uuid4()
    try:
        yield
    finally:
        patcher.patches, patcher.patches_uuid = saved


