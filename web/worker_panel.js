// The worker panel: what the persistent pool is doing, from GET /hybrid_parallel/pool.
//
// A sidebar tab so it stays out of the graph; it polls only while its element is in the page (the
// route may ask idle workers for their health, which should not happen when nobody looks).

const POLL_MS = 2000;
const STATE_COLOR = { none: "#888", starting: "#d9a400", ready: "#2e9d4f", busy: "#3b6fb6", stopping: "#888", failed: "#d04040" };

export const PANEL_STYLE = `
.hp-panel { padding: 10px; font: 12px/1.4 system-ui, sans-serif; display: flex; flex-direction: column; gap: 8px; }
.hp-panel h3 { margin: 0; font-size: 14px; }
.hp-join code { display: block; white-space: pre-wrap; word-break: break-all; font-size: 11px; margin: 2px 0; }
.hp-state { display: inline-block; padding: 1px 8px; border-radius: 9px; color: #fff; font-weight: 600; }
.hp-panel table { border-collapse: collapse; width: 100%; }
.hp-panel th, .hp-panel td { text-align: left; padding: 2px 4px; border-bottom: 1px solid rgba(128,128,128,.3); vertical-align: top; }
.hp-progress { height: 6px; background: rgba(128,128,128,.3); border-radius: 3px; overflow: hidden; }
.hp-progress > div { height: 100%; background: #3b6fb6; }
.hp-error { color: #ff8080; white-space: pre-wrap; max-height: 8em; overflow: auto; font-size: 11px; }
.hp-panel button { align-self: flex-start; }
.hp-panel button:disabled { opacity: .45; cursor: default; }
`;

function mib(bytes) {
  return bytes == null ? "?" : `${(bytes / 2 ** 20).toFixed(0)} MiB`;
}

function text(tag, t, attrs = {}) {
  const e = document.createElement(tag);
  e.textContent = t;
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

function jobLine(job) {
  if (!job) return null;
  const box = document.createElement("div");
  box.className = "hp-job";
  box.dataset.step = String(job.step ?? 0);
  box.dataset.total = String(job.total ?? "");
  const steps = job.total ? ` — step ${job.step} / ${job.total}` : "";
  box.append(text("div", `running: ${job.kind}${steps}`));
  if (job.total) {
    const bar = document.createElement("div");
    bar.className = "hp-progress";
    const fill = document.createElement("div");
    fill.style.width = `${Math.round((100 * job.step) / job.total)}%`;
    bar.append(fill);
    box.append(bar);
  }
  return box;
}

export function renderPanel(root, status, onStop) {
  root.replaceChildren();
  root.className = "hp-panel";
  root.append(text("h3", "Hybrid Parallel workers"));
  if (status.fetch_error) {
    root.dataset.state = "unknown";
    root.append(text("div", `cannot reach the pack's route: ${status.fetch_error}`, { class: "hp-error" }));
    return;
  }
  root.dataset.state = status.state;
  const head = document.createElement("div");
  const badge = text("span", status.state, { class: "hp-state" });
  badge.style.background = STATE_COLOR[status.state] || "#888";
  head.append(badge);
  if (status.mesh) head.append(text("span", `  ${status.mesh} · ${status.world_size} rank(s) · device ${status.device}`));
  root.append(head);
  if (status.state === "none") root.append(text("div", "No workers: the first Hybrid Sampler or Parallel VAE Decode run starts them."));
  const job = jobLine(status.job);
  if (job) root.append(job);
  const last = status.last_job;
  if (last) {
    const took = last.elapsed_s != null ? ` in ${last.elapsed_s.toFixed(1)} s` : "";
    const steps = last.total ? `, ${last.step}/${last.total} steps` : "";
    root.append(text("div", `last: ${last.kind} ${last.ok ? "ok" : "failed"}${steps}${took}`, { class: "hp-last" }));
    if (!last.ok && last.error) root.append(text("div", last.error, { class: "hp-error" }));
  }
  if (status.workers?.length) {
    const table = document.createElement("table");
    const hr = document.createElement("tr");
    for (const h of ["rank", "pid", "device", "memory", "models"]) hr.append(text("th", h));
    table.append(hr);
    for (const w of status.workers) {
      const tr = document.createElement("tr");
      tr.dataset.rank = String(w.rank);
      tr.title = `state: ${w.state}`;
      for (const v of [w.rank, w.pid, w.device ?? "?", mib(w.rss_bytes), (w.models || []).join(", ") || "—"]) {
        tr.append(text("td", String(v)));
      }
      table.append(tr);
    }
    root.append(table);
  }
  if (status.join_commands?.length) {
    // a world over several machines: what each other machine runs to join (with a copy of the key file)
    const join = document.createElement("div");
    join.className = "hp-join";
    join.append(text("div", "other machines join with:"));
    status.join_commands.forEach((cmd, i) => join.append(text("code", `machine ${i + 1}: ${cmd}`)));
    root.append(join);
  }
  const stop = text("button", "Stop workers", { class: "hp-stop p-button p-button-sm p-button-danger" });
  stop.disabled = status.state === "none";
  stop.title = "Interrupts a running job and stops every worker process; the next prompt starts them again.";
  stop.addEventListener("click", onStop);
  root.append(stop);
}

/** Poll the pool route into `root` while it is attached; returns a function that stops polling. */
export function mountPanel(root, api) {
  let timer = null;
  let alive = true;
  let seen = false;
  async function tick() {
    if (!alive) return;
    if (!root.isConnected) {  // not mounted yet: wait; mounted and gone: the tab was closed, stop
      if (!seen) timer = setTimeout(tick, 200);
      return;
    }
    seen = true;
    let status;
    try {
      const r = await api.fetchApi("/hybrid_parallel/pool");
      status = await r.json();
    } catch (e) {
      status = { fetch_error: String(e) };
    }
    if (!alive) return;
    renderPanel(root, status, async () => {
      await api.fetchApi("/hybrid_parallel/pool/stop", { method: "POST" });
      clearTimeout(timer);
      tick();
    });
    timer = setTimeout(tick, POLL_MS);
  }
  tick();
  return () => { alive = false; clearTimeout(timer); };
}
