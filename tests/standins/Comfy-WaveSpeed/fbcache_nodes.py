"""First Block Cache as Comfy-WaveSpeed's node applies it in ComfyUI's process, written for the tests to the node's
contract (read in its public code; none of it is here): a model function wrapper that, around each model call, puts
a cached runner in place of the diffusion model's block list. The runner computes the first block, compares its
residual on the image tokens with the previous step's (mean |r - r_prev| / mean |r_prev| below the threshold) and
then either adds the other blocks' stored residuals or runs them and stores theirs.

What the pack's bridge reads from the wrapper (workers/bridge/fbcache.py), kept as the real node keeps it: the
wrapper's closure holds `cached_transformer_blocks` (a ModuleList of one runner with `residual_diff_threshold` and
`validate_can_use_cache_function`, whose closure holds `start_sigma`, `end_sigma` and `max_consecutive_cache_hits`),
`double_blocks_name` and `single_blocks_name`. For Flux and the UNet the real node replaces the model's forward
instead (its wrapper's closure holds `patch_forward`): here that path only marks the model, for the refusal tests.
"""
import contextlib
import unittest.mock

import torch


class _Cache:
    """One sampling's cache (the real node keeps a context like it): buffers per chunk of a step, the decision."""

    def __init__(self):
        self.buffers, self.chunk, self.use = {}, 0, False

    def get(self, name):
        return self.buffers.get((name, self.chunk))

    def put(self, name, value):
        self.buffers[(name, self.chunk)] = value


class CachedJointBlocks(torch.nn.Module):
    """The runner for a block list whose blocks take (context, x) and return (context, x) - ComfyUI's MMDiT."""

    def __init__(self, blocks, *, residual_diff_threshold, validate_can_use_cache_function=None, state=None):
        super().__init__()
        self.transformer_blocks = blocks
        self.residual_diff_threshold = residual_diff_threshold
        self.validate_can_use_cache_function = validate_can_use_cache_function
        self.state = state

    def _similar(self, prev, now) -> bool:
        if prev.shape != now.shape:
            return False
        if self.state["cache"].chunk > 0:
            return True
        return ((prev - now).abs().mean() / prev.abs().mean()).item() < self.residual_diff_threshold

    def forward(self, context, x, *args, **kwargs):
        cache = self.state["cache"]
        x0 = x
        context, x = self.transformer_blocks[0](context, x, *args, **kwargs)
        first = x - x0
        prev = cache.get("first")
        use = False
        if prev is not None:
            use = self._similar(prev, first)
            if cache.chunk > 0:
                cache.use = cache.use and use
            else:
                if self.validate_can_use_cache_function is not None:
                    use = self.validate_can_use_cache_function(use)
                cache.use = use
            use = cache.use
        if use:
            rest_x, rest_c = cache.get("rest_x"), cache.get("rest_c")
            return (None if rest_c is None else rest_c + context), rest_x + x
        cache.put("first", first)
        x1, c1 = x, context
        for block in self.transformer_blocks[1:]:
            context, x = block(context, x, *args, **kwargs)
        cache.put("rest_x", x - x1)
        cache.put("rest_c", None if context is None else context - c1)
        return context, x


class ApplyFBCacheOnModel:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL",),
            "object_to_patch": ("STRING", {"default": "diffusion_model"}),
            "residual_diff_threshold": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001}),
            "start": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.01}),
            "end": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01}),
            "max_consecutive_cache_hits": ("INT", {"default": -1, "min": -1}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "wavespeed"

    def patch(self, model, object_to_patch, residual_diff_threshold, max_consecutive_cache_hits=-1, start=0.0,
              end=1.0):
        if residual_diff_threshold <= 0.0 or max_consecutive_cache_hits == 0:
            return (model,)
        state = {"cache": None, "t": None, "prev_t": None, "prev_input": None, "hits": 0}
        validate_use_cache = None
        if max_consecutive_cache_hits >= 0 or start > 0 or end < 1:
            sampling = model.get_model_object("model_sampling")
            start_sigma, end_sigma = (float(sampling.percent_to_sigma(p)) for p in (start, end))

            def validate_use_cache(use_cached):
                use_cached = use_cached and end_sigma <= state["t"] <= start_sigma
                use_cached = use_cached and (max_consecutive_cache_hits < 0 or
                                             state["hits"] < max_consecutive_cache_hits)
                state["hits"] = state["hits"] + 1 if use_cached else 0
                return use_cached

        def before_call(x, t):
            shape = (tuple(x.shape[1:]), x.dtype, x.device)
            if state["prev_t"] is None or state["prev_input"] != shape or state["cache"] is None or t > state["prev_t"]:
                state["cache"], state["hits"] = _Cache(), 0
            elif t == state["prev_t"]:
                state["cache"].chunk += 1
            else:
                state["cache"].chunk = 0
            state["t"] = t

        def after_call(x, t):
            state["prev_t"], state["prev_input"] = t, (tuple(x.shape[1:]), x.dtype, x.device)

        model = model.clone()
        diffusion_model = model.get_model_object(object_to_patch)
        if type(diffusion_model).__name__ in ("UNetModel", "Flux"):
            patch_forward = contextlib.nullcontext  # (the real node replaces forward / forward_orig here)

            def model_unet_function_wrapper(model_function, kwargs):
                with patch_forward():
                    return model_function(kwargs["input"], kwargs["timestep"], **kwargs["c"])
        else:
            double_blocks_name = next(n for n in ("transformer_blocks", "double_blocks", "joint_blocks")
                                      if hasattr(diffusion_model, n))
            single_blocks_name = "single_blocks" if hasattr(diffusion_model, "single_blocks") else None
            cached_transformer_blocks = torch.nn.ModuleList([CachedJointBlocks(
                getattr(diffusion_model, double_blocks_name), residual_diff_threshold=residual_diff_threshold,
                validate_can_use_cache_function=validate_use_cache, state=state)])

            def model_unet_function_wrapper(model_function, kwargs):
                x, t = kwargs["input"], kwargs["timestep"][0].item()
                before_call(x, t)
                singles = unittest.mock.patch.object(diffusion_model, single_blocks_name, torch.nn.ModuleList()) \
                    if single_blocks_name is not None else contextlib.nullcontext()
                with unittest.mock.patch.object(diffusion_model, double_blocks_name, cached_transformer_blocks), \
                        singles:
                    out = model_function(x, kwargs["timestep"], **kwargs["c"])
                after_call(x, t)
                return out

        model.set_model_unet_function_wrapper(model_unet_function_wrapper)
        return (model,)
