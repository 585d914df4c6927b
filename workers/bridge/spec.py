"""The driver's side of the ComfyUI-native path: what the workers need to run ComfyUI's own model.

ComfyUI built the MODEL's diffusion model from a `supported_models` config: its class, its
`unet_config` and an operations class that `comfy.ops.pick_operations` chose from the weight dtype,
the manual-cast dtype, the fp8 optimisation flag and the scaled-fp8 dtype. The spec below carries
exactly those facts (plus ComfyUI's directory and the flags that choose its attention kernel), so a
worker builds the same class with the same ops (workers/bridge/build.py). The weights travel as
ComfyUI holds them: the diffusion model's state dict in storage dtype, patches (LoRA) already
applied by ComfyUI's model management — fp8 stays fp8.

A custom loader's model (GGUF: its own tensor subclass, operations and patcher) travels the same way, its tensors as
raw bytes plus what rebuilds them (workers/bridge/loader_types.py). So does a quantized checkpoint ComfyUI loads through its
mixed-precision ops (`quant_config`; every scaled-fp8 file since ComfyUI 0.33): each QuantizedTensor as its inner
tensors' raw bytes (quantized values, scales), the layout and the layer's `comfy_quant` entry as JSON, and the
quant_config so that the workers pick the same ops. Everything here is checked before any worker starts:
weights that cannot be carried, or a method the model's class or weights cannot run, are refused with what works.
"""
from __future__ import annotations

import inspect

import torch

from ...parallel.models import ANY, adapter_for, supported_titles, unchecked_base
from ...parallel.models.any_model import RECIPE
from ..messages import ModelOps, NativeSpec
from ..transport import TRAVEL_DTYPES
from .build import comfy_runtime  # (re-exported: the VAE node and the runtime send it)

from ...parallel.config import ConfigError
from ...parallel.costmodel import shape_from_module
from ...parallel.memory import check_fits, host_memory_bytes, rank_memory, shard_traffic
from ...parallel.pipefusion.plans import pipeline_problems
from ...parallel.tp import tp_problems
from ..launch import gpu_order
from .capture import NotCarried  # (re-exported: the nodes' refusals)
from .carry import encode_value  # (re-exported)
from .host import comfy_gpus
from .loader_types import (NotCarriable, describe, describe_operations, host_tensors as held, is_plain, nbytes,
                           quantized_tensors, raw, tensor_packages)
from .sampling import DIFFUSION_MODEL, wrappers_of
from .seams import has, import_class


def diffusion_model_of(patcher):
    """The MODEL's diffusion model (ComfyUI's module the workers build): for code outside the bridge, which does not
    read ComfyUI's objects itself."""
    return patcher.model.diffusion_model


def family_adapter(diffusion_model):
    """The family adapter of this ComfyUI diffusion model; `ANY` (CFG / data parallel only) where no adapter declares
    its class (check_any_model refuses the other methods for it)."""
    a = adapter_for(diffusion_model)
    return ANY if a is None else a


def check_any_model(diffusion_model, hp) -> None:
    """Refuse, before any worker starts, a method that splits inside a model no family adapter declares: only CFG
    and data parallel (the batch) run it, every rank holding the whole model. The message names the class, why (a
    subclass of a supported class that nobody checked is not its base), what runs, and how to add an adapter."""
    if family_adapter(diffusion_model) is not ANY:
        return
    config = hp.config
    loop = config.pp_degree > 1 or getattr(hp, "mode", "auto") == "loop"
    if config.batch_only and not loop:
        return
    name = type(diffusion_model).__name__
    base = unchecked_base(diffusion_model)
    why = (f"{name} is a variant of {base.title}'s {base.comfy_class} whose forward the {base.title} plan was not "
           f"checked against (its extra inputs would not be split with the tokens)" if base is not None else
           f"{name} has no family adapter")
    asked = "sampling_mode loop" if config.batch_only else config.describe()
    raise NotCarried(f"{why}, so only CFG parallel and data parallel run it (every rank holds the whole model): "
                     f"{asked} cannot. Set ulysses/ring/tp/pp degrees to 1, shard_weights none and sampling_mode "
                     f"auto, and use cfg_degree 2 (cfg > 1 with a negative prompt) or dp_degree (batch > 1). "
                     f"Every method runs {supported_titles()}; to add an adapter for {name} see {RECIPE}")


def check_attention_requests(diffusion_model) -> None:
    """Refuse, before any worker starts, a checkpoint whose layers ask for an attention kernel of their own.

    Why: newer ComfyUI (read in its 0.38-era attention.py, not run here) lets a checkpoint ask for comfy-kitchen's int8
    attention per layer (`*.comfy_attention.config` tensors, loaded into a `ComfyAttention` module whose `function` is
    the kernel where the device runs it), and drops that kernel whenever an attention override is set - the pack's
    sequence-parallel seam. The request is no weight, so it does not travel either: KSampler would run the asked
    kernel and the workers the default one. Where the driver's device cannot run it (`function` None) ComfyUI runs the
    default kernel too, and so do the workers: nothing to refuse."""
    where = "comfy.ldm.modules.attention:ComfyAttention"
    if not has(where):
        return
    cls = import_class(where)  # (workers/bridge/seams.py lists it: optional, ComfyUI after 0.33)
    asking = [n for n, m in diffusion_model.named_modules() if isinstance(m, cls) and getattr(m, "function", None)]
    if asking:
        kind = (getattr(dict(diffusion_model.named_modules())[asking[0]], "config", None) or {}).get("attention", "?")
        raise NotCarried(f"this checkpoint asks for its own attention kernel ({kind!r}) in {len(asking)} layers "
                         f"(e.g. {asking[0]}); the workers run ComfyUI's default kernel there, so the picture would "
                         f"differ from KSampler's. Use a checkpoint without the attention request, or sample this "
                         f"MODEL with KSampler on one device")


def check_weights(diffusion_model) -> int:
    """Refuse weights the workers cannot carry (before any worker starts); returns their bytes. A custom loader's
    tensor subclass (GGUF's quantized weights) travels as its raw bytes plus what rebuilds it, a quantized weight of
    ComfyUI's mixed-precision ops as its inner tensors' bytes plus its layout (workers/bridge/loader_types.py); what cannot
    be rebuilt is refused with the reason."""
    try:
        quantized_tensors(diffusion_model)
    except NotCarriable as e:
        raise NotCarried(f"{e}; load the model with ComfyUI's Load Diffusion Model / Load Checkpoint") from None
    total = 0
    for name, t in sent_tensors(diffusion_model, cast=False).items():
        try:
            describe(t, name)
        except NotCarriable as e:
            raise NotCarried(f"{e}; load the model with ComfyUI's Load Diffusion Model / Load Checkpoint (any "
                             f"weight_dtype, fp8 included) or a GGUF loader") from None
        r = raw(t)
        dtype = str(r.dtype).removeprefix("torch.")
        if dtype not in TRAVEL_DTYPES:
            raise NotCarried(f"weight {name!r} has dtype {dtype}, which the workers cannot carry; supported: "
                             f"{', '.join(TRAVEL_DTYPES)}")
        total += r.numel() * r.element_size()
    return total


def host_tensors(diffusion_model) -> dict:
    """The weights as the model's layers hold them (not state_dict(), which a loader's ops may fake); a quantized
    weight (QuantizedTensor) as its inner tensors, "<name>#<inner>" each: what travels."""
    return held(diffusion_model)


def sent_tensors(module, cast: bool = True, unhooked: dict | None = None) -> dict:
    """The weights as the workers must hold them: `host_tensors`, each in the dtype ComfyUI computes the layer with.

    Why: under DynamicVRAM (ComfyUI 0.33 on NVIDIA) ComfyUI's loaders keep each layer's tensor as the checkpoint stores
    it (its mapping of the file, zero-copy) and record the model's dtype beside it (`weight_comfy_model_dtype`, ... -
    comfy.model_management.archive_model_dtypes, comfy.ops); its dynamic loader casts to that dtype as the weight goes
    to the GPU (ModelPatcherDynamic.load, comfy.ops.cast_modules_with_vbar: a plain cast, round to nearest). A bf16
    checkpoint loaded as fp8, an fp32 one as fp16, or an fp32 VAE decoding in bf16 is held in the file's dtype on the
    host, while the workers build ComfyUI's model in the model's dtype (the spec's unet_config / the VAE's dtype):
    such a tensor travels cast as ComfyUI's loader casts it. Elsewhere the recorded dtype is the one held, or there is
    none (ComfyUI 0.3.x): nothing is cast. `cast` False: the same tensors, each as a meta tensor of the dtype it
    travels in where that differs (sizes and dtypes only, nothing computed).
    A loader's tensor subclass (GGUF) travels as it is held. `unhooked`: {name: tensor} sent instead of what the
    layer holds (a weight a hook group holds patched now, as ComfyUI saved it: workers/bridge/residency.unhooked)."""
    owners = dict(module.named_modules())
    out = {}
    for name, t in held(module).items():
        t = (unhooked or {}).get(name, t)
        path, _, leaf = name.rpartition(".")
        want = getattr(owners.get(path), f"{leaf}_comfy_model_dtype", None)
        if isinstance(want, torch.dtype) and want != t.dtype and is_plain(t) and t.is_floating_point() and \
                want.is_floating_point:
            t = t.to(want) if cast else torch.empty(t.shape, dtype=want, device="meta")
        out[name] = t
    return out


def loader_tensors(diffusion_model) -> dict:
    """{name: description} of the weights a custom loader holds as its own tensor subclass (GGUF); {} for none.
    ComfyUI's own quantized weights are not a loader's (native_spec carries them as NativeSpec.quantized): every
    method that holds whole weights runs them, tensor parallel checks their layout (parallel/tp.py)."""
    return {k: describe(t, k) for k, t in host_tensors(diffusion_model).items() if not is_plain(t)}


def weight_bytes(diffusion_model) -> int:
    """Bytes of the weights as they travel and the workers hold them (sent_tensors: in the dtype ComfyUI computes
    with; a quantized GGUF weight counts its blocks, not its logical shape)."""
    return sum(nbytes(t) for t in sent_tensors(diffusion_model, cast=False).values())


def check_loader_methods(diffusion_model, config, patched: bool) -> None:
    """Refuse, before any worker starts, what a custom loader's quantized weights cannot run: tensor parallel
    (it cuts weight rows and columns; a quantized weight packs a row's values in blocks of 32 or 256 with their
    scales, so a shard would have to be re-quantized - not the loader's weights any more), PipeFusion (not
    checked with a loader's ops), and weight patches (LoRA) on ranks that do not hold the whole model (the loader
    keeps them on the tensor beside its bytes; sharded bytes would leave them behind). Weight patches (LoRA) on
    ComfyUI's own quantized weights (QuantizedTensor layouts) are patched on the workers as ComfyUI patches them
    (workers/bridge/patches.apply: dequantized, patched, re-quantized by the layer's own set_weight)."""
    tensors = loader_tensors(diffusion_model)
    if not tensors:
        return
    kind = next(iter(tensors.values()))["class"].rpartition(":")[2]
    if config.tp_degree > 1 or config.pp_degree > 1:
        what = "tensor parallel (tp_degree > 1)" if config.tp_degree > 1 else "PipeFusion (pp_degree > 1)"
        raise NotCarried(f"{what} does not run on a custom loader's quantized weights ({kind}: a quantized row is "
                         f"blocks of values with their scales, which tensor parallel would cut and PipeFusion was "
                         f"not checked with); use ulysses/ring/cfg/dp degrees, shard_weights or DistriFusion")
    if patched and not config.whole_model:
        raise NotCarried(f"weight patches (LoRA) on a custom loader's quantized weights ({kind}) run where every rank "
                         f"holds the whole model: set shard_weights none (ulysses/ring/cfg/dp degrees), or remove "
                         f"the LoRA")


def _declared(config, name: str):
    """`config.name` where this ComfyUI's model config declares it, else None - without reaching its __getattr__,
    which in ComfyUI 0.33 logs "you accessed ... which doesn't exist" for each name it no longer has (scaled_fp8,
    layer_quant_config), on every prompt."""
    return getattr(config, name) if name in vars(config) or hasattr(type(config), name) else None


def native_spec(base_model, compute_dtype=None) -> NativeSpec:
    """What a worker needs to build `base_model.diffusion_model` as ComfyUI built it (typed; its message() is JSON).
    `compute_dtype`: the dtype a ModelComputeDtype node set (its object patch `manual_cast_dtype`, with the patcher's
    forced weight cast): the workers build the same ops and cast every layer's weights to it at each call, as
    ComfyUI's load does."""
    dm = base_model.diffusion_model
    family_adapter(dm)
    config = base_model.model_config
    custom = None
    if _declared(config, "custom_operations") is not None:  # a custom loader's ops (GGUF): carried by name
        try:
            custom = describe_operations(config.custom_operations)
        except NotCarriable as e:
            raise NotCarried(f"this MODEL uses custom operations: {e}; load it with ComfyUI's own loaders or a "
                             f"GGUF loader") from None
    try:
        tensors = loader_tensors(dm)
        quantized = quantized_tensors(dm)
    except NotCarriable as e:
        raise NotCarried(f"{e}; load the model with ComfyUI's own loaders or a GGUF loader") from None
    if _declared(config, "layer_quant_config"):  # ComfyUI < 0.33's mixed precision: another loader and tensor
        raise NotCarried("mixed-precision quantized checkpoints of ComfyUI before 0.33 (layer_quant_config) do not run "
                         "on the workers; update ComfyUI (0.33 loads them as quantized tensors, which run), or use a "
                         "bf16 / fp16 checkpoint, an fp8 weight_dtype or a GGUF file")
    quant = _declared(config, "quant_config")
    if quantized and not quant:
        name, meta = next(iter(quantized.items()))
        raise NotCarried(f"weight {name!r} is a quantized tensor ({meta['layout']}) but the model has no "
                         f"quant_config, so the workers could not pick ComfyUI's mixed-precision ops for it; load the "
                         f"model with ComfyUI's own loaders")
    unet_config = dict(config.unet_config)
    ops = ModelOps(weight_dtype=encode_value(unet_config.get("dtype")),
                   manual_cast_dtype=encode_value(base_model.manual_cast_dtype),
                   fp8_optimizations=bool(config.optimizations.get("fp8", False)),
                   scaled_fp8=encode_value(_declared(config, "scaled_fp8")), custom=custom or None,
                   quant_config=encode_value(quant) if quant else None,
                   disabled=disabled_formats(dm) if quant else None)
    return NativeSpec(module=type(dm).__module__, class_name=type(dm).__qualname__,
                      unet_config=encode_value(unet_config), ops=ops, runtime=comfy_runtime(),
                      tensors=tensors or None, packages=tensor_packages(tensors) if tensors else None,
                      quantized=quantized or None, compute_dtype=encode_value(compute_dtype),
                      force_cast=compute_dtype is not None)


def disabled_formats(diffusion_model) -> list | None:
    """The quantized formats ComfyUI's mixed-precision ops emulate on its own device (pick_operations' `disabled`:
    dequantized, computed in the compute dtype), as its layers' class holds them; the workers log a device that
    differs (workers/bridge/build.py)."""
    for m in diffusion_model.modules():
        found = getattr(type(m), "_disabled_formats", None)
        if found is not None:
            return sorted(str(f) for f in found)
    return None


# ComfyUI runs DIFFUSION_MODEL wrappers inside the diffusion model's forward, which on the pool is the workers'.
# These keys only read the call's x and transformer_options and either call the model or return a cached output
# (ComfyUI's EasyCache: skip a step whose predicted output change is small). In step mode the driver runs them
# around the pool call, so a skipped step is skipped on every rank at once; in loop mode and PipeFusion the
# workers apply the same rule (parallel/stepcache.py). Any other such wrapper would act on a model the workers
# do not run: refused rather than silently left out.
DRIVER_WRAPPERS = ("easycache",)


def runs_diffusion_wrappers(diffusion_model) -> bool:
    """Whether ComfyUI's class runs DIFFUSION_MODEL wrappers around its forward at all (Flux, Wan, Qwen-Image,
    Lumina 2, HunyuanVideo, Chroma... do; SD3's MMDiT and PixArt do not, so EasyCache is a no-op on them in
    ComfyUI itself). Read from the class's own forward, so it follows the installed ComfyUI."""
    try:
        return "DIFFUSION_MODEL" in inspect.getsource(type(diffusion_model).forward)
    except (OSError, TypeError):
        return False


def diffusion_wrappers(wrappers: dict | None) -> dict:
    """{key: [functions]} of the non-empty DIFFUSION_MODEL wrappers in a ModelPatcher's or a call's `wrappers`."""
    return {k: v for k, v in wrappers_of(wrappers, DIFFUSION_MODEL).items() if v}


def check_diffusion_wrappers(wrappers: dict | None) -> None:
    """Refuse, before any worker starts, diffusion-model wrappers the pool cannot honour (see DRIVER_WRAPPERS)."""
    foreign = sorted(k for k in diffusion_wrappers(wrappers) if k not in DRIVER_WRAPPERS)
    if foreign:
        raise NotCarried(f"this MODEL carries diffusion-model wrappers {foreign} from another node; they run inside "
                         f"ComfyUI's diffusion model, which runs on the workers - remove that node or use KSampler")


def loop_step_cache(model_options: dict | None, base_model, cond_or_uncond: list, has_uncond: bool,
                    concat: bool) -> dict | None:
    """ComfyUI's EasyCache settings for the workers' loop (parallel/stepcache.py StepCacheSpec), from the holder its
    OUTER_SAMPLE wrapper prepared for this run (start/end percent already turned into sigmas); None without one, or
    when ComfyUI's class would not run it (then KSampler ignores it too). The statistics slice is ComfyUI's first
    chunk in the call: cond (0) or uncond (1) in the loop's [cond, uncond]."""
    holder = ((model_options or {}).get("transformer_options") or {}).get("easycache")
    if holder is None or type(holder).__name__ != "EasyCacheHolder" or \
            not runs_diffusion_wrappers(base_model.diffusion_model):
        return None
    # ComfyUI's model input is the sampler's batch itself when calculate_input returns it unchanged (flow models)
    # and neither concat channels nor a dtype cast copy it: then EasyCache's in-place add shifts that batch
    probe = torch.zeros(1)
    compute_dtype = base_model.manual_cast_dtype or base_model.get_dtype()
    shift = (base_model.model_sampling.calculate_input(torch.ones(1), probe) is probe and not concat
             and compute_dtype == torch.float32)
    return {"threshold": float(holder.reuse_threshold), "start_sigma": float(holder.start_t),
            "end_sigma": float(holder.end_t), "subsample": int(holder.subsample_factor),
            "channels": None if holder.output_channels is None else int(holder.output_channels),
            "first": int(cond_or_uncond[0]) if has_uncond else 0, "chunks": 2 if has_uncond else 1,
            "shift_input": bool(shift)}


def check_declared(diffusion_model, config) -> None:
    """Refuse, before any worker starts, tensor parallel or PipeFusion on a family whose ComfyUI plan declares no
    shard layout / pipeline stages, with the family's reason and what runs it instead."""
    a = family_adapter(diffusion_model)

    def refuse(what: str, why: str):
        fix = "" if "ulysses" in why else "; use ulysses/ring/cfg/dp degrees, shard_weights or DistriFusion"
        raise NotCarried(f"{what} is not available for {a.title}: {why}{fix}")
    if config.pp_degree > 1 and not a.pipefusion_nodes:
        refuse(f"PipeFusion (pp_degree={config.pp_degree})",
               a.comfy_plan.pipeline_refusal or "no pipeline stages are declared for it")
    if config.method == "distrifusion" and config.sp_degree > 1 and a.comfy_plan.distrifusion_refusal:
        refuse("DistriFusion (method distrifusion)", a.comfy_plan.distrifusion_refusal)
    if config.tp_degree > 1 and a.comfy_plan.tp is None:
        refuse(f"tensor parallel (tp_degree={config.tp_degree})", a.comfy_plan.tp_refusal or
               "no shard layout is declared for it")


def check_native_pipefusion(diffusion_model, config, latent_shape) -> None:
    """Refuse, before any worker starts, a PipeFusion config ComfyUI's model and this latent cannot run (more
    stages than blocks, warmup 0, a latent not on the patch grid, more patches than token rows, patches smaller
    than the sp degree): the checks the workers make at run start, on the driver's copy (reads only)."""
    if config.pp_degree <= 1:
        return
    problems = pipeline_problems(diffusion_model, family_adapter(diffusion_model).comfy_plan, config, latent_shape)
    if problems:
        raise NotCarried("; ".join(problems[:3]))


def check_native_grid(diffusion_model, config, latent_shape) -> None:
    """Refuse, before any worker starts, a latent whose grid of patch rows (a family declaring `grid_patch`: the
    sequence split cuts rows, plan.SplitGrid) has fewer rows than sequence-parallel ranks - the ranks would refuse it
    at the first call, after the weights were sent."""
    sp = config.ulysses_degree * config.ring_degree
    a = family_adapter(diffusion_model)
    if sp <= 1 or not a.grid_patch or len(latent_shape) < 4:
        return
    patch = getattr(diffusion_model, a.grid_patch, None)
    if not isinstance(patch, int) or patch < 1:
        return
    rows = -(-int(latent_shape[-2]) // patch)  # ComfyUI pads the latent to whole patches
    if rows < sp:
        raise NotCarried(f"{a.title}: this latent has {rows} rows of patches ({latent_shape[-2]} latent rows / patch "
                         f"{patch}), which cannot be split over {sp} sequence-parallel ranks; use a larger latent or a "
                         f"smaller ulysses/ring degree")


def check_native_tp(diffusion_model, config) -> None:
    """Refuse, before any worker starts, a tp_degree ComfyUI's model cannot be sharded by (heads, widths):
    the same check the workers run before sharding, on the driver's copy (reads only)."""
    if config.tp_degree <= 1:
        return
    problems = tp_problems(diffusion_model, family_adapter(diffusion_model).comfy_plan, config.tp_degree)
    if problems:
        raise NotCarried("; ".join(problems[:3]))


def device_capacity(hp) -> tuple:
    """(bytes a rank may use, where, ranks sharing it): the smallest total memory of the GPUs the ranks will take
    (the devices listed, else the pool's placement: workers/launch.gpu_order), or the host's RAM shared by every
    CPU rank. Read without creating a CUDA context on other GPUs (device properties only); a GPU this process cannot
    see (ComfyUI's --cuda-device) is sized by the one it sees."""
    import torch
    config = hp.config
    gpus = comfy_gpus() if hp.device != "cpu" else {}
    listed = [d for d in config.devices if d.startswith("cuda")]
    if listed or (gpus.get("count") and not config.devices):
        devices = listed or gpu_order(config.world_size, gpus["count"], gpus.get("driver"))
        seen = (lambda i: 0) if gpus.get("comfy_cuda_device") is not None else (lambda i: i)  # this process's index
        indices = sorted({int(d.partition(":")[2]) for d in devices})
        totals = {i: torch.cuda.get_device_properties(seen(i)).total_memory for i in indices}
        i = min(totals, key=totals.get)
        return totals[i], f"cuda:{i} ({torch.cuda.get_device_name(seen(i))})", 1
    return host_memory_bytes(), "this machine's RAM", config.world_size


def check_memory(model, hp, latent_shape, positive, cfg: float) -> dict | None:
    """Refuse, before any worker starts, a config whose ranks cannot hold this model and latent (parallel/memory.py):
    DistriFusion's K/V buffers on a video latent, weights no split makes fit, ... with the numbers and the fix.
    Returns the plan it checked (what the mesh picture shows: bytes per rank by item against the device), or None
    for a model no adapter describes."""
    import torch
    dm = model.model.diffusion_model
    if len(latent_shape) not in (4, 5):
        # the planner reads (B, C, H, W) / (B, C, T, H, W); a multi-stream latent reaches a guider packed into one
        # (B, C, L) tensor (LTX-2's video + audio, through Parallel Model): no plan for it
        return None
    try:
        shape = shape_from_module(dm)
    except ValueError:
        return None  # no adapter: nothing parallel inside the model to plan
    weights = weight_bytes(dm)
    capacity, where, ranks = device_capacity(hp)
    on_gpu = where.startswith("cuda")
    compute = model.model.manual_cast_dtype or dm.dtype
    if on_gpu and compute == torch.float32 and dm.dtype != torch.float32:
        compute = torch.bfloat16  # a GPU computes fp8 / half weights in half precision
    act_bytes = 4 if compute == torch.float32 else 2
    text = max((int(c[0].shape[1]) for c in positive or [] if hasattr(c[0], "shape") and c[0].dim() == 3), default=0)
    batch = int(latent_shape[0]) * (2 if cfg != 1.0 else 1)
    mem = rank_memory(shape, weights, hp.config, latent_shape, text, batch, act_bytes, cpu=ranks > 1)
    try:
        check_fits(mem, capacity, where, hp.config, ranks_on_host=ranks, weight_bytes=weights)
    except ConfigError as e:
        raise NotCarried(f"{e}") from None
    note = shard_traffic(weights, hp.config)
    if note and on_gpu:
        import logging
        logging.getLogger(__name__).warning("hybrid parallel: %s", note)
    return {"mesh": hp.config.describe(), "model": type(dm).__name__, "latent": [int(v) for v in latent_shape],
            "per_rank": int(mem.total), "items": {k: int(v) for k, v in mem.items.items() if v},
            "capacity": int(capacity), "where": where, "ranks_on_host": int(ranks),
            "shared_weights": bool(mem.shared_weights), "weights": int(weights), "note": note or None}


__all__ = ["DRIVER_WRAPPERS", "NotCarried", "check_declared", "check_diffusion_wrappers", "diffusion_wrappers", "loop_step_cache", "runs_diffusion_wrappers", "check_memory", "check_native_grid", "check_native_pipefusion", "check_native_tp", "check_weights", "check_any_model",
           "check_loader_methods", "host_tensors", "loader_tensors", "sent_tensors", "weight_bytes",
           "comfy_runtime", "encode_value", "family_adapter", "native_spec"]
