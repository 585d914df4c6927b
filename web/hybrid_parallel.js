// ComfyUI frontend extension of the Hybrid Parallel pack (served from WEB_DIRECTORY = ./web).
//
// - Parallel Config: a live device-mesh picture under the widgets (a DOM widget), refreshed whenever a
//   widget changes, with the config error shown inline; the server route validates, so the rules are
//   the Python ones.
// - A "Workers" sidebar tab: pool state, per-rank device / memory / models, current step, stop button.
// - Hybrid Sampler's progress: ComfyUI's standard per-node progress bar, fed by the node itself (step
//   mode: ComfyUI's sampler callback; loop mode: the workers' per-step reports).
// Works with the frontend's Vue nodes (Nodes 2.0: the picture's element moves into the node's component) and with
// the pack's nodes inside subgraphs (tests/web/test_web_browser.py checks both).
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { renderMesh, STYLE } from "./mesh_picture.js";
import { mountPanel, PANEL_STYLE } from "./worker_panel.js";

const CONFIG_NODE = "HybridParallelConfig";
const GPUS_NODE = "HybridParallelGPUs";
const PACK_NODES = new Set(["HybridParallelGPUs", "HybridParallelConfig", "HybridSampler", "HybridPatchVAEDecode", "HybridParallelModel",
                            "HybridParallelCluster"]);
let warmed = false;
const WARM_DELAY_MS = 300;

// The server starts nothing until the pack is used: a workflow holding one of its nodes, opened or built here,
// asks once for the spare worker interpreters (torch imported ahead of the first prompt's world) and sends its
// Parallel Config's widgets (else its Parallel GPUs node's), so the server can start that world too while the user
// edits. Sent a moment after the first node appears: a loaded workflow's nodes take their saved values only after
// nodeCreated.
function warmOnce() {
  if (warmed) return;
  warmed = true;
  setTimeout(() => {
    const nodes = workflowNodes(app.graph);
    const config = nodes.find((n) => n.comfyClass === CONFIG_NODE);
    const gpus = config ? null : nodes.find((n) => n.comfyClass === GPUS_NODE);
    const body = config ? { config: Object.fromEntries(widgetQuery(config)) }
               : gpus ? { gpus: Object.fromEntries((gpus.widgets || []).map((w) => [w.name, w.value])) } : {};
    api.fetchApi("/hybrid_parallel/warm", { method: "POST", headers: { "Content-Type": "application/json" },
                                            body: JSON.stringify(body) }).catch(() => { warmed = false; });
  }, WARM_DELAY_MS);
}
// Every node of a workflow, the root graph's first: a node inside a subgraph (frontend 1.2x+, a workflow's
// `definitions.subgraphs`) is in its subgraph's `nodes`, not in app.graph.nodes - only a subgraph node is.
function workflowNodes(graph) {
  const out = [];
  const seen = new Set();
  const queue = [graph];
  while (queue.length) {
    const g = queue.shift();
    if (!g || seen.has(g)) continue;
    seen.add(g);
    for (const n of g.nodes || g._nodes || []) {
      out.push(n);
      if (n.subgraph) queue.push(n.subgraph); // a subgraph node: its inner graph (instances share one definition)
    }
  }
  return out;
}
const MESH_WIDGET = "mesh_picture";
const DEBOUNCE_MS = 120;
const MARGIN = 4;

function addStyle() {
  if (document.getElementById("hp-style")) return;
  const style = document.createElement("style");
  style.id = "hp-style";
  style.textContent = STYLE + PANEL_STYLE;
  document.head.append(style);
}

function widgetQuery(node) {
  const q = new URLSearchParams();
  for (const w of node.widgets || []) {
    if (w.name === MESH_WIDGET || w.value == null || typeof w.value === "object") continue;
    q.set(w.name, String(w.value));
  }
  return q;
}

/** The mesh picture of one Parallel Config node; `node.hpMesh` exposes its state (tests read it). */
function attachMesh(node) {
  const root = document.createElement("div");
  root.className = "hp-mesh";
  const mesh = { payload: null, query: "", seq: 0, pending: false, colorBy: node.properties?.hp_color_by, timer: null };
  node.hpMesh = mesh;
  let height = 80;
  const widget = node.addDOMWidget(MESH_WIDGET, "hp_mesh", root, {
    serialize: false,
    hideOnZoom: false,
    margin: MARGIN,
    getMinHeight: () => height,
    getMaxHeight: () => height,
  });
  widget.serialize = false; // a picture, not an input: keep it out of widgets_values and the prompt

  // Where the picture shows. Frontend 1.47's Vue nodes (ComfyUI 0.30), loading an API workflow, build the node twice
  // and keep showing the first node's picture element in the component of the second, whose widgets are the live
  // ones: that element (this node's id, not ours) is drawn into as well, so the picture follows the widgets there too.
  const shown = () => {
    if (root.isConnected) return root;
    const twin = document.querySelector(`[data-node-id="${node.id}"] .hp-mesh`);
    return twin && twin !== root ? twin : root;
  };

  // Grow the node to the picture: measured, since the layout depends on degrees, fonts and wrapping.
  // A ResizeObserver also catches the first layout of a node that was off screen when it was drawn.
  function fit() {
    const el = shown();
    const inner = el.firstElementChild;
    if (!inner || !inner.offsetHeight) return; // hidden (off screen, collapsed): keep the last size
    const h = inner.offsetHeight + 2 * MARGIN + 2;
    let w = inner.scrollWidth + 2 * MARGIN + 4;
    // Vue nodes (the frontend's "Nodes 2.0") pad their body: the picture gets less than the node's width minus the
    // margins, so the node grows by what the picture still lacks (the observer sees the picture's box resized)
    if (el.clientWidth && inner.scrollWidth > el.clientWidth) {
      w = Math.max(w, node.size[0] + inner.scrollWidth - el.clientWidth + 2);
    }
    if (h === height && w <= node.size[0]) return;
    height = h;
    const min = node.computeSize();
    node.setSize([Math.max(node.size[0], w, min[0]), min[1]]);
    app.canvas?.setDirty(true, true); // the canvas shown (app.graph is the root even inside a subgraph)
  }
  const observer = new ResizeObserver(() => fit());
  mesh.observe = () => {
    observer.disconnect();
    const el = shown();
    observer.observe(el);
    if (el.firstElementChild) observer.observe(el.firstElementChild);
  };
  mesh.disconnect = () => observer.disconnect();

  function draw() {
    // mesh.colorBy is the user's pick only: the default follows the degrees (innermost split axis)
    const pick = (axis) => {
      mesh.colorBy = axis;
      node.properties = node.properties || {};
      node.properties.hp_color_by = axis;
      draw();
    };
    for (const el of new Set([root, shown()])) renderMesh(el, mesh.payload, mesh.colorBy, pick);
    mesh.observe();
    requestAnimationFrame(fit);
  }

  async function load() {
    const query = widgetQuery(node).toString();
    const seq = mesh.seq;
    let payload;
    try {
      const r = await api.fetchApi(`/hybrid_parallel/mesh?${query}`);
      payload = await r.json();
    } catch (e) {
      payload = { ok: false, error: `cannot reach the pack's server route /hybrid_parallel/mesh: ${e}` };
    }
    if (seq !== mesh.seq) return; // a newer request is on its way
    mesh.payload = payload;
    mesh.query = query;
    mesh.pending = false;
    draw();
  }

  mesh.refresh = () => {
    // A new seq at once, not when the debounced load starts: an answer already on its way was asked with the
    // old widget values and must neither be drawn nor clear `pending` (tests read the picture once settled).
    mesh.seq += 1;
    mesh.pending = true;
    clearTimeout(mesh.timer);
    mesh.timer = setTimeout(load, DEBOUNCE_MS);
  };
  draw();
  mesh.refresh();
}

app.registerExtension({
  name: "hybrid_parallel.ui",

  async setup() {
    addStyle();
    const tabs = app.extensionManager;
    if (tabs?.registerSidebarTab) {
      let stop = null;
      tabs.registerSidebarTab({
        id: "hybrid-parallel-workers",
        icon: "pi pi-sitemap",
        title: "Workers",
        tooltip: "Hybrid Parallel workers",
        type: "custom",
        render: (el) => {
          stop?.();
          const root = document.createElement("div");
          root.id = "hp-worker-panel";
          el.replaceChildren(root);
          stop = mountPanel(root, api);
        },
        destroy: () => { stop?.(); stop = null; },
      });
    }
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== CONFIG_NODE) return;
    const onWidgetChanged = nodeType.prototype.onWidgetChanged;
    nodeType.prototype.onWidgetChanged = function (...args) {
      const r = onWidgetChanged?.apply(this, args);
      if (args[0] !== MESH_WIDGET) this.hpMesh?.refresh();
      return r;
    };
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (...args) {
      const r = onConfigure?.apply(this, args);
      if (this.hpMesh) {
        this.hpMesh.colorBy = this.properties?.hp_color_by ?? this.hpMesh.colorBy;
        this.hpMesh.refresh();
      }
      return r;
    };
    const onRemoved = nodeType.prototype.onRemoved;
    nodeType.prototype.onRemoved = function (...args) {
      clearTimeout(this.hpMesh?.timer);
      this.hpMesh?.disconnect();
      return onRemoved?.apply(this, args);
    };
  },

  async nodeCreated(node) {
    if (PACK_NODES.has(node.comfyClass)) warmOnce();
    if (node.comfyClass !== CONFIG_NODE) return;
    attachMesh(node);
    // widget callbacks too: some frontends set values without onWidgetChanged (e.g. number steppers)
    for (const w of node.widgets || []) {
      if (w.name === MESH_WIDGET) continue;
      const cb = w.callback;
      w.callback = function (...args) {
        const r = cb?.apply(this, args);
        node.hpMesh?.refresh();
        return r;
      };
    }
  },
});
