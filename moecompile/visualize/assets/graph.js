// moecompile graph view. Reads the JSON in #graph-data; no network, no libraries.
// Layout: compound, top to bottom. Each expanded module group lays out its direct
// children (nodes and sub-groups): each child just below the lowest of its inputs,
// under the mean of their centres, nudged sideways to the nearest free spot; the
// group then becomes a box its parent lays out in turn.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("graph-data").textContent);
  const N = D.nodes, G = D.groups;
  const SVG_NS = "http://www.w3.org/2000/svg";
  const PAD = 10, HEADER = 22, ROW_GAP = 28, COL_GAP = 14, NODE_H = 34, CG_H = 36;

  G.forEach(g => { g.children = []; g.direct = []; g.count = 0; g.first = Infinity; });
  G.forEach(g => { if (g.parent >= 0) G[g.parent].children.push(g.id); });
  N.forEach(n => { G[n.group].direct.push(n.id); });
  G.forEach(g => { const c = []; let x = g.id; while (x >= 0) { c.push(x); x = G[x].parent; } g.chain = c.reverse(); });
  // where a node sits in program order; parameters (all get_attr at the graph's top) sit just before their first user
  N.forEach(n => { n.pos = n.op === "get_attr" && n.users.length ? Math.min(...n.users) - 0.5 : n.id; });
  N.forEach(n => G[n.group].chain.forEach(a => { G[a].count++; G[a].first = Math.min(G[a].first, n.pos); }));
  const layerGroups = (() => {
    const ls = G.filter(g => g.layer); if (!ls.length) return [];
    const d = Math.min(...ls.map(g => g.depth)); return ls.filter(g => g.depth === d);
  })();

  const state = {
    collapsed: new Set(G.filter(g => g.collapsed).map(g => g.id)),
    layer: -1, selected: null, query: "", matches: [], matchAt: -1,
    view: { x: 20, y: 20, k: 1 },
  };
  if (!state.collapsed.size && N.length > 800) layerGroups.slice(1).forEach(g => state.collapsed.add(g.id));

  // ---- text measurement -------------------------------------------------
  const ctx = document.createElement("canvas").getContext("2d");
  const widthOf = (text, px, bold) => { ctx.font = (bold ? "600 " : "") + px + "px Helvetica, Arial, sans-serif"; return ctx.measureText(text).width; };
  N.forEach(n => { n.w = Math.max(56, Math.ceil(Math.max(widthOf(n.label, 11, true), widthOf(n.detail, 10)) + 18)); n.h = NODE_H; });

  // ---- what is visible ----------------------------------------------------
  function inLayer(n) { return state.layer < 0 || G[n.group].chain.includes(state.layer); }
  function visibleNodes() {
    if (state.layer < 0) return N.map(n => n.id);
    const inside = new Set(N.filter(inLayer).map(n => n.id)), out = new Set(inside);
    inside.forEach(i => { N[i].inputs.forEach(j => out.add(j)); N[i].users.forEach(j => out.add(j)); });
    return [...out].sort((a, b) => a - b);
  }
  const effGroup = n => (inLayer(n) ? n.group : 0);
  function collapsedRoot(gid) { for (const a of G[gid].chain) if (state.collapsed.has(a)) return a; return -1; }
  // leaf key: "n<id>" for a drawn node, "c<gid>" for a collapsed group standing for its nodes
  function leafOf(n) { const c = collapsedRoot(effGroup(n)); return c >= 0 ? "c" + c : "n" + n.id; }

  // ---- layout -----------------------------------------------------------
  let boxes = {};  // key -> {x, y, w, h} absolute
  let drawn = [];  // [{kind, key, id, depth}] in paint order (groups before their contents)

  function layout() {
    const vis = visibleNodes(), leafs = new Map(), content = new Map();  // gid -> item keys
    const containerOf = {}, orderOf = {}, size = {};
    const addItem = (gid, key) => { if (!content.has(gid)) content.set(gid, new Set()); content.get(gid).add(key); };
    vis.forEach(i => {
      const n = N[i], leaf = leafOf(n); leafs.set(i, leaf);
      if (leaf[0] === "n") { containerOf[leaf] = effGroup(n); size[leaf] = [n.w, n.h]; }
      else { const g = +leaf.slice(1); containerOf[leaf] = G[g].parent; }
      orderOf[leaf] = Math.min(orderOf[leaf] ?? Infinity, n.pos);
      // register the leaf and every expanded group on its path
      const chain = G[containerOf[leaf]].chain;
      addItem(containerOf[leaf], leaf);
      for (let d = 1; d < chain.length; d++) addItem(chain[d - 1], "g" + chain[d]);
    });
    // lift each edge to the level of the lowest common group of its two leaves
    const levelEdges = new Map();
    const seen = new Set();
    vis.forEach(i => N[i].inputs.forEach(j => {
      if (!leafs.has(j)) return;
      const a = leafs.get(j), b = leafs.get(i); if (a === b) return;
      const ca = G[containerOf[a]].chain, cb = G[containerOf[b]].chain;
      let d = 0; while (d < ca.length && d < cb.length && ca[d] === cb[d]) d++;
      const lca = ca[d - 1];
      const ia = d < ca.length ? "g" + ca[d] : a, ib = d < cb.length ? "g" + cb[d] : b;
      if (ia === ib || seen.has(ia + ">" + ib)) return; seen.add(ia + ">" + ib);
      if (!levelEdges.has(lca)) levelEdges.set(lca, []);
      levelEdges.get(lca).push([ia, ib]);
    }));
    const rel = {};  // key -> {x, y} relative to its container's content origin
    const order = k => (k[0] === "g" ? G[+k.slice(1)].first : orderOf[k]);

    function layoutGroup(gid) {
      const items = [...(content.get(gid) || [])];
      items.forEach(k => {
        if (k[0] === "g") size[k] = layoutGroup(+k.slice(1));
        else if (k[0] === "c") { const g = G[+k.slice(1)]; size[k] = [Math.ceil(widthOf(cgLabel(g), 11, true) + 24), CG_H]; }
      });
      items.sort((a, b) => order(a) - order(b));
      const edges = levelEdges.get(gid) || [], preds = {};
      items.forEach(k => { preds[k] = []; });
      edges.forEach(([a, b]) => { if (order(a) < order(b)) preds[b].push(a); });
      // y: each item just below the lowest of its inputs (items are in program order, so inputs come first)
      const y = {}, x = {}, placed = [];
      items.forEach(k => { y[k] = preds[k].reduce((m, p) => Math.max(m, y[p] + size[p][1] + ROW_GAP), 0); });
      // x: under the mean of its inputs' centres, moved to the nearest spot no placed box overlaps
      const byY = [...items].sort((a, b) => y[a] - y[b] || order(a) - order(b));
      let sourceX = 0;
      byY.forEach(k => {
        const [w, h] = size[k], top = y[k], bottom = top + h;
        const rows = placed.filter(r => r.y < bottom + ROW_GAP / 2 && r.y + r.h > top - ROW_GAP / 2);
        const free = c => rows.every(r => c + w + COL_GAP <= r.x || c >= r.x + r.w + COL_GAP);
        const src = !preds[k].length;
        const want = src ? sourceX : preds[k].reduce((s, p) => s + x[p] + size[p][0] / 2, 0) / preds[k].length - w / 2;
        const candidates = [want];
        rows.forEach(r => { candidates.push(r.x + r.w + COL_GAP); if (!src) candidates.push(r.x - w - COL_GAP); });
        candidates.sort((a, b) => Math.abs(a - want) - Math.abs(b - want));
        x[k] = candidates.find(c => (!src || c >= want) && free(c));
        if (x[k] === undefined) x[k] = Math.max(want, ...rows.map(r => r.x + r.w + COL_GAP));
        if (src) sourceX = x[k] + w + COL_GAP;
        placed.push({ x: x[k], y: top, w, h });
      });
      let minX = Infinity, maxX = -Infinity, maxY = 0;
      items.forEach(k => { minX = Math.min(minX, x[k]); maxX = Math.max(maxX, x[k] + size[k][0]); maxY = Math.max(maxY, y[k] + size[k][1]); });
      items.forEach(k => { rel[k] = { x: x[k] - minX, y: y[k] }; });
      const contentW = items.length ? maxX - minX : 0, contentH = maxY;
      if (gid === 0) return [contentW, contentH];
      const labelW = widthOf(G[gid].label, 11, true) + 30;
      return [Math.max(contentW, labelW) + 2 * PAD, contentH + HEADER + PAD];
    }

    const rootSize = layoutGroup(0);
    boxes = {}; drawn = [];
    function place(gid, ox, oy, depth) {
      [...(content.get(gid) || [])].sort((a, b) => order(a) - order(b)).forEach(k => {
        const x = ox + rel[k].x, y = oy + rel[k].y, [w, h] = size[k];
        boxes[k] = { x, y, w, h };
        if (k[0] === "g") { drawn.push({ kind: "group", key: k, id: +k.slice(1), depth }); place(+k.slice(1), x + PAD, y + HEADER, depth + 1); }
        else drawn.push({ kind: k[0] === "c" ? "cgroup" : "node", key: k, id: +k.slice(1), depth });
      });
    }
    place(0, 0, 0, 1);
    // the order of paint: groups (outer first), then edges, then nodes
    return { leafs, width: rootSize[0], height: rootSize[1] };
  }
  const cgLabel = g => "▸ " + g.label + " (" + g.count + " nodes)";

  // ---- drawing ----------------------------------------------------------
  const svg = document.getElementById("graph");
  const viewport = document.getElementById("viewport");
  const el = (tag, attrs, parent) => {
    const e = document.createElementNS(SVG_NS, tag);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  };
  let current = null;

  function render() {
    current = layout();
    viewport.textContent = "";
    const gLayer = el("g", { class: "groups" }, viewport), eLayer = el("g", { class: "edges" }, viewport), nLayer = el("g", { class: "nodes" }, viewport);
    drawn.forEach(d => {
      const b = boxes[d.key];
      if (d.kind === "group") {
        const g = G[d.id];
        const grp = el("g", { class: "group", "data-id": g.id, "data-path": g.path, transform: `translate(${b.x},${b.y})` }, gLayer);
        el("rect", { class: "box", width: b.w, height: b.h, rx: 6, fill: d.depth % 2 ? "#f1f5f9" : "#f8fafc" }, grp);
        const t = el("g", { class: "group-toggle", "data-id": g.id }, grp);
        el("rect", { width: b.w, height: HEADER }, t);
        el("text", { x: 8, y: 15 }, t).textContent = "▾ " + g.label;
        el("title", {}, t).textContent = g.path + " (click to collapse)";
      } else if (d.kind === "cgroup") {
        const g = G[d.id];
        const grp = el("g", { class: "cgroup", "data-id": g.id, "data-path": g.path, transform: `translate(${b.x},${b.y})` }, nLayer);
        el("rect", { width: b.w, height: b.h, rx: 6 }, grp);
        el("text", { x: 12, y: 22 }, grp).textContent = cgLabel(g);
        el("title", {}, grp).textContent = g.path + " (click to expand)";
      } else {
        const n = N[d.id];
        const cls = ["node", n.new ? "new" : "", n.recompute ? "recompute" : "", n.external || !inLayer(n) ? "external" : "",
          state.selected === n.id ? "selected" : ""].filter(Boolean).join(" ");
        const grp = el("g", { class: cls, "data-id": n.id, "data-name": n.name, "data-role": n.role || "", transform: `translate(${b.x},${b.y})` }, nLayer);
        el("rect", { width: b.w, height: b.h, rx: 4, fill: n.color }, grp);
        el("text", { x: b.w / 2, y: n.detail ? 14 : 21, "text-anchor": "middle", "font-weight": 600, fill: n.ink }, grp).textContent = n.label;
        if (n.detail) el("text", { class: "detail", x: b.w / 2, y: 27, "text-anchor": "middle", style: `fill:${n.ink};opacity:.75` }, grp).textContent = n.detail;
        el("title", {}, grp).textContent = n.name + (n.role ? " [" + n.role + "]" : "");
      }
    });
    const seen = new Set();
    current.leafs.forEach((b, i) => N[i].inputs.forEach(j => {
      const a = current.leafs.get(j); if (a === undefined || a === b || seen.has(a + ">" + b)) return;
      seen.add(a + ">" + b);
      const s = boxes[a], t = boxes[b]; if (!s || !t) return;
      const x1 = s.x + s.w / 2, y1 = s.y + s.h, x2 = t.x + t.w / 2, y2 = t.y;
      const dy = Math.max(18, Math.abs(y2 - y1) / 2);
      el("path", { class: "edge", d: `M${x1},${y1} C${x1},${y1 + dy} ${x2},${y2 - dy} ${x2},${y2}`, "marker-end": "url(#arrow)", "data-from": a, "data-to": b }, eLayer);
    }));
    highlight();
    applyView();
    document.getElementById("visible-count").textContent =
      document.querySelectorAll("#viewport .node").length + " of " + N.length + " nodes shown";
  }

  // ---- view transform ---------------------------------------------------
  function applyView() { const v = state.view; viewport.setAttribute("transform", `translate(${v.x},${v.y}) scale(${v.k})`); }
  function fit() {
    const r = svg.getBoundingClientRect();
    // fit the width, but never so small that labels can't be read: pan for the rest
    const k = Math.max(0.45, Math.min(1.2, (r.width - 40) / Math.max(1, current.width)));
    state.view = { k, x: Math.max(20, (r.width - current.width * k) / 2), y: 20 };
    applyView();
  }
  function centerOn(key) {
    const b = boxes[key]; if (!b) return;
    const r = svg.getBoundingClientRect(), k = Math.max(state.view.k, 0.9);
    // a node: in the middle; an open group (taller than the screen, often): its title near the top
    const y = key[0] === "g" ? 40 - b.y * k : r.height / 2 - (b.y + b.h / 2) * k;
    state.view = { k, x: r.width / 2 - (b.x + b.w / 2) * k, y };
    applyView();
  }
  const canvas = document.getElementById("canvas");
  canvas.addEventListener("wheel", e => {
    e.preventDefault();
    const r = svg.getBoundingClientRect(), v = state.view;
    const f = Math.exp(-e.deltaY * 0.0015), k = Math.min(4, Math.max(0.05, v.k * f));
    const px = e.clientX - r.left, py = e.clientY - r.top;
    state.view = { k, x: px - (px - v.x) * (k / v.k), y: py - (py - v.y) * (k / v.k) };
    applyView();
  }, { passive: false });
  let drag = null;
  canvas.addEventListener("mousedown", e => {
    if (e.target.closest(".node, .cgroup, .group-toggle")) return;
    drag = { x: e.clientX, y: e.clientY, vx: state.view.x, vy: state.view.y }; canvas.classList.add("panning");
  });
  window.addEventListener("mousemove", e => {
    if (!drag) return;
    state.view.x = drag.vx + e.clientX - drag.x; state.view.y = drag.vy + e.clientY - drag.y; applyView();
  });
  window.addEventListener("mouseup", () => { drag = null; canvas.classList.remove("panning"); });

  // ---- interaction ------------------------------------------------------
  svg.addEventListener("click", e => {
    const t = e.target.closest(".group-toggle");
    if (t) { state.collapsed.add(+t.dataset.id); render(); return; }
    const c = e.target.closest(".cgroup");
    if (c) { state.collapsed.delete(+c.dataset.id); render(); return; }
    const n = e.target.closest(".node");
    if (n) select(+n.dataset.id, false);
  });

  function reveal(id) {
    const n = N[id];
    if (!inLayer(n) && !(visibleNodes().includes(id))) { state.layer = -1; document.getElementById("layer").value = "-1"; }
    G[effGroup(n)].chain.forEach(a => state.collapsed.delete(a));
  }
  function select(id, move) {
    const n = N[id];
    if (move) { reveal(id); state.selected = id; render(); centerOn("n" + id); }
    else { state.selected = id; highlight(); }
    showNode(n);
  }

  function highlight() {
    document.querySelectorAll("#viewport .node").forEach(e => {
      const id = +e.dataset.id;
      e.classList.toggle("selected", id === state.selected);
      const sel = state.selected !== null ? N[state.selected] : null;
      e.classList.toggle("neighbor", sel !== null && id !== state.selected &&
        (sel.inputs.includes(id) || sel.users.includes(id) || Object.values(sel.notes).some(ids => ids.includes(id))));
    });
    const sel = state.selected !== null ? current.leafs.get(state.selected) : null;
    document.querySelectorAll("#viewport .edge").forEach(e => e.classList.toggle("hot", sel !== null && (e.dataset.from === sel || e.dataset.to === sel)));
    const hits = new Set(state.matches);
    document.querySelectorAll("#viewport .node").forEach(e => e.classList.toggle("match", hits.has(+e.dataset.id)));
    const hitGroups = new Set(state.matches.map(i => current.leafs.get(i)).filter(k => k && k[0] === "c"));
    document.querySelectorAll("#viewport .cgroup").forEach(e => e.classList.toggle("match", hitGroups.has("c" + e.dataset.id)));
  }

  // ---- side panel -------------------------------------------------------
  const side = document.getElementById("side");
  const esc = s => String(s).replace(/[&<>"]/g, c => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" }[c]));
  const link = i => `<a data-node="${i}">${esc(N[i].name)}</a>`;
  function showNode(n) {
    const row = (k, v) => `<tr><td class="k">${k}</td><td>${v}</td></tr>`;
    const moe = Object.keys(n.moe).length ? JSON.stringify(n.moe, null, 2) : "(none)";
    document.getElementById("panel").innerHTML =
      `<h2 id="panel-name">${esc(n.name)}</h2><table>` +
      row("op", `<span id="panel-op">${esc(n.op)}</span>`) + row("target", `<span id="panel-target">${esc(n.target)}</span>`) +
      row("module", esc(n.module || "(root)")) + row("role", `<span id="panel-role">${esc(n.role || "-")}</span>`) +
      row("output", `<span id="panel-values">${n.values.map(esc).join("<br>") || "-"}</span>`) +
      (n.new ? row("pass", "added by this pass") : "") + (n.recompute ? row("recompute", "yes") : "") +
      row("inputs", n.inputs.map(link).join(", ") || "-") + row("users", n.users.map(link).join(", ") || "-") +
      Object.entries(n.notes).map(([k, ids]) => row(esc(k), `<span class="panel-note" data-note="${esc(k)}">${ids.map(link).join(", ") || "-"}</span>`)).join("") +
      `</table><h3>meta["moe"]</h3><pre id="panel-moe">${esc(moe)}</pre>` +
      (n.stack ? `<h3>source</h3><pre>${esc(n.stack)}</pre>` : "");
  }
  side.addEventListener("click", e => {
    const a = e.target.closest("a[data-node]"); if (a) { select(+a.dataset.node, true); return; }
    const r = e.target.closest(".legend-row"); if (r) { search.value = "role:" + r.dataset.role; runSearch(); }
  });

  function legend() {
    const counts = {};
    N.forEach(n => { if (n.role) counts[n.role] = (counts[n.role] || 0) + 1; });
    document.getElementById("legend").innerHTML = Object.entries(D.roles).map(([r, v]) =>
      `<div class="legend-row${counts[r] ? "" : " absent"}" data-role="${r}" title="${esc(v.description)}">` +
      `<span class="swatch" style="background:${v.color}"></span>${esc(r)} <span style="color:#6b7280">${esc(v.description)}${counts[r] ? " · " + counts[r] : ""}</span></div>`).join("") +
      Object.entries(D.opColors).filter(([op]) => op !== "call_method").map(([op, c]) =>
        `<div class="legend-row absent" data-role=""><span class="swatch" style="background:${c}"></span>${esc(op)} (no role)</div>`).join("");
  }

  // ---- search, layer selector, buttons -----------------------------------
  const search = document.getElementById("search");
  function runSearch() {
    const q = search.value.trim().toLowerCase();
    state.query = q; state.matchAt = -1;
    if (!q) state.matches = [];
    else if (q.startsWith("role:")) { const r = q.slice(5); state.matches = N.filter(n => (n.role || "") === r).map(n => n.id); }
    else state.matches = N.filter(n => (n.name + " " + n.target + " " + n.label + " " + (n.role || "") + " " + n.module).toLowerCase().includes(q)).map(n => n.id);
    document.getElementById("search-count").textContent = q ? state.matches.length + " matches" : "";
    highlight();
  }
  search.addEventListener("input", runSearch);
  search.addEventListener("keydown", e => {
    if (e.key !== "Enter" || !state.matches.length) return;
    state.matchAt = (state.matchAt + (e.shiftKey ? -1 : 1) + state.matches.length) % state.matches.length;
    document.getElementById("search-count").textContent = (state.matchAt + 1) + " of " + state.matches.length;
    select(state.matches[state.matchAt], true);
  });
  const layerSel = document.getElementById("layer");
  layerGroups.forEach(g => { const o = document.createElement("option"); o.value = g.id; o.textContent = g.path; layerSel.appendChild(o); });
  layerSel.addEventListener("change", () => { state.layer = +layerSel.value; render(); fit(); });
  document.getElementById("expand-all").addEventListener("click", () => { state.collapsed.clear(); render(); });
  document.getElementById("collapse-layers").addEventListener("click", () => {
    (layerGroups.length ? layerGroups : G.filter(g => g.depth === 2)).forEach(g => state.collapsed.add(g.id)); render(); fit();
  });
  document.getElementById("fit").addEventListener("click", fit);
  document.getElementById("mark-new").addEventListener("change", e => document.body.classList.toggle("hide-new", !e.target.checked));

  legend();
  render();
  fit();
  // for scripted checks (tests, tools): the view's state after each render
  // centerOn("n<node id>" | "g<group id>" | "c<collapsed group id>")
  window.moeGraph = { render, select: id => select(id, true), centerOn, state, nodes: N, groups: G, boxes: () => boxes };
  document.body.dataset.ready = "1";
})();
