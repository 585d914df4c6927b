"""No import circle in the product code (the pack's __init__, nodes/, parallel/, workers/).

Why: a circle hides behind imports inside functions - it works until someone moves one to the top of a file, and it
means two modules that cannot be read, tested or replaced one without the other. Every import counts here, at the top
of a file or inside a function. Pure AST, no import of the pack: fast and offline.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("__init__.py", "nodes", "parallel", "workers")


def _modules() -> dict:
    """{dotted name relative to the pack: (path, is a package)}."""
    out = {}
    for entry in PRODUCT:
        path = ROOT / entry
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            out[".".join(parts[:-1] if is_pkg else parts)] = (f, is_pkg)
    return out


PACKAGE = "comfyui_hybrid_parallel"


def _absolute(node):
    """[(target module, imported name)] of an absolute import of the pack's own modules (the pack imports itself by
    its package name inside functions: a circle closed that way is one as well), else None."""
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
            (node.module == PACKAGE or node.module.startswith(PACKAGE + ".")):
        target = node.module[len(PACKAGE) + 1:]
        return [(target, a.name) for a in node.names]
    if isinstance(node, ast.Import):
        found = [(a.name[len(PACKAGE) + 1:], "") for a in node.names if a.name.startswith(PACKAGE + ".")]
        return [(t, "") for t, _ in found] or None
    return None


def import_graph(mods: dict) -> dict:
    """{module: the pack's modules it imports}. `from . import x` depends on the submodule x (not on the package's
    __init__, which Python has already begun); `from .m import name` on m (and on m.name where that is a module)."""
    graph = {}
    for name, (path, is_pkg) in mods.items():
        base = name.split(".") if name else []
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            absolute = _absolute(node)  # `from comfyui_hybrid_parallel.x import y` / `import comfyui_hybrid_parallel.x`
            if absolute is not None:
                subs = {f"{t}.{a}".lstrip(".") for t, a in absolute} & mods.keys()
                deps |= subs | ({t for t, _ in absolute} & mods.keys())
                continue
            if not (isinstance(node, ast.ImportFrom) and node.level > 0):
                continue
            here = base if is_pkg else base[:-1]
            here = here[:len(here) - (node.level - 1)] if node.level > 1 else here
            target = ".".join(here + (node.module.split(".") if node.module else []))
            subs = {f"{target}.{a.name}".lstrip(".") for a in node.names} & mods.keys()
            deps |= subs if subs else ({target} & mods.keys())
        # importing a.b.c runs the __init__ of a.b first: an edge to every package above a target, but those above
        # the importing module itself (already being imported when it runs)
        mine = {".".join(base[:i]) for i in range(len(base) + 1)}
        deps |= {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)} & mods.keys() - mine
        graph[name] = deps - {name}
    return graph


def circles(graph: dict) -> list:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circle_in_product_code():
    graph = import_graph(_modules())
    assert len(graph) > 80 and graph["nodes.sampler_node"], "the scan found too little: it is broken"
    assert not circles(graph), circles(graph)


def test_a_circle_through_a_package_init_is_found(tmp_path):
    """p/__init__.py imports p.loop, which imports q; q imports p.sampling - Python runs p/__init__ first: a circle."""
    for rel, text in (("p/__init__.py", "from .loop import run\n"), ("p/loop.py", "from ..q import f\n"),
                      ("p/sampling.py", ""), ("q.py", "from .p.sampling import g\n")):
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = {"p": (tmp_path / "p/__init__.py", True), "p.loop": (tmp_path / "p/loop.py", False),
            "p.sampling": (tmp_path / "p/sampling.py", False), "q": (tmp_path / "q.py", False)}
    assert circles(import_graph(mods)) == [["p", "p.loop", "q"]]


def test_an_absolute_self_import_inside_a_function_closes_a_circle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text(f"def f():\n    from {PACKAGE}.a import g\n")
    mods = {"a": (tmp_path / "a.py", False), "b": (tmp_path / "b.py", False)}
    assert circles(import_graph(mods)) == [["a", "b"]]


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []



def lazy_without_reason(path: Path) -> list:
    """The pack's own modules imported inside a function of `path` without `# lazy: <why>` on the import's line
    ("line: import"). An import belongs at the top of its file; inside a function only where it is heavy or optional
    for the importing module (torch in a module that stays free of it), said where it is."""
    lines = path.read_text().splitlines()
    out = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out += [f"{node.lineno}: {lines[node.lineno - 1].strip()}" for node in ast.walk(fn)
                    if isinstance(node, ast.ImportFrom) and node.level > 0 and "# lazy:" not in lines[node.lineno - 1]]
    return sorted(set(out))


def test_imports_inside_functions_say_why():
    found = {str(path.relative_to(ROOT)): bad for path, _ in _modules().values() if (bad := lazy_without_reason(path))}
    assert not found, found


def test_the_lazy_import_check_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from .x import y\n\n\ndef f():\n    from .a import b\n    from .c import d  # lazy: torch\n")
    assert lazy_without_reason(f) == ["5: from .a import b"]


def test_the_path_of_a_prompt_goes_one_way():
    """nodes -> workers/driver -> workers/bridge -> ... -> parallel: the bridge (ComfyUI's surface) is called, never
    calls up into the driver room or the nodes; the driver room never imports a node; the engine imports neither."""
    graph = import_graph(_modules())
    up = {m: sorted(d for d in deps if d.startswith(above))
          for m, deps in graph.items()
          for above in [("nodes", "workers.driver") if m.startswith("workers.bridge") else
                        ("nodes",) if m.startswith("workers.driver") else
                        ("nodes", "workers") if m.startswith("parallel") else ()]
          if above and any(d.startswith(above) for d in deps)}
    assert any(m.startswith("workers.driver.") for m in graph) and graph["nodes.model_node"] & {"workers.driver.run"}
    assert not up, up


def test_every_file_in_nodes_is_a_node_class_file():
    """nodes/ holds the node classes and nothing else: each file defines node classes (INPUT_TYPES), its helpers are
    private, and a wire type, a rule the routes share or the runtime lives in workers/ (the driver room). Why: the
    path of a prompt starts in a node and leaves nodes/ at once; a reader finds the node's widgets there, not the pack."""
    found = {}
    for f in sorted((ROOT / "nodes").glob("*.py")):
        if f.name == "__init__.py":
            continue
        tree = ast.parse(f.read_text())
        public = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not n.name.startswith("_")]
        nodes = [n.name for n in tree.body if isinstance(n, ast.ClassDef) and any(
            isinstance(b, ast.FunctionDef) and b.name == "INPUT_TYPES" for b in n.body)]
        found[f.name] = (nodes, sorted(set(public) - set(nodes)))
    assert len(found) >= 6 and all(nodes for nodes, _ in found.values()), found
    assert not {name: other for name, (_, other) in found.items() if other}, found
