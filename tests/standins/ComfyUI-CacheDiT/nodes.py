"""CacheDiT Accelerator's mechanism (see __init__.py)."""
import comfy.patcher_extension


class CacheConfig:
    def __init__(self, warmup_steps: int, skip_interval: int):
        self.warmup_steps, self.skip_interval, self.current_step = warmup_steps, skip_interval, 0


def _outer_sample(executor, *args, **kwargs):
    guider = executor.class_obj
    transformer = guider.model_patcher.model.diffusion_model
    config = guider.model_options["transformer_options"]["cache_dit_turbo"]
    original = transformer.forward
    calls = {"n": 0, "last": None}

    def cached_forward(*a, **k):
        calls["n"] += 1
        after = calls["n"] - config.warmup_steps
        if after > 0 and after % config.skip_interval == 0 and calls["last"] is not None:
            return calls["last"]
        calls["last"] = original(*a, **k)
        return calls["last"]

    transformer.forward = cached_forward  # in place, on ComfyUI's own model object
    try:
        return executor(*args, **kwargs)
    finally:
        del transformer.forward


def _diffusion_model(executor, *args, **kwargs):
    options = args[-1] if isinstance(args[-1], dict) else kwargs.get("transformer_options", {})
    config = options.get("cache_dit_turbo")
    if config is not None:
        config.current_step += 1
    return executor(*args, **kwargs)


class CacheDiT_Model_Optimizer:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "enable": ("BOOLEAN", {"default": True}),
                             "warmup_steps": ("INT", {"default": 2, "min": 0}),
                             "skip_interval": ("INT", {"default": 2, "min": 1})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "optimize"
    CATEGORY = "CacheDiT"

    def optimize(self, model, enable, warmup_steps, skip_interval):
        if not enable:
            return (model,)
        model = model.clone()
        model.model_options.setdefault("transformer_options", {})["cache_dit_turbo"] = CacheConfig(warmup_steps,
                                                                                                   skip_interval)
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "cache_dit_turbo", _outer_sample)
        model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "cache_dit_turbo",
                                   _diffusion_model)
        return (model,)
