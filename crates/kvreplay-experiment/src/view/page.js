// kvreplay view: draws the data of <script id="view-data"> (crates/kvreplay-experiment/src/view/mod.rs, `View`).
"use strict";
window.addEventListener("error", (event) => { document.body.dataset.error = String(event.message); });

const V = JSON.parse(document.getElementById("view-data").textContent);
const $ = (id) => document.getElementById(id);
const SPAN_COLOURS = { needle: "#d62828", question: "#2a9d8f", answer: "#7b2cbf", sinks: "#555", window: "#999" };
const LEFT = 34, BAND = 14, WIDTH = 1200;

function decode(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}
// One byte a cell (fractions in 255ths), or at one position a bin one bit a cell.
function cells(p) {
  const bytes = decode(p.kept);
  if (!p.packed) return bytes;
  const n = p.steps * p.layers.length * p.caches * V.bins.count, out = new Uint8Array(n);
  for (let i = 0; i < n; i++) out[i] = (bytes[i >> 3] >> (i & 7)) & 1 ? 255 : 0;
  return out;
}
V.policies.forEach((p) => { p.cells = cells(p); });

// One policy's kept fractions (0..1) of layer row `row`, cache `cache` (-1: mean over caches), at `step`.
function keptRow(p, row, cache, step) {
  const bins = V.bins.count, out = new Float32Array(bins);
  const s = Math.min(step, p.steps - 1);
  const first = cache < 0 ? 0 : cache, last = cache < 0 ? p.caches : cache + 1;
  for (let c = first; c < last; c++) {
    const base = ((s * p.layers.length + row) * p.caches + c) * bins;
    for (let b = 0; b < bins; b++) out[b] += p.cells[base + b] / 255 / (last - first);
  }
  return out;
}

function mix(a, b, t) { return a.map((x, i) => Math.round(x + (b[i] - x) * t)); }
const WHITE = [250, 250, 250], BLUE = [31, 78, 156], RED = [139, 26, 26];
const ONLY_A = [230, 134, 46], ONLY_B = [42, 157, 143], BOTH = [90, 111, 154];

function geometry(rows) {
  const cell = Math.max(1, Math.floor(WIDTH / V.bins.count));
  const height = Math.max(4, Math.min(16, Math.floor(520 / Math.max(1, rows))));
  return { cell, height, width: LEFT + V.bins.count * cell, total: BAND + rows * height };
}

function paint(canvas, rows, colourOf, labels) {
  const g = geometry(rows);
  canvas.width = g.width; canvas.height = g.total;
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, g.width, g.total);
  const image = ctx.createImageData(V.bins.count * g.cell, rows * g.height);
  for (let r = 0; r < rows; r++) {
    const colours = colourOf(r);
    for (let b = 0; b < V.bins.count; b++) {
      const [red, green, blue] = colours[b];
      for (let y = 0; y < g.height; y++) for (let x = 0; x < g.cell; x++) {
        const at = (((r * g.height + y) * V.bins.count * g.cell) + b * g.cell + x) * 4;
        image.data[at] = red; image.data[at + 1] = green; image.data[at + 2] = blue; image.data[at + 3] = 255;
      }
    }
  }
  ctx.putImageData(image, LEFT, BAND);
  // Labels keep about 10 px on screen however far the canvas is scaled down to fit.
  const scale = Math.min(1, (canvas.parentElement.clientWidth || g.width) / g.width);
  const font = Math.min(Math.floor((LEFT - 4) / 2), Math.ceil(10 / scale));
  ctx.fillStyle = "#333"; ctx.font = `${font}px sans-serif`; ctx.textBaseline = "middle";
  const every = Math.ceil(font / g.height);
  labels.forEach((label, r) => { if (r % every === 0) ctx.fillText(String(label), 2, BAND + r * g.height + g.height / 2); });
  marks().forEach((m) => {
    ctx.fillStyle = SPAN_COLOURS[m.name] || "#e9c46a";
    const x0 = LEFT + Math.floor(m.start / V.bins.size) * g.cell;
    const x1 = LEFT + Math.ceil(m.end / V.bins.size) * g.cell;
    ctx.fillRect(x0, 2, Math.max(2, x1 - x0), BAND - 4);
  });
  canvas.dataset.rows = rows;
}

// The spans, with the main policy's protected sinks and recent window.
function marks() {
  const p = current().policies[0], n = V.trace.prompt_len, found = V.spans.slice();
  if (p.sinks > 0) found.push({ name: "sinks", start: 0, end: p.sinks });
  if (p.window > 0) found.push({ name: "window", start: Math.max(0, n - p.window), end: n });
  return found;
}

function current() {
  const choice = $("policy").value;
  const policies = choice === "diff" ? V.policies : [V.policies[Number(choice)]];
  return { policies, cache: Number($("cache").value), step: Number($("step").value) };
}

function drawKept() {
  const { policies, cache, step } = current();
  const rows = policies[0].layers.length;
  paint($("kept"), rows, (r) => {
    const a = keptRow(policies[0], r, cache, step);
    if (policies.length === 1) return Array.from(a, (f) => mix(WHITE, BLUE, f));
    const b = keptRow(policies[1], r, cache, step);
    return Array.from(a, (fa, i) => {
      const both = Math.min(fa, b[i]);
      const colour = mix(WHITE, BOTH, both);
      return mix(mix(colour, ONLY_A, fa - both), ONLY_B, b[i] - both);
    });
  }, policies[0].layers);
  const legend = policies.length === 1
    ? [["kept", "rgb(31,78,156)"], ["evicted", "rgb(250,250,250)"]]
    : [[`kept by both`, "rgb(90,111,154)"], [`only ${V.policies[0].label}`, "rgb(230,134,46)"], [`only ${V.policies[1].label}`, "rgb(42,157,143)"]];
  const spans = marks().map((m) => [m.name, SPAN_COLOURS[m.name] || "#e9c46a"]);
  $("kept-legend").innerHTML = "";
  legend.concat(spans).forEach(([name, colour]) => {
    const span = document.createElement("span");
    span.textContent = name; span.style.setProperty("--swatch", colour);
    $("kept-legend").appendChild(span);
  });
}

function drawMass() {
  const rows = V.mass.length;
  paint($("mass"), rows, (r) => {
    const row = V.mass[r], top = Math.max(...row, 1e-12);
    return row.map((m) => mix(WHITE, RED, Math.sqrt(m / top)));
  }, V.mass.map((_, i) => i));
}

function tables() {
  const box = $("tables"); box.innerHTML = "";
  const step = Number($("step").value);
  V.policies.forEach((p) => {
    const regions = p.per_layer.length ? p.per_layer[0].lost_by_region.map((s) => s.name) : [];
    const when = p.per_layer.length ? p.per_layer[0].lost_by_when.map((s) => s.name) : [];
    const spans = p.per_layer.length ? p.per_layer[0].spans.map((s) => s.name) : [];
    const stepped = p.steps > 1;
    const head = ["layer", "budget", "retained mass"].concat(stepped ? [`retained at step ${step + 1}`] : [])
      .concat(spans.map((s) => `${s}: tokens kept`), spans.map((s) => `${s}: mass kept`))
      .concat(regions.map((r) => `lost: ${r}`), when.map((w) => `lost: ${w}`));
    const rows = p.per_layer.map((l) => [l.layer, l.budget, l.retained_mass]
      .concat(stepped ? [l.retained_by_step[Math.min(step, l.retained_by_step.length - 1)]] : [])
      .concat(l.spans.map((s) => s.kept_fraction), l.spans.map((s) => (s.full_mass > 0 ? s.kept_mass / s.full_mass : null)))
      .concat(l.lost_by_region.map((s) => s.mass), l.lost_by_when.map((s) => s.mass)));
    box.appendChild(table(`${p.label}: retained mass ${fmt(p.metrics.retained_mass)}`, head, rows));
  });
}

function fmt(x) { return x === null || x === undefined ? "—" : (Number.isInteger(x) ? String(x) : x.toFixed(4)); }

function table(caption, head, rows) {
  const t = document.createElement("table");
  t.createCaption().textContent = caption;
  const tr = t.createTHead().insertRow();
  head.forEach((h, i) => {
    const th = document.createElement("th"); th.textContent = h;
    th.onclick = () => { rows.sort((a, b) => (b[i] ?? -Infinity) - (a[i] ?? -Infinity)); fill(); };
    tr.appendChild(th);
  });
  const body = t.createTBody();
  function fill() {
    body.innerHTML = "";
    rows.forEach((row) => { const r = body.insertRow(); row.forEach((x) => { r.insertCell().textContent = fmt(x); }); });
  }
  fill();
  return t;
}

function hover(canvas, rowsOf) {
  canvas.addEventListener("mousemove", (event) => {
    const g = geometry(Number(canvas.dataset.rows));
    const scale = canvas.width / canvas.clientWidth;
    const x = event.offsetX * scale - LEFT, y = event.offsetY * scale - BAND;
    const bin = Math.floor(x / g.cell), row = Math.floor(y / g.height);
    const tip = $("tooltip");
    if (bin < 0 || bin >= V.bins.count || row < 0 || row >= Number(canvas.dataset.rows)) { tip.hidden = true; return; }
    tip.textContent = describe(rowsOf(row), row, bin);
    tip.style.left = `${event.clientX + 12}px`; tip.style.top = `${event.clientY + 12}px`; tip.hidden = false;
  });
  canvas.addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
}

function describe(layer, row, bin) {
  const start = bin * V.bins.size, end = Math.min(start + V.bins.size, V.trace.prompt_len) - 1;
  const lines = [`layer ${layer} · ${start === end ? `position ${start}` : `positions ${start}–${end}`}`];
  const { cache, step } = current();
  V.policies.forEach((p) => {
    const r = p.layers.indexOf(layer);
    if (r >= 0) lines.push(`${p.label}: ${(keptRow(p, r, cache, step)[bin] * 100).toFixed(0)}% kept`);
  });
  if (V.mass[layer]) lines.push(`full-cache attention: ${V.mass[layer][bin].toExponential(2)}`);
  marks().filter((m) => m.start <= end && m.end > start).forEach((m) => lines.push(`in ${m.name}`));
  if (V.texts) lines.push(JSON.stringify(V.texts[bin]));
  return lines.join("\n");
}

function controls() {
  V.policies.forEach((p, i) => $("policy").add(new Option(p.label, String(i))));
  if (V.policies.length === 2) $("policy").add(new Option(`${V.policies[0].label} vs ${V.policies[1].label}`, "diff"));
  if (V.policies.length === 2) $("policy").value = "diff";
  $("cache").add(new Option("mean over caches", "-1"));
  const caches = Math.min(...V.policies.map((p) => p.caches));
  for (let c = 0; c < caches; c++) $("cache").add(new Option(`cache ${c}`, String(c)));
  // Each policy's caches are its own layout's: say so where two layouts differ.
  $("cache-note").textContent = new Set(V.policies.map((p) => p.caches)).size > 1
    ? `(each policy's own: ${V.policies.map((p) => `${p.label} ${p.caches} a layer, ${p.settings.gqa}`).join("; ")})`
    : "";
  const steps = Math.max(...V.policies.map((p) => p.steps));
  $("step").max = String(steps - 1);
  $("step-box").hidden = steps <= 1;
  const redraw = () => { $("step-label").textContent = `${Number($("step").value) + 1} of ${steps}`; drawKept(); tables(); };
  ["policy", "cache", "step"].forEach((id) => $(id).addEventListener("input", redraw));
  redraw();
}

function summary() {
  const t = V.trace;
  $("summary").textContent = `${t.path} · ${t.model} · ${t.prompt_len} prompt positions, ${t.n_positions - t.prompt_len} decode steps, ${t.n_layers} layers, ${t.n_heads} query heads over ${t.n_kv_heads} KV heads`;
  $("bin-note").textContent = V.bins.size === 1
    ? "One column per prompt position; one row per compressed layer (its number at the left)."
    : `Positions binned by ${V.bins.size} (${V.bins.count} bins): each cell is the fraction of its bin's positions kept; one row per compressed layer.`;
}

function readback() {
  if (location.hash !== "#readback") return;
  $("readback").textContent = JSON.stringify(V.policies.map((p) => ({
    label: p.label, layers: p.layers, caches: p.caches, steps: p.steps, bins: V.bins, cells: Array.from(p.cells),
  })));
}

summary();
controls();
drawMass();
hover($("kept"), (row) => current().policies[0].layers[row]);
hover($("mass"), (row) => row);
readback();
document.body.dataset.rendered = "ok";
