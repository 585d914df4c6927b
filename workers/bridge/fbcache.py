"""Comfy-WaveSpeed's First Block Cache on the pool: the node's parameters read from its wrapper, refused before work
where the workers cannot apply its rule exactly.

Why: the node's model function wrapper swaps ComfyUI's block list for a cached runner around each model call - on
ComfyUI's own model object, which never runs on the pool. The wrapper itself can run in the driver as it is (its
swap there is inert); the workers apply the same rule to their model (parallel/fbcache.py), its similarity reduced
over the ranks. What the rule needs travels with each call: the threshold, the node's sigma window and run limit,
and the call's sigma (the node compares sigmas; the model is handed ComfyUI's converted timestep).

Read from the wrapper's closure as the node keeps it (Comfy-WaveSpeed's fbcache_nodes.py, read in its public code):
`cached_transformer_blocks` - one runner with `residual_diff_threshold` and `validate_can_use_cache_function`
(whose closure holds `start_sigma`, `end_sigma`, `max_consecutive_cache_hits`) - with `double_blocks_name` and
`single_blocks_name`. For Flux and the UNet the node replaces the model's forward instead (`patch_forward`): refused.
"""
from __future__ import annotations

from ...parallel.fbcache import FirstBlockRule
from ...parallel.models import adapter_for
from .origin import NotCarried, function_rule, origin_of

# families whose block list the rule runs on as the node does, checked against KSampler with the node
# (tests/server_e2e/test_first_block_cache.py): one block list, blocks taking and returning the image and text streams
FAMILIES = ("sd3",)
IMAGE_STREAMS = ("x", "img", "hidden_states")
FIX = ("use Parallel Config's step_cache (EasyCache's rule on the workers) or ComfyUI's EasyCache node, or remove "
       "Apply First Block Cache")


def _cells(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    return dict(zip(code.co_freevars, (c.cell_contents for c in getattr(fn, "__closure__", None) or ())))


def first_block_rule(fn, diffusion_model, config, compiled: bool = False) -> FirstBlockRule:
    """The rule of First Block Cache's wrapper `fn` for this model and config; NotCarried (before any worker starts)
    where the workers cannot apply it exactly."""
    name = type(diffusion_model).__name__
    cells = _cells(fn)
    runners = cells.get("cached_transformer_blocks")
    adapter = adapter_for(diffusion_model)
    family = getattr(adapter, "family", None)
    if runners is None or family not in FAMILIES:
        raise NotCarried(f"Apply First Block Cache on {name} runs its cache inside the model's own forward, which the "
                         f"pack carries for SD3/3.5 only (checked against KSampler with the node); {FIX}")
    plan = adapter.comfy_plan.pipeline
    lists = plan.blocks if plan is not None else ()
    if len(lists) != 1 or lists[0].path != cells.get("double_blocks_name") or cells.get("single_blocks_name"):
        raise NotCarried(f"Apply First Block Cache on {name} caches the block list "
                         f"{cells.get('double_blocks_name')!r}, which is not the one block list the pack's plan for "
                         f"{adapter.title} runs it on; {FIX}")
    if config.pp_degree > 1 or config.method == "distrifusion" or not config.whole_model:
        raise NotCarried("Apply First Block Cache runs on the pool with ulysses / ring / cfg / dp / tp degrees (method "
                         "usp, shard_weights none): PipeFusion and DistriFusion keep stale activations per step, which "
                         f"the cache's residuals would replace; {FIX}")
    if compiled:
        raise NotCarried(f"Apply First Block Cache does not run on a compiled model on the pool; remove "
                         f"TorchCompileModel, or {FIX}")
    runner = runners[0]
    threshold = float(getattr(runner, "residual_diff_threshold"))
    validate = getattr(runner, "validate_can_use_cache_function", None)
    window = {}
    if validate is not None:
        v = _cells(validate)
        missing = [k for k in ("start_sigma", "end_sigma", "max_consecutive_cache_hits") if k not in v]
        if missing:
            raise NotCarried(f"Apply First Block Cache's validation keeps its settings where the pack does not read "
                             f"them ({missing}); {FIX}")
        window = {"validate": True, "start_sigma": float(v["start_sigma"]), "end_sigma": float(v["end_sigma"]),
                  "max_hits": int(v["max_consecutive_cache_hits"])}
    block_list = lists[0]
    streams = tuple((s, None) if isinstance(s, str) else tuple(s) for s in block_list.streams)  # None: by name
    image = next((s for s, _ in streams if s in IMAGE_STREAMS), None)
    if image is None:
        raise NotCarried(f"the pack's plan for {adapter.title} names no image stream for First Block Cache; {FIX}")
    return FirstBlockRule(blocks=block_list.path, streams=streams, returns=tuple(block_list.returns), image=image,
                          threshold=threshold, **window)


def without_fbcache_wrapper(patcher=None, model_options: dict | None = None) -> None:
    """Take First Block Cache's model function wrapper out of `patcher`'s options (the pool's clone) or a run's
    `model_options` (a guider's): the workers apply its rule; in the driver it would only swap ComfyUI's block list
    around each pool call - while the pool reads that model's weights for its first load, which then no longer match
    ComfyUI's class. Its wrapper calls the model function with the very arguments ComfyUI does without it."""
    options = patcher.model_options if patcher is not None else (model_options or {})
    fn = options.get("model_function_wrapper")
    rule = function_rule(origin_of(fn)) if fn is not None else None
    if rule is not None and rule.carry == "fbcache":
        options.pop("model_function_wrapper")


def call_sigma(transformer_options) -> float | None:
    """The sigma of a model call (ComfyUI puts it in transformer_options["sigmas"] before its model function
    wrapper): what First Block Cache compares."""
    sigmas = (transformer_options or {}).get("sigmas")
    try:
        return float(sigmas.reshape(-1)[0])
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
