"""The web extension in the real ComfyUI frontend, in headless Chromium (Debian's package, selenium).

What a user sees: the Parallel Config node's mesh picture (cells, groups, colours) following the
widgets, the config error inline, the worker panel, and Hybrid Sampler's progress reaching the
frontend; the same with the frontend's Vue nodes (Nodes 2.0) and with the pack's nodes inside a subgraph. Screenshots
go to $HP_ARTIFACTS_DIR (default build/test-artifacts).
Under scripts/test.sh (HP_REQUIRE_BROWSER=1) a missing browser fails these tests; elsewhere it skips them.
"""
import json
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from comfy_server import workflow
from comfyui_hybrid_parallel.parallel import ParallelConfig
from comfyui_hybrid_parallel.parallel.mesh import rank_groups

pytestmark = [pytest.mark.comfy, pytest.mark.browser]

CHROMIUM = os.environ.get("HP_CHROMIUM", "/usr/bin/chromium")  # Debian's packages (scripts/setup_browser.sh)
CHROMEDRIVER = os.environ.get("HP_CHROMEDRIVER", "/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("HP_ARTIFACTS_DIR", REPO / "build" / "test-artifacts"))
SEED = dict(dp_degree=2, cfg_degree=2, pp_degree=2, ulysses_degree=2)  # xDiT's 16-device example
W, H = 104, 72

APP = """const app = window.comfyAPI.app.app;
const node = (() => {  // the workflow's Parallel Config: the root graph's, else the first inside a subgraph
  for (const gs = [app.graph], seen = new Set(); gs.length;) {
    const g = gs.shift();
    if (seen.has(g)) continue;
    seen.add(g);
    const n = g.nodes.find((n) => n.comfyClass === 'HybridParallelConfig');
    if (n) return n;
    gs.push(...g.nodes.filter((n) => n.subgraph).map((n) => n.subgraph));
  }
})();"""
READY = """const a = window.comfyAPI?.app?.app;
return !!(a && a.graph && window.LiteGraph?.registered_node_types?.HybridSampler
          && a.extensions?.some((e) => e.name === 'hybrid_parallel.ui')
          && a.graph.nodes.length > 0);"""  # the default graph is in: loading ours now is not overwritten
SET_WIDGETS = APP + """
for (const [name, value] of Object.entries(arguments[0])) {
  const w = node.widgets.find((w) => w.name === name);
  w.setValue(value, { node, canvas: app.canvas });  // what a click or a typed value does
}"""
SETTLED = APP + "return !!node?.hpMesh && !node.hpMesh.pending && node.hpMesh.payload !== null;"
# the picture shown in the node's Vue component: the widget's element, or (frontend 1.47, an API workflow loaded: the
# node built twice) the first build's element in the same component, drawn alike (web/hybrid_parallel.js `shown`)
SHOWN = """const el = node.widgets.find((w) => w.name === 'mesh_picture').element;
const shown = el.isConnected ? el : document.querySelector(`[data-node-id="${node.id}"] .hp-mesh`);"""
READ = APP + SHOWN + """
const root = shown || el;
const cells = [...root.querySelectorAll('.hp-cell')].map((c) => {
  const group = {};
  for (const [k, v] of Object.entries(c.dataset)) if (k.startsWith('group')) group[k.slice(5).toLowerCase()] = +v;
  return { rank: +c.dataset.rank, group, color: getComputedStyle(c).backgroundColor };
});
const boxes = {};
for (const b of root.querySelectorAll('.hp-box')) boxes[b.dataset.axis] = (boxes[b.dataset.axis] || 0) + 1;
return { ok: root.dataset.ok, worldSize: +root.dataset.worldSize, colorBy: root.dataset.colorBy || null, cells, boxes,
         chips: [...root.querySelectorAll('.hp-chip')].map((c) => c.dataset.axis),
         error: root.querySelector('.hp-mesh-error')?.textContent ?? null, query: node.hpMesh.query };"""


def _browser_missing():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package")
    return missing


def _chrome(profile):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--disable-dev-shm-usage", "--window-size=1600,1300", "--force-device-scale-factor=1",
              f"--user-data-dir={profile}"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)  # explicit driver: no selenium-manager


def _until(fn, timeout_s=60.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def page(request):
    """The ComfyUI frontend in headless Chromium with a Hybrid Parallel workflow loaded."""
    missing = _browser_missing()
    if missing:
        msg = f"browser tests need {', '.join(missing)}: run scripts/setup_browser.sh"
        if os.environ.get("HP_REQUIRE_BROWSER") == "1":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg)
    server = request.getfixturevalue("server")  # only now (tests ask `page` for it): a skip must not start ComfyUI
    server.post("/settings/Comfy.TutorialCompleted", True)  # no first-run templates dialog over the canvas
    warmed = server.get("/hybrid_parallel/pool")["warm_requests"]
    profile = tempfile.mkdtemp(prefix="hp-chromium-")
    driver = _chrome(profile)
    try:
        driver.get(server.url)
        _until(lambda: driver.execute_script(READY), 120, "the frontend with our extension")
        driver.execute_script("window.comfyAPI.app.app.loadApiJson(arguments[0], 'hybrid_parallel.json')",
                              workflow({}, "browser", W, H, steps=3))
        _until(lambda: driver.execute_script(SETTLED), 30, "the first mesh picture")
        # the frontend's warm request carries the workflow's config as loaded: the tests change widgets only after it
        _until(lambda: server.get("/hybrid_parallel/pool")["warm_requests"] > warmed, 30, "the frontend's warm request")
        driver.comfy = server
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _set(page, **widgets):
    page.execute_script(SET_WIDGETS, widgets)
    _until(lambda: page.execute_script(SETTLED), 30, f"the mesh picture for {widgets}")
    return page.execute_script(READ)


def _partition(cells, axis):
    groups = {}
    for c in cells:
        groups.setdefault(c["group"][axis], []).append(c["rank"])
    return sorted(sorted(g) for g in groups.values())


def _colors_follow(cells, axis):
    """Same colour inside a group, a different colour for every other group."""
    by_group = {}
    for c in cells:
        by_group.setdefault(c["group"][axis], set()).add(c["color"])
    return all(len(s) == 1 for s in by_group.values()) and len({s.pop() for s in by_group.values()}) == len(by_group)


def _screenshot(page, name, crop_node=True):
    """A full-window screenshot and, with crop_node, the Parallel Config node cut out of it."""
    from PIL import Image
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    full = ARTIFACTS / f"{name}_window.png"
    page.save_screenshot(str(full))
    if not crop_node:
        return full
    box = page.execute_script(APP + """
const r = app.canvas.canvas.getBoundingClientRect(), ds = app.canvas.ds, title = window.LiteGraph.NODE_TITLE_HEIGHT;
const [x, y] = ds.convertOffsetToCanvas([node.pos[0], node.pos[1] - title]);
return [r.left + x, r.top + y, node.size[0] * ds.scale, (node.size[1] + title) * ds.scale, window.devicePixelRatio];""")
    x, y, w, h, dpr = box
    pad = 12
    img = Image.open(full)
    left, top = max(0, int((x - pad) * dpr)), max(0, int((y - pad) * dpr))
    crop = img.crop((left, top, min(img.width, int((x + w + pad) * dpr)), min(img.height, int((y + h + pad) * dpr))))
    out = ARTIFACTS / f"{name}.png"
    crop.save(out)
    return out


def test_mesh_picture_follows_the_degree_widgets(page):
    one = page.execute_script(READ)
    assert one["ok"] == "true" and one["worldSize"] == 1 and len(one["cells"]) == 1

    pic = _set(page, **SEED)
    assert pic["ok"] == "true" and pic["worldSize"] == 16 and len(pic["cells"]) == 16
    assert sorted(c["rank"] for c in pic["cells"]) == list(range(16))
    groups = rank_groups(ParallelConfig(**SEED))
    for axis in ("dp", "cfg", "pp", "ulysses", "ring", "sp", "tp"):
        assert _partition(pic["cells"], axis) == sorted(groups[axis]), axis
    assert [0, 4] in _partition(pic["cells"], "cfg") and [0, 2] in _partition(pic["cells"], "pp")
    assert [0, 1] in _partition(pic["cells"], "sp")
    assert pic["boxes"] == {"dp": 2, "cfg": 4, "pp": 8}  # replicas > cfg halves > stages, as nested boxes
    assert pic["chips"] == ["ulysses", "pp", "cfg", "dp"] and pic["colorBy"] == "ulysses"
    assert _colors_follow(pic["cells"], "ulysses")

    page.execute_script(APP + """const ds = app.canvas.ds, title = window.LiteGraph.NODE_TITLE_HEIGHT;
ds.scale = 1.25;  // the node near the top left, large enough to read
ds.offset[0] = 420 / ds.scale - node.pos[0]; ds.offset[1] = 150 / ds.scale - node.pos[1] + title;
app.canvas.setDirty(true, true);""")
    time.sleep(0.5)  # a frame for the canvas and the DOM widget positions
    out = _screenshot(page, "mesh_picture")
    assert out.stat().st_size > 10_000
    if os.environ.get("HP_UPDATE_DOCS_SCREENSHOT") == "1":
        shutil.copy(out, REPO / "docs" / "mesh_picture.png")

    # colour by CFG half instead: a click on the legend chip
    page.execute_script(APP + "node.widgets.find((w) => w.name === 'mesh_picture').element"
                              ".querySelector('.hp-chip[data-axis=\"cfg\"]').click();")
    by_cfg = page.execute_script(READ)
    assert by_cfg["colorBy"] == "cfg" and _colors_follow(by_cfg["cells"], "cfg")
    assert not _colors_follow(by_cfg["cells"], "ulysses")

    _screenshot(page, "mesh_picture_by_cfg")

    ring = _set(page, dp_degree=1, cfg_degree=1, pp_degree=1, ulysses_degree=2, ring_degree=2)
    assert ring["worldSize"] == 4 and ring["boxes"] == {}  # no box for an axis of degree 1
    assert _partition(ring["cells"], "ring") == [[0, 2], [1, 3]]
    assert _partition(ring["cells"], "sp") == [[0, 1, 2, 3]]


def test_invalid_degrees_show_the_config_error_inline(page):
    server = page.comfy
    _set(page, dp_degree=1, cfg_degree=1, ring_degree=1, ulysses_degree=1, pp_degree=2, tp_degree=1)
    bad = _set(page, tp_degree=2)
    assert bad["ok"] == "false" and bad["cells"] == [] and bad["worldSize"] == 0
    assert bad["error"] == server.get(f"/hybrid_parallel/mesh?{bad['query']}")["error"]  # the server's rules
    assert "tp_degree" in bad["error"] and "pp_degree" in bad["error"]
    _screenshot(page, "mesh_error")
    fixed = _set(page, tp_degree=1)
    assert fixed["ok"] == "true" and fixed["error"] is None and fixed["worldSize"] == 2


def test_worker_panel_and_sampler_progress(page):
    """Sidebar tab: the pool route's state; a multi-rank prompt from this page: progress on Hybrid Sampler."""
    server = page.comfy
    page.execute_script("window.comfyAPI.app.app.extensionManager.command"
                        ".execute('Workspace.ToggleSidebarTab.hybrid-parallel-workers');")
    state = "return document.getElementById('hp-worker-panel')?.dataset.state ?? null;"
    shown = _until(lambda: page.execute_script(state), 20, "the worker panel")
    assert shown in {"none", "ready", "failed"} and shown == server.get("/hybrid_parallel/pool")["state"]

    page.execute_script("""window.__hpProgress = [];
window.comfyAPI.api.api.addEventListener('progress', (e) => window.__hpProgress.push(e.detail));""")
    client = page.execute_script("return window.comfyAPI.api.api.clientId;")
    graph = workflow({"ulysses_degree": 2}, f"browser_{uuid.uuid4().hex[:6]}", W, H, steps=3)
    pid = server.post("/prompt", {"prompt": graph, "client_id": client})["prompt_id"]
    entry = _until(lambda: server.get(f"/history/{pid}").get(pid, {}).get("status", {}).get("completed") is not None
                   and server.get(f"/history/{pid}")[pid], 300, "the prompt")
    assert entry["status"]["status_str"] == "success", entry["status"]
    events = page.execute_script("return window.__hpProgress;")
    sampler = [e for e in events if str(e["node"]) == "5"]  # "5" is Hybrid Sampler in comfy_server.workflow
    assert sampler and {e["max"] for e in sampler} == {3} and max(e["value"] for e in sampler) == 3, events

    rows = "return [...document.querySelectorAll('#hp-worker-panel tr[data-rank]')].map((r) => r.innerText);"
    _until(lambda: page.execute_script(state) == "ready" and len(page.execute_script(rows)) == 2, 20,
           "the panel to show 2 ready workers")
    text = page.execute_script("return document.getElementById('hp-worker-panel').innerText;")
    assert "ulysses2" in text and "sd3" in text and "MiB" in text
    _screenshot(page, "worker_panel", crop_node=False)


UI_DIR, API_DIR = REPO / "examples" / "workflows", REPO / "examples" / "api"
TO_PROMPT = """const done = arguments[arguments.length - 1];
window.comfyAPI.app.app.graphToPrompt().then((p) => done(JSON.stringify(p.output)), (e) => done(String(e)));"""


def _shape(prompt: dict) -> list:
    """A prompt without its node ids: each node's class and inputs, links as (source class, slot), numbers
    as floats (JavaScript writes the 1.0 of a Python prompt as 1)."""
    cls = {k: v["class_type"] for k, v in prompt.items()}
    num = lambda v: float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v  # noqa: E731
    out = []
    for node in prompt.values():
        inputs = {k: (cls[v[0]], v[1]) if isinstance(v, list) and len(v) == 2 and str(v[0]) in cls else num(v)
                  for k, v in node["inputs"].items()}
        out.append(json.dumps([node["class_type"], inputs], sort_keys=True))
    return sorted(out)


def test_ui_workflows_are_the_api_prompts(page):
    """examples/workflows/*.json (drag-and-drop UI format) turn into exactly examples/api/*.json in the real
    frontend. HP_UPDATE_EXAMPLES=1 regenerates them from the API prompts with the frontend's own loader.
    The Flux/SD3.5/PixArt/Wan 2.1 UI files were saved before Parallel Config gained `shard_weights` and are kept
    so: they must still load with every saved widget value in its place (saved workflows store widget values
    by position, so new widgets go last)."""
    app = "const app = window.comfyAPI.app.app;"
    names = sorted(p.stem for p in API_DIR.glob("*.json"))
    assert names, "no API prompts in examples/api"
    try:
        for name in names:
            api = json.loads((API_DIR / f"{name}.json").read_text())
            if os.environ.get("HP_UPDATE_EXAMPLES") == "1":
                page.execute_script(app + "app.loadApiJson(arguments[0], arguments[1]);", api, f"{name}.json")
                ui = page.execute_script(app + "return JSON.stringify(app.graph.serialize());")
                UI_DIR.mkdir(exist_ok=True)
                (UI_DIR / f"{name}.json").write_text(json.dumps(json.loads(ui), indent=1) + "\n")
            ui = json.loads((UI_DIR / f"{name}.json").read_text())
            assert ui.get("nodes") and ui.get("links") is not None, f"{name}: not a UI-format workflow"
            page.execute_script(app + "return app.loadGraphData(arguments[0], true, true, arguments[1]);", ui, name)
            got = json.loads(page.execute_async_script(TO_PROMPT))
            a, b = _shape(got), _shape(api)
            assert a == b, f"{name}: only in the frontend's prompt {sorted(set(a) - set(b))}, only in the API " \
                           f"prompt {sorted(set(b) - set(a))}"
    finally:  # the other tests of this module expect the Hybrid Parallel test workflow
        page.execute_script("window.comfyAPI.app.app.loadApiJson(arguments[0], 'hybrid_parallel.json')",
                            workflow({}, "browser", W, H, steps=3))


def test_degrees_auto_shows_the_predicted_time_per_choice(page):
    """degrees auto: the picture says Hybrid Sampler picks the degrees, and lists the cost model's predicted time
    per step of each choice once a run made one (the route's payload, workers/driver/routes.py)."""
    got = _set(page, dp_degree=1, cfg_degree=1, ring_degree=1, ulysses_degree=1, pp_degree=1, tp_degree=1,
               degrees="auto")
    assert got["ok"] == "true" and got["worldSize"] == 1
    assert "degrees=auto" in got["query"], f"the picture settled on older widget values: {got['query']}"
    text = page.execute_script(APP + "return node.widgets.find((w) => w.name === 'mesh_picture').element"
                               ".querySelector('.hp-mesh-auto')?.textContent ?? null;")
    payload = page.comfy.get(f"/hybrid_parallel/mesh?{got['query']}")
    if payload["auto"] is None:
        assert "shows here after a run" in text, text
    else:
        assert all(c["config"] in text for c in payload["auto"]["candidates"]), (text, payload["auto"])
    _screenshot(page, "mesh_degrees_auto", crop_node=False)
    manual = _set(page, degrees="manual")
    assert manual["ok"] == "true" and page.execute_script(
        APP + "return node.widgets.find((w) => w.name === 'mesh_picture').element.querySelector('.hp-mesh-auto');") \
        is None


def test_the_picture_shows_the_latest_runs_memory_plan(page):
    """After a Hybrid Sampler run, the picture shows the memory plan that run was checked against before any worker
    started (bytes per rank by item, of the device's memory), saying whether it was this mesh or another."""
    entry = page.comfy.run(workflow({"ulysses_degree": 2}, "browser_memory", W, H, steps=2))
    assert entry["status"]["status_str"] == "success", entry["status"]
    got = _set(page, dp_degree=1, cfg_degree=1, ring_degree=1, ulysses_degree=2, pp_degree=1, tp_degree=1,
               degrees="manual")
    payload = page.comfy.get(f"/hybrid_parallel/mesh?{got['query']}")
    mem = payload["memory"]
    assert mem["this_mesh"], mem
    assert mem["per_rank"] == sum(mem["items"].values()) and "weights" in mem["items"] and mem["capacity"] > 0
    read = APP + ("const m = node.widgets.find((w) => w.name === 'mesh_picture').element"
                  ".querySelector('.hp-mesh-memory'); return m && [m.textContent, m.dataset.thisMesh];")
    text, this_mesh = page.execute_script(read)
    assert this_mesh == "true" and "this mesh" in text and "per rank of" in text and "weights" in text, text
    _set(page, ulysses_degree=1)
    text, this_mesh = page.execute_script(read)
    assert this_mesh == "false" and f"another mesh, {mem['mesh']}" in text, text


def test_opening_a_workflow_with_the_packs_nodes_warms_the_server(page):
    """Nothing starts with ComfyUI; the frontend asks for the spare interpreters when a workflow holding the pack's
    nodes is opened (once per page: the fixture opened one), with its Parallel Config's widgets as the workflow
    holds them - the server may start that world (this server keeps no spares, so it only records the mesh)."""
    import urllib.parse
    from comfy_server import PARALLEL_DEFAULTS
    status = page.comfy.get("/hybrid_parallel/pool")
    assert status["warm_requests"] >= 1, status  # (the fixture waited for it)
    fixture_mesh = page.comfy.get("/hybrid_parallel/mesh?" + urllib.parse.urlencode(PARALLEL_DEFAULTS))["describe"]
    assert status["warm_mesh"] == fixture_mesh, status


# Nodes 2.0: the frontend (1.2x+; ComfyUI 0.33 ships 1.49.6) can draw every node as a Vue component over the canvas
# instead of on it; a DOM widget's element then moves into the node's component (WidgetDOM)
VUE_NODES = "Comfy.VueNodes.Enabled"
SETTING = """const [id, value, done] = arguments;
window.comfyAPI.app.app.extensionManager.setting.set(id, value).then(() => done(true), (e) => done(String(e)));"""
LOAD_API = """const [api, name, done] = arguments;
Promise.resolve(window.comfyAPI.app.app.loadApiJson(api, name)).then(() => done(true), (e) => done(String(e)));"""
IN_VUE_NODE = APP + SHOWN + """
return !!shown && shown.closest('[data-node-id]')?.dataset.nodeId === String(node.id) && shown.offsetParent !== null
  && shown.innerHTML === el.innerHTML;"""
FITS = APP + SHOWN + """
return [shown.firstElementChild.scrollWidth, shown.clientWidth];"""


def _setting(page, key, value, mode=None):
    assert page.execute_async_script(SETTING, key, value) is True, key
    if mode is not None:
        _until(lambda: page.execute_script("return window.LiteGraph.vueNodesMode;") == mode, 10, f"{key} = {value}")


def _load_api(page, graph):
    assert page.execute_async_script(LOAD_API, graph, "hybrid_parallel.json") is True
    _until(lambda: page.execute_script(SETTLED), 30, "the mesh picture")


def _picture_with(page, what, **widgets):
    """The picture once settled on these widget values (a click's value reaches the widget a moment later)."""
    import urllib.parse

    def ready():
        if not page.execute_script(SETTLED):
            return None
        pic = page.execute_script(READ)
        q = dict(urllib.parse.parse_qsl(pic["query"], keep_blank_values=True))
        return pic if all(q.get(k) == str(v) for k, v in widgets.items()) else None
    return _until(ready, 30, what)


def _focus_config(page, x=420, y=110):
    page.execute_script(APP + """const c = app.canvas, ds = c.ds;
ds.scale = 1; ds.offset[0] = arguments[0] - node.pos[0]; ds.offset[1] = arguments[1] - node.pos[1];
c.setDirty(true, true);""", x, y)
    time.sleep(0.3)  # a frame for the canvas and the node components


def test_vue_nodes_mode_shows_the_picture_in_the_node(page):
    """With Nodes 2.0 on: the picture sits inside Parallel Config's Vue component, wide enough for it (the component
    pads its body), follows clicks on the component's own "+" buttons and its legend chips; the Workers panel shows
    the pool's state; switched back, the picture is the canvas's DOM widget again."""
    from selenium.webdriver.common.by import By
    if not page.execute_script("return 'vueNodesMode' in window.LiteGraph;"):
        pytest.skip("this frontend has no Vue nodes mode (Nodes 2.0)")
    try:
        _setting(page, VUE_NODES, True, mode=True)
        _load_api(page, workflow({}, "browser", W, H, steps=3))
        _focus_config(page)
        _until(lambda: page.execute_script(IN_VUE_NODE), 10, "the picture inside the Vue node")
        vue_node = f'[data-node-id="{page.execute_script(APP + "return node.id;")}"]'
        for name in ("dp_degree", "cfg_degree", "pp_degree", "ulysses_degree"):  # a click on each "+": 1 -> 2
            page.find_element(By.CSS_SELECTOR, f'{vue_node} [aria-label="{name}"] [data-testid="increment"]').click()
        pic = _picture_with(page, "the picture after the clicks", **SEED)
        assert pic["ok"] == "true" and pic["worldSize"] == 16 and len(pic["cells"]) == 16
        groups = rank_groups(ParallelConfig(**SEED))
        for axis in ("dp", "cfg", "pp", "ulysses", "sp"):
            assert _partition(pic["cells"], axis) == sorted(groups[axis]), axis
        assert pic["boxes"] == {"dp": 2, "cfg": 4, "pp": 8} and pic["colorBy"] == "ulysses"
        assert _colors_follow(pic["cells"], "ulysses")
        _until(lambda: (lambda s: s[0] <= s[1])(page.execute_script(FITS)), 5,
               "the node wide enough for the picture")  # not clipped by the component's padding
        page.find_element(By.CSS_SELECTOR, f'{vue_node} .hp-chip[data-axis="cfg"]').click()
        by_cfg = page.execute_script(READ)
        assert by_cfg["colorBy"] == "cfg" and _colors_follow(by_cfg["cells"], "cfg")
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.find_element(By.CSS_SELECTOR, vue_node).screenshot(str(ARTIFACTS / "vue_nodes_mesh_picture.png"))

        if not page.execute_script("return !!document.getElementById('hp-worker-panel')?.isConnected;"):
            page.execute_script("window.comfyAPI.app.app.extensionManager.command"
                                ".execute('Workspace.ToggleSidebarTab.hybrid-parallel-workers');")
        state = "return document.getElementById('hp-worker-panel')?.dataset.state ?? null;"
        want = page.comfy.get("/hybrid_parallel/pool")["state"]
        _until(lambda: page.execute_script(state) == want, 20, f"the worker panel showing {want}")

        _setting(page, VUE_NODES, False, mode=False)  # back on the canvas: the same element, a DOM widget again
        _until(lambda: page.execute_script(APP + """const el = node.widgets.find((w) => w.name === 'mesh_picture')
.element; return el.isConnected && !el.closest('[data-node-id]');"""), 10, "the picture back on the canvas")
    finally:
        _setting(page, VUE_NODES, False)
        _load_api(page, workflow({}, "browser", W, H, steps=3))


TO_SUBGRAPH = """const done = arguments[arguments.length - 1];
const app = window.comfyAPI.app.app, c = app.canvas;
c.deselectAll();
for (const type of ['HybridParallelConfig', 'HybridSampler']) c.select(app.graph.findNodesByType(type)[0]);
app.extensionManager.command.execute('Comfy.Graph.ConvertToSubgraph')  // what the selection toolbox's button runs
  .then(() => done(JSON.stringify(app.graph.serialize())), (e) => done(JSON.stringify({ error: String(e) })));"""
OPEN_SUBGRAPH = """const app = window.comfyAPI.app.app;
const host = app.graph.nodes.find((n) => n.isSubgraphNode?.());
app.canvas.openSubgraph(host.subgraph, host);"""


def test_the_packs_nodes_inside_a_subgraph(page):
    """Parallel Config and Hybrid Sampler converted to a subgraph (Convert to Subgraph; the saved workflow holds them
    in definitions.subgraphs): the frontend's prompt (ids "<subgraph node>:<node>") runs through the pack to the end,
    with Hybrid Sampler's progress reaching the page; opened, the subgraph shows the config's picture, which follows
    its widgets; and a fresh page opening the saved workflow (in Vue nodes mode) sends the warm request with the
    Parallel Config inside the subgraph, whose picture the opened subgraph shows in the node's component."""
    server = page.comfy
    if not page.execute_script("return typeof window.comfyAPI.app.app.graph.convertToSubgraph === 'function';"):
        pytest.skip("this frontend has no subgraphs")
    vue = page.execute_script("return 'vueNodesMode' in window.LiteGraph;")
    persist = page.execute_script("return window.comfyAPI.app.app.extensionManager.setting"
                                  ".get('Comfy.Workflow.Persist');")
    import urllib.parse
    from comfy_server import PARALLEL_DEFAULTS
    mesh = server.get("/hybrid_parallel/mesh?" + urllib.parse.urlencode({**PARALLEL_DEFAULTS, "ulysses_degree": 2}))
    mesh = mesh["describe"]
    try:
        _load_api(page, workflow({"ulysses_degree": 2}, "browser_subgraph", W, H, steps=2))
        saved = json.loads(page.execute_async_script(TO_SUBGRAPH))
        assert "error" not in saved, saved
        [sub] = saved["definitions"]["subgraphs"]
        [host] = [n for n in saved["nodes"] if n["type"] == sub["id"]]
        inner = {n["type"]: n["id"] for n in sub["nodes"]}
        assert sorted(inner) == ["HybridParallelConfig", "HybridSampler"], inner
        assert not {n["type"] for n in saved["nodes"]} & set(inner)
        cfg_id, sampler_id = (f"{host['id']}:{inner[t]}" for t in ("HybridParallelConfig", "HybridSampler"))

        prompt = json.loads(page.execute_async_script(TO_PROMPT))
        assert prompt[cfg_id]["class_type"] == "HybridParallelConfig"
        assert prompt[cfg_id]["inputs"]["ulysses_degree"] == 2
        assert prompt[sampler_id]["inputs"]["parallel_config"] == [cfg_id, 0], prompt[sampler_id]
        page.execute_script("""window.__hpProgress = [];
window.comfyAPI.api.api.addEventListener('progress', (e) => window.__hpProgress.push(e.detail));""")
        client = page.execute_script("return window.comfyAPI.api.api.clientId;")
        pid = server.post("/prompt", {"prompt": prompt, "client_id": client})["prompt_id"]
        entry = _until(lambda: server.get(f"/history/{pid}").get(pid, {}).get("status", {}).get("completed")
                       is not None and server.get(f"/history/{pid}")[pid], 300, "the subgraph's prompt")
        assert entry["status"]["status_str"] == "success", entry["status"]
        events = page.execute_script("return window.__hpProgress;")
        assert max(e["value"] for e in events if str(e["node"]) == sampler_id) == 2, events

        page.execute_script(OPEN_SUBGRAPH)
        _until(lambda: page.execute_script(SETTLED), 30, "the picture in the opened subgraph")
        _focus_config(page)
        pic = page.execute_script(READ)
        assert pic["ok"] == "true" and pic["worldSize"] == 2 and _partition(pic["cells"], "ulysses") == [[0, 1]]
        assert page.execute_script(APP + "return node.widgets.find((w) => w.name === 'mesh_picture')"
                                   ".element.offsetParent !== null;"), "the picture is hidden in the subgraph"
        assert _set(page, ring_degree=2)["worldSize"] == 4
        _screenshot(page, "subgraph_mesh_picture")
        assert _set(page, ring_degree=1)["worldSize"] == 2

        # a fresh page (the warm request goes once per page) opening the saved workflow
        _setting(page, "Comfy.Workflow.Persist", False)  # it opens the default workflow, not the last one
        if vue:
            _setting(page, VUE_NODES, True)
        warmed = server.get("/hybrid_parallel/pool")["warm_requests"]
        page.refresh()
        _until(lambda: page.execute_script(READY), 60, "the frontend, reloaded")
        page.execute_script("return window.comfyAPI.app.app.loadGraphData(arguments[0], true, true, 'subgraph.json');",
                            saved)
        _until(lambda: server.get("/hybrid_parallel/pool")["warm_requests"] > warmed, 30, "the warm request")
        assert server.get("/hybrid_parallel/pool")["warm_mesh"] == mesh  # the config inside the subgraph
        if vue:
            page.execute_script(OPEN_SUBGRAPH)
            _until(lambda: page.execute_script(SETTLED), 30, "the picture in the opened subgraph, Vue nodes")
            _focus_config(page)
            _until(lambda: page.execute_script(IN_VUE_NODE), 10, "the picture inside the Vue node in the subgraph")
            assert page.execute_script(READ)["worldSize"] == 2
    finally:
        if vue:
            _setting(page, VUE_NODES, False)
        _setting(page, "Comfy.Workflow.Persist", persist if persist is not None else True)
        page.execute_script("window.comfyAPI.app.app.extensionManager.command.execute('Comfy.Graph.ExitSubgraph');")
        _load_api(page, workflow({}, "browser", W, H, steps=3))
