// The live dashboard: reads GET /dashboard/events (DashboardUpdate, openapi.json) and draws it.
// No framework and no network beyond the feed: the gateway ships this file as it is.
"use strict";

const BLOCK_FREE = 0, BLOCK_CACHED = 1, BLOCK_HELD = 2;  // ember_proto's BlockMap.holders values
const COLORS = [[48, 54, 61], [88, 166, 255], [63, 185, 80]];  // free, cached, held (as the CSS swatches)
const HELD_SHADES = ["rgb(63,185,80)", "rgb(35,134,54)"];  // neighbouring requests' blocks alternate
const CELL_PX = 9, GAP_PX = 1, MAX_ROWS = 40;  // past MAX_ROWS rows a cell stands for several blocks
const RATE_WINDOW_S = 5, HISTORY_S = 300, LIST_LENGTH = 8, STEPS_SHOWN = 64;  // ember_proto.BLOCK_MAP_STEPS

const key = new URLSearchParams(location.search).get("key");
const feedUrl = "dashboard/events" + (key ? "?key=" + encodeURIComponent(key) : "");
const history = [];  // {time, totals}, oldest first
const engines = new Map();  // address -> the engine's elements and latest grid
const tooltip = document.getElementById("tooltip");

function decodeHolders(base64) {
  const bytes = Uint8Array.from(atob(base64), (c) => c.charCodeAt(0));
  const view = new DataView(bytes.buffer);
  const holders = new Uint16Array(bytes.length / 2);
  for (let i = 0; i < holders.length; i++) holders[i] = view.getUint16(2 * i, true);
  return holders;
}

function sizeCanvas(canvas, cssHeight) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth;
  canvas.style.height = cssHeight + "px";
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(cssHeight * ratio);
  const context = canvas.getContext("2d");
  context.setTransform(ratio, 0, 0, ratio, 0, 0);
  return {context, width};
}

// The grid: one cell a block, or, when that would pass MAX_ROWS rows, one cell per blocksPerCell
// blocks coloured by the mix of their states (so 64k blocks stay one screen).
function layoutGrid(numBlocks, width) {
  const columns = Math.max(1, Math.floor(width / CELL_PX));
  const blocksPerCell = Math.max(1, Math.ceil(numBlocks / (columns * MAX_ROWS)));
  const cells = Math.ceil(numBlocks / blocksPerCell);
  return {columns, blocksPerCell, cells, rows: Math.ceil(cells / columns)};
}

function cellCounts(holders, start, end) {
  const counts = [0, 0, 0];
  for (let i = start; i < end; i++) counts[Math.min(holders[i], BLOCK_HELD)]++;
  return counts;
}

function mixColor(counts) {
  const total = counts[0] + counts[1] + counts[2];
  const channel = (c) => Math.round((counts[0] * COLORS[0][c] + counts[1] * COLORS[1][c] + counts[2] * COLORS[2][c]) / total);
  return `rgb(${channel(0)},${channel(1)},${channel(2)})`;
}

function drawBlocks(view, engine) {
  const holders = engine.holders ? decodeHolders(engine.holders) : new Uint16Array(engine.num_blocks);
  const grid = layoutGrid(holders.length, view.blocks.clientWidth);
  const {context} = sizeCanvas(view.blocks, Math.max(grid.rows, 1) * CELL_PX);
  for (let cell = 0; cell < grid.cells; cell++) {
    const start = cell * grid.blocksPerCell;
    context.fillStyle = grid.blocksPerCell === 1 && holders[start] >= BLOCK_HELD
      ? HELD_SHADES[holders[start] % 2]
      : mixColor(cellCounts(holders, start, Math.min(start + grid.blocksPerCell, holders.length)));
    context.fillRect((cell % grid.columns) * CELL_PX, Math.floor(cell / grid.columns) * CELL_PX,
      CELL_PX - GAP_PX, CELL_PX - GAP_PX);
  }
  const totals = cellCounts(holders, 0, holders.length);
  Object.assign(view.root.dataset, {free: totals[BLOCK_FREE], cached: totals[BLOCK_CACHED], held: totals[BLOCK_HELD],
    blocksPerCell: grid.blocksPerCell});
  view.scale.textContent = grid.blocksPerCell > 1 ? `· one cell = ${grid.blocksPerCell} blocks` : "· one cell = one block";
  view.grid = {...grid, holders, running: engine.running};
}

function describeCell(grid, cell) {
  const start = cell * grid.blocksPerCell;
  const end = Math.min(start + grid.blocksPerCell, grid.holders.length);
  if (start >= end) return null;
  const holderName = (value) => grid.running[value - BLOCK_HELD] ?? "?";
  if (end - start === 1) {
    const value = grid.holders[start];
    const state = value === BLOCK_FREE ? "free" : value === BLOCK_CACHED ? "cached prefix (reusable)" : "held by " + holderName(value);
    return `block ${start}: ${state}`;
  }
  const counts = cellCounts(grid.holders, start, end);
  const byHolder = new Map();
  for (let i = start; i < end; i++) {
    if (grid.holders[i] >= BLOCK_HELD) byHolder.set(grid.holders[i], (byHolder.get(grid.holders[i]) || 0) + 1);
  }
  const top = [...byHolder.entries()].sort((a, b) => b[1] - a[1]).slice(0, 3);
  const lines = [`blocks ${start}-${end - 1}: ${counts[2]} held, ${counts[1]} cached, ${counts[0]} free`];
  for (const [value, count] of top) lines.push(`  ${count} held by ${holderName(value)}`);
  return lines.join("\n");
}

function onBlocksHover(view, event) {
  const grid = view.grid;
  const box = view.blocks.getBoundingClientRect();
  const column = Math.floor((event.clientX - box.left) / CELL_PX);
  const row = Math.floor((event.clientY - box.top) / CELL_PX);
  const text = grid && column < grid.columns ? describeCell(grid, row * grid.columns + column) : null;
  tooltip.hidden = !text;
  if (text) {
    tooltip.textContent = text;
    tooltip.style.left = event.clientX + 12 + "px";
    tooltip.style.top = event.clientY + 12 + "px";
  }
}

function fillList(list, ids) {
  list.replaceChildren(...ids.slice(0, LIST_LENGTH).map((id) => Object.assign(document.createElement("li"), {textContent: id})));
  if (ids.length > LIST_LENGTH) list.append(Object.assign(document.createElement("li"), {textContent: `+ ${ids.length - LIST_LENGTH} more`}));
}

function drawSteps(view, steps) {
  const height = 64;
  const {context, width} = sizeCanvas(view.steps, height);
  const peak = Math.max(1, ...steps.map((s) => s.prefill_tokens + s.decode_tokens));
  const barWidth = width / STEPS_SHOWN;
  steps.forEach((step, i) => {
    const x = i * barWidth;
    const prefill = (step.prefill_tokens / peak) * height, decode = (step.decode_tokens / peak) * height;
    context.fillStyle = "#3fb950";
    context.fillRect(x, height - decode, barWidth - 1, decode);
    context.fillStyle = "#d29922";
    context.fillRect(x, height - decode - prefill, barWidth - 1, prefill);
  });
  const last = steps[steps.length - 1];
  const meanMs = steps.length ? (1000 * steps.reduce((sum, s) => sum + s.seconds, 0)) / steps.length : 0;
  view.lastStep.textContent = last
    ? `last: ${last.prefill_tokens} prefill + ${last.decode_tokens} decode tokens, batch ${last.batch_size}, ` +
      `${(1000 * last.seconds).toFixed(1)} ms · mean of ${steps.length}: ${meanMs.toFixed(1)} ms`
    : "no step yet";
}

function engineView(address) {
  if (engines.has(address)) return engines.get(address);
  const root = document.getElementById("engine-template").content.firstElementChild.cloneNode(true);
  const find = (selector) => root.querySelector(selector);
  const view = {root, blocks: find(".blocks"), steps: find(".steps"), scale: find(".scale"), lastStep: find(".last-step"),
    running: find(".running"), waiting: find(".waiting"), grid: null};
  view.blocks.addEventListener("mousemove", (event) => onBlocksHover(view, event));
  view.blocks.addEventListener("mouseleave", () => { tooltip.hidden = true; });
  find(".address").textContent = address;
  document.getElementById("engines").append(root);
  engines.set(address, view);
  return view;
}

function showEngine(engine) {
  const view = engineView(engine.address);
  const find = (selector) => view.root.querySelector(selector);
  view.root.dataset.engineId = engine.engine_id;
  const cache = engine.kv_cache_dtype
    ? ` (${engine.kv_cache_dtype}, ${(engine.kv_cache_bytes / 2 ** 20).toFixed(0)} MiB)` : "";
  // What the engine's bits depend on besides the requests: two engines that differ here answer differently.
  const bits = [engine.dtype, engine.numerics && `${engine.numerics} numerics`, engine.cpu_build && `${engine.cpu_build} build`]
    .filter(Boolean).join(", ");
  // A hybrid model's recurrent layers keep one state slot per running sequence beside the blocks.
  const states = engine.state_slots
    ? ` · ${engine.state_slots_used}/${engine.state_slots} state slots (${(engine.state_pool_bytes / 2 ** 20).toFixed(0)} MiB)` : "";
  find(".model").textContent = `${engine.model}${bits ? ` (${bits})` : ""} · ${engine.num_blocks} blocks${cache}${states} · `
    + `engine ${engine.engine_id.slice(0, 8)}`;
  find(".state").textContent = engine.accepting ? "" : "· not taking requests";
  find(".num-running").textContent = engine.running.length;
  find(".num-waiting").textContent = engine.waiting.length;
  fillList(view.running, engine.running);
  fillList(view.waiting, engine.waiting);
  drawBlocks(view, engine);
  drawSteps(view, engine.steps);
}

// Rates and means over the last RATE_WINDOW_S seconds, from the cumulative totals.
function windowed(now, older) {
  const seconds = now.time - older.time;
  const delta = (field) => now.totals[field] - older.totals[field];
  const ratio = (num, den) => (delta(den) > 0 ? delta(num) / delta(den) : null);
  return {
    time: now.time,
    tokensPerS: seconds > 0 ? delta("generation_tokens") / seconds : null,
    ttft: ratio("time_to_first_token_sum", "time_to_first_token_count"),
    tpot: ratio("inter_token_latency_sum", "inter_token_latency_count"),
    hitRate: ratio("prefix_cache_hits", "prefix_cache_queries"),
  };
}

function drawSeries(canvas, points, field) {
  const {context, width} = sizeCanvas(canvas, 48);
  const values = points.filter((p) => p[field] !== null);
  if (values.length < 2) return;
  const peak = Math.max(...values.map((p) => p[field])) || 1;
  const end = points[points.length - 1].time;
  context.strokeStyle = "#58a6ff";
  context.lineWidth = 1.5;
  context.beginPath();
  values.forEach((p, i) => {
    const x = width - ((end - p.time) / HISTORY_S) * width, y = 46 - (p[field] / peak) * 44;
    if (i === 0) context.moveTo(x, y); else context.lineTo(x, y);
  });
  context.stroke();
}

const formats = {
  tokensPerS: (v) => v.toFixed(1),
  ttft: (v) => (1000 * v).toFixed(0) + " ms",
  tpot: (v) => (1000 * v).toFixed(1) + " ms",
  hitRate: (v) => (100 * v).toFixed(1) + " %",
};
const outputs = {tokensPerS: "tokens-per-s", ttft: "ttft", tpot: "tpot", hitRate: "hit-rate"};

function showTotals(update) {
  history.push({time: update.time, totals: update.totals, models: update.models});
  while (history[0].time < update.time - HISTORY_S - RATE_WINDOW_S) history.shift();
  const points = [];
  for (let i = 0, j = 0; i < history.length; i++) {
    while (history[j].time < history[i].time - RATE_WINDOW_S) j++;
    if (j < i) points.push(windowed(history[i], history[j]));
  }
  const latest = points[points.length - 1];
  for (const [field, id] of Object.entries(outputs)) {
    const value = latest ? latest[field] : null;
    document.getElementById(id).textContent = value === null ? "–" : formats[field](value);
    drawSeries(document.getElementById("chart-" + id), points, field);
  }
  document.getElementById("preemptions").textContent = update.totals.preemptions;
  document.getElementById("migrations").textContent = update.totals.migrations;
  const routing = document.getElementById("routing");
  routing.replaceChildren(...Object.entries(update.totals.routing_decisions).flatMap(([reason, count]) =>
    [Object.assign(document.createElement("dt"), {textContent: reason}), Object.assign(document.createElement("dd"), {textContent: count})]));
}

// One row per model and LoRA adapter; its rate over the last RATE_WINDOW_S seconds of history.
function showModels(update) {
  const older = history.find((entry) => entry.time >= update.time - RATE_WINDOW_S) || history[history.length - 1];
  const rows = update.models.map((model) => {
    const before = older.models.find((m) => m.name === model.name);
    const seconds = update.time - older.time;
    const rate = before && seconds > 0 ? ((model.generation_tokens - before.generation_tokens) / seconds).toFixed(1) : "–";
    const row = document.createElement("tr");
    row.dataset.model = model.name;
    for (const value of [model.name, model.parent ?? "", model.engines, model.requests, model.prompt_tokens,
                         model.generation_tokens, rate]) {
      row.append(Object.assign(document.createElement("td"), {textContent: value}));
    }
    return row;
  });
  document.querySelector("#models tbody").replaceChildren(...rows);
}

function show(update) {
  showTotals(update);
  showModels(update);
  const seen = new Set(update.engines.map((engine) => engine.address));
  for (const [address, view] of engines) {
    if (!seen.has(address)) { view.root.remove(); engines.delete(address); }
  }
  update.engines.forEach(showEngine);
  document.body.dataset.updates = Number(document.body.dataset.updates) + 1;
}

const status = document.getElementById("status");
const feed = new EventSource(feedUrl);
feed.onopen = () => { status.textContent = "live"; status.className = "status live"; };
feed.onerror = () => { status.textContent = "reconnecting"; status.className = "status lost"; };
feed.onmessage = (event) => show(JSON.parse(event.data));
