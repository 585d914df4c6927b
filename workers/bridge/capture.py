"""The capture: everything ComfyUI hands the sampler besides the weights, enumerated channel by channel - fail closed.

Why: a MODEL reaching the pack carries what every node before it added: weight patches, hook LoRAs, object patches,
injections, wrappers and callbacks, additional models, attachments, model_options with CFG functions and
transformer_options, and conds with hooks, controls and areas. Listing what the pack carries and letting the rest
through gave silently different pictures (a hook or an object patch left out). Here every channel of ComfyUI 0.33's
ModelPatcher and conds is walked; each thing found gets a verdict from workers/bridge/known.py for the sampling
mode - DRIVER (ComfyUI runs it in its own process, as under KSampler), CARRIED (travels to the workers), or REFUSED
- and anything no rule names is refused. `Capture.check` raises before any worker starts or any step runs, naming
the node that put it there (workers/bridge/graph.py). A channel a later ComfyUI adds is refused until classified:
`unknown_channels` lists the attributes of the ModelPatcher this module does not read.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import known
from .classified import unclassified
from .graph import Graph, class_of_origin, classes_of_module
from .known import CARRIED, DRIVER, IGNORED, REFUSED, Rule
from .origin import NotCarried, bypass_adapters, function_rule, origin_of  # noqa: F401 (NotCarried: re-exported)

OWN_KEY = "comfyui_hybrid_parallel"  # the pack's own wrappers (nodes: WRAPPER_KEY): never a finding


@dataclass(frozen=True)
class Found:
    """One thing a node put on the MODEL or a conditioning, and the rule that decides it."""
    what: str            # for the user: "a post-CFG function", "object patch 'manual_cast_dtype'"
    origin: str          # "module:qualname" of the function or holder class ("" for plain values)
    rule: Rule
    detail: dict = field(default_factory=dict, compare=False)  # what a CARRIED item needs (carry.py)


@dataclass
class Capture:
    mode: str                       # "step" (ComfyUI's sampler, each model call on the pool) or "loop"
    found: list = field(default_factory=list)
    graph: Graph = field(default_factory=Graph)  # the prompt, to name nodes (check sets it)

    def creator(self, f: Found) -> str:
        """The node(s) that added `f`, as the user sees them."""
        return _creator(f, self.graph)

    def verdicts(self) -> list:
        return [(f, f.rule.verdict(self.mode)) for f in self.found]

    def refused(self) -> list:
        return [f for f, v in self.verdicts() if v == REFUSED]

    def carried(self, kind: str) -> list:
        return [f for f, v in self.verdicts() if v == CARRIED and f.rule.carry == kind]

    def check(self, who: str, graph: Graph | None = None) -> None:
        """Raise NotCarried for the refused findings (the first three), each naming its node."""
        self.graph = graph or self.graph
        refused = self.refused()
        if not refused:
            return
        groups = {}  # one sentence per node and reason: "X adds a and b: why; fix"
        for f in refused:
            why = f.rule.why or "the pack does not know what it does, so it cannot carry it exactly"
            groups.setdefault((self.creator(f), why, f.rule.fix), []).append(f.what)
        parts = [f"{by} adds {' and '.join(dict.fromkeys(whats))}: {why}; {fix}"
                 for (by, why, fix), whats in list(groups.items())[:3]]
        more = f" (and {len(groups) - 3} more)" if len(groups) > 3 else ""
        mode = "the workers' own loop" if self.mode == "loop" else "the pool"
        raise NotCarried(f"{who} cannot run this graph on {mode} exactly - " + ". ".join(parts) + more)


def _creator(f: Found, graph: Graph) -> str:
    """The node(s) that added `f`: by the class whose code defined its function, else the classes known to add it,
    else every upstream node of an unclassified class."""
    classes = tuple(c for c in (class_of_origin(f.origin) if f.origin else None,) if c) + tuple(f.rule.nodes)
    if not classes and f.origin:
        classes = classes_of_module(f.origin)
    named = graph.name(classes) if classes else None
    if named:
        return named
    if graph.prompt and not classes:
        named = graph.name(tuple(unclassified(graph.class_type(n) for n in graph.upstream())))
        if named:
            return f"a node upstream ({named})"
    if classes:
        return f"a {classes[0]} node" if len(classes) == 1 else f"a node ({' / '.join(classes[:4])})"
    return f"a node ({f.origin})" if f.origin else "a node upstream"


UNKNOWN_FUNCTION = Rule(REFUSED, REFUSED, why="a function from a node the pack has not checked: it may act inside "
                                              "the model call, which runs on the workers")


def _functions(value, what: str, out: list) -> None:
    for fn in value if isinstance(value, (list, tuple)) else [value]:
        origin = origin_of(fn)
        rule = function_rule(origin) or UNKNOWN_FUNCTION
        out.append(Found(f"{what} ({origin.partition(':')[2]})", origin, rule, {"function": fn}))


# ---- the ModelPatcher's channels (ComfyUI 0.33) ----
READ = {"patches", "object_patches", "weight_wrapper_patches", "model_options", "injections", "wrappers", "callbacks",
        "additional_models", "attachments", "hook_patches", "current_hooks", "forced_hooks"}
# ModelPatcher attributes that are bookkeeping (devices, sizes, backups, ids, caches) - nothing a node adds
BOOKKEEPING = {"size", "model", "backup", "backup_buffers", "object_patches_backup", "load_device", "offload_device",
               "weight_inplace_update", "force_cast_weights", "patches_uuid", "parent", "pinned", "is_injected",
               "skip_injection", "hook_patches_backup", "hook_backup", "cached_hook_patches", "is_clip", "hook_mode",
               "cached_patcher_init", "is_multigpu_base_clone", "clone_base_uuid", "model_lowvram",
               "lowvram_patch_counter", "model_loaded_weight_memory", "current_weight_patches_uuid",
               "model_offload_buffer_memory", "non_dynamic_delegate_model"}


def unknown_channels(patcher) -> list:
    """The ModelPatcher's attributes this module neither reads nor knows as bookkeeping: a channel a newer ComfyUI
    added (a test fails on it; the capture refuses a MODEL that fills one). A custom loader's patcher class (GGUF's)
    declares its own plain settings as class attributes: those travel with it (workers/bridge/loader_types.describe_patcher)."""
    return sorted(k for k in vars(patcher) if k not in READ | BOOKKEEPING and not k.startswith("_")
                  and not _loader_setting(patcher, k))


def _loader_setting(patcher, name: str) -> bool:
    """`name` is a plain value a ModelPatcher subclass declares on its class (a loader's own setting)."""
    import comfy.model_patcher as mp
    value = getattr(patcher, name, None)
    if not (value is None or isinstance(value, (str, int, float, bool))):
        return False
    for base in type(patcher).__mro__:
        if base is mp.ModelPatcher or not issubclass(base, mp.ModelPatcher):
            return False
        if name in vars(base):
            return True
    return False


def _empty(value) -> bool:
    if value is None:
        return True
    if isinstance(value, dict):
        return all(_empty(v) for v in value.values())
    if isinstance(value, (list, tuple, set)):
        return len(value) == 0
    return False


def capture(patcher, mode: str, *, model_options: dict | None = None, conds=None, carried_options=()) -> Capture:
    """Every thing `patcher` (a ModelPatcher), its `model_options` (a guider's, when given) and `conds` carry, with its
    verdict for `mode`. `conds`: Hybrid Sampler's CONDITIONING lists, or a guider's {name: [cond dict]}.
    `carried_options`: the transformer_options entries the model's family reads (FamilyAdapter.carried_options)."""
    out = Capture(mode)
    f = out.found
    if patcher.patches:
        f.append(Found("weight patches (LoRA)", "", Rule(CARRIED, CARRIED, carry="weights")))
    for key, value in patcher.object_patches.items():
        _object_patch(key, value, f)
    if not _empty(patcher.weight_wrapper_patches):
        f.append(Found("weight wrappers", "", known.WEIGHT_WRAPPERS))
    for key, injections in patcher.injections.items():
        if not injections:
            continue
        adapters = bypass_adapters(injections) if key == "bypass_lora" else None
        if adapters is not None:  # ComfyUI's LoRA bypass: its adapters travel, the workers inject them as it does
            f.append(Found("a LoRA in bypass mode", "", known.BYPASS, {"adapters": adapters}))
        else:
            f.append(Found(f"injections '{key}'", origin_of(getattr(injections[0], "inject", injections[0])),
                           known.INJECTIONS))
    _wrappers(patcher.wrappers, f)
    _callbacks(patcher.callbacks, f)
    for key, models in patcher.additional_models.items():
        if models:
            rule = known.ADDITIONAL_MODELS.get(key) or Rule(REFUSED, REFUSED, why="it adds a model ComfyUI loads "
                                                            "beside this one in its own process")
            f.append(Found(f"additional models '{key}'", "", rule))
    for key, value in patcher.attachments.items():
        rule = known.ATTACHMENTS.get(key) or Rule(REFUSED, REFUSED, why="it attaches an object ComfyUI's model "
                                                  "reads in its own process")
        f.append(Found(f"attachment '{key}'", origin_of(value), rule))
    if not _empty(patcher.hook_patches) or patcher.current_hooks is not None:
        f.append(Found("hook weight patches", "", known.HOOKS))
    for name in unknown_channels(patcher):
        if not _empty(getattr(patcher, name)):
            f.append(Found(f"ModelPatcher.{name} (a channel of a ComfyUI newer than the pack knows)", "",
                           Rule(REFUSED, REFUSED, why="the pack does not read it yet", fix="update the pack, or "
                                "remove that node")))
    _model_options(patcher.model_options if model_options is None else model_options, f, carried_options)
    if conds is not None:
        _conds(conds, mode, f)
    return out


def _object_patch(key: str, value, f: list) -> None:
    rule = known.OBJECT_PATCHES.get(key)
    if rule is None and key.startswith("diffusion_model.") and (value is None or isinstance(value, (str, int, float,
                                                                                                       bool))):
        rule = known.PLAIN_OBJECT_PATCH
    if rule is None and not key.startswith("diffusion_model."):
        rule = known.BASE_MODEL_PATCH
    if rule is None:
        rule = Rule(REFUSED, REFUSED, why="it replaces a part of ComfyUI's model in ComfyUI's process; the workers "
                                          "build their own model, without it")
    f.append(Found(f"object patch '{key}'", "" if _plain(value) else origin_of(value), rule,
                   {"key": key, "value": value}))


def _plain(value) -> bool:
    import torch
    return value is None or isinstance(value, (str, int, float, bool, torch.dtype))


def _wrappers(wrappers: dict, f: list) -> None:
    _keyed(wrappers, known.WRAPPERS, "wrapper", "a wrapper the pack has not checked: it may act inside the model "
                                                "call, which runs on the workers", f)


def _callbacks(callbacks: dict, f: list) -> None:
    _keyed(callbacks, known.CALLBACKS, "callback", "a callback the pack has not checked", f)


def _keyed(by_kind: dict, table: dict, noun: str, why: str, f: list) -> None:
    """ComfyUI's wrappers or callbacks ({type: {key: [functions]}}), each function with its rule."""
    for kind, by_key in (by_kind or {}).items():
        for key, fns in (by_key or {}).items():
            if key == OWN_KEY or not fns:
                continue
            for fn in fns:
                origin = origin_of(fn)
                rule = _keyed_rule(table, kind, key, origin) or Rule(REFUSED, REFUSED, why=why)
                f.append(Found(f"a {noun} ({kind} '{key}')" if key is not None else f"a {kind} {noun}", origin, rule))


def _keyed_rule(table: dict, kind, key, origin: str) -> Rule | None:
    """The rule of a wrapper / callback: by its (type, key) where its function comes from where that rule expects
    (known.WRAPPER_ORIGINS), else - unkeyed, or keyed but unknown - by where its function was defined."""
    rule = table.get((str(kind), str(key))) if key is not None else None
    need = known.WRAPPER_ORIGINS.get((str(kind), str(key)))
    if rule is not None and (need is None or origin.startswith(need)):
        return rule
    return function_rule(origin)


def _model_options(options: dict, f: list, carried_options) -> None:
    for key, value in (options or {}).items():
        if key in known.FUNCTION_OPTIONS:
            if not _empty(value):
                _functions(value, known.FUNCTION_OPTIONS[key], f)
            continue
        rule = known.MODEL_OPTIONS.get(key)
        if rule is None:
            rule = Rule(REFUSED, REFUSED, why="a sampling option the pack does not know")
        elif rule.step == IGNORED:
            continue
        if key == "disable_cfg1_optimization" and not value:
            continue
        f.append(Found(f"model option '{key}'", "" if _plain(value) else origin_of(value), rule))
    _transformer_options((options or {}).get("transformer_options") or {}, f, carried_options)


def _transformer_options(opts: dict, f: list, carried_options) -> None:
    for key, value in opts.items():
        if key == "patches":
            for slot, fns in (value or {}).items():
                for fn in fns or ():
                    origin = origin_of(fn)
                    rule = function_rule(origin)
                    if rule is None or rule.carry != "closure":
                        rule = Rule(REFUSED, REFUSED, why=known.INSIDE)
                    f.append(Found(f"a model patch (patches['{slot}'])", origin, rule, {"function": fn}))
        elif key == "patches_replace":
            for kind, entries in (value or {}).items():
                for where, fn in (entries or {}).items():
                    f.append(Found(f"a block replacement (patches_replace['{kind}'] at {where})", origin_of(fn),
                                   Rule(REFUSED, REFUSED, why=known.INSIDE)))
        elif key in ("wrappers", "callbacks"):
            (_wrappers if key == "wrappers" else _callbacks)(value, f)
        elif key in carried_options:  # (the workers' own loop calls the model without transformer options)
            f.append(Found(f"transformer option '{key}'", "", Rule(CARRIED, REFUSED, carry="family_option",
                                                                    why=known.TRANSFORMER_OPTIONS["rope_options"].why,
                                                                    fix=known.STEP_FIX)))
        elif value is not None:
            rule = known.TRANSFORMER_OPTIONS.get(key) or Rule(
                REFUSED, REFUSED, why="an entry the diffusion model may read inside the call, which the pack does not "
                                      "know how to carry")
            if rule.step != IGNORED:
                f.append(Found(f"transformer option '{key}'", "" if _plain(value) else origin_of(value), rule))


# ---- conds ----
def cond_dicts(conds) -> list:
    """(name, cond dict) of Hybrid Sampler's CONDITIONING lists ({"positive": [[tensor, dict], ...]}) or a guider's
    converted conds ({"positive": [dict, ...]})."""
    out = []
    for name, entries in (conds or {}).items():
        for c in entries or ():
            d = c[1] if isinstance(c, (list, tuple)) and len(c) == 2 and isinstance(c[1], dict) else c
            if isinstance(d, dict):
                out.append((name, d))
    return out


LOOP_COND_KEYS = ("area", "mask", "start_percent", "end_percent", "timestep_start", "timestep_end", "control",
                  "gligen", "hooks", "set_area_to_bounds")


def _conds(conds, mode: str, f: list) -> None:
    dicts = cond_dicts(conds)
    weight_hooks, other_hooks = [], []
    for name, d in dicts:
        groups = [d.get("hooks")] + [h for h in _control_hooks(d.get("control"))]
        for group in groups:
            for hook in getattr(group, "hooks", None) or ():
                (weight_hooks if _is_weight_hook(hook) else other_hooks).append(hook)
        if d.get("gligen") is not None:
            f.append(Found("a GLIGEN position patch", "", known.GLIGEN))
    if weight_hooks:
        f.append(Found("hook LoRAs on a conditioning", "", known.HOOKS, {"hooks": weight_hooks}))
    for hook in other_hooks:
        f.append(Found(f"a {type(hook).__name__} on a conditioning", origin_of(hook), known.OTHER_HOOKS))
    if mode != "loop":
        return
    per_side = {}
    for name, d in dicts:
        per_side[name] = per_side.get(name, 0) + 1
        used = [k for k in LOOP_COND_KEYS if d.get(k) is not None and k != "hooks"]
        if d.get("strength", 1.0) != 1.0:
            used.append("strength")
        for k in used:
            what = "a ControlNet" if k == "control" else f"a conditioning '{k}'"
            f.append(Found(f"{what} ({name})", "", Rule(DRIVER, REFUSED, why=known.CONDS_LOOP_FIX, fix=known.STEP_FIX,
                                                        nodes=known.COND_NODES.get(k, ()))))
    for name, n in per_side.items():
        if n > 1:
            f.append(Found(f"{n} {name} conditionings (combined)", "", Rule(
                DRIVER, REFUSED, why=known.CONDS_LOOP_FIX, fix=known.STEP_FIX, nodes=known.COND_NODES["combined"])))


def _control_hooks(control) -> list:
    out = []
    while control is not None:
        extra = getattr(control, "extra_hooks", None)
        if extra is not None:
            out.append(extra)
        control = getattr(control, "previous_controlnet", None)
    return out


def _is_weight_hook(hook) -> bool:
    import comfy.hooks
    return isinstance(hook, comfy.hooks.WeightHook)
