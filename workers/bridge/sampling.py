"""ComfyUI's sampling services as the nodes call them: its sampler and scheduler lists, noise, sigmas, samplers,
previews, progress bar, interrupt, and the wrapper kinds of its patcher extension.

Why here (the bridge): the nodes' code then names what it needs - "sample as KSampler does", "the APPLY_MODEL
wrappers of this patcher" - and this module is where each is read from ComfyUI, so a ComfyUI that moves one changes
this file only (and its seams in seams.py). Every import is inside a function: the nodes load without ComfyUI (the
pack's tests with fake workers).
"""
from __future__ import annotations

# the kinds of ComfyUI's patcher-extension wrappers the pack reads or adds (comfy.patcher_extension.WrappersMP)
OUTER_SAMPLE, APPLY_MODEL, DIFFUSION_MODEL = "outer_sample", "apply_model", "diffusion_model"


def _ext():
    import comfy.patcher_extension
    return comfy.patcher_extension


def wrapper_kind(kind: str) -> str:
    """ComfyUI's name of a wrapper kind (its WrappersMP constant), checked: a kind this ComfyUI lacks is an error
    here, not a wrapper silently filed under a key nothing runs."""
    return getattr(_ext().WrappersMP, kind.upper())


def wrappers_of(wrappers: dict | None, kind: str) -> dict:
    """{key: [functions]} of one kind in a patcher's or a call's `wrappers` ({} when none)."""
    return (wrappers or {}).get(wrapper_kind(kind)) or {}


def add_wrapper(patcher, kind: str, key: str, fn) -> None:
    """Add a wrapper of `kind` under `key` to a ModelPatcher (ComfyUI runs it around that stage of sampling)."""
    patcher.add_wrapper_with_key(wrapper_kind(kind), key, fn)


def run_wrapped(call, owner, functions: list, *args, **kwargs):
    """Call `call(*args, **kwargs)` through `functions` as ComfyUI runs a class's wrappers (its WrapperExecutor)."""
    return _ext().WrapperExecutor.new_class_executor(call, owner, functions).execute(*args, **kwargs)


def samplers_and_schedulers() -> tuple[list, list]:
    """KSampler's sampler and scheduler names (the node's combo lists)."""
    import comfy.samplers
    return comfy.samplers.KSampler.SAMPLERS, comfy.samplers.KSampler.SCHEDULERS


def fix_empty_latent(model, latent: dict, taken: list) -> dict:
    """ComfyUI's fix_empty_latent_channels on the LATENT's samples, with the keys of `taken` it accepts."""
    import comfy.sample
    return comfy.sample.fix_empty_latent_channels(model, latent["samples"], **{k: latent.get(k) for k in taken})


def ksample(m, latent: dict, seed, steps, cfg, sampler_name, scheduler, positive, negative, denoise, preview_from):
    """What KSampler does (nodes.common_ksampler) with the patcher `m`, the previews rendered for `preview_from`
    (the MODEL on its own load device, not the host clone the pool samples). Returns the samples."""
    import comfy.sample
    import comfy.utils
    import latent_preview
    latent_image = latent["samples"]
    noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
    callback = latent_preview.prepare_callback(preview_from, steps)
    return comfy.sample.sample(m, noise, steps, cfg, sampler_name, scheduler, positive, negative, latent_image,
                               denoise=denoise, noise_mask=latent.get("noise_mask"), callback=callback,
                               disable_pbar=not comfy.utils.PROGRESS_BAR_ENABLED, seed=seed)


def ksample_with(m, latent: dict, seed, steps, cfg, sampler_name, scheduler, positive, negative, denoise,
                 preview_from, make_sampler):
    """KSampler's noise and sigmas, sampled by the sampler object `make_sampler()` returns (ComfyUI's
    SamplerCustom path): the workers' loop."""
    import comfy.sample
    import comfy.samplers
    import latent_preview  # ComfyUI's: its callback renders previews (when enabled) and moves the bar
    latent_image = latent["samples"]
    noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
    sigmas = comfy.samplers.KSampler(m, steps=steps, device=m.load_device, sampler=sampler_name,
                                     scheduler=scheduler, denoise=denoise, model_options=m.model_options).sigmas
    callback = latent_preview.prepare_callback(preview_from, sigmas.shape[-1] - 1)  # on the MODEL's GPU
    return comfy.sample.sample_custom(m, noise, cfg, make_sampler(), sigmas, positive, negative, latent_image,
                                      noise_mask=latent.get("noise_mask"), callback=callback, seed=seed)


def sampler_object(function):
    """A ComfyUI sampler object (KSAMPLER) running `function(model, x, sigmas, extra_args, callback, disable)`."""
    import comfy.samplers
    return comfy.samplers.KSAMPLER(function)


def previews_enabled() -> bool:
    """Whether ComfyUI renders latent previews (--preview-method)."""
    from comfy.cli_args import LatentPreviewMethod, args
    return args.preview_method != LatentPreviewMethod.NoPreviews


def progress_bar(total: int):
    """ComfyUI's progress bar (the UI's and the console's), `update_absolute(step, total)`."""
    import comfy.utils
    return comfy.utils.ProgressBar(total)


def interrupted() -> bool:
    """Whether ComfyUI's interrupt button was pressed for the running prompt."""
    import comfy.model_management
    return comfy.model_management.processing_interrupted()


def raise_if_interrupted() -> None:
    """ComfyUI's own interrupt exception, when its interrupt was pressed."""
    import comfy.model_management
    comfy.model_management.throw_exception_if_processing_interrupted()


class ComfyInterrupt:
    """ComfyUI's interrupt flag as the pool's cancel token (polled while a job runs)."""

    def is_set(self) -> bool:
        return interrupted()
