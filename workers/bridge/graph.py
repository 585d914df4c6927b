"""The prompt graph a node runs in: which nodes sit upstream of it, and what a user calls them.

Why: ComfyUI does not record which node put a patch, a hook or a wrapper on a MODEL; a refusal that says only
"patches_replace ['dit']" leaves the user hunting through the graph. The pack's nodes get the prompt (ComfyUI's
hidden inputs `PROMPT` / `UNIQUE_ID`, or - inside a sampler that runs a Parallel Model's MODEL - the prompt
ComfyUI is executing now), walk upstream of their inputs, and name the node whose class put what was found: by the
class a patch function was defined in (`class_of_origin`), by the classes a channel is known to come from
(workers/bridge/known.py), else every upstream node that is not known to leave a MODEL as it is.

Reads ComfyUI's execution context and queue only through `sys.modules` (never imports `server`: outside a running
ComfyUI there is none, and importing it would start one).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from .origin import module_name


@dataclass
class Graph:
    """An API prompt ({id: {"class_type", "inputs", "_meta"}}) and the node asking (its id), or empty."""
    prompt: dict = field(default_factory=dict)
    node_id: str | None = None

    def upstream(self, start: str | None = None) -> list:
        """Ids of the nodes `start` (default: the asking node) depends on, nearest first (breadth first)."""
        start = self.node_id if start is None else start
        if start is None or start not in self.prompt:
            return []
        seen, order, todo = {start}, [], [start]
        while todo:
            nxt = []
            for nid in todo:
                for value in (self.prompt.get(nid) or {}).get("inputs", {}).values():
                    if _is_link(value) and str(value[0]) not in seen:
                        seen.add(str(value[0]))
                        order.append(str(value[0]))
                        nxt.append(str(value[0]))
            todo = nxt
        return [n for n in order if n in self.prompt]

    def class_type(self, node_id: str) -> str:
        return str((self.prompt.get(node_id) or {}).get("class_type", "?"))

    def label(self, node_id: str) -> str:
        """'"Title" (node 12, ClassType)': the title the user sees, then what finds it in the graph."""
        node = self.prompt.get(node_id) or {}
        cls = node.get("class_type", "?")
        title = (node.get("_meta") or {}).get("title") or display_name(cls)
        return f'"{title}" (node {node_id}, {cls})' if title != cls else f"{cls} (node {node_id})"

    def name(self, classes: tuple, fallback: tuple = ()) -> str | None:
        """The upstream nodes whose class is one of `classes` ("A, B"); else those of `fallback`; None if neither is
        upstream (or there is no graph)."""
        ups = self.upstream()
        for group in (classes, fallback):
            found = [self.label(n) for n in ups if self.class_type(n) in set(group)]
            if found:
                return ", ".join(found)
        return None


def _is_link(value) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], (str, int)) and \
        isinstance(value[1], int)


def display_name(class_type: str) -> str:
    """ComfyUI's display name of a node class (what the node's title shows by default), else the class type."""
    names = getattr(sys.modules.get("nodes"), "NODE_DISPLAY_NAME_MAPPINGS", None) or {}
    return str(names.get(class_type) or class_type)


def node_classes() -> dict:
    """ComfyUI's registry of node classes (class type -> class) in this process, {} outside a ComfyUI."""
    return dict(getattr(sys.modules.get("nodes"), "NODE_CLASS_MAPPINGS", None) or {})


def class_of_origin(origin: str) -> str | None:
    """The node class type whose code defined `origin` ("module:Qualified.name", a patch function or a holder's
    class): the registered node class of that module whose name starts the qualified name. None if no node class
    of this ComfyUI defined it."""
    module, _, qualname = origin.partition(":")
    head = qualname.split(".", 1)[0]
    for class_type, cls in node_classes().items():
        if module_name(getattr(cls, "__module__", "")) == module and getattr(cls, "__qualname__", None) == head:
            return class_type
    return None


def classes_of_module(origin: str) -> tuple:
    """The node class types defined in the module of `origin` ("module:qualname"): where a replacement is a module's
    own function (PuLID-Flux's `forward_orig`), not a node class's, the module's nodes are the ones that install it."""
    module = origin.partition(":")[0]
    return tuple(t for t, cls in node_classes().items() if module_name(getattr(cls, "__module__", "")) == module)


def executing() -> Graph:
    """The prompt ComfyUI is executing in this thread and the node running now (ComfyUI's execution context and its
    queue's running items); an empty Graph outside a running ComfyUI server."""
    utils = sys.modules.get("comfy_execution.utils")
    get = getattr(utils, "get_executing_context", None)
    ctx = get() if callable(get) else None
    server = getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)
    queue = getattr(server, "prompt_queue", None)
    if ctx is None or queue is None:
        return Graph()
    for item in list(getattr(queue, "currently_running", {}).values()):
        if len(item) > 2 and item[1] == ctx.prompt_id and isinstance(item[2], dict):
            return Graph(item[2], str(ctx.node_id))
    return Graph()


def given(prompt, unique_id) -> Graph:
    """The Graph of a node's hidden PROMPT / UNIQUE_ID inputs (None when a caller - a test, a script - gives none)."""
    return Graph(prompt if isinstance(prompt, dict) else {}, None if unique_id is None else str(unique_id))


def prompt_server():
    """ComfyUI's running PromptServer, or None outside a running server (pytest, a plain import of the pack)."""
    return getattr(getattr(sys.modules.get("server"), "PromptServer", None), "instance", None)


def server_routes(server):
    """PromptServer's aiohttp route table, which the pack's routes join (workers/bridge/seams.py: `routes`)."""
    return server.routes


def user_directory() -> str | None:
    """ComfyUI's user directory (folder_paths; `--user-directory` / `--base-directory` move it), or None outside a
    running ComfyUI server: where the pack keeps what must outlive a restart (workers/driver/routes.py: the last world).
    Not in a plain import of ComfyUI (pytest, scripts): its user folder is no server's."""
    if prompt_server() is None:
        return None
    get = getattr(sys.modules.get("folder_paths"), "get_user_directory", None)
    try:
        return get() if callable(get) else None
    except Exception:  # noqa: BLE001 - a ComfyUI that cannot say: nothing is kept
        return None


def on_each_prompt(server, handler) -> bool:
    """Have ComfyUI's server call `handler(json_data)` for each prompt queued (its on-prompt handlers); False where
    this ComfyUI has none."""
    add = getattr(server, "add_on_prompt_handler", None)
    if add is None:
        return False
    add(handler)
    return True
