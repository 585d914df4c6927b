"""The seam inventory (workers/bridge/seams.py) against the ComfyUI under test, and what a ComfyUI lacking a seam gets.

Why: a ComfyUI release that removes or renames something the pack uses must fail here, in one test that names the
symbol - not in a worker mid-prompt (0.33 dropped `pick_operations(scaled_fp8=)`: every model build failed on the
workers). The scans below keep the inventory honest: every ComfyUI symbol the pack's code reaches for is listed in it,
and only the bridge (workers/bridge/) reaches ComfyUI at all.

Marker `comfy`: needs ComfyUI (scripts/setup_comfyui.sh); without it these tests fail, never skip.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from comfy_env import setup_comfy

pytestmark = pytest.mark.comfy

PACK = Path(__file__).resolve().parents[2]
COMFY_TOPS = ("comfy", "latent_preview", "comfy_extras", "comfy_api", "folder_paths", "node_helpers")


@pytest.fixture(scope="module", autouse=True)
def _comfy():
    setup_comfy()


def test_inventory_complete_on_this_comfyui():
    from comfyui_hybrid_parallel.workers.bridge import seams as comfy_seams
    assert comfy_seams.missing() == []
    assert comfy_seams.problem_line() is None
    version = comfy_seams.comfyui_version()
    assert version in comfy_seams.TESTED + comfy_seams.EARLIER, f"ComfyUI {version} under test is not listed in comfy_seams.TESTED"


def _module_and_path(dotted: str):
    """('comfy.utils', 'set_attr_param') for 'comfy.utils.set_attr_param': the longest importable module prefix."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return ".".join(parts[:i]), ".".join(parts[i:])
    return None, dotted


def _comfy_uses(path: Path) -> set:
    """module:attribute (first attribute only) of every ComfyUI symbol a file reaches: `from comfy.x import y`,
    `comfy.x.y` after `import comfy.x`, and `alias.y` after `import comfy.x as alias`."""
    tree = ast.parse(path.read_text())
    aliases, uses = {}, set()  # a name bound by `import` -> the dotted prefix it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in COMFY_TOPS:
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] in COMFY_TOPS:
            uses.update(f"{node.module}:{a.name}" for a in node.names)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts, n = [], node
        while isinstance(n, ast.Attribute):
            parts.append(n.attr)
            n = n.value
        if not isinstance(n, ast.Name) or n.id not in aliases:
            continue
        dotted = ".".join([aliases[n.id]] + parts[::-1])
        module, attr = _module_and_path(dotted)
        if module and attr and not attr.startswith("__"):
            uses.add(f"{module}:{attr.split('.')[0]}")
    return uses


BRIDGE = PACK / "workers" / "bridge"
# The product code (what ComfyUI loads from this folder) besides the bridge. doctor/ is the one exception, for now: it
# builds ComfyUI-format test models and runs ComfyUI's own forward to compare against (a diagnosis kit, run beside the
# pack, never on a prompt's path); its ComfyUI reads are in the scan of the inventory above.
PRODUCT = ("__init__.py", "nodes", "parallel", "workers")
COMFY_MODULES = COMFY_TOPS + ("comfy_execution", "execution", "server", "nodes", "comfy_config", "app")


def _product_files():
    for entry in PRODUCT:
        path = PACK / entry
        yield from [path] if path.is_file() else sorted(path.rglob("*.py"))


def _comfy_reaches(path: Path) -> list:
    """Where a file imports ComfyUI (`import comfy.x`, `from comfy.x import y`; relative imports are the pack's own)
    or reaches a ComfyUI module by its name (`sys.modules.get("comfy.x")`, `import_module("server")`)."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and ast.unparse(node.func) in (
                    "sys.modules.get", "importlib.import_module", "import_module", "__import__"):
            names = [node.args[0].value]
        found += [f"{n} (line {node.lineno})" for n in names if n.split(".")[0] in COMFY_MODULES]
    return found


def test_only_the_bridge_reaches_comfyui():
    """The bridge (workers/bridge/) is the only product code that imports ComfyUI or looks its modules up: the next
    ComfyUI changes that folder only. The scan must see the bridge's own reaches (else it is broken)."""
    outside = {str(f.relative_to(PACK)): r for f in _product_files() if BRIDGE not in f.parents
               for r in [_comfy_reaches(f)] if r}
    assert not outside, f"ComfyUI reached outside workers/bridge/: {outside}"
    inside = [r for f in sorted(BRIDGE.glob("*.py")) for r in _comfy_reaches(f)]
    assert len(inside) > 20 and any(r.startswith("comfy.model_patcher") for r in inside), inside


def test_every_comfy_symbol_the_bridge_uses_is_in_the_inventory():
    from comfyui_hybrid_parallel.workers.bridge import seams as comfy_seams
    listed = {s.where.split(".")[0] if ":" not in s.where else
              s.where.partition(":")[0] + ":" + s.where.partition(":")[2].split(".")[0] for s in comfy_seams.SEAMS}
    found = {}
    for f in _product_files():
        for use in _comfy_uses(f):
            found.setdefault(use, []).append(str(f.relative_to(PACK)))
    assert found, "the scan found no ComfyUI symbol at all: it is broken"
    unlisted = {u: where for u, where in found.items() if u not in listed}
    assert not unlisted, f"ComfyUI symbols used but not in workers/bridge/seams.SEAMS: {unlisted}"


def test_missing_seam_refused_before_any_worker(monkeypatch):
    """A ComfyUI without a seam: the node's pool request fails with one line naming it and the tested versions,
    and no pool (no worker) is made."""
    from comfyui_hybrid_parallel.workers.driver.runtime import Runtime
    from comfyui_hybrid_parallel.parallel.config import ParallelConfig
    from comfyui_hybrid_parallel.workers.bridge import seams as comfy_seams
    monkeypatch.setattr(comfy_seams, "SEAMS", comfy_seams.SEAMS + (
        comfy_seams.Seam("comfy.ops:no_such_operations", "a test: a seam this ComfyUI lacks"),
        comfy_seams.Seam("comfy.sample:sample", "a test: a parameter it lacks", params=("no_such_param",)),
    ))
    made = []
    rt = Runtime(make_pool=lambda device: made.append(device))

    class HP:
        device = "cpu"
        cluster = None
        config = ParallelConfig(ulysses_degree=2)
    with pytest.raises(RuntimeError) as e:
        rt.pool(HP())
    line = str(e.value)
    assert "\n" not in line
    assert "comfy.ops:no_such_operations is missing" in line
    assert "comfy.sample:sample does not accept no_such_param" in line
    assert comfy_seams.comfyui_version() in line and all(v in line for v in comfy_seams.TESTED)
    assert made == []


def test_moved_symbol_needs_one_of_its_places(monkeypatch):
    from comfyui_hybrid_parallel.workers.bridge import seams as comfy_seams
    Seam = comfy_seams.Seam
    assert comfy_seams.missing((Seam("comfy.utils:nope", "t", one_of="g"), Seam("comfy.utils:get_attr", "t",
                                                                              one_of="g"))) == []
    gone = comfy_seams.missing((Seam("comfy.utils:nope", "t", one_of="g"), Seam("comfy.ops:nope2", "t", one_of="g")))
    assert len(gone) == 1 and "none of comfy.utils:nope, comfy.ops:nope2" in gone[0]


def test_every_family_adapter_names_the_modules_comfyui_defines_its_classes_in():
    """A family's plan applies to ComfyUI's class by name *and module*: a class of the same name elsewhere (a custom
    node's own `WanModel`, AuraFlow's `MMDiT` beside SD3's) is another forward and must not inherit the plan. So every
    adapter names its module(s), and each is where this ComfyUI defines the class - a release that moves a class
    fails here, not as a model that silently runs as "any model". A family this ComfyUI lacks (its modules do not
    import: 0.3.75 and the 2026 families) is skipped; its subclasses are checked where all its modules import."""
    from comfyui_hybrid_parallel.parallel.models import ADAPTERS
    checked = 0
    for a in ADAPTERS.values():
        assert a.comfy_module, f"{a.family}: no comfy_module"
        modules = (a.comfy_module,) if isinstance(a.comfy_module, str) else a.comfy_module
        loaded = []
        for name in modules:
            try:
                loaded.append(importlib.import_module(name))
            except ImportError:
                pass
        if not loaded:
            continue
        defined = {n for m in loaded for n, c in vars(m).items() if isinstance(c, type) and c.__module__ == m.__name__}
        names = (a.comfy_class,) + (tuple(a.comfy_subclasses) if len(loaded) == len(modules) else ())
        missing = [n for n in names if n not in defined]
        assert not missing, f"{a.family}: {missing} not defined in {[m.__name__ for m in loaded]}"
        cls = next(getattr(m, a.comfy_class) for m in loaded if a.comfy_class in vars(m))
        assert a.declares(cls) and not a.declares(type(a.comfy_class, (), {})), a.family
        checked += 1
    assert checked >= 11, checked  # the families of ComfyUI 0.3.75 at least


def test_the_object_protocol_and_markers_are_on_this_comfyui(monkeypatch):
    """Every attribute of ComfyUI's objects the bridge reads, and every private marker, is in the manifest and present
    (on the primary ComfyUI the optional ones too); one renamed is one line of the load check."""
    from comfyui_hybrid_parallel.workers.bridge import seams
    gone = [p for a in seams.PROTOCOL if not a.server for p in [seams._attr_problem(a)] if p and
            (not a.optional or seams.comfyui_version() == seams.TESTED[0])]  # (server ones: the server seams test)
    assert not gone, gone
    renamed = seams.Attr("comfy.model_patcher:ModelPatcher", "patches_uuid_v2", "a test")
    monkeypatch.setattr(seams, "PROTOCOL", seams.PROTOCOL + (renamed,))
    line = seams.problem_line()
    assert line and "ModelPatcher no longer has 'patches_uuid_v2'" in line and "tests ran on ComfyUI" in line


def _protocol_reads(path: Path, names: set) -> list:
    """Where a file reads one of ComfyUI's object attributes (`x.diffusion_model`, `getattr(x, "current_hooks")`,
    `opts["transformer_options"]`, `opts.get("transformer_options")`) - code, not comments or docstrings."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute) and node.attr in names:
            name = node.attr
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value in names:
            name = node.slice.value
        elif isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
                ast.unparse(node.func) in ("getattr", "hasattr", "setattr") and node.args[1].value in names:
            name = node.args[1].value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value in names:
            name = node.args[0].value
        if name is not None:
            found.append(f"{name} (line {node.lineno})")
    return found


# What the engine reads of ComfyUI's modules is theirs by design: a family adapter declares ComfyUI's classes and the
# ranks run ComfyUI's forward, whose keyword `transformer_options` passes through the engine's hooks. The patcher, the
# model wrapper, the VAE wrapper and the markers are read by the bridge only.
ENGINE_PASSES = {"transformer_options"}
# The guider's `cfg` and `conds` are also the pack's own words elsewhere (the mesh's cfg axis, ctx.cfg; the wire's
# "conds" of a forward job): they are ComfyUI's object only in the nodes, which hold ComfyUI's guider - scanned there.
PACK_WORDS = {"cfg", "conds"}


def test_only_the_bridge_reads_comfyuis_objects():
    """Attribute reads of ComfyUI's objects (the manifest's PROTOCOL - the patcher, the model, the VAE, the guider and
    the wrapper executor, the server - and the model options' transformer_options) are the bridge's alone, like its
    imports. The scan must see the bridge's own reads (else it is broken), the guider's among them."""
    from comfyui_hybrid_parallel.workers.bridge import seams
    names = {a.name for a in seams.PROTOCOL if a.name != "model"} | {"transformer_options"}
    outside = {}
    for f in _product_files():
        if BRIDGE in f.parents:
            continue
        engine = PACK / "parallel" in f.parents
        scanned = names - ENGINE_PASSES if engine else names
        reads = _protocol_reads(f, scanned if PACK / "nodes" in f.parents else scanned - PACK_WORDS)
        if reads:
            outside[str(f.relative_to(PACK))] = reads
    assert not outside, f"ComfyUI's objects read outside workers/bridge/: {outside}"
    inside = [r for f in sorted(BRIDGE.glob("*.py")) for r in _protocol_reads(f, names)]
    assert len(inside) > 30 and any(r.startswith("diffusion_model") for r in inside), inside
    assert {r.split()[0] for r in inside} >= {"class_obj", "original_conds", "conds", "routes", "prompt_queue"}, inside


SERVER_PROBE = r'''
import json, re, sys
sys.path.insert(0, sys.argv[1])
from comfy_env import comfy_nodes, setup_comfy
comfy_dir = setup_comfy()
comfy_nodes(comfy_dir)
import execution, server  # ComfyUI's own server side, as a running ComfyUI has it loaded
from comfy_execution.utils import CurrentNodeContext
from comfyui_hybrid_parallel.workers.bridge import graph, seams
out = {"loaded": seams.server_loaded(), "missing": seams.missing()}
# the running item as ComfyUI's server queues it (its post_prompt), read back by the pack's graph.executing()
text = open(server.__file__, encoding="utf-8").read()
put = re.search(r"prompt_queue\.put\(\((.*?)\)\)", text)
out["put"] = put.group(1) if put else None
class Stub:
    def queue_updated(self): pass
queue = execution.PromptQueue(Stub())
prompt = {"7": {"class_type": "KSampler", "inputs": {"model": ["3", 0]}}, "3": {"class_type": "UNETLoader", "inputs": {}}}
queue.put((0, "p1", prompt, {}, ["7"], {}))
queue.get()
server.PromptServer.instance = type("S", (), {"prompt_queue": queue})()
with CurrentNodeContext("p1", "7"):
    g = graph.executing()
out["graph"] = [g.node_id, g.upstream()]
print(json.dumps(out))
'''


def test_the_server_seams_and_the_running_prompt_layout():
    """ComfyUI's server side (PromptServer's routes and prompt handler, the prompt queue's running items) is checked
    where a server is loaded - here in a process that loads ComfyUI's server module, as a running ComfyUI has it - and
    the layout the pack reads a running prompt in, (number, prompt_id, prompt, ...), is the one ComfyUI queues."""
    import json
    import subprocess
    import sys
    tests = str(Path(__file__).resolve().parents[1])
    run = subprocess.run([sys.executable, "-c", SERVER_PROBE, tests], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["loaded"] and out["missing"] == [], out
    assert out["put"] is not None and out["put"].split(",")[1].strip() == "prompt_id" and \
        out["put"].split(",")[2].strip() == "prompt", out["put"]
    assert out["graph"] == ["7", ["3"]], out
    from comfyui_hybrid_parallel.workers.bridge import seams
    assert {s.where for s in seams.SEAMS if s.server} >= {"server:PromptServer", "execution:PromptQueue",
                                                           "server:PromptServer.add_on_prompt_handler"}
