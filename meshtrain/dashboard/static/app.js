// meshtrain dashboard: polls /api/state and redraws. No libraries: the charts are SVG drawn here.
// Every text that came from a run (host names, events) goes in through textContent, never as markup.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const POLL_MS = 1000;
const SVG_NS = "http://www.w3.org/2000/svg";
const PALETTE = ["#58a6ff", "#f778ba", "#3fb950", "#d29922", "#a371f7", "#ff7b72", "#39c5cf", "#e3b341"];

let snapshot = null;
let focus = null;               // the run shown in the table
const compared = new Set();     // runs whose curves are drawn
let lastVersion = -1;

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined && text !== null) node.textContent = text;
  return node;
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

// ---------------------------------------------------------------- formatting
function bytes(n) {
  if (n === null || n === undefined) return "-";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return i === 0 ? `${n.toFixed(0)} B` : `${n.toFixed(2)} ${units[i]}`;
}
function seconds(s) {
  if (s === null || s === undefined) return "-";
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}
function fixed(v, digits) { return v === null || v === undefined ? "-" : v.toFixed(digits); }
function short(v) {
  if (v === 0) return "0";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toFixed(a >= 1e10 ? 0 : 1) + "G";
  if (a >= 1e6) return (v / 1e6).toFixed(a >= 1e7 ? 0 : 1) + "M";
  if (a >= 1e3) return (v / 1e3).toFixed(a >= 1e4 ? 0 : 1) + "k";
  if (a >= 10) return v.toFixed(0);
  if (a >= 1) return v.toFixed(1);
  if (a < 0.01) return v.toExponential(0);
  return String(Number(v.toPrecision(2)));
}

// ---------------------------------------------------------------- the plotter
// Ticks at 1, 2 or 5 times a power of ten, about `count` of them across [lo, hi].
function ticks(lo, hi, count) {
  const span = hi - lo || Math.abs(hi) || 1;
  const raw = span / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map(m => m * power).find(s => s >= raw);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

function extent(values, padFraction) {
  let lo = Math.min(...values), hi = Math.max(...values);
  if (lo === hi) { lo -= Math.abs(lo) * 0.1 || 1; hi += Math.abs(hi) * 0.1 || 1; }
  const pad = (hi - lo) * padFraction;
  return [lo - pad, hi + pad];
}

// Ticks for a log10 axis spanning [lo, hi] (in log10 units): 1, 2 and 5 times each power of
// ten when there are few decades, powers of ten only when there are many.
function logTicks(lo, hi) {
  const out = [], multiples = hi - lo > 4 ? [1] : hi - lo > 2 ? [1, 3] : [1, 2, 5];
  for (let e = Math.floor(lo); e <= Math.ceil(hi); e++)
    for (const m of multiples) {
      const v = m * Math.pow(10, e);
      if (Math.log10(v) >= lo && Math.log10(v) <= hi) out.push(v);
    }
  return out;
}

// series: [{name, color, points: [[x, y], ...], dots}], drawn into `svg` at its current size.
function plot(svg, series, opts) {
  while (svg.firstChild) svg.removeChild(svg.firstChild);
  const width = svg.clientWidth || 480, height = svg.clientHeight || 250;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const m = { left: 48, right: 12, top: 22, bottom: 30 };
  const drawn = series.map(s => ({ ...s, points: s.points.filter(p => p[0] !== null && p[1] !== null) }))
    .filter(s => s.points.length);
  if (!drawn.length) {
    const t = svgEl("text", { x: width / 2, y: height / 2, "text-anchor": "middle", class: "empty" });
    t.textContent = opts.empty || "no data yet";
    svg.appendChild(t);
    return;
  }
  const xs = drawn.flatMap(s => s.points.map(p => p[0])), ys = drawn.flatMap(s => s.points.map(p => p[1]));
  // Losses that fall over decades are read on a log scale (a linear one flattens all but the start).
  const log = opts.logY && Math.min(...ys) > 0 && Math.max(...ys) / Math.min(...ys) > 20;
  const ty = log ? Math.log10 : (v => v);
  const [x0, x1] = extent(xs, 0), [y0, y1] = extent(ys.map(ty), 0.05);
  const X = v => m.left + (v - x0) / (x1 - x0) * (width - m.left - m.right);
  const Y = v => height - m.bottom - (ty(v) - y0) / (y1 - y0) * (height - m.top - m.bottom);
  const yTicks = log ? logTicks(y0, y1) : ticks(y0, y1, 5);
  for (const v of yTicks) {
    svg.appendChild(svgEl("line", { x1: m.left, x2: width - m.right, y1: Y(v), y2: Y(v), class: "grid" }));
    const t = svgEl("text", { x: m.left - 6, y: Y(v) + 3, "text-anchor": "end" });
    t.textContent = (opts.yFormat || short)(v);
    svg.appendChild(t);
  }
  for (const v of ticks(x0, x1, 6)) {
    svg.appendChild(svgEl("line", { x1: X(v), x2: X(v), y1: height - m.bottom, y2: height - m.bottom + 4, class: "axis" }));
    const t = svgEl("text", { x: X(v), y: height - m.bottom + 15, "text-anchor": "middle" });
    t.textContent = (opts.xFormat || short)(v);
    svg.appendChild(t);
  }
  svg.appendChild(svgEl("line", { x1: m.left, x2: width - m.right, y1: height - m.bottom, y2: height - m.bottom, class: "axis" }));
  svg.appendChild(svgEl("line", { x1: m.left, x2: m.left, y1: m.top, y2: height - m.bottom, class: "axis" }));
  const label = svgEl("text", { x: width - m.right, y: height - 3, "text-anchor": "end" });
  label.textContent = opts.xLabel;
  svg.appendChild(label);
  if (log) {
    const scale = svgEl("text", { x: width - m.right, y: 11, "text-anchor": "end" });
    scale.textContent = "log scale";
    svg.appendChild(scale);
  }
  for (const s of drawn) {
    const d = s.points.map((p, i) => `${i ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join("");
    const path = svgEl("path", { d, class: "line", stroke: s.color, "data-series": s.name, "data-n": s.points.length });
    if (s.dashed) path.setAttribute("stroke-dasharray", "5 4");
    if (s.dots) { path.setAttribute("stroke-width", "1"); }
    svg.appendChild(path);
    if (s.dots) for (const p of s.points) svg.appendChild(svgEl("circle", { cx: X(p[0]), cy: Y(p[1]), r: 2.6, fill: s.color }));
  }
  // The legend, along the top.
  let lx = m.left + 4;
  for (const s of drawn.slice(0, 8)) {
    svg.appendChild(svgEl("rect", { x: lx, y: 6, width: 10, height: 3, fill: s.color }));
    const t = svgEl("text", { x: lx + 14, y: 11 });
    t.textContent = s.name;
    svg.appendChild(t);
    lx += 22 + 6.2 * s.name.length;
  }
}

// ---------------------------------------------------------------- drawing the state
function runColour(index) { return PALETTE[index % PALETTE.length]; }

function renderRuns() {
  const list = document.getElementById("runs");
  while (list.firstChild) list.removeChild(list.firstChild);
  snapshot.runs.forEach((run, i) => {
    const item = el("li", { "data-run": run.id });
    if (run.id === focus) item.classList.add("focus");
    const box = el("input", { type: "checkbox", title: "compare" });
    box.checked = compared.has(run.id);
    box.addEventListener("click", ev => {
      ev.stopPropagation();
      if (box.checked) compared.add(run.id); else compared.delete(run.id);
      if (!compared.size) compared.add(focus);
      render();
    });
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = runColour(i);
    item.append(box, swatch, el("span", { class: "name", title: run.id }, run.id),
                el("span", { class: `state ${run.status === "running" ? "training" : ["failed", "damaged"].includes(run.status) ? "failed" : "done"}` },
                   run.status));
    item.addEventListener("click", () => { focus = run.id; compared.clear(); compared.add(run.id); render(); });
    list.appendChild(item);
  });
}

function tile(label, value, sub) {
  const t = el("div", { class: "tile" });
  t.append(el("div", { class: "label" }, label), el("div", { class: "value" }, value));
  if (sub) t.append(el("div", { class: "sub" }, sub));
  return t;
}

function renderHead(run) {
  document.getElementById("run-title").textContent = run.id;
  const config = (run.info && run.info.config) || {};
  const strategy = (run.summary && run.summary.strategy) || (config.strategy && config.strategy.name) || run.info.strategy || "";
  const where = run.kind === "launch" ? "launched on" : run.kind === "simulate" ? "simulated on" : "ran on";
  document.getElementById("run-info").textContent =
    `${strategy ? strategy + " · " : ""}${where} ${run.nodes.length} ${run.kind === "launch" ? "hosts" : "nodes"} · ${run.status}`;
  const tiles = document.getElementById("tiles");
  while (tiles.firstChild) tiles.removeChild(tiles.firstChild);
  const steps = Math.max(0, ...run.nodes.map(n => n.step || 0));
  const budget = Math.max(0, ...run.nodes.map(n => n.steps || 0)) || (run.summary && run.summary.steps) || null;
  const losses = run.nodes.map(n => n.loss).filter(v => v !== null);
  const loss = run.summary && run.summary.final_train_loss !== undefined && run.status === "finished" && !losses.length
    ? run.summary.final_train_loss : (losses.length ? losses.reduce((a, b) => a + b, 0) / losses.length : null);
  const sent = run.nodes.map(n => n.bytes_sent).filter(v => v !== null);
  const measured = run.measured.length ? run.measured[run.measured.length - 1][1]
    : (run.summary && run.summary.wall_seconds) || null;
  tiles.append(tile("step", budget ? `${steps} / ${budget}` : `${steps}`));
  tiles.append(tile("loss", fixed(loss, 4), losses.length > 1 ? "mean of hosts" : ""));
  tiles.append(tile("sent per host", bytes(sent.length ? sent.reduce((a, b) => a + b, 0) / sent.length
    : (run.summary && run.summary.bytes_sent_per_node)), ""));
  const eta = run.status === "running" && measured && steps && budget ? measured / steps * budget : null;
  tiles.append(tile("measured time", seconds(measured), eta ? `at this rate: ${seconds(eta)} in all` : ""));
  if (run.projected_total !== null && run.projected_total !== undefined)
    tiles.append(tile(`projected on ${run.projected_cluster}`, seconds(run.projected_total),
      measured ? `measured ${seconds(measured)} here` : ""));
  const events = run.events.filter(e => e.kind !== "note").length;
  tiles.append(tile("events", `${events}`, run.events.length ? run.events[run.events.length - 1].kind : ""));
}

function renderNodes(run) {
  const body = document.querySelector("#nodes tbody");
  while (body.firstChild) body.removeChild(body.firstChild);
  for (const n of run.nodes) {
    const row = el("tr", { "data-host": n.name, "data-state": n.state });
    const state = el("td");
    state.append(el("span", { class: `state ${n.state}` }, n.state));
    if (n.reason) state.append(el("span", { class: "reason" }, n.reason));
    if (n.restarts) state.append(el("span", { class: "reason" }, `restarted ${n.restarts}x`));
    const heard = el("td", { class: "num" }, n.silent_for === null ? "-" : `${n.silent_for.toFixed(1)} s ago`);
    if (n.silent_for > 10 && ["training", "starting", "finishing"].includes(n.state)) heard.classList.add("late");
    row.append(
      el("td", {}, n.name), el("td", {}, `${n.rank}`), state,
      el("td", { class: "num" }, n.step === null ? "-" : (n.steps ? `${n.step}/${n.steps}` : `${n.step}`)),
      el("td", { class: "num" }, fixed(n.steps_per_second, 1)),
      el("td", { class: "num" }, fixed(n.loss, 4)),
      el("td", { class: "num" }, n.batch_size === null ? "-" : `${n.batch_size}`),
      el("td", { class: "num" }, bytes(n.bytes_sent)),
      el("td", { class: "num" }, n.cpu_percent === null ? "-" : `${n.cpu_percent.toFixed(0)} %`),
      el("td", { class: "num" }, bytes(n.rss_bytes)),
      el("td", { class: "num" }, bytes(n.gpu_bytes)),
      heard);
    body.appendChild(row);
  }
}

function renderEvents(run) {
  const list = document.getElementById("events");
  while (list.firstChild) list.removeChild(list.firstChild);
  const shown = run.events.slice(-200).reverse();
  if (!shown.length) list.appendChild(el("li", { class: "dim" }, "nothing yet: restarts, hosts lost and skipped steps show here"));
  for (const e of shown) {
    const item = el("li", { class: e.kind });
    item.append(el("span", { class: "time" }, `+${seconds(e.time - run.started_at)}`), el("span", { class: "kind" }, e.kind),
                document.createTextNode(e.text));
    list.appendChild(item);
  }
}

// The curves of one run: every node's when it is the only one shown, else its mean (or rank 0's).
function curves(run, colourIndex, alone) {
  const out = [];
  if (alone) {
    run.node_series.forEach((s, i) => out.push({ name: s.name, color: PALETTE[i % PALETTE.length], points: s.points }));
    if (run.mean_series) out.push({ name: "mean of nodes", color: "#dfe6ee", points: run.mean_series.points });
    if (run.val_series) out.push({ name: "validation", color: "#e3b341", points: run.val_series.points, dots: true });
  } else {
    const s = run.mean_series || run.node_series[0];
    if (s) out.push({ name: run.id, color: runColour(colourIndex), points: s.points });
  }
  return out;
}

function renderCharts() {
  const runs = snapshot.runs.map((r, i) => [r, i]).filter(([r]) => compared.has(r.id));
  const alone = runs.length === 1;
  const all = runs.flatMap(([r, i]) => curves(r, i, alone));
  const pick = (xi) => all.map(s => ({ ...s, points: s.points.map(p => [p[xi], p[1]]) }));
  plot(document.getElementById("chart-step"), pick(0), { xLabel: "step", logY: true });
  plot(document.getElementById("chart-bytes"), pick(2), { xLabel: "bytes sent", logY: true,
                                                          xFormat: v => bytes(v).replace(".00", "") });
  plot(document.getElementById("chart-time"), pick(3), { xLabel: "seconds", logY: true });
  const time = [];
  runs.forEach(([r, i]) => {
    const name = alone ? "" : `${r.id} `;
    time.push({ name: `${name}measured`, color: alone ? "#58a6ff" : runColour(i), points: r.measured });
    if (r.projected.length)
      time.push({ name: `${name}projected${r.projected_cluster ? " on " + r.projected_cluster : ""}`,
                  color: alone ? "#f778ba" : runColour(i), points: r.projected, dashed: true });
  });
  plot(document.getElementById("chart-projected"), time,
       { xLabel: "step", yFormat: v => short(v) + "s", empty: "no timing yet" });
}

function render() {
  if (!snapshot || !snapshot.runs.length) return;
  const ids = snapshot.runs.map(r => r.id);
  if (!ids.includes(focus)) {
    const live = snapshot.runs.find(r => r.status === "running");
    focus = (live || snapshot.runs[0]).id;
    compared.clear();
    compared.add(focus);
  }
  for (const id of [...compared]) if (!ids.includes(id)) compared.delete(id);
  const run = snapshot.runs.find(r => r.id === focus);
  renderRuns();
  renderHead(run);
  renderNodes(run);
  renderCharts();
  renderEvents(run);
}

function setConnection(kind, text) {
  const c = document.getElementById("connection");
  c.className = `connection ${kind}`;
  document.getElementById("connection-text").textContent = text;
}

async function poll() {
  try {
    const response = await fetch(`api/state?token=${encodeURIComponent(TOKEN)}`, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    snapshot = await response.json();
    setConnection("ok", "live");
    if (snapshot.version !== lastVersion || snapshot.runs.some(r => r.status === "running")) {
      lastVersion = snapshot.version;
      render();
    }
  } catch (err) {
    setConnection("lost", `no answer from meshtrain (${err.message}); the page keeps what it had`);
  }
  setTimeout(poll, POLL_MS);
}

window.addEventListener("resize", () => { if (snapshot) renderCharts(); });
poll();
