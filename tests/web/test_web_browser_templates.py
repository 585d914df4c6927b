"""The pack's templates in the real ComfyUI frontend (headless Chromium; tests/web/test_web_browser.py's page fixture, a
browser of its own here): listed in ComfyUI's Templates browser, each loading with no missing node, offering exactly
its loaders' files in the missing-models dialog, and turning into exactly its API prompt. HP_UPDATE_TEMPLATES=1
regenerates the UI files and their thumbnails through the frontend's own loader and serializer.
"""
import json
import os
import time

import pytest

from test_web_browser import APP, ARTIFACTS, REPO, SETTLED, TO_PROMPT, _shape, _until, page  # noqa: F401

pytestmark = [pytest.mark.comfy, pytest.mark.browser]

TEMPLATE_UI, TEMPLATE_API = REPO / "example_workflows", REPO / "examples" / "template_prompts"
TEMPLATE_MODULE = "hybrid_parallel_under_test"  # the pack's folder name in the test server's custom_nodes
DECORATE = """const app = window.comfyAPI.app.app, LG = window.LiteGraph;
const [api, name, note, links, done] = arguments;
(async () => {
await app.loadApiJson(api, name + '.json');  // async in frontend 1.49 (ComfyUI 0.33): the graph is empty until then
for (const [id, models] of Object.entries(links)) app.graph.getNodeById(+id).properties.models = models;
let x0 = Infinity, y0 = Infinity;
for (const n of app.graph.nodes) { x0 = Math.min(x0, n.pos[0]); y0 = Math.min(y0, n.pos[1]); }
const memo = LG.createNode('Note');
memo.title = 'Read me: GPUs, memory, files';
memo.widgets[0].value = note;
memo.color = '#432'; memo.bgcolor = '#653';
app.graph.add(memo);
memo.pos = [x0 - 560, y0]; memo.size = [520, 620];
done(JSON.stringify(app.graph.serialize()));
})().catch(e => done(JSON.stringify({error: String(e)})));"""
# What the frontend reports missing when a workflow loads, from either frontend: before 1.4x it calls
# app.showMissingNodesError / showMissingModelsError (hooked); later ones (ComfyUI 0.33 ships 1.49.6) fill the Pinia
# stores 'missingNodesError' and 'missingModel' (the errors side panel), the models asynchronously once the server's
# folder list arrives - a sentinel marks the candidates not yet surfaced for this load.
PINIA = """const el = document.querySelector('#vue-app');
const pinia = el && el.__vue_app__ && el.__vue_app__.config.globalProperties.$pinia;
const models = pinia && pinia._s.get('missingModel'), nodes = pinia && pinia._s.get('missingNodesError');"""
HOOK_MISSING = PINIA + """const app = window.comfyAPI.app.app;
window.__hpMissing = { nodes: null, models: null, pending: [{ name: '__hp_pending__' }] };
app.showMissingNodesError = (types) => { window.__hpMissing.nodes = types; };
app.showMissingModelsError = (models) => { window.__hpMissing.models = models; };
if (models) models.missingModelCandidates = window.__hpMissing.pending;
return app.extensionManager.setting.set('Comfy.Workflow.ShowMissingModelsWarning', true);"""
READ_MISSING = PINIA + """const h = window.__hpMissing;
if (!models) return { done: true, nodes: h.nodes, models: h.models };
const got = models.missingModelCandidates;
if (got === h.pending) return { done: false };
return { done: true, nodes: h.nodes || (nodes.missingNodesError && nodes.missingNodesError.nodeTypes) || null,
         models: (got || []).filter(m => m.isMissing && m.url && m.directory)
                            .map(m => ({ name: m.name, url: m.url, directory: m.directory })),
         };"""
FOCUS_CONFIG = APP + """const c = app.canvas, ds = c.ds, title = window.LiteGraph.NODE_TITLE_HEIGHT;
ds.scale = 1;  // the Parallel Config node (its mesh picture shows the GPU layout) in the middle of the canvas
const r = c.canvas.getBoundingClientRect();
ds.offset[0] = r.width / 2 - node.pos[0] - node.size[0] / 2;
ds.offset[1] = r.height / 2 - node.pos[1] - (node.size[1] - title) / 2;
c.setDirty(true, true);
return [r.left + r.width / 2, r.top + r.height / 2, node.size[0], node.size[1] + title, window.devicePixelRatio];"""

# the templates on the simple path (no Parallel Config): the thumbnail is their Parallel GPUs node (devices, preset),
# enlarged in the middle of the canvas, with the toasts of the missing-models check out of the way
FOCUS_SIMPLE = """const app = window.comfyAPI.app.app, c = app.canvas, ds = c.ds, LG = window.LiteGraph;
const node = app.graph.nodes.find((n) => n.comfyClass === 'HybridParallelGPUs');
document.querySelectorAll('.p-toast, .p-toast-message').forEach((e) => e.remove());
const r = c.canvas.getBoundingClientRect(), title = LG.NODE_TITLE_HEIGHT;
ds.scale = 1.6;
ds.offset[0] = r.width / ds.scale / 2 - node.pos[0] - node.size[0] / 2;
ds.offset[1] = r.height / ds.scale / 2 - node.pos[1] - (node.size[1] - title) / 2;
c.setDirty(true, true);
return [r.left + r.width / 2, r.top + r.height / 2, node.size[0] * ds.scale * 1.4, (node.size[1] + title) * ds.scale * 1.4,
        window.devicePixelRatio];"""


def _template_names():
    import make_templates  # examples/ (comfy_server put it on sys.path)
    return sorted(make_templates.templates())


def _regenerate_template(page, name):
    """HP_UPDATE_TEMPLATES=1: the UI file from the API prompt by the frontend's own loader and serializer, with
    the Note node and the loaders' model links; and a screenshot of it as the Templates browser's thumbnail."""
    import make_templates
    from PIL import Image
    api, note, vl = make_templates.templates()[name]
    page.execute_async_script("const done = arguments[arguments.length - 1]; window.comfyAPI.app.app.extensionManager"
                              ".setting.set('Comfy.NodeBadge.NodeSourceBadgeMode', 'None').then(done, done);")
    ui = json.loads(page.execute_async_script(DECORATE, api, name, note, make_templates.model_links(api, vl)))
    assert "error" not in ui, (name, ui)
    TEMPLATE_UI.mkdir(exist_ok=True)
    (TEMPLATE_UI / f"{name}.json").write_text(json.dumps(ui, indent=1, ensure_ascii=False) + "\n")
    page.execute_script("return window.comfyAPI.app.app.loadGraphData(arguments[0], true, true, arguments[1], "
                        "{showMissingModelsDialog: false, showMissingNodesDialog: false});", ui, name)
    if any(n["class_type"] == "HybridParallelConfig" for n in api.values()):
        _until(lambda: page.execute_script(SETTLED), 30, f"the mesh picture of {name}")
        cx, cy, w, h, dpr = page.execute_script(FOCUS_CONFIG)
    else:
        cx, cy, w, h, dpr = page.execute_script(FOCUS_SIMPLE)
    time.sleep(0.5)  # a frame for the canvas and the DOM widgets
    shot = ARTIFACTS / f"template_{name}.png"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.save_screenshot(str(shot))
    half_w = max(w / 2 + 24, (h / 2 + 24) * 4 / 3)  # 4:3 around the node
    half_h = half_w * 3 / 4
    img = Image.open(shot).convert("RGB").crop(
        (int((cx - half_w) * dpr), int((cy - half_h) * dpr), int((cx + half_w) * dpr), int((cy + half_h) * dpr)))
    img.thumbnail((640, 480))
    img.save(TEMPLATE_UI / f"{name}.jpg", quality=80)


def _schema_errors(info, prompt):
    bad = []
    for nid, n in prompt.items():
        if n["class_type"] not in info:
            bad.append((nid, n["class_type"], "unknown node"))
            continue
        spec = info[n["class_type"]]["input"]
        declared = set(spec.get("required", {})) | set(spec.get("optional", {}))
        given = {k.split(".")[0] for k in n["inputs"]}  # "format.codec": a dynamic combo's sub-input (ComfyUI 0.33)
        if given - declared or set(spec.get("required", {})) - given:
            bad.append((nid, n["class_type"], sorted(given ^ declared)))
    return bad


def _defaults_added(info, got: dict, api: dict) -> dict:
    """The inputs a newer ComfyUI added that the frontend wrote into its prompt at their defaults while the API
    prompt (written for the older one) leaves them out - which the server then fills alike: an optional input at its
    declared default (CreateVideo's bit_depth), or a sub-input of a dynamic combo the API prompt sets (SaveVideo's
    format.codec, at its first option). {node id: {input: value}}; anything else stays for the comparison to see."""
    added = {}
    for nid, node in got.items():
        if nid not in api or api[nid]["class_type"] != node["class_type"] or node["class_type"] not in info:
            continue
        spec = info[node["class_type"]]["input"]
        declared = {**spec.get("required", {}), **spec.get("optional", {})}
        for k in set(node["inputs"]) - set(api[nid]["inputs"]):
            v, root = node["inputs"][k], k.split(".")[0]
            if "." in k and root in api[nid]["inputs"] and isinstance(declared.get(root), list) and \
                    str(declared[root][0]).startswith("COMFY_DYNAMICCOMBO"):
                added.setdefault(nid, {})[k] = v
            elif k in spec.get("optional", {}) and len(declared[k]) > 1 and \
                    isinstance(declared[k][1], dict) and declared[k][1].get("default") == v:
                added.setdefault(nid, {})[k] = v
    return added


def test_templates_load_in_the_frontend_and_are_listed(page):
    """example_workflows/*.json, the pack's entries in ComfyUI's Templates browser: the server lists them (and
    serves each file and its .jpg thumbnail where the frontend asks for it); each loads in the real frontend with no
    missing node, offers exactly its loaders' files in the missing-models dialog (name, Hugging Face URL, an existing
    models folder), carries a Note node, and turns (graphToPrompt) into exactly examples/template_prompts/<name>.json,
    a prompt whose every node and input this server knows. HP_UPDATE_TEMPLATES=1 regenerates the UI files and
    thumbnails from make_templates.py's API prompts."""
    import urllib.request
    server, app = page.comfy, "const app = window.comfyAPI.app.app;"
    names = _template_names()
    assert len(names) >= 6 and sorted(p.stem for p in TEMPLATE_API.glob("*.json")) == names
    info = server.get("/object_info")
    dialogs = 0
    for name in names:
        if os.environ.get("HP_UPDATE_TEMPLATES") == "1":
            _regenerate_template(page, name)
    listed = server.get("/workflow_templates")
    assert sorted(listed.get(TEMPLATE_MODULE, [])) == names, listed
    for name in names:
        ui = json.loads((TEMPLATE_UI / f"{name}.json").read_text())
        with urllib.request.urlopen(f"{server.url}/api/workflow_templates/{TEMPLATE_MODULE}/{name}.json") as r:
            assert json.load(r) == ui, name
        with urllib.request.urlopen(f"{server.url}/api/workflow_templates/{TEMPLATE_MODULE}/{name}.jpg") as r:
            assert r.headers["Content-Type"] == "image/jpeg" and len(r.read()) > 5_000, name
        assert ui.get("nodes") and ui.get("links"), f"{name}: not a UI-format workflow"
        notes = [n for n in ui["nodes"] if n["type"] == "Note"]
        assert len(notes) == 1 and "GPU" in notes[0]["widgets_values"][0], name
        offered = sorted((m["name"], m["url"], m["directory"]) for n in ui["nodes"]
                         for m in n.get("properties", {}).get("models", []))
        assert offered and all(u.startswith("https://huggingface.co/") for _, u, _ in offered), (name, offered)

        page.execute_script(HOOK_MISSING)
        page.execute_script(app + "return app.loadGraphData(arguments[0], true, true, arguments[1]);", ui, name)
        _until(lambda: page.execute_script(READ_MISSING)["done"], 30, f"{name}: the missing-models check")
        missing = page.execute_script(READ_MISSING)
        assert missing["nodes"] is None, (name, missing["nodes"])
        # once per file (the frontend lists a file once per loader naming it: LTX-2.3's checkpoint, three)
        shown = sorted({(m["name"], m["url"], m["directory"]) for m in missing["models"] or []})
        # the files the server lacks (the template run test may have written tiny stand-ins under some names)
        absent = sorted(o for o in set(offered) if o[0] not in server.get(f"/models/{o[2]}"))
        assert shown == absent, (name, shown, absent)
        dialogs += bool(shown)
        assert not [m for m in missing["models"] or [] if m.get("directory_invalid")], (name, missing["models"])
        folders = server.get("/models")  # each file's folder is one the server has
        assert {d for _, _, d in shown} <= set(folders), (name, shown, folders)
        got = json.loads(page.execute_async_script(TO_PROMPT))
        api = json.loads((TEMPLATE_API / f"{name}.json").read_text())
        added = _defaults_added(info, got, api)
        if added:
            print(f"{name}: inputs this ComfyUI added, at their defaults: {added}")
        a = _shape({nid: {**n, "inputs": {k: v for k, v in n["inputs"].items() if k not in added.get(nid, {})}}
                    for nid, n in got.items()})
        b = _shape(api)
        assert a == b, f"{name}: only in the frontend's prompt {sorted(set(a) - set(b))}, only in the API " \
                       f"prompt {sorted(set(b) - set(a))}"
        assert not _schema_errors(info, got), (name, _schema_errors(info, got))
    assert dialogs, "no template showed the missing-models dialog: its check ran on nothing"
