// kvreplay report pages: every table sorts by the column clicked (numbers by value, an interval
// "x [lo, hi]" by its estimate x; a second click reverses).
"use strict";
window.addEventListener("error", (event) => { document.body.dataset.error = String(event.message); });

function sortKey(text) {
  const number = parseFloat(text.replace(/[−–]/g, "-"));
  return Number.isNaN(number) ? text : number;
}

function sortable(table) {
  const body = table.tBodies[0];
  if (!body || !table.tHead) return;
  Array.from(table.tHead.rows[0].cells).forEach((th, column) => {
    th.title = "sort by this column";
    th.addEventListener("click", () => {
      const rows = Array.from(body.rows);
      const descending = th.dataset.order !== "descending";
      rows.sort((a, b) => {
        const x = sortKey(a.cells[column].textContent), y = sortKey(b.cells[column].textContent);
        const order = typeof x === "number" && typeof y === "number" ? x - y : String(x).localeCompare(String(y));
        return descending ? -order : order;
      });
      th.dataset.order = descending ? "descending" : "ascending";
      rows.forEach((row) => body.appendChild(row));
    });
  });
}

// Charts drawn from their data (`<figure class="chart">`): the value under the pointer, and a
// legend whose entries hide and show their series.
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
const SVG = "http://www.w3.org/2000/svg";

function element(name, attributes, parent) {
  const node = document.createElementNS(SVG, name);
  Object.entries(attributes).forEach(([key, value]) => node.setAttribute(key, String(value)));
  if (parent) parent.appendChild(node);
  return node;
}

function ticks(lo, hi, log) {
  if (log) {
    const out = [];
    for (let e = Math.floor(Math.log10(lo)); e <= Math.ceil(Math.log10(hi)); e++) [1, 2, 5].forEach((m) => out.push(m * 10 ** e));
    return out.filter((t) => t >= lo && t <= hi);
  }
  const step = 10 ** Math.floor(Math.log10((hi - lo) / 4 || 1));
  const nice = [1, 2, 5, 10].map((m) => m * step).find((s) => (hi - lo) / s <= 6) || step * 10;
  const out = [];
  for (let t = Math.ceil(lo / nice) * nice; t <= hi + 1e-12; t += nice) out.push(+t.toPrecision(12));
  return out;
}

function chart(figure) {
  const data = JSON.parse(figure.querySelector("script").textContent);
  const W = 860, H = 420, left = 64, right = 16, top = 34, bottom = 48;
  const points = data.series.flatMap((s) => s.points.filter((p) => p && p[0] !== null && p[1] !== null));
  if (!points.length) return;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  let [x0, x1] = [Math.min(...xs), Math.max(...xs)], [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const pad = (y1 - y0) * 0.05 || 0.5; y0 -= pad; y1 += pad;
  const fx = data.log_x && x0 > 0
    ? (x) => left + (Math.log(x) - Math.log(x0)) / (Math.log(x1) - Math.log(x0)) * (W - left - right)
    : (x) => left + (x - x0) / (x1 - x0) * (W - left - right);
  const fy = (y) => H - bottom - (y - y0) / (y1 - y0) * (H - top - bottom);
  const svg = element("svg", { viewBox: `0 0 ${W} ${H}`, width: W, height: H, class: "interactive" });
  element("text", { x: W / 2, y: 20, "text-anchor": "middle", "font-weight": "bold" }, svg).textContent = data.title;
  element("text", { x: W / 2, y: H - 8, "text-anchor": "middle" }, svg).textContent = data.x_label;
  element("text", { x: 14, y: H / 2, "text-anchor": "middle", transform: `rotate(-90 14 ${H / 2})` }, svg).textContent = data.y_label;
  element("rect", { x: left, y: top, width: W - left - right, height: H - top - bottom, fill: "none", stroke: "#999" }, svg);
  ticks(x0, x1, data.log_x && x0 > 0).forEach((t) => {
    element("line", { x1: fx(t), x2: fx(t), y1: H - bottom, y2: H - bottom + 4, stroke: "#666" }, svg);
    element("text", { x: fx(t), y: H - bottom + 16, "text-anchor": "middle", "font-size": 11 }, svg).textContent = String(t);
  });
  ticks(y0, y1, false).forEach((t) => {
    element("line", { x1: left - 4, x2: W - right, y1: fy(t), y2: fy(t), stroke: "#eee" }, svg);
    element("text", { x: left - 6, y: fy(t) + 4, "text-anchor": "end", "font-size": 11 }, svg).textContent = String(t);
  });
  const groups = data.series.map((s, i) => {
    const g = element("g", { stroke: PALETTE[i % 10], fill: PALETTE[i % 10], "data-series": s.name }, svg);
    const valid = s.points.filter((p) => p && p[0] !== null && p[1] !== null);
    if (data.mark === "lines") element("polyline", { points: valid.map((p) => `${fx(p[0])},${fy(p[1])}`).join(" "), fill: "none", "stroke-width": 2, "stroke-dasharray": ["", "6 3", "2 3"][Math.floor(i / 10) % 3] }, g);
    valid.forEach((p) => element("circle", { cx: fx(p[0]), cy: fy(p[1]), r: 3 }, g));
    return g;
  });
  const legend = document.createElement("div");
  legend.className = "legend";
  data.series.forEach((s, i) => {
    const entry = document.createElement("span");
    entry.textContent = s.name; entry.style.setProperty("--swatch", PALETTE[i % 10]); entry.style.cursor = "pointer";
    entry.addEventListener("click", () => {
      const hidden = groups[i].style.display === "none";
      groups[i].style.display = hidden ? "" : "none"; entry.style.opacity = hidden ? "1" : "0.35";
    });
    legend.appendChild(entry);
  });
  const tip = element("text", { x: W - right - 6, y: top + 16, "text-anchor": "end", "font-size": 12 }, svg);
  svg.addEventListener("mousemove", (event) => {
    const box = svg.getBoundingClientRect(), mx = (event.clientX - box.left) * W / box.width, my = (event.clientY - box.top) * H / box.height;
    let best = null;
    data.series.forEach((s, i) => {
      if (groups[i].style.display === "none") return;
      s.points.forEach((p) => {
        if (!p || p[0] === null || p[1] === null) return;
        const d = (fx(p[0]) - mx) ** 2 + (fy(p[1]) - my) ** 2;
        if (!best || d < best.d) best = { d, s: s.name, p };
      });
    });
    tip.textContent = best ? `${best.s}: ${best.p[0]}, ${best.p[1].toFixed(4)}` : "";
  });
  figure.insertBefore(legend, figure.querySelector("details"));
  figure.insertBefore(svg, legend);
}

document.querySelectorAll("figure.chart").forEach(chart);
document.body.dataset.charts = String(document.querySelectorAll("svg.interactive").length);
document.querySelectorAll("table").forEach(sortable);
// `#sort=N` sorts the first table by column N on opening, as a click would.
const sortOnOpen = /^#sort=(\d+)$/.exec(location.hash);
if (sortOnOpen && document.querySelector("table")) document.querySelector("table").tHead.rows[0].cells[Number(sortOnOpen[1])].click();
document.body.dataset.tables = String(document.querySelectorAll("table").length);
document.body.dataset.rendered = "ok";
