"""Weights and classes of a custom loader (ComfyUI-GGUF's quantized tensors and ops) carried to the workers.

Why: GGUF is how many people fit Flux, Wan and Qwen-Image on consumer GPUs. Its loader keeps each quantized
weight as a `torch.Tensor` subclass over the raw block bytes (uint8 rows) with the quantization type and the
logical shape as attributes, builds ComfyUI's model with its own operations class (which dequantizes on the fly,
applying LoRA patches held on the tensor), and patches through its own ModelPatcher. The workers run ComfyUI's
own model, so they need exactly those: the raw bytes travel as any weight does (shared memory, sharded as bytes),
and each subclass tensor is rebuilt around them from its class - imported by module path from the folder the
driver loaded it from - and its plain attributes. Nothing is pickled: classes are named, values are JSON.

What is carried, and what is refused (with the reason, before any worker starts):
- a tensor subclass with storage of its own (`as_subclass(torch.Tensor)` gives its raw bytes) whose attributes
  are plain values, enums, dtypes, sizes or empty lists; a wrapper subclass (no storage: torchao, DTensor) or an
  attribute holding anything else (a LoRA patch list attached by the loader) is refused;
- the loader's operations class (an instance or the class) and the plain class attributes of its layer classes
  (ComfyUI-GGUF sets `Linear.dequant_dtype` / `patch_dtype` on the class itself when it loads);
- the loader's ModelPatcher class where it patches weights its own way (ComfyUI-GGUF attaches LoRA patches to
  the quantized tensor instead of computing a patched weight), with its plain class-level settings.

ComfyUI's own quantized weights (its mixed-precision ops, `quant_config`: every scaled-fp8 checkpoint since ComfyUI
0.33, and the per-layer `comfy_quant` files - fp8, int8, nvfp4, mxfp8) are comfy-kitchen `QuantizedTensor`s: wrapper
subclasses without storage, made of inner tensors (`__tensor_flatten__`: the quantized bytes, the scales). They travel
as those inner tensors, each raw bytes like a plain weight under its own name ("<weight>#<inner>", `host_tensors`),
plus JSON (`quantized_tensors`): the layout and its other parameters (the flatten context: orig_dtype,
orig_shape, ...), and the layer's own `comfy_quant` entry as ComfyUI writes it. A worker builds the model with the
ops ComfyUI picks for that quant_config, loads it through the layers' own loader (workers/bridge/build.py) and holds
each weight as the wrapper `__tensor_unflatten__` makes of the bytes that travelled (`rebuild_quantized`) - never
dequantized, never copied.

A module is imported normally where the worker's sys.path finds it (gguf, comfy); a custom node's folder,
which ComfyUI imports by file path, is registered as a package *without running its __init__* (that would
register its nodes, import ComfyUI's server modules...): only the module that defines the class runs.
"""
from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import json
import os
import sys
import types

import torch

from ...parallel.shard import as_parameter, is_wrapper, layout_name, rebuild_wrapper, wrapper_parts, wrapper_problem

PLAIN = (type(None), bool, int, float, str)


class NotCarriable(ValueError):
    """A loader's tensor or class the workers cannot rebuild; the message says why."""


# ---- the tensors a module holds ----

INNER = "#"  # "<weight name>#<inner tensor>": a quantized weight's inner tensors, travelling as plain weights


def host_tensors(module: torch.nn.Module) -> dict:
    """{state-dict name: tensor} of the parameters and persistent buffers `module` holds, as it holds them; a
    quantized weight (a wrapper subclass: ComfyUI's QuantizedTensor) as its inner tensors, "<name>#<inner>" each
    (its quantized bytes and scales, the very tensors it holds).

    Not `state_dict()`: an operations class may write something else there - ComfyUI-GGUF writes meta-device
    placeholders (and a "temp.weight" for the largest layer) so that ComfyUI's memory estimate counts the
    dequantized size; ComfyUI's mixed-precision ops write their file form (scales renamed, a JSON `comfy_quant`).
    What the workers need is what the layers compute with."""
    out = {}
    for key, t in module_tensors(module).items():
        if is_wrapper(t):
            out.update((f"{key}{INNER}{n}", p) for n, p in wrapper_parts(t)[0].items())
        else:
            out[key] = t
    return out


def module_tensors(module: torch.nn.Module) -> dict:
    """{state-dict name: tensor} of the parameters and persistent buffers as the layers hold them, a quantized
    weight as its wrapper tensor."""
    out, seen = {}, set()
    for prefix, owner in module.named_modules():
        tensors = [(n, p) for n, p in owner._parameters.items() if p is not None]
        tensors += [(n, b) for n, b in owner._buffers.items()
                    if b is not None and n not in owner._non_persistent_buffers_set]
        for name, t in tensors:
            key = f"{prefix}.{name}" if prefix else name
            if key not in out and (id(t), key) not in seen:
                out[key] = t
                seen.add((id(t), key))
    return out


def is_plain(t) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def raw(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor over `t`'s own storage and sizes (a subclass may report a logical `shape`)."""
    return t.detach() if is_plain(t) else torch.Tensor.as_subclass(t, torch.Tensor).detach()


def nbytes(t: torch.Tensor) -> int:
    """Bytes `t` holds (its storage as laid out, not its logical shape; a quantized weight: its inner tensors')."""
    if is_wrapper(t):
        return sum(nbytes(p) for p in wrapper_parts(t)[0].values())
    r = raw(t)
    return r.numel() * r.element_size()


# Attributes that hold a ModelPatcher's state, not the weight: ComfyUI-GGUF's patcher attaches the MODEL's LoRA
# patches to a quantized tensor (`patches`) while that MODEL is loaded, and clears them when it unloads. The bytes are
# the base weight either way; the patches travel as the MODEL's own (workers/bridge/patches.py).
PATCHER_STATE = ("patches",)


def describe(t: torch.Tensor, name: str = "") -> dict | None:
    """What a worker needs to rebuild `t` around its raw bytes: None for a plain tensor, else {"class": module:name,
    "fields": {attribute: encoded value}} (a patcher's state, PATCHER_STATE, as its empty value). NotCarriable names
    what cannot travel."""
    if is_plain(t):
        return None
    cls = type(t)
    where = f"weight {name!r} " if name else ""
    if getattr(cls, "__tensor_flatten__", None) is not None or not _has_storage(t):
        raise NotCarriable(f"{where}is a {cls.__name__}, a wrapper tensor subclass without storage of its own, "
                           f"which the workers cannot rebuild from bytes")
    fields = {}
    for attr, value in vars(t).items():
        if attr.startswith("_"):
            continue  # torch's own bookkeeping (_is_param...)
        if attr in PATCHER_STATE and isinstance(value, list):
            value = []
        try:
            fields[attr] = encode(value)
        except NotCarriable as e:
            raise NotCarriable(f"{where}is a {cls.__name__} whose {attr!r} holds {e}") from None
    return {"class": class_path(cls), "fields": fields}


def _has_storage(t) -> bool:
    try:
        r = torch.Tensor.as_subclass(t, torch.Tensor)
        return r.untyped_storage().nbytes() >= r.numel() * r.element_size() and r.device.type != "meta"
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def rebuild(r: torch.Tensor, meta: dict | None) -> torch.Tensor:
    """The loader's tensor of `meta` over the plain tensor `r` (its raw bytes), as the loader made it: its class
    called with the fields it takes as keywords, the others set as attributes. `r` itself when `meta` is None or
    `r` is already rebuilt (a model rebuilt for another mesh from the kept host weights)."""
    if meta is None or not is_plain(r):
        return r
    cls = import_class(meta["class"])
    fields = {k: decode(v) for k, v in meta["fields"].items()}
    params = {}
    for fn in (cls.__new__, cls.__init__):
        try:
            params.update(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            pass
    keywords = {k: v for k, v in fields.items()
                if k in params and params[k].kind in (inspect.Parameter.KEYWORD_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    t = cls(r, **keywords)
    for k, v in fields.items():
        if k not in keywords:
            setattr(t, k, v)
    return t


# ---- ComfyUI's quantized weights (comfy-kitchen QuantizedTensor in mixed-precision ops) ----

def quantized_tensors(module: torch.nn.Module) -> dict:
    """{weight name: description} of the quantized weights `module`'s layers hold (wrapper tensor subclasses), {}
    for none. A description is JSON: the class, the flatten context (layout, its parameter class by path, the
    parameters that are not tensors), the inner tensors' names and the size / stride, and `comfy_quant` - the
    layer's own entry in its file form (ComfyUI's `state_dict()` of the layer: {"format": "float8_e4m3fn", ...}),
    which its loader reads on the workers. NotCarriable: a wrapper the workers could not rebuild (its context holds
    something JSON cannot, an inner tensor is not plain bytes, or its layer's file form is not its tensors)."""
    owners = dict(module.named_modules())
    out = {}
    for name, t in module_tensors(module).items():
        if not is_wrapper(t):
            continue
        where = f"weight {name!r} ({layout_name(t)})"
        problem = wrapper_problem(t)
        if problem:
            raise NotCarriable(f"{where}: {problem}")
        parts, ctx = wrapper_parts(t)
        try:
            context = _encode_context(ctx)
        except NotCarriable as e:
            raise NotCarriable(f"{where} is a {type(t).__name__} whose flatten context holds {e}") from None
        path, _, leaf = name.rpartition(".")
        owner = owners[path]
        out[name] = {"class": class_path(type(t)), "context": context, "inner": list(parts),
                     "size": [int(v) for v in t.size()], "stride": [int(v) for v in t.stride()],
                     "layout": layout_name(t), "comfy_quant": _comfy_quant(owner, path, leaf, t, where)}
    return out


def _comfy_quant(owner, path: str, leaf: str, t, where: str) -> dict:
    """The layer's `comfy_quant` entry as ComfyUI's own state_dict writes it (its format and flags), checked to be
    all the layer's file form adds to its tensors: what the workers' load of the layer needs."""
    prefix = f"{path}." if path else ""
    try:
        written = owner.state_dict(prefix=prefix)
    except Exception as e:  # noqa: BLE001 - any failure: the layer's file form is not known
        raise NotCarriable(f"{where}: its {type(owner).__name__} layer cannot write its state dict ({e})") from None
    conf = written.get(f"{prefix}comfy_quant")
    if conf is None:
        raise NotCarriable(f"{where} is held by a {type(owner).__name__} that writes no comfy_quant entry (not "
                           f"ComfyUI's mixed-precision ops), so the workers could not load it as ComfyUI does")
    tensors = {f"{prefix}{k}" for k, v in owner._parameters.items() if v is not None and k != leaf}
    tensors |= {f"{prefix}{k}" for k, v in owner._buffers.items()
                if v is not None and k not in owner._non_persistent_buffers_set}
    rebuilt = tensors | set(t.state_dict(f"{prefix}{leaf}")) | {f"{prefix}comfy_quant"}
    if set(written) != rebuilt:
        raise NotCarriable(f"{where}: its {type(owner).__name__} layer writes {sorted(set(written) ^ rebuilt)[:4]} "
                           f"beyond its tensors, which the workers would not rebuild")
    return json.loads(bytes(conf.detach().cpu().numpy().tobytes()).decode("utf-8"))


def comfy_quant_tensor(conf: dict) -> torch.Tensor:
    """A layer's `comfy_quant` entry as ComfyUI stores it in a state dict (comfy.utils.convert_old_quants): the
    JSON's UTF-8 bytes as a uint8 tensor."""
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def rebuild_quantized(name: str, meta: dict, weights: dict) -> torch.Tensor:
    """The quantized weight `name` of `meta` (quantized_tensors) made by its class's own `__tensor_unflatten__`
    around the inner tensors that travelled (`weights["<name>#<inner>"]`, raw bytes mapped as any weight), flagged
    as a parameter without a copy."""
    cls = import_class(meta["class"])
    parts = {n: weights[name + INNER + n] for n in meta["inner"]}
    return as_parameter(rebuild_wrapper(cls, parts, _decode_context(meta["context"]), meta["size"], meta["stride"]))


def adopt_inner(owners: dict, name: str, mapped: torch.Tensor) -> bool:
    """For the driver's adopter (workers/bridge/host.py): ComfyUI's quantized weight holding the inner tensor `name`
    ("<weight>#<inner>", as `host_tensors` names it) takes `mapped` - the pages just written for the workers, same
    dtype and shape - in place of its own copy, so that ComfyUI and the local ranks hold one copy. The weight is
    rebuilt by its class's `__tensor_unflatten__` around its other inner tensors and `mapped`, and put in the layer's
    slot (a new object, as ComfyUI's own patching does). `owners`: {path: module} of the model. False where `name` is
    no such tensor on the host (then nothing changes). Not thread-safe for two inner tensors of one weight: call it
    under the adopter's lock."""
    weight, sep, inner = name.partition(INNER)
    path, _, leaf = weight.rpartition(".")
    owner = owners.get(path)
    t = owner._parameters.get(leaf) if sep and owner is not None else None
    if not is_wrapper(t):
        return False
    parts, ctx = wrapper_parts(t)
    old = parts.get(inner)
    if old is None or old.device.type != "cpu" or old.dtype != mapped.dtype or old.shape != mapped.shape:
        return False
    parts[inner] = mapped
    owner._parameters[leaf] = as_parameter(rebuild_wrapper(type(t), parts, ctx, t.size(), t.stride()))
    return True


def _encode_context(value):
    """JSON form of a flatten context: containers, plain values, dtypes, sizes, enums, and classes by path."""
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise NotCarriable(f"a dict with non-string keys ({list(value)[:3]!r:.60})")
        return {"$dict": {k: _encode_context(v) for k, v in value.items()}}
    if isinstance(value, type):
        return {"$class": class_path(value)}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return {"$list" if isinstance(value, list) else "$tuple": [_encode_context(v) for v in value]}
    return encode(value)


def _decode_context(value):
    if isinstance(value, dict):
        if "$dict" in value:
            return {k: _decode_context(v) for k, v in value["$dict"].items()}
        if "$class" in value:
            return import_class(value["$class"])
        if "$list" in value:
            return [_decode_context(v) for v in value["$list"]]
        if "$tuple" in value:
            return tuple(_decode_context(v) for v in value["$tuple"])
    return decode(value)


# ---- values ----

def encode(value):
    """JSON form of a plain attribute value; NotCarriable (with what it is) for anything else."""
    if isinstance(value, enum.Enum):
        return {"$enum": class_path(type(value)), "value": value.value}
    if isinstance(value, torch.Size):
        return {"$size": [int(s) for s in value]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, PLAIN):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, PLAIN) for v in value):
        return {"$list": list(value)} if isinstance(value, list) else {"$tuple": list(value)}
    what = "a non-empty list" if isinstance(value, list) else f"a value of type {type(value).__name__}"
    raise NotCarriable(f"{what} ({value!r:.60})")


def decode(value):
    if isinstance(value, dict):
        if "$enum" in value:
            return import_class(value["$enum"])(value["value"])
        if "$size" in value:
            return torch.Size(value["$size"])
        if "$dtype" in value:
            return getattr(torch, value["$dtype"])
        if "$list" in value:
            return list(value["$list"])
        if "$tuple" in value:
            return tuple(value["$tuple"])
        raise ValueError(f"unexpected encoded value {value!r:.80}")
    return value


# ---- classes by path ----

def class_path(cls) -> str:
    """"module:qualname" of a class the workers can import; NotCarriable for one defined in a function or
    whose module is not a file."""
    if "<locals>" in cls.__qualname__:
        raise NotCarriable(f"class {cls.__qualname__} is defined inside a function, so the workers cannot import it")
    return f"{cls.__module__}:{cls.__qualname__}"


def package_of(cls) -> dict | None:
    """{"name", "path", "package"} of the top-level module that defines `cls` when a fresh interpreter could not
    import it by name: a custom node, which ComfyUI imports from its file; None otherwise."""
    top = cls.__module__.split(".")[0]
    mod = sys.modules.get(top)
    path = getattr(mod, "__file__", None)
    if mod is None or path is None:
        return None
    is_package = hasattr(mod, "__path__")
    where = os.path.dirname(os.path.abspath(path))
    parent = os.path.dirname(where) if is_package else where
    if any(os.path.abspath(p or os.getcwd()) == parent for p in sys.path) and top.isidentifier():
        return None  # importable by name
    return {"name": top, "path": where if is_package else os.path.abspath(path), "package": is_package}


def register_packages(packages) -> None:
    """Make the custom nodes' top-level modules importable in this worker: a package as a bare package over its
    folder (its __init__ does not run), a single-file module from its file."""
    for p in packages or ():
        name = p["name"]
        if name in sys.modules:
            continue
        if p.get("package"):
            mod = types.ModuleType(name)
            mod.__path__ = [p["path"]]
            mod.__package__ = name
            mod.__file__ = os.path.join(p["path"], "__init__.py")
            sys.modules[name] = mod
        else:
            spec = importlib.util.spec_from_file_location(name, p["path"])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)


def import_class(path: str):
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# ---- the loader's operations and patcher classes ----

def _plain_class_attrs(cls, stop=()) -> dict:
    """The public class attributes with plain values (None, bool, int, float, str, dtype) of `cls` and its bases up
    to `stop`, as the class holds them now (a loader may have set them)."""
    out = {}
    for base in reversed([c for c in cls.__mro__ if c not in stop and c is not object]):
        for k in vars(base):
            if k.startswith("_"):
                continue
            v = getattr(cls, k)
            if isinstance(v, PLAIN + (torch.dtype,)):
                out[k] = encode(v)
    return out


def describe_operations(ops) -> dict:
    """What a worker needs to use the same operations class as the driver's model: the class (and whether the
    model got an instance), its layer classes' plain settings, and where to import it from."""
    cls = ops if isinstance(ops, type) else type(ops)
    layers = {}
    for name in dir(cls):
        layer = getattr(cls, name, None)
        if isinstance(layer, type) and issubclass(layer, torch.nn.Module) and not name.startswith("_"):
            layers[name] = _plain_class_attrs(layer, stop=set(torch.nn.Module.__mro__))
    if not isinstance(ops, type) and {k: v for k, v in vars(ops).items() if not k.startswith("_")}:
        raise NotCarriable(f"the operations object {cls.__name__} carries instance settings "
                           f"({sorted(vars(ops))[:5]}), which the workers cannot rebuild")
    return {"class": class_path(cls), "instance": not isinstance(ops, type), "layers": layers,
            "packages": [p for p in (package_of(cls),) if p]}


def operations(desc: dict):
    """The operations of `describe_operations`' description, imported and set as the driver's were."""
    register_packages(desc.get("packages"))
    cls = import_class(desc["class"])
    for name, attrs in (desc.get("layers") or {}).items():
        layer = getattr(cls, name)
        for k, v in attrs.items():
            if getattr(layer, k, None) != decode(v):
                setattr(layer, k, decode(v))
    return cls() if desc.get("instance") else cls


def describe_patcher(patcher) -> dict | None:
    """The loader's ModelPatcher class where it applies weight patches its own way (overrides
    `patch_weight_to_device`), with its own plain settings (ComfyUI-GGUF: `patch_on_device`); None for ComfyUI's."""
    import comfy.model_patcher as mp
    cls = type(patcher)
    if cls.patch_weight_to_device is mp.ModelPatcher.patch_weight_to_device:
        return None
    settings = {}
    for base in cls.__mro__:
        if base is mp.ModelPatcher or not issubclass(base, mp.ModelPatcher):
            break
        for k in vars(base):
            v = getattr(patcher, k, None)
            if not k.startswith("_") and isinstance(v, PLAIN) and k not in settings:
                settings[k] = v
    return {"class": class_path(cls), "settings": settings, "packages": [p for p in (package_of(cls),) if p]}


def patcher_class(desc: dict):
    register_packages(desc.get("packages"))
    return import_class(desc["class"])


def tensor_packages(metas: dict) -> list:
    """The custom nodes' folders the tensor classes of `metas` ({name: describe(...)}) come from (driver side)."""
    out = {}
    for meta in metas.values():
        module = meta["class"].partition(":")[0]
        cls = import_class(meta["class"]) if module in sys.modules else None
        p = package_of(cls) if cls is not None else None
        if p:
            out[p["name"]] = p
    return list(out.values())
