"""The worker's side of the ComfyUI-native path: build ComfyUI's own diffusion model from its spec.

Why the workers run ComfyUI's classes rather than a diffusers re-implementation: the MODEL then
runs with ComfyUI's own ops and casting (fp8 `weight_dtype`, fp8-stored and scaled-fp8 checkpoints,
manual casting), with the weights exactly as ComfyUI holds them (storage dtype, LoRA already
applied), and no family needs a converter. The driver (workers/bridge/spec.py) sends a *spec* — the module
and class of the diffusion model, ComfyUI's `unet_config`, the facts ComfyUI's `pick_operations`
decides by, and the ComfyUI command-line flags that choose the attention kernel — and the weights as
mapped shared-memory files. Here the class is built on the meta device (no allocation, no random
initialisation) with the same operations class, and the state dict is assigned: on CPU the
parameters *are* the shared mappings, so N ranks hold one copy.

A quantized checkpoint (ComfyUI's `quant_config`: mixed-precision ops, each quantized weight a comfy-kitchen
QuantizedTensor - every scaled-fp8 file since ComfyUI 0.33) is built with the ops `pick_operations` returns for that
quant_config on this device, loaded through the layers' own loader from the file form ComfyUI itself writes (the
inner tensors that travelled, named by the tensor's own `state_dict`, plus each layer's `comfy_quant` entry), and then
holds each weight exactly as the driver does: the wrapper `__tensor_unflatten__` makes of the bytes that travelled
(workers/bridge/loader_types.py).

This module is the only place in the workers that imports ComfyUI, and only when a native model
is loaded. The workers are started by ComfyUI's process, which passes its ComfyUI directory.
"""
from __future__ import annotations

import importlib
import os
import sys

import torch

from ...parallel.shard import wrapper_parts
from ..bootstrap import imports_without_gc
from ..messages import ComfyRuntime, ModelOps, NativeSpec, VaeSpec
from .loader_types import (INNER, comfy_quant_tensor, host_tensors, operations, rebuild, rebuild_quantized,
                           register_packages)

# ComfyUI flags copied from the driver: the ones that choose the attention kernel, precision and device.
FORWARDED_ARGS = ("cpu", "use_pytorch_cross_attention", "use_split_cross_attention", "use_quad_cross_attention",
                  "use_sage_attention", "use_flash_attention", "disable_xformers", "force_upcast_attention",
                  "dont_upcast_attention", "force_fp32", "force_fp16", "deterministic", "fast")
_ATTENTION_FLAGS = ("use_split_cross_attention", "use_quad_cross_attention", "use_sage_attention",
                    "use_flash_attention")


def decode_value(v):
    """Inverse of workers/bridge/spec.py's encode_value: {"__dtype__": name} -> torch dtype, recursively."""
    if isinstance(v, dict):
        if set(v) == {"__dtype__"}:
            return getattr(torch, v["__dtype__"])
        if set(v) == {"__tuple__"}:
            return tuple(decode_value(x) for x in v["__tuple__"])
        return {k: decode_value(x) for k, x in v.items()}
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


def import_comfy(runtime: ComfyRuntime, sequence_parallel: bool):
    """Put ComfyUI on sys.path and configure it as the driver's ComfyUI (`runtime`) before its first import.

    With sequence parallelism the worker uses ComfyUI's pytorch attention kernel: attention calls that
    bypass ComfyUI's override seam (PixArt's) are then F.scaled_dot_product_attention calls, which the
    plan's interceptor swaps. At world size 1 the driver's kernel is kept, so degree 1 is bitwise KSampler.
    """
    if "comfy.model_management" not in sys.modules:
        path = runtime.comfy_dir
        if path and path not in sys.path:
            sys.path.append(path)
        import comfy.cli_args
        args = comfy.cli_args.args
        for name, value in (runtime.comfy_args or {}).items():
            if name not in FORWARDED_ARGS or not hasattr(args, name):
                continue
            if name == "fast":
                value = {comfy.cli_args.PerformanceFeature(v) for v in value or ()}
            setattr(args, name, value)
        if sequence_parallel:
            args.use_pytorch_cross_attention = True
            for name in _ATTENTION_FLAGS:
                setattr(args, name, False)
    import comfy.model_management  # noqa: F401  (device and kernel choice happen at this import)
    import comfy.ops
    # model code that reaches comfy.patcher_extension without importing it (Kandinsky 5's forward), as ComfyUI's
    # own process has it imported by then
    import comfy.patcher_extension  # noqa: F401
    return comfy


def attention_kernel(runtime: ComfyRuntime) -> tuple:
    """(ComfyUI's attention function the driver runs - unwrapped, ComfyUI's signature - or None, its name as this
    worker runs it) for the Ulysses ranks' local attention (parallel/attention_seam.py).

    Why: with sequence parallelism this process imports ComfyUI with its pytorch kernel (see `import_comfy`), yet
    the user picked a kernel in ComfyUI (sage, flash, sub-quadratic...) and degree 1 runs it; a Ulysses rank's
    attention is that same kernel on a share of the heads, so it runs it too - same speed and same rounding as
    one device. The driver names it by ComfyUI's registry (comfy_runtime, below); a kernel this process
    cannot run (xformers, enabled only by the driver's import) falls back to the seam's, with a warning.
    """
    name = runtime.attention
    if not name:
        return None, None
    fn = attention_function(name)
    if fn is None:
        import logging

        import comfy.ldm.modules.attention as attention
        fallback = attention.optimized_attention.__name__
        logging.getLogger(__name__).warning("hybrid parallel: ComfyUI's %r attention is not available on the "
                                            "workers; Ulysses ranks use %s", name, fallback)
        return None, fallback
    return fn, name


def picked_attention() -> str | None:
    """The name, in ComfyUI's attention registry, of the kernel ComfyUI picked in this process (its flags and
    device decide): "pytorch", "sage", "flash", "xformers", "sub_quad", "split"; None if not registered. The
    driver sends it to the workers (comfy_runtime, below), which look it up with `attention_function`."""
    import comfy.ldm.modules.attention as attention
    picked = attention.optimized_attention
    return next((n for n, f in getattr(attention, "REGISTERED_ATTENTION_FUNCTIONS", {}).items() if f is picked), None)


def attention_function(name: str):
    """ComfyUI's attention kernel registered as `name`, unwrapped from `wrap_attn` (so a call never consults
    `optimized_attention_override` again), or None where this process has no such kernel."""
    import comfy.ldm.modules.attention as attention
    get = getattr(attention, "get_attention_function", None)
    fn = get(name, None) if get is not None else None
    return None if fn is None else getattr(fn, "__wrapped__", fn)


def _operations(comfy, ops: ModelOps, device: torch.device):
    """The operations class ComfyUI's pick_operations returns for `ops` on `device`, or a custom loader's own."""
    if ops.custom:  # a custom loader's operations (ComfyUI-GGUF's), imported from its folder
        return operations(ops.custom)
    weight_dtype = decode_value(ops.weight_dtype)
    compute_dtype = decode_value(ops.manual_cast_dtype)
    scaled = decode_value(ops.scaled_fp8)
    kwargs = {"load_device": device, "fp8_optimizations": bool(ops.fp8_optimizations)}
    if scaled is not None:
        # ComfyUI <= 0.3.x's scaled-fp8 ops; later ComfyUIs load those files as quantized tensors instead
        # (mixed-precision ops) and have no such argument - the driver never sends it there.
        kwargs["scaled_fp8"] = scaled
    quant = decode_value(ops.quant_config)
    if quant:
        # ComfyUI's mixed-precision ops, chosen as ComfyUI chooses them: pick_operations reads the model config's
        # quant_config and disables the formats this device cannot compute natively (emulated: dequantized)
        import types
        kwargs["model_config"] = types.SimpleNamespace(quant_config=quant)
    picked = comfy.ops.pick_operations(weight_dtype, compute_dtype, **kwargs)
    if quant:
        mine, driver = getattr(picked, "_disabled", None), ops.disabled
        if driver is not None and mine is not None and sorted(mine) != sorted(driver):
            import logging
            logging.getLogger(__name__).warning(
                "hybrid parallel: this worker's device computes the quantized formats %s natively where ComfyUI's "
                "own device emulates %s (ComfyUI: %s): results follow this device, as ComfyUI's would on it",
                sorted(set(driver) - set(mine)) or "none", sorted(set(mine) - set(driver)) or "none", sorted(driver))
    return picked


def loader_weights(spec: NativeSpec, weights: dict) -> dict:
    """`weights` with every tensor a custom loader held as its own subclass (GGUF's quantized tensors) rebuilt
    around the raw bytes that travelled (workers/bridge/loader_types.py); the dict itself where there are none."""
    metas = spec.tensors
    if not metas:
        return weights
    register_packages(spec.packages)
    return {k: rebuild(v, metas.get(k)) for k, v in weights.items()}


def build_native(spec: NativeSpec, weights: dict, device: torch.device, sequence_parallel: bool) -> torch.nn.Module:
    """ComfyUI's diffusion model of `spec`, holding `weights` (assigned, not copied; a loader's tensors already
    rebuilt by `loader_weights`), with the operations ComfyUI picks for `device` - or the loader's own; the model
    itself stays on the host (the engine moves its shard)."""
    with imports_without_gc():
        comfy = import_comfy(spec.runtime, sequence_parallel)
        module = importlib.import_module(spec.module)
    cls = module
    for part in spec.class_name.split("."):
        cls = getattr(cls, part)
    unet_config = decode_value(spec.unet_config)
    operations = _operations(comfy, spec.ops, device)
    model = cls(**unet_config, device=torch.device("meta"), operations=operations)
    quantized = spec.ops.quant_config or spec.quantized
    # (a custom loader's layers - and mixed-precision ops' Linear layers - hold no weight until loaded: compare
    # what the model holds once loaded)
    expected = set(host_tensors(model)) if not spec.ops.custom and not quantized else set(weights)
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if not missing and not unexpected:
        if quantized:
            _load_quantized(model, spec.quantized or {}, weights)
        else:
            model.load_state_dict(weights, strict=True, assign=True)
        held = set(host_tensors(model))
        missing, unexpected = sorted(set(weights) - held), sorted(held - set(weights))
    if missing or unexpected:
        raise RuntimeError(f"{spec.class_name} built from ComfyUI's config does not match the weights sent: "
                           f"missing {missing[:8]}, unexpected {unexpected[:8]}")
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left and not any(n in dict(model.named_parameters()) for n in left):
        # buffers the model computes at init and keeps out of its state dict (Cosmos Predict2's RoPE ranges): built
        # on the meta device they hold nothing - take them from the class built on the host (its weights are left
        # uninitialised by ComfyUI's operations, and dropped)
        host = dict(cls(**unet_config, device=None, operations=operations).named_buffers())
        owners = dict(model.named_modules())
        for n in left:
            path, _, leaf = n.rpartition(".")
            owners[path]._buffers[leaf] = host[n]
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{spec.class_name} keeps tensors outside its state dict ({left[:8]}); the workers "
                           f"cannot build it without initialising them - report this model class")
    if spec.force_cast:
        # a ModelComputeDtype node: ComfyUI's load casts every layer's weights to the compute dtype at each call
        # (ModelPatcher.force_cast_weights -> comfy_cast_weights on each op module); the same here
        for m in model.modules():
            if hasattr(m, "comfy_cast_weights"):
                m.comfy_cast_weights = True
                m.comfy_force_cast_weights = True
    # on the host still: the engine shards it (tensor parallel, PipeFusion stages) before it moves to `device`
    return model.eval().requires_grad_(False)


def _load_quantized(model: torch.nn.Module, metas: dict, weights: dict) -> None:
    """Load a mixed-precision model (built on the meta device) as ComfyUI loads it, then hold the weights that
    travelled: the layers' own loader reads the file form ComfyUI writes - each quantized weight's tensors named by
    its own `state_dict` plus its layer's `comfy_quant` entry - and sets the layer up (format, layout, whether this
    device computes it natively); each weight is then the wrapper rebuilt around the mapped bytes, checked to be what
    the loader made of them (same layout, parameters, shapes) but holding the very tensors that travelled (the
    loader's Parameter() would have cloned its scales)."""
    ours = {name: rebuild_quantized(name, meta, weights) for name, meta in metas.items()}
    form = {k: v for k, v in weights.items() if INNER not in k}
    for name, t in ours.items():
        path, _, leaf = name.rpartition(".")
        form.update(t.state_dict(name))
        form[f"{path}.comfy_quant" if path else "comfy_quant"] = comfy_quant_tensor(metas[name]["comfy_quant"])
    # the layers' loader puts what it reads on the device the layer was built for (the meta device here): the host
    # tensors that travelled stay where they are (assign), the engine moves the model afterwards
    moved = []
    for m in model.modules():
        kw = getattr(m, "factory_kwargs", None)
        if isinstance(kw, dict) and isinstance(kw.get("device"), torch.device) and kw["device"].type == "meta":
            moved.append((m, kw))
            m.factory_kwargs = dict(kw, device=None)
    try:
        model.load_state_dict(form, strict=True, assign=True)
    finally:
        for m, kw in moved:
            m.factory_kwargs = kw
    stranded = [n for n, p in model.named_parameters() if p.is_meta and n not in ours]
    if stranded:
        raise RuntimeError(f"ComfyUI's mixed-precision loader put {stranded[:4]} on the meta device the model was "
                           f"built on (its layers no longer say where they load in factory_kwargs): report this "
                           f"ComfyUI version")
    modules = dict(model.named_modules())
    for name, t in ours.items():
        path, _, leaf = name.rpartition(".")
        owner = modules[path]
        loaded = owner._parameters.get(leaf)
        if loaded is None or type(loaded) is not type(t):
            raise RuntimeError(f"ComfyUI's {type(owner).__name__} loaded {name} as a {type(loaded).__name__}, the "
                               f"driver holds a {type(t).__name__} ({metas[name].get('layout')})")
        (got, got_ctx), (want, want_ctx) = wrapper_parts(loaded), wrapper_parts(t)
        same = (got_ctx == want_ctx and tuple(loaded.shape) == tuple(t.shape) and loaded.dtype == t.dtype and
                {n: (p.dtype, tuple(p.shape)) for n, p in got.items()} ==
                {n: (p.dtype, tuple(p.shape)) for n, p in want.items()})
        if not same:
            fields = lambda c: c.get("non_tensor_fields") if isinstance(c, dict) else c  # noqa: E731
            raise RuntimeError(f"ComfyUI's loader made {name} a {metas[name].get('layout')} tensor with "
                               f"{fields(got_ctx)}, the driver holds {fields(want_ctx)}")
        owner._parameters[leaf] = t


def build_native_vae(spec: VaeSpec, weights: dict) -> torch.nn.Module:
    """ComfyUI's own VAE model (the `first_stage_model` its VAE Decode runs) for `weights`, picked by ComfyUI's own
    detection from the weights' names and shapes - the class and configuration the driver's ComfyUI built - on the
    meta device, then holding `weights` (assigned, not copied: the ranks share the mapped pages)."""
    with imports_without_gc():  # comfy.sd: ComfyUI's VAE and text-encoder code, transformers with it (~1.2 s)
        import_comfy(spec.runtime, sequence_parallel=False)
        import comfy.sd

    meta = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device="meta") for k, v in weights.items()}
    with torch.device("meta"):
        vae = comfy.sd.VAE(sd=meta, dtype=decode_value(spec.dtype), metadata=spec.metadata)
    model = vae.first_stage_model
    got = f"{type(model).__module__}.{type(model).__qualname__}"
    if got != spec.class_name:
        raise RuntimeError(f"ComfyUI built a {got} from the VAE weights sent, the driver holds a {spec.class_name}")
    expected = set(host_tensors(model))
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise RuntimeError(f"{got} does not match the VAE weights sent: missing {missing[:8]}, unexpected "
                           f"{unexpected[:8]}")
    for k, v in (spec.attrs or {}).items():  # e.g. TAEHV's latent format, which ComfyUI picks by weight dtype
        mine = getattr(model, k, None)
        mine = f"class {mine.__module__}.{mine.__qualname__}" if isinstance(mine, type) else mine
        if mine != v:
            raise RuntimeError(f"ComfyUI built this {got} with {k} = {mine!r} from the weights sent, the driver's has "
                               f"{v!r}; report this VAE")
    model.load_state_dict(weights, strict=True, assign=True)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{got} keeps tensors outside its state dict ({left[:8]}); the workers cannot build it "
                           f"without initialising them - report this VAE")
    return model.eval().requires_grad_(False)


def compute_dtype(spec: NativeSpec) -> torch.dtype:
    """The dtype ComfyUI hands the spec's model its latent in (BaseModel._apply_model: the manual-cast dtype,
    else the model's own)."""
    ops = spec.ops
    return (decode_value(spec.compute_dtype) or decode_value(ops.manual_cast_dtype) or
            decode_value(ops.weight_dtype) or torch.float32)


def call_native(model, inputs: dict):
    """Call ComfyUI's diffusion model as BaseModel._apply_model does: (x, timestep, context=..., ...)."""
    inputs = dict(inputs)
    x, t = inputs.pop("x"), inputs.pop("timestep")
    return model(x, t, **inputs)


def prepare_comfy(runtime: ComfyRuntime, sequence_parallel: bool) -> None:
    """import_comfy as the driver's ComfyUI is configured (comfy_runtime), and its attention module: every diffusion
    model imports it, it picks its kernel from the arguments just set, and it is most of a model class's import
    (0.1 s)."""
    with imports_without_gc():
        import_comfy(runtime, sequence_parallel=sequence_parallel)
        import comfy.ldm.modules.attention  # noqa: F401


# ---- the driver's side: what a worker needs to import ComfyUI as ComfyUI's own process did ----

def _comfy_args() -> dict:
    import comfy.cli_args
    args = comfy.cli_args.args
    out = {}
    for name in FORWARDED_ARGS:
        if not hasattr(args, name):
            continue
        v = getattr(args, name)
        if name == "fast":
            v = sorted(getattr(f, "value", f) for f in (v or ()))
        if v is None or isinstance(v, (bool, int, float, str, list)):
            out[name] = v
    return out


def comfy_runtime() -> ComfyRuntime:
    """Where this process's ComfyUI lives, the flags that choose its kernels and the attention kernel it picked
    (its name in ComfyUI's registry): what a worker needs to import ComfyUI as this process did."""
    import comfy.model_management
    return ComfyRuntime(comfy_dir=os.path.dirname(os.path.dirname(os.path.abspath(comfy.model_management.__file__))),
                        comfy_args=_comfy_args(), attention=picked_attention())


def driver_attention_is_pytorch() -> bool:
    """Whether this process's ComfyUI computes attention with its pytorch kernel: then workers that intercept
    attention (sequence / pipeline parallel) import ComfyUI exactly as those that do not, and a config change
    between them keeps the workers (workers/pool.py split_kernel_worlds). False without ComfyUI."""
    attention = sys.modules.get("comfy.ldm.modules.attention")
    kernel = getattr(attention, "optimized_attention", None)
    return kernel is not None and kernel is getattr(attention, "attention_pytorch", None)
