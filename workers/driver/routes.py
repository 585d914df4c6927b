"""HTTP routes for the web extension (web/hybrid_parallel.js), registered on ComfyUI's PromptServer.

The mesh picture must never disagree with what a prompt would do, so the mesh
route builds the config with the config nodes' own rules (configs.configure /
configure_gpus: same defaults, same validation, same error text) and the groups with
`parallel.mesh` - the browser computes nothing. The pool routes read the
`Runtime` the nodes use. Everything that may block (the worker health probe,
stopping workers) runs off the server's event loop.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import threading
import time

from ...parallel.mesh import AXES, rank_coords, rank_groups
from ..bridge.classified import refused_in
from ..bridge.graph import on_each_prompt, server_routes, user_directory
from ..forkserver import default_count
from .configs import MAX_LISTED_RANKS, check_hp_placement, check_placement, configure, configure_gpus, summary

MAX_PICTURE_RANKS = MAX_LISTED_RANKS  # larger worlds get totals only: a picture of them would not be read anyway
PICTURE_AXES = ("dp", "cfg", "pp", "ring", "ulysses", "tp", "sp")


def _defaults() -> dict:
    """Parallel Config's widget defaults: `configure`'s own (tests/web keeps them equal to the node's widgets); the
    cluster is a link, not a widget, and not in the picture's query."""
    return {name: p.default for name, p in inspect.signature(configure).parameters.items() if name != "cluster"}


def _coerce(name: str, value: str, default):
    if isinstance(default, bool):
        return value.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"Parallel Config: {name} must be an integer, got {value!r}") from None
    return value


def config_from_widgets(widgets: dict):
    """The Parallel Config node's result for these widget values (missing ones take the defaults, unknown ones are
    ignored), built and validated by the node's own rules; ValueError as the node would raise it."""
    defaults = _defaults()
    kwargs = dict(defaults)
    for name, value in widgets.items():
        if name in defaults:
            kwargs[name] = _coerce(name, str(value), defaults[name])
    return configure(**kwargs)


def node_config_why(kind: str, widgets) -> tuple:
    """(hp, "") for the world a Parallel Config (`kind` "HybridParallelConfig") or Parallel GPUs
    ("HybridParallelGPUs") node's widget values fix now, valid and placeable here; else (None, why): another node,
    values the node itself will refuse when the prompt runs (its message), or degrees / devices "auto" (they choose
    at the sampler)."""
    build = {"HybridParallelConfig": config_from_widgets,
             "HybridParallelGPUs": lambda w: configure_gpus(**{k: w[k] for k in ("devices", "preset") if k in w})
             }.get(kind)
    if build is None or not isinstance(widgets, dict):
        return None, "not a Parallel Config / Parallel GPUs node"
    try:
        hp = build(widgets)
        check_hp_placement(hp)
    except (ValueError, TypeError) as e:
        return None, str(e)  # the node itself reports it when the prompt runs
    if getattr(hp, "auto_devices", 0):
        return None, "its degrees / devices are 'auto' (chosen at the sampler)"
    return hp, ""


def node_config(kind: str, widgets) -> object | None:
    """node_config_why's world, or None (and None for no widget values at all): what the headless warm-up
    (prompt_config) and the frontend's /warm start."""
    return node_config_why(kind, widgets)[0] if widgets else None


def config_node(prompt) -> tuple | None:
    """(class_type, widget values) of an API prompt's first Parallel Config / Parallel GPUs node (a linked input, a
    list, is not a widget value), or None."""
    if not isinstance(prompt, dict):
        return None
    for node in prompt.values():
        if isinstance(node, dict) and node.get("class_type") in ("HybridParallelConfig", "HybridParallelGPUs"):
            return node["class_type"], {k: v for k, v in (node.get("inputs") or {}).items()
                                        if not isinstance(v, list)}
    return None


def prompt_config(prompt) -> object | None:
    """The world an API prompt's first Parallel Config / Parallel GPUs node fixes now (widget values only; a
    linked input or degrees "auto" choose at the sampler): what the headless warm-up starts; else None."""
    found = config_node(prompt)
    return None if found is None else node_config(*found)


PACK_NODES = ("HybridParallelConfig", "HybridParallelGPUs", "HybridSampler", "HybridParallelModel",
              "HybridPatchVAEDecode", "HybridParallelCluster")


def warm_on_prompt(runtime, start=None):
    """ComfyUI's on-prompt handler for headless clients (a script posting /prompt, no frontend, no /warm): a
    prompt holding the pack's nodes starts the fork server and its Parallel Config's world in the background the moment it
    is queued - while ComfyUI still loads and encodes - as opening the workflow in the frontend does (/warm). Returns
    the prompt unchanged; never raises (ComfyUI would log it for every prompt)."""

    def handler(json_data):
        seen = time.time()
        try:
            prompt = json_data.get("prompt") if isinstance(json_data, dict) else None
            if not isinstance(prompt, dict) or not any(isinstance(n, dict) and n.get("class_type") in PACK_NODES
                                                       for n in prompt.values()):
                return json_data
            hp = prompt_config(prompt)
            if hp is not None and refused_in(prompt, loop=hp.config.pp_degree > 1 or hp.mode == "loop"):
                return json_data  # its sampler will refuse it before any work: no workers for it either

            def run():
                try:
                    if hp is not None:
                        remember_world(config_node(prompt))
                    runtime.warm_for_prompt(default_count(), hp, queued=seen)
                except Exception as e:  # noqa: BLE001 - a head start only: the prompt's own run reports errors
                    import logging
                    logging.getLogger(__name__).info("hybrid parallel: warm-up on prompt failed: %s", e)
            (start or (lambda f: threading.Thread(target=f, name="hybrid-parallel-warm", daemon=True).start()))(run)
        except Exception:  # noqa: BLE001
            pass
        return json_data
    return handler


def mesh_payload(query: dict, runtime=None) -> dict:
    """What the mesh picture draws for these widget values: {ok, world_size, groups, ranks} or {ok: False, error}.

    Unknown widget names are ignored (a newer frontend workflow), missing ones take the node's defaults. A
    valid config this machine cannot place (more GPUs than it has, a CPU world over the limit) is still drawn -
    the picture plans a bigger machine too - with `placement` saying what running it here would refuse.
    Nothing here grows with the world beyond MAX_PICTURE_RANKS, so the route answers in milliseconds.
    """
    try:
        hp = config_from_widgets(query)
    except ValueError as e:
        return {"ok": False, "error": str(e)}
    config = hp.config
    try:
        check_placement(config, hp.device)
        placement = None
    except ValueError as e:
        placement = str(e)
    payload = {"ok": True, "world_size": config.world_size, "describe": hp.describe(), "text": summary(hp),
               "placement": placement,
               "degrees": {ax: getattr(config, f"{ax}_degree") for ax in AXES + ("sp",)},
               "device": hp.device, "picture": config.world_size <= MAX_PICTURE_RANKS}
    if getattr(hp, "auto_devices", 0):  # degrees auto: the predicted time per step per choice of the latest run
        payload["auto"] = getattr(runtime, "last_auto", None)
    memory = getattr(runtime, "last_memory", None)
    if memory:  # the memory plan the latest Hybrid Sampler run was checked against (bytes per rank by item)
        payload["memory"] = {**memory, "this_mesh": memory.get("mesh") == config.describe()}
    if not payload["picture"]:
        payload["error_hint"] = (f"{config.world_size} ranks: too many to draw (the picture shows up to "
                                 f"{MAX_PICTURE_RANKS}); the degrees themselves are valid")
        return payload
    groups = rank_groups(config)
    payload["groups"] = {ax: groups[ax] for ax in PICTURE_AXES}
    index = {ax: {r: i for i, g in enumerate(groups[ax]) for r in g} for ax in PICTURE_AXES}
    devices = list(config.devices) or _default_devices(hp.device, config.world_size)
    payload["ranks"] = [{"rank": r, "device": devices[r], "coords": rank_coords(config, r),
                         "group": {ax: index[ax][r] for ax in PICTURE_AXES}} for r in range(config.world_size)]
    return payload


def _default_devices(kind: str, n: int) -> list:
    """The devices the pool would pick without a list (workers/launch.py): cuda:i per rank, else CPU processes."""
    if kind != "cpu":
        try:
            import torch
            if torch.cuda.is_available():
                return [f"cuda:{i}" for i in range(n)]
        except ImportError:
            pass
        if kind == "cuda":
            return [f"cuda:{i}" for i in range(n)]
    return [f"cpu #{i}" for i in range(n)]


def register(server, runtime) -> None:
    """Add the routes to ComfyUI's PromptServer (also served under /api/... by ComfyUI)."""

    from aiohttp import web

    routes = server_routes(server)
    on_each_prompt(server, warm_on_prompt(runtime))

    @routes.get("/hybrid_parallel/mesh")
    async def mesh(request):
        return web.json_response(mesh_payload(dict(request.rel_url.query), runtime))

    @routes.get("/hybrid_parallel/pool")
    async def pool(request):
        return web.json_response(await asyncio.get_running_loop().run_in_executor(None, runtime.status))

    @routes.post("/hybrid_parallel/warm")
    async def warm(request):
        """A workflow holding the pack's nodes was opened in the frontend: start the fork server (torch imported,
        workers/forkserver.py) now, and with its Parallel Config's widgets ({"config": {...}}) or its Parallel GPUs node's
        ({"gpus": {...}}) that world (Runtime.warm), so the first prompt does not wait for them - and not before
        anyone uses the pack."""
        try:
            body = json.loads(await request.text() or "{}")
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        kind, widgets = (("HybridParallelConfig", body["config"]) if "config" in body else
                         ("HybridParallelGPUs", body.get("gpus")))

        def start():
            n = default_count()
            return n, runtime.warm(n, node_config(kind, widgets))
        try:
            n, mesh = await asyncio.get_running_loop().run_in_executor(None, start)
        except Exception as e:  # noqa: BLE001 - a convenience: say why, never fail the frontend
            return web.json_response({"ok": False, "error": str(e)})
        return web.json_response({"ok": True, "spares": n, "world": mesh})

    @routes.post("/hybrid_parallel/pool/stop")
    async def stop(request):
        """Interrupt the running job (its prompt ends as interrupted) and stop every worker; the next
        prompt starts them again."""
        cancelled = runtime.cancel()
        was = await asyncio.get_running_loop().run_in_executor(None, runtime.stop)
        return web.json_response({"ok": True, "stopped": was, "cancelled": cancelled})


PRESTART_HELP = ("HP_PRESTART takes 'spares' (the fork server alone), an API prompt file (ComfyUI's 'Export (API)': its Parallel Config / "
                 "Parallel GPUs node), or a Parallel Config's widgets as JSON, e.g. '{\"ulysses_degree\": 2}'")


def prestart_config(value: str):
    """HP_PRESTART's value -> (hp or None, why not): what a headless server starts with ComfyUI. A ValueError names
    the fix for a value that cannot mean anything; hp None with a reason for a world that chooses at the sampler or
    cannot be placed here (the fork server still starts)."""
    text = value.strip()
    if text.lower() == "spares":
        return None, "the fork server only (asked)"
    if not text.startswith("{"):
        if not os.path.isfile(text):
            raise ValueError(f"HP_PRESTART={value!r}: no such file. {PRESTART_HELP}")
        with open(text, encoding="utf-8") as f:
            text = f.read()
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"HP_PRESTART: not JSON ({e}). {PRESTART_HELP}") from None
    if isinstance(data, dict) and isinstance(data.get("prompt"), dict):  # the body a script posts to /prompt
        data = data["prompt"]
    if not isinstance(data, dict) or isinstance(data.get("nodes"), list):
        raise ValueError("HP_PRESTART: a workflow saved by the frontend (its 'nodes' list) - save it with 'Export "
                         f"(API)' instead. {PRESTART_HELP}")
    if any(isinstance(n, dict) and "class_type" in n for n in data.values()):  # an API prompt
        found = config_node(data)
        if found is None:
            return None, "the prompt has no Parallel Config / Parallel GPUs node: the fork server only"
    else:
        found = "HybridParallelConfig", data
    hp, why = node_config_why(*found)
    return (hp, "") if hp is not None else (None, f"{why}: the fork server only")


LAST_WORLD = "hybrid_parallel_last_world.json"  # in ComfyUI's user directory
OFF = ("0", "off", "no", "false", "none")


def last_world_path(directory: str | None = None) -> str | None:
    directory = user_directory() if directory is None else directory
    return None if not directory else os.path.join(directory, LAST_WORLD)


def remember_world(found, directory: str | None = None) -> None:
    """Keep the config node (class_type, widgets) of the latest queued prompt whose world is fixed, as a one-node API
    prompt in ComfyUI's user directory: the next start of this ComfyUI starts that world (prestart_from_env), so a
    script's or a Docker service's first prompt after a restart finds it up. Only the widget values (no prompt
    text, no file names); written owner-only; never raises (a head start only)."""
    path = last_world_path(directory)
    if found is None or path is None:
        return
    kind, widgets = found
    body = json.dumps({"hp": {"class_type": kind, "inputs": widgets}}, sort_keys=True)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read() == body:
                return
    except OSError:
        pass
    try:
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as e:
        logging.getLogger(__name__).info("hybrid parallel: could not keep the last world in %s: %s", path, e)


def prestart_from_env(runtime, value: str | None = None, start=None, directory: str | None = None) -> str:
    """A headless server's head start (HP_PRESTART; no frontend opens its workflow, so no /warm comes): the spare
    interpreters, and the world of the prompt the scripts will post, start with ComfyUI - a first prompt on a
    model ComfyUI already holds then pays only for its weights. Unset: the world of the last prompt queued on this
    ComfyUI that fixed one (remember_world, in its user directory), if any - a ComfyUI that never ran the pack's
    nodes starts nothing; HP_PRESTART=0 starts nothing either. A bad value is one log line naming the fix, never an
    error in ComfyUI's start. Returns that line ("" when nothing starts)."""
    value = os.environ.get("HP_PRESTART", "") if value is None else value
    log = logging.getLogger(__name__)
    source = "HP_PRESTART"
    if value.strip().lower() in OFF:
        return ""
    if not value.strip():  # unset: the world this ComfyUI's last queued prompt asked for, if it ever had one
        path = last_world_path(directory)
        if path is None or not os.path.isfile(path) or default_count() <= 0:
            return ""
        value, source = path, f"the last world a prompt asked for ({path}; HP_PRESTART=0: off)"
    try:
        hp, why = prestart_config(value)
    except ValueError as e:
        log.error("hybrid parallel: %s", e)
        return str(e)
    line = (f"hybrid parallel: {source} starts {hp.describe()} with ComfyUI" if hp is not None else
            f"hybrid parallel: {source}: {why}")
    log.info("%s", line)

    def run():
        try:
            runtime.warm(default_count() or (0 if hp is None else hp.config.world_size), hp)
        except Exception as e:  # noqa: BLE001 - a head start only: the prompt's own run reports errors
            log.error("hybrid parallel: HP_PRESTART failed: %s", e)
    (start or (lambda f: threading.Thread(target=f, name="hybrid-parallel-prestart", daemon=True).start()))(run)
    return line
