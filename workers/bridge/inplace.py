"""A model changed in place - outside ModelPatcher - is found before any work, as findings of the capture.

Why: the workers build their own diffusion model from ComfyUI's class and the weights (workers/bridge/build.py).
Whatever a node changed on ComfyUI's model object itself never reaches them: ComfyUI-PuLID-Flux replaces
`forward_orig` on the Flux instance and adds `pulid_ca` modules to it, BrushNet replaces functions of ComfyUI's model
code module-wide, other packs replace a method on ComfyUI's class. Under KSampler those changes run; on the pool they
were silently absent (2.6e-2 from KSampler, the node's whole effect). ModelPatcher's channels are the capture's
(capture.py); this module reads the model object and ComfyUI's code:

- instance: a module of the diffusion model (or the BaseModel) holding a callable from outside ComfyUI in its own
  `__dict__` (a method replaced on the instance, a function put there), or such a torch forward / pre-forward hook;
- structure: the submodules (and, where the layer class is the one the workers build, the parameters and buffers)
  differ from those of ComfyUI's class built from the model's config, as the workers build it (an added `pulid_ca`
  is a refusal, not a silently dropped key);
- class: a method of one of ComfyUI's model classes, or a function or class of ComfyUI's model code (`comfy.ldm.*`:
  the modules the model's classes live in and the model-code modules they name), whose code lives outside ComfyUI;
- sampler (the workers' own loop only): ComfyUI's sampling functions are its own. In step mode ComfyUI's sampler
  runs in its own process, as under KSampler: a replaced sampling function runs there too.

Code is ComfyUI's by where it lives (`__code__.co_filename` inside ComfyUI's tree, outside its custom_nodes); the
pack's own code and installed libraries (torch, einops, comfy-kitchen...) are not findings. What ComfyUI itself puts
on layer instances (ModelPatcher's per-layer `weight_function` / `bias_function` lists, cast flags, DynamicVRAM's
state) are not callables and are not read; a custom loader's layer classes (GGUF's) are its own classes, not ComfyUI's,
and travel with the loader (workers/bridge/loader_types.py). Where a replacement was defined names the node
(graph.class_of_origin, else a node class of the same module), as for the capture's findings.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import sysconfig
import types
from typing import NamedTuple

import torch
import torch.nn.modules.module as torch_module

from ..messages import NativeSpec
from .build import decode_value
from .capture import Found
from .carry import encode_value
from .known import IN_PLACE_ATTENTION, IN_PLACE_MODEL, IN_PLACE_SAMPLER, IN_PLACE_STRUCTURE
from .origin import module_name

# torch's hook dicts on a module (the forward path; state-dict hooks do not change what a call computes)
HOOK_SLOTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# ComfyUI's sampling code the workers' own loop stands in for (loop mode, PipeFusion)
SAMPLER_MODULES = ("comfy.samplers", "comfy.sample", "comfy.sampler_helpers", "comfy.k_diffusion.sampling")
PACK_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def comfy_root() -> str | None:
    """ComfyUI's directory in this process (the folder holding its `comfy` package), None without ComfyUI."""
    f = getattr(sys.modules.get("comfy.model_management"), "__file__", None)
    return os.path.dirname(os.path.dirname(os.path.abspath(f))) if f else None


def library_folders(comfy: str | None) -> set:
    """The folders on sys.path that installed libraries live in besides the interpreter's own scheme (sysconfig's
    purelib): `pip install --user`'s site, a `pip install --target` folder or an image's packages put on the path by
    PYTHONPATH or a .pth file. Such a folder holds the distributions' `*.dist-info` / `*.egg-info` records; one inside
    ComfyUI's tree or under a custom_nodes folder never counts (a pack that put its own folder on sys.path stays a
    pack). Why: torch's or einops' functions imported from there were taken for a node's code, and every graph on
    such an installation was refused ("a node (torch.functional:einsum) adds ...": the GPU kit's rehearsal)."""
    return set(_library_folders(tuple(sys.path), comfy))


@functools.lru_cache(maxsize=64)
def _library_folders(entries: tuple, comfy: str | None) -> frozenset:
    """library_folders for one sys.path (read once per path: the check runs at every prompt)."""
    found = set()
    for entry in entries:
        path = os.path.abspath(entry) if entry else ""
        if not path or not os.path.isdir(path) or "custom_nodes" in path.split(os.sep):
            continue
        if comfy and (path == comfy or path.startswith(comfy + os.sep)):
            continue
        try:
            names = os.listdir(path)
        except OSError:
            continue
        if any(n.endswith((".dist-info", ".egg-info")) for n in names):
            found.add(path)
    return frozenset(found)


def _roots(comfy: str | None) -> tuple:
    """(folder, kind) by which a file's place is judged, the longest folder holding it deciding: ComfyUI's tree is
    'comfy' but for its custom_nodes ('foreign'); the pack is 'own' (installed in custom_nodes, or a checkout
    holding a venv with ComfyUI inside), its tests 'foreign' (their stand-in nodes are other packs); Python and the
    installed libraries 'own' (the interpreter's scheme and `library_folders`)."""
    paths = sysconfig.get_paths()
    roots = [(os.path.abspath(r), "own") for r in {paths.get(k) for k in ("stdlib", "platstdlib", "purelib",
                                                                             "platlib")} | {sys.base_prefix} if r]
    roots += [(r, "own") for r in library_folders(comfy)]
    roots += [(PACK_ROOT, "own"), (os.path.join(PACK_ROOT, "tests"), "foreign")]
    if comfy:
        roots += [(comfy, "comfy"), (os.path.join(comfy, "custom_nodes"), "foreign")]
    return tuple(sorted(roots, key=lambda r: -len(r[0])))


@functools.lru_cache(maxsize=8192)
def _where(filename: str, roots: tuple) -> str:
    """'comfy', 'own' (the pack, a library, Python itself) or 'foreign' (a custom node, a user's file) for a code
    object's file. Generated code ('<string>': dataclasses' methods) counts as its maker's: 'own'. A folder named
    custom_nodes anywhere (a ComfyUI's base directory elsewhere) is another pack's."""
    if filename.startswith("<"):
        return "own"
    path = os.path.abspath(filename)
    kind = next((k for r, k in roots if path.startswith(r + os.sep)), "foreign")
    if kind == "own" and "custom_nodes" in path.split(os.sep) and not path.startswith(PACK_ROOT + os.sep):
        return "foreign"
    return kind


def _codes(value) -> list:
    """The functions behind a callable: unwrapped through methods, partials, descriptors and decorators
    (`__wrapped__`, a foreign function under a library's decorator is still foreign)."""
    out, todo, seen = [], [value], set()
    while todo:
        v = todo.pop()
        if id(v) in seen or v is None:
            continue
        seen.add(id(v))
        if isinstance(v, (staticmethod, classmethod)):
            todo.append(v.__func__)
        elif isinstance(v, property):
            todo += [v.fget, v.fset]
        elif isinstance(v, functools.partial):
            todo.append(v.func)
        elif isinstance(v, types.MethodType):
            todo.append(v.__func__)
        elif isinstance(v, types.FunctionType):
            out.append(v)
            todo.append(getattr(v, "__wrapped__", None))
        elif callable(v) and not isinstance(v, type) and hasattr(type(v), "__call__"):
            call = getattr(type(v), "__call__", None)
            if isinstance(call, types.FunctionType):
                out.append(call)
            todo.append(getattr(v, "__wrapped__", None))
    return out


class Reader:
    """Where code lives, for one check (ComfyUI's root and the libraries' read once)."""

    def __init__(self, comfy: str | None = None):
        self.comfy = comfy if comfy is not None else comfy_root()
        self.roots = _roots(self.comfy)

    def foreign(self, value) -> types.FunctionType | None:
        """The first function behind `value` whose code lives outside ComfyUI, the pack and the libraries."""
        for fn in _codes(value):
            if _where(fn.__code__.co_filename, self.roots) == "foreign":
                return fn
        return None

    def kind_of_class(self, cls) -> str:
        """Where a class was defined: 'comfy', 'own' or 'foreign' (by its module's file)."""
        mod = sys.modules.get(getattr(cls, "__module__", ""))
        f = getattr(mod, "__file__", None)
        return _where(f, self.roots) if f else "own"

    def comfy_class(self, cls) -> bool:
        """A class defined in ComfyUI's tree (not in a custom node)."""
        return self.kind_of_class(cls) == "comfy"


def origin(fn) -> str:
    fn = getattr(fn, "__func__", fn)
    return f"{module_name(getattr(fn, '__module__', '?') or '?')}:{getattr(fn, '__qualname__', '?')}"


def _found(what: str, org: str, rule):
    return Found(what, org, rule)


# ---- instance ----
def instance_findings(base_model, reader: Reader) -> list:
    """Callables and torch hooks from outside ComfyUI that a node put on the modules of `base_model` (the BaseModel
    and its diffusion model). ComfyUI's own code on an instance is ModelPatcher's doing (its LoRA bypass injection
    replaces a layer's `forward` with its own hook while it is injected): a channel the capture reads, not a change
    made in place."""
    out = []
    for path, m in base_model.named_modules():
        where = f"{type(m).__name__}" + (f" '{path}'" if path else "")
        cls = type(m)
        for name, value in vars(m).items():
            if name.startswith("_") or not callable(value) or isinstance(value, type) or _module_or_tensor(value):
                continue
            bad = reader.foreign(value)
            if bad is not None:
                what = "replaced" if callable(getattr(cls, name, None)) else "put"
                out.append(_found(f"'{name}' {what} on the model's {where} ({origin(bad)})", origin(bad),
                                  IN_PLACE_MODEL))
        for slot in HOOK_SLOTS:
            for hook in (getattr(m, slot, None) or {}).values():
                bad = reader.foreign(hook)
                if bad is not None:
                    out.append(_found(f"a torch hook on the model's {where} ({origin(bad)})", origin(bad),
                                      IN_PLACE_MODEL))
    for slot in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"):
        # torch's global module hooks run on every module of every model
        for hook in (getattr(torch_module, slot, None) or {}).values():
            bad = reader.foreign(hook)
            if bad is not None:
                out.append(_found(f"a global torch module hook ({origin(bad)})", origin(bad), IN_PLACE_MODEL))
    return out


def _module_or_tensor(value) -> bool:
    return isinstance(value, (torch.nn.Module, torch.Tensor))


# ---- structure ----
@functools.lru_cache(maxsize=32)
def _built_structure(module: str, cls_name: str, config_json: str) -> dict:
    """{submodule path: (class, sorted tensor names)} of ComfyUI's class built on the meta device from its config,
    with ComfyUI's plain operations: what the workers' model holds (cached per class and config)."""
    import importlib

    import comfy.ops  # lazy: ComfyUI (the pack loads without it)
    cls = importlib.import_module(module)
    for part in cls_name.split("."):
        cls = getattr(cls, part)
    model = cls(**decode_value(json.loads(config_json)), device=torch.device("meta"),
                operations=comfy.ops.disable_weight_init)
    return {p: (type(m), tuple(sorted(set(m._parameters) | set(m._buffers)))) for p, m in model.named_modules()}


def built_structure(spec: BuildKey | NativeSpec | None) -> dict | None:
    """`_built_structure` of what the workers build (a BuildKey, or the whole NativeSpec: both name the module, the
    class and its unet_config); None where the class does not build on the meta device here (the workers then say so
    themselves)."""
    if spec is None:
        return None
    try:
        return _built_structure(spec.module, spec.class_name, json.dumps(spec.unet_config, sort_keys=True))
    except Exception:  # noqa: BLE001
        return None


def structure_findings(diffusion_model, built: dict, reader: Reader) -> list:
    """Submodules, parameters and buffers the driver's diffusion model has and the workers' would not (or lacks).
    An added module is named by the first class inside it that is another pack's (a ModuleList of PuLID's blocks)."""
    have = dict(diffusion_model.named_modules())

    def named(m) -> str:
        cls = next((type(x) for x in m.modules() if reader.kind_of_class(type(x)) == "foreign"), type(m))
        return f"{module_name(cls.__module__)}:{cls.__qualname__}"
    out = []
    added = sorted(p for p in set(have) - set(built) if p.rpartition(".")[0] in built or "." not in p)
    gone = sorted(p for p in set(built) - set(have) if p.rpartition(".")[0] in have or "." not in p)
    for p in added[:4]:
        org = named(have[p])
        out.append(_found(f"a module '{p}' ({org.rpartition(':')[2]}) added to ComfyUI's "
                          f"{type(diffusion_model).__name__}", org, IN_PLACE_STRUCTURE))
    for p in gone[:4]:
        out.append(_found(f"the module '{p}' removed from ComfyUI's {type(diffusion_model).__name__}", "",
                          IN_PLACE_STRUCTURE))
    for p, m in have.items():
        if p not in built or built[p][0] is not type(m):
            continue  # a loader's own layer class (GGUF, mixed precision) holds its tensors its own way
        names = tuple(sorted({k for k, v in m._parameters.items() if v is not None} | set(m._buffers)))
        if not set(names) <= set(built[p][1]):
            extra = sorted(set(names) - set(built[p][1]))
            out.append(_found(f"tensors {extra[:3]} added to '{p}' of ComfyUI's {type(diffusion_model).__name__}", "",
                              IN_PLACE_STRUCTURE))
    return out


# ---- class and module code ----
def model_code_modules(diffusion_model, reader: Reader) -> list:
    """ComfyUI's model-code modules (`comfy.ldm.*`) the diffusion model runs: those its classes live in, and the
    model-code modules those name (attention, RoPE, shared blocks)."""
    names = {c.__module__ for m in diffusion_model.modules() for c in type(m).__mro__ if reader.comfy_class(c)}
    names = {n for n in names if n.startswith("comfy.ldm.")}
    for n in list(names):
        for v in vars(sys.modules[n]).values():
            ref = v.__name__ if isinstance(v, types.ModuleType) else getattr(v, "__module__", None)
            if isinstance(ref, str) and ref.startswith("comfy.ldm.") and ref in sys.modules:
                names.add(ref)
    return sorted(names)


def class_findings(diffusion_model, reader: Reader) -> list:
    """Methods of ComfyUI's model classes whose code lives outside ComfyUI."""
    out, seen = [], set()
    for m in diffusion_model.modules():
        for cls in type(m).__mro__:
            if cls in seen or not reader.comfy_class(cls):
                continue
            seen.add(cls)
            for name, value in vars(cls).items():
                bad = reader.foreign(value) if callable(value) or isinstance(value, (staticmethod, classmethod,
                                                                                     property)) else None
                if bad is not None:
                    out.append(_found(f"ComfyUI's {cls.__name__}.{name} replaced ({origin(bad)})", origin(bad),
                                      IN_PLACE_MODEL))
    return out


def module_findings(modules, reader: Reader, rule, attention_rule=None) -> list:
    """Functions and classes of ComfyUI's modules (by name) whose code lives outside ComfyUI."""
    out = []
    for n in modules:
        mod = sys.modules.get(n)
        for name, value in list(vars(mod).items()) if mod is not None else ():
            if name.startswith("__") or isinstance(value, types.ModuleType):
                continue
            if isinstance(value, type):  # (ComfyUI's own classes: their methods are class_findings' where the model
                bad = value if reader.kind_of_class(value) == "foreign" else None  # holds one)
            else:
                bad = reader.foreign(value) if callable(value) else None
            if bad is None:
                continue
            r = attention_rule if attention_rule is not None and "attention" in name else rule
            out.append(_found(f"ComfyUI's {n}.{name} replaced ({origin(bad)})", origin(bad), r))
    return out


class BuildKey(NamedTuple):
    """What the workers build the diffusion model from (the module and class of ComfyUI's model, its encoded
    unet_config): the part of NativeSpec the structure comparison needs, read without the weights' checks."""
    module: str
    class_name: str
    unet_config: dict


def build_key(base_model) -> BuildKey:
    """The BuildKey of `base_model` (ComfyUI's BaseModel), as spec.native_spec would write its fields."""
    dm = base_model.diffusion_model
    return BuildKey(module=type(dm).__module__, class_name=type(dm).__qualname__,
                    unet_config=encode_value(dict(base_model.model_config.unet_config)))


def in_place_findings(base_model, spec: BuildKey | NativeSpec | None = None, reader: Reader | None = None) -> list:
    """Every in-place change of `base_model` (ComfyUI's BaseModel) and of ComfyUI's model and sampling code, as the
    capture's findings (their rules say in which sampling mode each is refused). `spec`: what the workers build
    (build_key, or spec.native_spec's NativeSpec), for the structure comparison."""
    reader = reader or Reader()
    if reader.comfy is None:
        return []
    dm = base_model.diffusion_model
    built = built_structure(spec)
    out = instance_findings(base_model, reader) + class_findings(dm, reader)
    out += module_findings(model_code_modules(dm, reader), reader, IN_PLACE_MODEL, IN_PLACE_ATTENTION)
    out += module_findings([n for n in SAMPLER_MODULES if n in sys.modules], reader, IN_PLACE_SAMPLER)
    if built is not None:
        out += structure_findings(dm, built, reader)
    return out
