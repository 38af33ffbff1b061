// plan.html's script, inlined by circuit/viz/html.py. It reads the embedded report (and the few
// series html.py derived from it), never recomputes a plan; it draws the chosen width's arena
// chart, rewrites kernel lines, fills the details panel, then marks <body data-rendered="1">.
"use strict";
window.addEventListener("error", (e) => { document.body.dataset.error = String(e.message || e); });

(function () {
  const $ = (id) => document.getElementById(id);
  const report = JSON.parse($("plan-report").textContent);
  const view = JSON.parse($("viz-view").textContent);
  const SVG_NS = $("dag").namespaceURI; // taken from the page: it spells out no URL
  const nodes = new Map(report.nodes.map((n) => [n.name, n]));
  const plans = new Map(report.widths.map((w) => [w.width, w]));
  const launchAt = new Map(report.widths.map((w) => [w.width, new Map(w.schedule.map((x, i) => [x.node, i]))]));
  const nodeEls = new Map([...document.querySelectorAll("#dag .node")].map((g) => [g.dataset.node, g]));
  const state = { width: view.default_width, pinned: null };

  // ---- formatting
  const KiB = 1024;
  function fmtBytes(b) {
    if (b < KiB) return `${b} B`;
    if (b < KiB * KiB) return `${(b / KiB).toFixed(1)} KiB`;
    if (b < KiB ** 3) return `${(b / KiB ** 2).toFixed(2)} MiB`;
    return `${(b / KiB ** 3).toFixed(2)} GiB`;
  }
  function fmtCount(x, unit) {
    const steps = [[1e9, "G"], [1e6, "M"], [1e3, "K"]];
    for (const [k, p] of steps) if (x >= k) return `${(x / k).toFixed(1)} ${p}${unit}`;
    return `${x} ${unit}`;
  }
  const colourOf = (op) => view.colours[view.groups[op] || "other"] || view.colours.other;

  // ---- tiny DOM builders
  function svg(tag, attrs, text) {
    const e = document.createElementNS(SVG_NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function html(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    for (const c of children) e.append(c);
    return e;
  }
  function table(rows) { // rows: [[cell, ...]]; a cell is text or [text, className]
    return html("table", {}, ...rows.map((r) => html("tr", {}, ...r.map((c) =>
      Array.isArray(c) ? html("td", { class: c[1] }, c[0]) : html("td", {}, c)))));
  }

  // ---- width
  function setWidth(n) {
    state.width = n;
    $("width-select").value = String(n);
    document.querySelectorAll("#width-table tbody tr").forEach((tr) =>
      tr.classList.toggle("selected", Number(tr.dataset.width) === n));
    $("memory-width").textContent = String(n);
    const lines = view.kernel_lines[String(n)] || {};
    for (const [name, g] of nodeEls) { // the kernel a node runs can change with the width
      const line = g.querySelector("[data-kernel]");
      if (line && lines[name]) line.textContent = lines[name];
    }
    drawMemory();
    show(state.pinned);
  }

  // ---- memory chart: launches (x) by arena offset (y)
  function niceStep(span, count) {
    const raw = span / count, p = 10 ** Math.floor(Math.log10(raw));
    return [1, 2, 2.5, 5, 10].map((m) => m * p).find((s) => s >= raw) || raw;
  }
  function drawMemory() {
    const plan = plans.get(state.width), host = $("memory");
    host.replaceChildren();
    const W = Math.max(640, host.clientWidth || 900), H = 330;
    const m = { l: 70, r: 140, t: 26, b: 40 }, n = Math.max(plan.schedule.length, 1);
    const top = Math.max(plan.arena_bytes, plan.lower_bound_bytes, 1) * 1.1;
    const X = (i) => m.l + (i / n) * (W - m.l - m.r);
    const Y = (b) => H - m.b - (b / top) * (H - m.t - m.b);
    const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, role: "img",
      "aria-label": `arena plan at width ${state.width}` });
    let start = 0, band = 0; // a shaded band per draft step, in schedule order
    for (let i = 1; i <= plan.schedule.length; i++) {
      if (i < plan.schedule.length && plan.schedule[i].step === plan.schedule[start].step) continue;
      const step = plan.schedule[start].step;
      chart.append(svg("rect", { class: `step-band${band++ % 2 ? " odd" : ""}`, x: X(start), y: m.t,
        width: X(i) - X(start), height: H - m.t - m.b }));
      chart.append(svg("text", { class: "step-label", x: (X(start) + X(i)) / 2, y: m.t - 8 },
        step === null ? "outside" : `s${step}`));
      start = i;
    }
    const unit = top >= KiB * KiB ? KiB * KiB : top >= KiB ? KiB : 1; // ticks at round KiB
    const yStep = niceStep(top / unit, 5) * unit;
    for (let b = 0; b <= top; b += yStep) {
      chart.append(svg("line", { class: "grid-line", x1: m.l, x2: W - m.r, y1: Y(b), y2: Y(b) }));
      chart.append(svg("text", { class: "tick", x: m.l - 6, y: Y(b) + 4, "text-anchor": "end" }, fmtBytes(Math.round(b))));
    }
    const xStep = Math.max(1, niceStep(n, 10));
    for (let i = 0; i <= n; i += xStep) {
      chart.append(svg("text", { class: "tick", x: X(i), y: H - m.b + 15, "text-anchor": "middle" }, String(i)));
    }
    chart.append(svg("text", { class: "axis-label", x: (m.l + W - m.r) / 2, y: H - 6, "text-anchor": "middle" },
      "launch (schedule order)"));
    chart.append(svg("text", { class: "axis-label", x: 14, y: (m.t + H - m.b) / 2, "text-anchor": "middle",
      transform: `rotate(-90 14 ${(m.t + H - m.b) / 2})` }, "arena offset"));
    for (const b of plan.buffers) {
      const writer = plan.schedule[b.first] || { node: "", op: "" };
      const y0 = Y(b.offset + b.size_bytes), h = Math.max(2.5, Y(b.offset) - y0); // tiny ones stay visible
      const r = svg("rect", { class: "buf", x: X(b.first), y: y0, width: Math.max(1, X(b.last + 1) - X(b.first)),
        height: h, fill: colourOf(writer.op)[0], "fill-opacity": 0.78, "data-buffer": b.name, "data-node": writer.node });
      r.append(svg("title", {}, `${b.name}: ${fmtBytes(b.size_bytes)} at ${b.offset}, launches ${b.first}..${b.last}`));
      r.addEventListener("mouseenter", () => showBuffer(b));
      r.addEventListener("mouseleave", () => show(state.pinned));
      r.addEventListener("click", () => pin(writer.node));
      chart.append(r);
    }
    const same = plan.arena_bytes === plan.lower_bound_bytes;
    chart.append(svg("line", { class: "arena", x1: m.l, x2: W - m.r, y1: Y(plan.arena_bytes), y2: Y(plan.arena_bytes) }));
    chart.append(svg("line", { class: "lower", x1: m.l, x2: W - m.r, y1: Y(plan.lower_bound_bytes), y2: Y(plan.lower_bound_bytes) }));
    chart.append(svg("text", { class: "line-label", x: W - m.r + 8, y: Y(plan.arena_bytes) - (same ? 6 : -4), fill: "#1f2430" },
      `arena ${fmtBytes(plan.arena_bytes)}`));
    chart.append(svg("text", { class: "line-label", x: W - m.r + 8, y: Y(plan.lower_bound_bytes) + (same ? 12 : 4), fill: "#d62728" },
      `lower bound ${fmtBytes(plan.lower_bound_bytes)}`));
    chart.append(svg("text", { class: "tick", x: W - m.r + 8, y: Y(0) - 4 },
      `naive ${fmtBytes(plan.naive_bytes)}`));
    chart.append(svg("line", { class: "cursor", id: "memory-cursor", x1: 0, x2: 0, y1: m.t, y2: H - m.b, visibility: "hidden" }));
    chart.dataset.x0 = m.l; chart.dataset.dx = (W - m.l - m.r) / n;
    host.append(chart);
  }

  // ---- details panel
  function slotText(slot) {
    if (!slot) return "";
    const at = slot.where === "arena" ? ` @${slot.offset}` : "";
    return `${slot.dtype}[${slot.shape.join(",")}]${at}`;
  }
  function values(names, slots, node) { // a value's symbolic spec, then its slot at this width
    return html("div", {}, ...names.map((v, i) => html("div", { class: "val" },
      html("code", { class: "spec" }, node.shapes[v] || "?"), html("code", {}, v),
      html("div", { class: "slot" }, html("span", { class: "where" }, slots[i] ? slots[i].where : "?"), " ",
        html("code", {}, slotText(slots[i]))))));
  }
  function builtAt(o) { // a node's origin: the layer line that built it (scope in the tooltip)
    return o ? html("code", { class: "origin", title: o.scope ? `builder scope ${o.scope}` : "outside any scope" },
      `${o.file}:${o.line}`) : "—";
  }
  function showNode(name, hint) {
    const node = nodes.get(name), plan = plans.get(state.width);
    const index = launchAt.get(state.width).get(name), x = plan.schedule[index];
    const body = $("detail-body"), colour = colourOf(node.op);
    const origin = node.origin || []; // reports written before origins were recorded have none
    const aligned = node.fused.length > 0 && origin.length === node.fused.length; // one per part
    const moved = x ? x.bytes_read + x.bytes_written : 0, bw = view.bandwidth_gbps;
    body.replaceChildren(
      html("div", { class: "d-head" }, html("span", { class: "swatch", style: `background:${colour[1]};border-color:${colour[0]}` }),
        html("h3", {}, name)),
      html("div", { class: "d-name" }, `op ${node.op}`),
      ...(hint ? [html("p", { class: "d-hint" }, hint)] : []),
      table([[["step", "k"], node.step === null ? "outside the steps" : `s${node.step}`],
        [["kernel", "k"], x ? `${x.kernel} (width ${state.width})` : "not launched"],
        [["launch", "k"], x ? `#${index} of ${plan.schedule.length}` : "—"],
        ...(aligned ? [] : [[["built at", "k"], origin.length ? html("span", {}, ...origin.map(builtAt)) : "—"]])]),
      ...(node.fused.length ? [html("h4", {}, `fused from ${node.fused.length} nodes`),
        html("ul", {}, ...node.fused.map((p, i) => html("li", {}, html("code", {}, p),
          ...(aligned ? [" built at ", builtAt(origin[i])] : []))))] : []),
      html("h4", {}, "attrs"),
      Object.keys(node.attrs).length ? table(Object.entries(node.attrs).map(([k, v]) => [[k, "k"], html("code", {}, JSON.stringify(v))]))
        : html("div", { class: "d-hint" }, "none"),
      html("h4", {}, "inputs"), values(node.inputs, x ? x.inputs : [], node),
      html("h4", {}, "outputs"), values(node.outputs, x ? x.outputs : [], node),
      ...(x && x.workspace.length ? [html("h4", {}, "workspace"), table(x.workspace.map((s) => [html("code", {}, s.name), slotText(s)]))] : []),
      html("h4", {}, `cost at width ${state.width}`),
      x ? table([[["bytes read", "k"], [fmtBytes(x.bytes_read), "num"]], [["bytes written", "k"], [fmtBytes(x.bytes_written), "num"]],
        [["share of bytes moved", "k"], [`${(100 * moved / Math.max(plan.bytes_moved, 1)).toFixed(1)} %`, "num"]],
        [["flops", "k"], [fmtCount(x.flops, "FLOP"), "num"]],
        [[`floor at ${bw} GB/s`, "k"], [`${(moved / (bw * 1e3) * 1e3).toFixed(2)} ns`, "num"]]]) : html("div", {}, "—"));
    focus(name, x ? [index] : []);
  }
  function showBuffer(b) {
    const plan = plans.get(state.width), first = plan.schedule[b.first], last = plan.schedule[b.last];
    $("detail-body").replaceChildren(
      html("div", { class: "d-head" }, html("h3", {}, `arena buffer ${b.name}`)),
      html("div", { class: "d-name" }, `width ${state.width}`),
      table([[["offset", "k"], [`${b.offset} B`, "num"]], [["size", "k"], [fmtBytes(b.size_bytes), "num"]],
        [["first launch", "k"], `#${b.first} ${first ? first.node : ""}`], [["last launch", "k"], `#${b.last} ${last ? last.node : ""}`]]),
      html("h4", {}, "values sharing it"), html("ul", {}, ...b.values.map((v) => html("li", {}, html("code", {}, v)))));
    focus(first ? first.node : null, [b.first, b.last]);
  }
  function show(name) {
    if (name && nodes.has(name)) return showNode(name, state.pinned === name ? "pinned: click it again (or Esc) to release" : "");
    const plan = plans.get(state.width); // nothing chosen: the launch that moves the most bytes
    const heavy = plan.schedule.reduce((a, x) => (x.bytes_read + x.bytes_written > a.bytes_read + a.bytes_written ? x : a), plan.schedule[0]);
    if (!heavy) return;
    showNode(heavy.node, `the heaviest launch at width ${state.width}; hover or click a node or buffer`);
    focus(null, []);
  }
  function pin(name) {
    state.pinned = state.pinned === name ? null : name;
    show(state.pinned);
    writeHash();
  }

  // ---- the address: #width=N&node=NAME opens the page on a width and a pinned node
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    if (plans.has(Number(p.get("width")))) state.width = Number(p.get("width"));
    if (nodes.has(p.get("node"))) state.pinned = p.get("node");
  }
  function writeHash() {
    const p = new URLSearchParams({ width: String(state.width) });
    if (state.pinned) p.set("node", state.pinned);
    try {
      history.replaceState(null, "", `#${p}`);
    } catch (e) { // some browsers refuse it on file:// pages; the link is a convenience only
      console.debug("viz: address not updated", e);
    }
  }

  // ---- highlighting: a node, its edges and neighbours, its buffers and launch in the chart
  function focus(name, launches) {
    const dag = $("dag"), mem = $("memory");
    dag.classList.toggle("focus", !!name);
    mem.classList.toggle("focus", !!name);
    document.querySelectorAll("#dag .hot, #dag .near, #memory .hot").forEach((e) => e.classList.remove("hot", "near"));
    const cursor = $("memory-cursor"), chart = mem.querySelector("svg");
    if (cursor && chart) {
      const x = Number(chart.dataset.x0) + (launches.length ? launches[0] + 0.5 : 0) * Number(chart.dataset.dx);
      cursor.setAttribute("x1", x); cursor.setAttribute("x2", x);
      cursor.setAttribute("visibility", launches.length ? "visible" : "hidden");
    }
    if (!name) return;
    nodeEls.get(name)?.classList.add("hot");
    document.querySelectorAll("#dag .edge").forEach((p) => {
      if (p.dataset.src !== name && p.dataset.dst !== name) return;
      p.classList.add("hot");
      nodeEls.get(p.dataset.src === name ? p.dataset.dst : p.dataset.src)?.classList.add("near");
    });
    const node = nodes.get(name), values = new Set(node ? [...node.inputs, ...node.outputs] : []);
    const plan = plans.get(state.width);
    document.querySelectorAll("#memory .buf").forEach((r) => {
      const b = plan.buffers.find((x) => x.name === r.dataset.buffer);
      if (b && b.values.some((v) => values.has(v))) r.classList.add("hot");
    });
  }

  // ---- wiring
  for (const [name, g] of nodeEls) {
    g.addEventListener("mouseenter", () => show(name));
    g.addEventListener("mouseleave", () => show(state.pinned));
    g.addEventListener("click", () => pin(name));
    g.addEventListener("keydown", (e) => { if (e.key === "Enter") pin(name); });
  }
  const chooseWidth = (n) => { setWidth(n); writeHash(); };
  $("width-select").addEventListener("change", (e) => chooseWidth(Number(e.target.value)));
  document.querySelectorAll("#width-table tbody tr").forEach((tr) =>
    tr.addEventListener("click", () => chooseWidth(Number(tr.dataset.width))));
  document.addEventListener("keydown", (e) => { if (e.key === "Escape") pin(null); });
  window.addEventListener("resize", () => { drawMemory(); show(state.pinned); });

  readHash();
  setWidth(state.width);
  document.body.dataset.rendered = "1";
  console.log(`viz: rendered ${nodeEls.size} nodes, ${report.widths.length} widths`);
})();
