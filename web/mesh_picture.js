// The device-mesh picture of the Parallel Config node, drawn as plain HTML.
//
// HTML rather than canvas so that every cell carries its rank, device, coordinates and group ids as
// data-* attributes: users get tooltips, and the browser test reads exactly what is drawn. Nothing is
// computed here: the payload comes from GET /hybrid_parallel/mesh (the node's own validation and
// parallel/mesh.py), so the picture cannot disagree with what a prompt does.

// Nesting from outermost in: replicas (dp) stacked, CFG halves and pipeline stages side by side, then a
// grid of the sequence/tensor ranks (rows = ring, columns = ulysses x tp).
const BOX_AXES = [
  { axis: "dp", label: (i) => `replica ${i}`, dir: "column" },
  { axis: "cfg", label: (i) => (i === 0 ? "cfg 0 · cond" : "cfg 1 · uncond"), dir: "row" },
  { axis: "pp", label: (i) => `stage ${i}`, dir: "row" },
];
const COLOR_AXES = ["sp", "ulysses", "ring", "tp", "pp", "cfg", "dp"];
const AXIS_TITLE = {
  dp: "data parallel: each replica takes part of the batch",
  cfg: "CFG parallel: conditional and unconditional halves",
  pp: "PipeFusion stages: layers split, patches pipelined",
  sp: "sequence parallel (ulysses × ring): tokens split",
  ulysses: "Ulysses: all-to-all over attention heads",
  ring: "Ring attention: K/V blocks passed around",
  tp: "tensor parallel: weights split",
};

export const STYLE = `
.hp-mesh { font: 11px/1.3 system-ui, sans-serif; color: var(--input-text, #ddd); overflow: hidden; }
.hp-mesh-inner { display: inline-flex; flex-direction: column; align-items: flex-start; gap: 4px; padding: 2px; max-width: 420px; }
.hp-mesh-summary { font-weight: 600; }
.hp-auto-row { font-family: monospace; font-size: 11px; }
.hp-auto-chosen { font-weight: 700; }
.hp-mesh-legend { display: flex; flex-wrap: wrap; gap: 3px; align-items: center; }
.hp-chip { border: 1px solid #666; border-radius: 9px; padding: 0 6px; cursor: pointer; background: transparent; color: inherit; font: inherit; }
.hp-chip-active { background: #3b6fb6; border-color: #3b6fb6; color: #fff; }
.hp-box { border: 1px dashed #777; border-radius: 5px; padding: 2px 4px 4px; display: flex; flex-direction: column; gap: 2px; }
.hp-box[data-axis="dp"] { border-style: solid; border-color: #999; }
.hp-box-label { font-size: 10px; opacity: .8; white-space: nowrap; }
.hp-box-inner { display: flex; gap: 4px; }
.hp-grid { display: grid; gap: 3px; }
.hp-cell { min-width: 34px; height: 30px; border-radius: 4px; display: flex; flex-direction: column; align-items: center;
  justify-content: center; color: #fff; box-shadow: inset 0 0 0 1px rgba(0,0,0,.35); cursor: default; }
.hp-cell b { font-size: 12px; } .hp-cell small { font-size: 8px; opacity: .85; white-space: nowrap; }
.hp-cell.hp-peer { box-shadow: inset 0 0 0 2px #fff; }
.hp-mesh-groups { font-family: ui-monospace, monospace; font-size: 10px; opacity: .85; white-space: normal; }
.hp-mesh-error { color: #ff8080; background: rgba(255,0,0,.12); border: 1px solid #c44; border-radius: 4px; padding: 4px 6px;
  white-space: normal; }
.hp-mesh-hint { opacity: .8; white-space: normal; }
`;

export function groupColor(index) {
  const hue = (index * 137.508 + 210) % 360; // golden angle: neighbouring groups get distant hues
  return `hsl(${hue.toFixed(1)}, 55%, 40%)`;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c) e.append(c);
  return e;
}

/** The axes worth a colour chip for these degrees (sp only when both ulysses and ring split). */
export function colorAxes(degrees) {
  return COLOR_AXES.filter((ax) =>
    ax === "sp" ? degrees.ulysses > 1 && degrees.ring > 1 : degrees[ax] > 1);
}

/** The axis to colour by: the user's pick when it still applies, else the innermost split axis. */
export function pickColorAxis(degrees, wanted) {
  const axes = colorAxes(degrees);
  if (wanted && axes.includes(wanted)) return wanted;
  return axes[0] || "dp";
}

function cell(rank, colorBy) {
  const c = rank.coords;
  const attrs = { class: "hp-cell", "data-rank": rank.rank, "data-device": rank.device, "data-color": rank.group[colorBy] };
  for (const [ax, v] of Object.entries(c)) attrs[`data-coord-${ax}`] = v;
  for (const [ax, g] of Object.entries(rank.group)) attrs[`data-group-${ax}`] = g;
  attrs.title = `rank ${rank.rank} on ${rank.device}\n` +
    ["dp", "cfg", "pp", "ring", "ulysses", "tp"].map((ax) => `${ax} ${c[ax]}`).join(" · ");
  const e = el("div", attrs, el("b", { text: String(rank.rank) }), el("small", { text: rank.device }));
  e.style.background = groupColor(rank.group[colorBy]);
  return e;
}

function grid(ranks, degrees, colorBy) {
  const g = el("div", { class: "hp-grid" });
  const cols = degrees.ulysses * degrees.tp;
  g.style.gridTemplateColumns = `repeat(${cols}, auto)`;
  const sorted = [...ranks].sort((a, b) =>
    a.coords.ring - b.coords.ring || a.coords.ulysses - b.coords.ulysses || a.coords.tp - b.coords.tp);
  for (const r of sorted) g.append(cell(r, colorBy));
  return g;
}

function nest(ranks, degrees, colorBy, level) {
  if (level === BOX_AXES.length) return grid(ranks, degrees, colorBy);
  const { axis, label, dir } = BOX_AXES[level];
  if (degrees[axis] <= 1) return nest(ranks, degrees, colorBy, level + 1);
  const inner = el("div", { class: "hp-box-inner" });
  inner.style.flexDirection = dir;
  for (let i = 0; i < degrees[axis]; i++) {
    const part = ranks.filter((r) => r.coords[axis] === i);
    inner.append(el("div", { class: "hp-box", "data-axis": axis, "data-index": i, title: AXIS_TITLE[axis] },
      el("span", { class: "hp-box-label", text: label(i) }), nest(part, degrees, colorBy, level + 1)));
  }
  return inner;
}

function groupsLine(payload, axis) {
  const groups = payload.groups[axis];
  const shown = groups.slice(0, 8).map((g) => `[${g.join(",")}]`).join(" ");
  const more = groups.length > 8 ? ` … ${groups.length - 8} more` : "";
  return `${axis} groups: ${shown}${more}`;
}

/**
 * Draw `payload` into `root`. `colorBy` is the user's chosen axis (may be stale), `onColorBy(axis)` is
 * called when a chip is clicked. Returns the axis actually used.
 */
// degrees "auto": what Hybrid Sampler's cost model predicted per step for each choice in its latest run
function autoTable(auto) {
  const box = el("div", { class: "hp-mesh-auto" });
  if (!auto) {
    box.append(el("div", { class: "hp-mesh-hint",
      text: "degrees auto: Hybrid Sampler picks them from the model, latent and cfg; the predicted time per step of each choice shows here after a run" }));
    return box;
  }
  if (auto.batch_only) {  // a model no family adapter knows: only its batch splits, no cost model
    box.append(el("div", { class: "hp-mesh-hint",
      text: `latest run: ${auto.model} (no family adapter: CFG / data parallel only), batch ${auto.batch}, cfg ${auto.cfg ? "on" : "off"}, up to ${auto.devices} device(s) - chose ${auto.chosen}` }));
    return box;
  }
  box.append(el("div", { class: "hp-mesh-hint",
    text: `latest run: ${auto.model}, ${auto.tokens} image + ${auto.text_tokens} text tokens, cfg ${auto.cfg ? "on" : "off"}, up to ${auto.devices} device(s) (${auto.cost}) - predicted per step:` }));
  for (const c of auto.candidates) {
    box.append(el("div", { class: `hp-auto-row${c.chosen ? " hp-auto-chosen" : ""}`, "data-config": c.config,
      text: `${c.chosen ? "▶ " : ""}${c.config}: ${c.ms.toFixed(1)} ms (${c.speedup.toFixed(2)}× degree 1)` }));
  }
  return box;
}

function bytes(n) {
  return n >= 2 ** 30 / 10 ? `${(n / 2 ** 30).toFixed(1)} GiB` : `${Math.round(n / 2 ** 20)} MiB`;
}

// the memory plan the latest Hybrid Sampler run was checked against before any worker started (nodes/native.py)
function memoryLine(mem) {
  const items = Object.entries(mem.items).sort((a, b) => b[1] - a[1]).map(([k, v]) => `${k} ${bytes(v)}`);
  const host = mem.ranks_on_host > 1 ? ` (${mem.ranks_on_host} ranks share it)` : "";
  const which = mem.this_mesh ? "this mesh" : `another mesh, ${mem.mesh}`;
  return el("div", { class: "hp-mesh-memory hp-mesh-hint", "data-per-rank": String(mem.per_rank),
    "data-this-mesh": String(!!mem.this_mesh),
    text: `latest run (${which}; ${mem.model}, latent ${mem.latent.join("×")}): about ${bytes(mem.per_rank)} per rank`
      + (mem.capacity ? ` of ${bytes(mem.capacity)} on ${mem.where}${host}` : "") + ` - ${items.join(", ")}`
      + (mem.note ? `. ${mem.note}` : "") });
}

export function renderMesh(root, payload, colorBy, onColorBy) {
  root.replaceChildren();
  const inner = el("div", { class: "hp-mesh-inner" });
  root.append(inner);
  if (!payload) {
    root.dataset.ok = "pending";
    inner.append(el("div", { class: "hp-mesh-hint", text: "computing the mesh…" }));
    return colorBy;
  }
  root.dataset.ok = String(!!payload.ok);
  if (!payload.ok) {
    root.dataset.worldSize = "0";
    delete root.dataset.colorBy;
    inner.append(el("div", { class: "hp-mesh-error", role: "alert", text: payload.error }));
    return colorBy;
  }
  const degrees = payload.degrees;
  root.dataset.worldSize = String(payload.world_size);
  inner.append(el("div", { class: "hp-mesh-summary",
    text: `${payload.world_size} rank${payload.world_size === 1 ? "" : "s"} · ${payload.describe}` }));
  if ("auto" in payload) inner.append(autoTable(payload.auto));
  if (payload.memory) inner.append(memoryLine(payload.memory));
  if (payload.placement) {  // a valid plan this machine cannot run: drawn, with what a prompt would refuse
    inner.append(el("div", { class: "hp-mesh-error hp-mesh-placement", role: "status", text: payload.placement }));
  }
  if (!payload.picture) {
    delete root.dataset.colorBy;
    inner.append(el("div", { class: "hp-mesh-hint", text: payload.error_hint }));
    return colorBy;
  }
  const axis = pickColorAxis(degrees, colorBy);
  root.dataset.colorBy = axis;
  const chips = colorAxes(degrees).map((ax) => el("button", {
    class: `hp-chip${ax === axis ? " hp-chip-active" : ""}`, "data-axis": ax, title: AXIS_TITLE[ax],
    text: ax === "sp" ? `sp ×${degrees.sp}` : `${ax} ×${degrees[ax]}`,
    onclick: (e) => { e.stopPropagation(); onColorBy(ax); },
  }));
  const caption = el("span", { text: "same colour = one group of", title: "ranks that communicate along this axis" });
  if (chips.length) inner.append(el("div", { class: "hp-mesh-legend" }, caption, ...chips));
  const body = nest(payload.ranks, degrees, axis, 0);
  body.addEventListener("mouseover", (e) => {
    const c = e.target.closest?.(".hp-cell");
    for (const x of root.querySelectorAll(".hp-cell")) {
      x.classList.toggle("hp-peer", !!c && x.dataset.color === c.dataset.color);
    }
  });
  body.addEventListener("mouseleave", () => root.querySelectorAll(".hp-peer").forEach((x) => x.classList.remove("hp-peer")));
  inner.append(body);
  if (payload.world_size > 1) inner.append(el("div", { class: "hp-mesh-groups", text: groupsLine(payload, axis) }));
  return axis;
}
