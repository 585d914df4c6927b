"""Where a function or an object on a MODEL came from, as the rules tables (known.py) name it, and the refusal.

Why its own module: the capture (capture.py), what travels per call (carry.py) and the prompt walk (graph.py) all name
things by their origin; here, below the three, none imports another for it (no import circle in the bridge).
"""
from __future__ import annotations

import functools

from . import known
from .known import Rule


class NotCarried(ValueError):
    """This MODEL (or conditioning) cannot run on the workers exactly; the message says why and what works."""


def origin_of(value) -> str:
    """"module:qualname" of a function (a bound method's, a partial's), else of the object's class."""
    while isinstance(value, functools.partial):
        value = value.func
    fn = getattr(value, "__func__", value)
    if hasattr(fn, "__code__") or isinstance(fn, type):
        return f"{module_name(getattr(fn, '__module__', '?'))}:{getattr(fn, '__qualname__', '?')}"
    cls = type(value)
    return f"{module_name(cls.__module__)}:{cls.__qualname__}"


CORE_FOLDERS = ("comfy_extras", "comfy_api_nodes")


def module_name(module: str) -> str:
    """A module's name as the tables write it. A ComfyUI server loads comfy_extras by file path
    (nodes.load_custom_node: the module is "/.../comfy_extras/nodes_slg") and a custom node pack by its folder's path
    with "." written "_x_" (its submodules "/.../custom_nodes/ComfyUI-KJNodes.nodes.model_optimization_nodes"); a plain
    import gives "comfy_extras.nodes_slg". These become "comfy_extras.nodes_slg" and
    "custom_nodes.kjnodes.nodes.model_optimization_nodes": a pack by its folder's name in lower case without a
    leading "comfyui-" (users install KJNodes as ComfyUI-KJNodes from git, comfyui-kjnodes from the registry)."""
    path = str(module).replace("\\", "/")
    if "/" not in path:
        return path
    parent, _, tail = path.rpartition("/")
    folder = parent.rpartition("/")[2]
    if folder in CORE_FOLDERS:
        return f"{folder}.{tail}"
    pack, _, rest = tail.partition(".")
    return "custom_nodes." + ".".join(p for p in (pack_name(pack.replace("_x_", ".")), rest) if p)


def pack_name(folder: str) -> str:
    """A custom node pack's name in the tables: its folder's name, lower case, without "comfyui-" / "comfyui_"."""
    name = folder.lower()
    for prefix in ("comfyui-", "comfyui_"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def function_rule(origin: str) -> Rule | None:
    """The FUNCTIONS rule of the longest prefix of `origin`, else None."""
    best = None
    for prefix, rule in known.FUNCTIONS.items():
        if origin.startswith(prefix) and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rule)
    return None if best is None else best[1]


BYPASS_ORIGIN = "comfy.weight_adapter.bypass:BypassInjectionManager."


def bypass_adapters(injections: list) -> dict | None:
    """{module key: (adapter, strength)} of ComfyUI's LoRA-bypass injections (its BypassInjectionManager, found in
    the closure of the injection it made), or None when they are not that manager's."""
    found = {}
    for inj in injections or ():
        fn = getattr(inj, "inject", None)
        code = getattr(fn, "__code__", None)
        if code is None or not f"{fn.__module__}:{fn.__qualname__}".startswith(BYPASS_ORIGIN):
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        manager = cells.get("self")
        adapters = getattr(manager, "adapters", None)
        if not isinstance(adapters, dict):
            return None
        found.update(adapters)
    return found
