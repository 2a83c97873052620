// pagellm dashboard: polls /v1/engine/state and draws the KV block map, queues and charts.
// Plain JavaScript and canvas, no external libraries (the page must work offline).
"use strict";

const STATE_URL = "/v1/engine/state";
const POLL_MS = 1000;
const COLORS = { free: "#2a313a", cached: "#4b6584", shared: "#f5f5f5", null: "#000000" };
const FREE = 0, CACHED_FREE = 1, NULL = 2, OWNED = 3, SHARED = 4;

function requestColor(id) {
  // A stable colour per request id (hash -> hue).
  let h = 0;
  for (let i = 0; i < id.length; i++) h = (h * 31 + id.charCodeAt(i)) >>> 0;
  return `hsl(${h % 360}, 70%, 55%)`;
}

function drawBlockMap(state) {
  const canvas = document.getElementById("block-map");
  const ctx = canvas.getContext("2d");
  const blocks = state.blocks.state;
  const owners = state.blocks.owner;
  const n = blocks.length;
  const width = canvas.width;
  // Square cells, as large as fit.
  let cell = Math.max(2, Math.floor(Math.sqrt((width * canvas.height) / n)));
  let cols = Math.floor(width / cell);
  while (Math.ceil(n / cols) * cell > canvas.height && cell > 2) { cell--; cols = Math.floor(width / cell); }
  const rows = Math.ceil(n / cols);
  canvas.height = Math.max(40, rows * cell);
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  const counts = [0, 0, 0, 0, 0];
  for (let b = 0; b < n; b++) {
    const s = blocks[b];
    counts[s]++;
    let color = COLORS.free;
    if (s === CACHED_FREE) color = COLORS.cached;
    else if (s === NULL) color = COLORS.null;
    else if (s === SHARED) color = COLORS.shared;
    else if (s === OWNED) {
      const owner = owners[b] >= 0 ? state.requests[owners[b]] : null;
      color = owner ? requestColor(owner.id) : "#e8a33d";
    }
    ctx.fillStyle = color;
    const gap = cell > 4 ? 1 : 0;
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - gap, cell - gap);
  }
  canvas.dataset.blocks = String(n);
  canvas.dataset.used = String(counts[OWNED] + counts[SHARED]);
  document.getElementById("block-summary").textContent =
    `${n - 1} blocks of ${state.block_size} tokens: ${counts[OWNED]} owned, ${counts[SHARED]} shared, ` +
    `${counts[CACHED_FREE]} cached, ${counts[FREE]} free; host blocks: ${state.host_blocks.total}`;
}

function drawQueues(state) {
  document.getElementById("model").textContent = `${state.model} · step ${state.step}`;
  document.getElementById("q-running").textContent = state.queues.running;
  document.getElementById("q-waiting").textContent = state.queues.waiting;
  document.getElementById("q-swapped").textContent = state.queues.swapped;
  document.getElementById("kv-usage").textContent = `${(100 * state.kv_usage).toFixed(1)}%`;
  const tbody = document.querySelector("#requests tbody");
  tbody.replaceChildren(...state.requests.map((r) => {
    const tr = document.createElement("tr");
    const swatch = `<i class="sw" style="background:${requestColor(r.id)}"></i>`;
    tr.innerHTML = `<td>${swatch}</td><td></td><td>${r.prompt_tokens}</td><td>${r.output_tokens}</td>` +
      `<td>${r.device_blocks}${r.host_blocks ? " (+" + r.host_blocks + " host)" : ""}</td>`;
    tr.children[0].append(document.createTextNode(r.id));
    tr.children[1].textContent = r.adapter ? `${r.status} · ${r.adapter}` : r.status;
    return tr;
  }));
  const c = state.counters;
  const hit = c.prefix_query_tokens ? (100 * c.prefix_hit_tokens / c.prefix_query_tokens).toFixed(1) + "%" : "–";
  const items = [
    ["prefill tokens", c.prefill_tokens], ["decode tokens", c.decode_tokens],
    ["prefix hit rate", hit], ["preemptions", c.preemptions], ["alloc failures", c.allocation_failures],
  ];
  const spec = state.spec_decode;  // null unless some step speculated
  if (spec) {
    items.push(["spec acceptance", (100 * spec.acceptance_rate).toFixed(1) + "%"],
               ["tokens / verification", spec.mean_accepted_length.toFixed(2)]);
  }
  document.getElementById("counters").replaceChildren(...items.map(([label, value]) => {
    const div = document.createElement("div");
    const b = document.createElement("b");
    b.textContent = value;
    div.append(b, document.createTextNode(label));
    return div;
  }));
}

function drawChart(id, series, lines) {
  const canvas = document.getElementById(id);
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 28;
  ctx.clearRect(0, 0, w, h);
  let max = 0;
  for (const [key] of lines) for (const p of series) if (p[key] != null) max = Math.max(max, p[key]);
  max = max || 1;
  ctx.strokeStyle = "#262d36";
  ctx.fillStyle = "#7d8a99";
  ctx.font = "10px sans-serif";
  for (let i = 0; i <= 2; i++) {
    const y = pad / 2 + ((h - pad) * i) / 2;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText((max * (1 - i / 2)).toPrecision(3), 0, y + 3);
  }
  const t0 = series.length ? series[0].time : 0;
  const span = series.length > 1 ? series[series.length - 1].time - t0 : 1;
  lines.forEach(([key, label, color], li) => {
    ctx.strokeStyle = color;
    ctx.beginPath();
    let started = false;
    for (const p of series) {
      if (p[key] == null) continue;
      const x = pad + ((w - pad) * (p.time - t0)) / (span || 1);
      const y = pad / 2 + (h - pad) * (1 - p[key] / max);
      if (started) ctx.lineTo(x, y); else { ctx.moveTo(x, y); started = true; }
    }
    ctx.stroke();
    ctx.fillStyle = color;
    ctx.fillText(label, pad + 6 + li * 80, h - 2);
  });
  canvas.dataset.points = String(series.length);
}

function drawCharts(series) {
  drawChart("chart-throughput", series, [["prompt_tps", "prompt", "#3e8ed0"], ["generation_tps", "generation", "#48c774"]]);
  drawChart("chart-mix", series, [["prefill_tps", "prefill", "#e8a33d"], ["decode_tps", "decode", "#b86bff"]]);
  drawChart("chart-kv", series, [["kv_usage", "KV usage", "#ff6b6b"]]);
  drawChart("chart-latency", series, [
    ["ttft_p50", "TTFT p50", "#3e8ed0"], ["ttft_p90", "TTFT p90", "#1d5fa0"],
    ["itl_p50", "ITL p50", "#48c774"], ["itl_p90", "ITL p90", "#2a8a4e"],
  ]);
  drawChart("chart-utilization", series, [["mfu", "compute (MFU)", "#e8a33d"], ["mbu", "memory (MBU)", "#3e8ed0"]]);
}

function drawBound(state) {
  const u = state.utilization;
  const el = document.getElementById("bound");
  if (!u) return;
  el.textContent = u.summary + (u.hint ? ` — ${u.hint}` : "") +
    ` (ceilings ${(u.flops_ceiling / 1e9).toFixed(0)} GFLOP/s, ${(u.bandwidth_ceiling / 1e9).toFixed(1)} GB/s, ${u.source})`;
}

let updates = 0;
async function poll() {
  const status = document.getElementById("status");
  try {
    const response = await fetch(STATE_URL, { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const state = await response.json();
    drawBlockMap(state);
    drawQueues(state);
    drawCharts(state.series);
    drawBound(state);
    updates++;
    document.body.dataset.updates = String(updates);
    status.textContent = `live · ${new Date(state.time * 1000).toLocaleTimeString()}`;
    status.className = "status live";
  } catch (err) {
    status.textContent = `engine unreachable (${err.message})`;
    status.className = "status down";
  }
  setTimeout(poll, POLL_MS);
}
poll();
