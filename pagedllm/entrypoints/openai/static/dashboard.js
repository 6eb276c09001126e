// The KV dashboard: polls GET v1/kv twice a second and draws the cache as the seed lesson does.
// Paged: one cell per block, filled with live tokens from the left, the rest is the block's empty tail.
// Contiguous: the slot address space in rows; one cell per run (a slab, or a free gap).
"use strict";

const ROOT = location.pathname.replace(/dashboard\/?$/, "");
const POLL_MS = 500;
const HISTORY = 240; // points kept for the time series (two minutes at two per second)
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
const COLOR = {
  live: css("--live"), tail: css("--empty"), reserved: css("--empty"), external: css("--external"),
  free: css("--free"),
};
const PARTS = ["live", "tail", "reserved", "external", "free"];
const PART_LABEL = {
  live: "live tokens", tail: "tails of last blocks", reserved: "reserved in slabs, empty",
  external: "gaps too small (external)", free: "free",
};

const $ = (sel) => document.querySelector(sel);
const fmt = (x) => x.toLocaleString("en-US");
const pct = (x) => (100 * x).toFixed(1) + "%";

const state = { snap: null, history: [], selected: null, pinned: false, cells: [], updates: 0 };
window.kvDashboard = state; // read by the browser test

// -- polling -------------------------------------------------------------------------------------------

async function poll() {
  const started = performance.now();
  try {
    const headers = {};
    const key = sessionStorage.getItem("pagedllm-api-key");
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(ROOT + "v1/kv", { headers, cache: "no-store" });
    if (response.status === 401) {
      $("#key-box").hidden = false;
      throw new Error("this server needs an API key");
    }
    if (!response.ok) throw new Error("HTTP " + response.status);
    render(await response.json());
  } catch (error) {
    $("#status").className = "stale";
    $("#status").textContent = "not updating: " + error.message;
  }
  setTimeout(poll, Math.max(0, POLL_MS - (performance.now() - started)));
}

$("#key-box").onsubmit = (event) => {
  event.preventDefault();
  sessionStorage.setItem("pagedllm-api-key", $("#key").value);
  $("#key-box").hidden = true;
};

// -- one snapshot --------------------------------------------------------------------------------------

function render(snap) {
  const previous = state.snap;
  state.snap = snap;
  state.updates += 1;
  remember(snap, previous);
  const contiguous = snap.layout === "contiguous";
  document.body.classList.toggle("contiguous", contiguous);
  document.body.classList.toggle("paged", !contiguous);
  const what = contiguous ? `contiguous slabs (reserve ${snap.reserve})` : "paged";
  $("#config").textContent = `${snap.model} · ${what} · ${fmt(snap.num_blocks)} blocks × ${snap.block_size} ` +
    `tokens = ${fmt(snap.total_slots)} slots · max_model_len ${fmt(snap.max_model_len)}`;
  $("#status").className = "live";
  $("#status").textContent = `live · step ${fmt(snap.step)} · ${new Date(snap.time * 1000).toLocaleTimeString()}`;
  $("#k-empty").textContent = contiguous ? "reserved in a slab, empty" : "empty tail of a block in use";
  if (contiguous) drawRuns(snap); else drawBlocks(snap);
  drawNumbers(snap);
  drawTiers(snap);
  drawSeqs(snap);
  drawCharts();
  if (state.selected && !snap.seqs.some((s) => s.id === state.selected)) select(null);
  else select(state.selected);
}

function ownersOf(snap) {
  const owners = new Map(); // block id -> sequence ids
  for (const seq of snap.seqs) {
    for (const block of heldBlocks(seq)) {
      if (!owners.has(block)) owners.set(block, []);
      owners.get(block).push(seq.id);
    }
  }
  return owners;
}

// Every block a sequence holds, in all its KV groups' tables (-1: a window group gave it back).
function heldBlocks(seq) {
  return (seq.tables || [seq.table || []]).flat().filter((b) => b >= 0);
}

function groupName(snap, g) {
  const window = snap.kv_groups[g];
  return `group ${g} (${window === null ? "full attention" : `window ${window}`})`;
}

function fill(tokens, size, empty) {
  const p = (100 * tokens) / size;
  return `linear-gradient(to right, ${COLOR.live} ${p}%, ${empty} ${p}%)`;
}

// Paged: the cells are made once (the pool never changes size) and restyled every update.
function drawBlocks(snap) {
  const map = $("#map");
  const { ref, tokens, cached } = snap.blocks;
  if (state.cells.length !== ref.length) {
    map.className = "paged";
    map.replaceChildren();
    const width = map.clientWidth || 800;
    const side = Math.max(8, Math.min(40, Math.floor(Math.sqrt((width * 360) / ref.length)) - 2));
    map.style.setProperty("--cell", side + "px");
    state.cells = ref.map((_, id) => {
      const cell = document.createElement("div");
      cell.className = "cell";
      cell.dataset.block = id;
      cell.onmousemove = (event) => tip(event, blockTip(id));
      cell.onmouseleave = () => tip(null);
      cell.onclick = () => {
        const first = (ownersOf(state.snap).get(id) || [])[0];
        if (first) select(first, true);
      };
      map.appendChild(cell);
      return cell;
    });
  }
  const showRef = parseInt(map.style.getPropertyValue("--cell")) >= 14;
  state.cells.forEach((cell, id) => {
    const held = ref[id] > 0;
    cell.style.background = held ? fill(tokens[id], snap.block_size, COLOR.tail) : "";
    cell.classList.toggle("cached", !held && cached[id] === 1);
    cell.classList.toggle("shared", ref[id] > 1);
    cell.dataset.ref = ref[id];
    cell.textContent = ref[id] > 1 && showRef ? ref[id] : "";
  });
  const shared = ref.filter((r) => r > 1).length;
  const cachedFree = ref.filter((r, id) => r === 0 && cached[id]).length;
  $("#map-caption").textContent = `one cell = one block of ${snap.block_size} slots · ` +
    `${fmt(ref.filter((r) => r > 0).length)} in use, ${fmt(shared)} shared, ${fmt(cachedFree)} free but cached`;
}

function blockTip(id) {
  const snap = state.snap;
  const { ref, tokens, cached } = snap.blocks;
  if (ref[id] === 0) return `block ${id}: free` + (cached[id] ? " (still holds a cached prefix block)" : "");
  const holders = ownersOf(snap).get(id) || [];
  const group = snap.kv_groups && snap.kv_groups.length > 1 ? " · " + groupName(snap, snap.blocks.group[id]) : "";
  return `block ${id}: ${tokens[id]}/${snap.block_size} tokens · ref count ${ref[id]}` + group +
    (holders.length ? " · " + holders.join(", ") : "");
}

// Contiguous: the address space in rows of equal slots; a run crossing a row end is drawn in pieces.
function drawRuns(snap) {
  const map = $("#map");
  map.className = "contiguous";
  state.cells = [];
  const rows = Math.max(4, Math.min(40, Math.round(Math.sqrt(snap.total_slots / 64))));
  const perRow = Math.ceil(snap.total_slots / rows);
  const rowDivs = Array.from({ length: rows }, () => {
    const row = document.createElement("div");
    row.className = "row";
    return row;
  });
  snap.runs.forEach(([start, size, tokens, owner, external], index) => {
    for (let at = start; at < start + size; ) {
      const row = Math.floor(at / perRow);
      const end = Math.min(start + size, (row + 1) * perRow);
      const seg = document.createElement("div");
      seg.className = "seg" + (owner === null ? (external ? " external gap" : " gap") : "");
      seg.dataset.run = index;
      if (owner !== null) {
        seg.dataset.seq = owner;
        const live = Math.max(0, Math.min(end - at, start + tokens - at));
        seg.style.background = fill(live, end - at, COLOR.reserved);
        seg.onclick = () => select(owner, true);
      }
      seg.style.left = (100 * (at - row * perRow)) / perRow + "%";
      seg.style.width = (100 * (end - at)) / perRow + "%";
      seg.onmousemove = (event) => tip(event, runTip(start, size, tokens, owner, external));
      seg.onmouseleave = () => tip(null);
      rowDivs[row].appendChild(seg);
      state.cells.push(seg);
      at = end;
    }
  });
  map.replaceChildren(...rowDivs);
  const slabs = snap.runs.filter((r) => r[3] !== null).length;
  $("#map-caption").textContent = `one cell = one slab or free gap · ${rows} rows of ${fmt(perRow)} slots · ` +
    `${slabs} slabs, ${snap.runs.length - slabs} gaps`;
}

function runTip(start, size, tokens, owner, external) {
  const where = `slots ${fmt(start)}–${fmt(start + size - 1)}`;
  if (owner === null) {
    return `free gap of ${fmt(size)} slots, ${where}` +
      (external ? " · too small for the waiting request's slab (external fragmentation)" : "");
  }
  return `slab of ${owner}: ${where} · ${fmt(tokens)} live, ${fmt(size - tokens)} reserved but empty`;
}

// -- figures -------------------------------------------------------------------------------------------

function drawNumbers(snap) {
  const u = snap.usage;
  const total = snap.total_slots;
  $("#slots-total").textContent = `${fmt(total)} in all`;
  $("#split").replaceChildren(...PARTS.filter((p) => u[p] > 0).map((p) => {
    const div = document.createElement("div");
    div.style.width = (100 * u[p]) / total + "%";
    div.style.background = COLOR[p];
    div.title = `${PART_LABEL[p]}: ${pct(u[p] / total)}`;
    return div;
  }));
  const last = state.history[state.history.length - 1];
  const c = snap.counters;
  const parts = snap.layout === "contiguous" ? ["live", "reserved", "external", "free"] : ["live", "tail", "free"];
  const rows = parts.map((p) => [p, `<span class="swatch" style="--c:${COLOR[p]}"></span>${PART_LABEL[p]}`,
    pct(u[p] / total), fmt(u[p])]);
  if (snap.layout !== "contiguous") rows.push(["shared_saved", "slots saved by sharing", "", fmt(u.shared_saved)]);
  rows.push(["running", "running / waiting / swapped", "",
    `${snap.queues.running} / ${snap.queues.waiting} / ${snap.queues.swapped}`]);
  rows.push(["tps", "tokens/s generated · prompt", "", `${last.tps.toFixed(1)} · ${last.prompt_tps.toFixed(1)}`]);
  rows.push(["preemptions", "preemptions", "", fmt(c.preemptions)]);
  rows.push(["hit_rate", "prefix cache hit rate", "",
    snap.prefix_caching ? (c.prefix_cache_queries ? pct(c.prefix_cache_hits / c.prefix_cache_queries) : "–") : "off"]);
  $("#numbers tbody").innerHTML = rows.map(([k, label, share, value]) =>
    `<tr data-k="${k}"><td>${label}</td><td class="n">${share}</td><td class="n v">${value}</td></tr>`).join("");
}

// The device cache and the host and disk tiers under it: each one's use against its size, the prefix
// blocks it caches, the blocks loaded from it, and where the prompt tokens found cached came from.
function drawTiers(snap) {
  const t = snap.tiers;
  $("#tiers-panel").hidden = !t;
  if (!t) return;
  const ref = snap.blocks.ref, cached = snap.blocks.cached;
  const deviceUsed = ref.filter((r) => r > 0).length;
  const deviceCached = cached.filter((c, b) => c && ref[b] === 0).length;
  const rows = [["device", deviceUsed, snap.num_blocks, deviceCached, "–"],
    ["host", t.host_used_blocks, t.host_blocks, t.host_cached_blocks, t.counters.host_hit_blocks]];
  if (t.disk_blocks) rows.push(["disk", t.disk_cached_blocks, t.disk_blocks, t.disk_cached_blocks, t.counters.disk_hit_blocks]);
  $("#tiers tbody").innerHTML = rows.map(([tier, used, size, held, loads]) =>
    `<tr data-tier="${tier}"><td>${tier}</td><td><div class="bar"><div style="width:${size ? (100 * used) / size : 0}%">` +
    `</div></div></td><td class="n used">${fmt(used)} / ${fmt(size)}</td><td class="n cached">${fmt(held)}</td>` +
    `<td class="n loads">${typeof loads === "number" ? fmt(loads) : loads}</td></tr>`).join("");
  const c = snap.counters, below = t.counters.host_hit_blocks * snap.block_size;
  $("#tier-hits").textContent = c.prefix_cache_queries
    ? `prompt tokens found cached: ${pct(Math.max(0, c.prefix_cache_hits - below) / c.prefix_cache_queries)} on the ` +
      `device, ${pct(below / c.prefix_cache_queries)} loaded from the tiers` : "no prompt looked up yet";
}

// One row per sequence, kept across updates (so a hovered or clicked row stays put), in snapshot order.
function drawSeqs(snap) {
  const contiguous = snap.layout === "contiguous";
  $("#h-blocks").textContent = contiguous ? "slab slots" : "blocks";
  $("#h-shared").textContent = contiguous ? "first slot" : "shared blocks";
  $("#h-empty").textContent = contiguous ? "reserved, empty" : "tail slots";
  const body = $("#seqs tbody");
  const rows = new Map([...body.children].map((tr) => [tr.dataset.seq, tr]));
  const wanted = snap.seqs.map((s) => {
    let tr = rows.get(s.id);
    if (!tr) {
      tr = document.createElement("tr");
      tr.dataset.seq = s.id;
      tr.innerHTML = '<td></td><td></td>' + '<td class="n"></td>'.repeat(5);
      tr.onmouseenter = () => { if (!state.pinned) select(s.id); };
      tr.onclick = () => select(s.id, !(state.pinned && state.selected === s.id));
    }
    let extra;
    if (contiguous) extra = [fmt(s.slab[1]), fmt(s.slab[0]), fmt(s.slab[1] - s.tokens)];
    else {
      const shared = s.table.filter((b) => snap.blocks.ref[b] > 1).length;
      extra = [s.table.length, shared, s.table.length ? s.table.length * snap.block_size - s.tokens : 0];
    }
    [s.id, s.status, fmt(s.tokens), fmt(s.prompt), ...extra].forEach((v, i) => {
      if (tr.children[i].textContent !== String(v)) tr.children[i].textContent = v;
    });
    return tr;
  });
  const keep = new Set(wanted);
  for (const tr of [...body.children]) if (!keep.has(tr)) tr.remove();
  wanted.forEach((tr, i) => { if (body.children[i] !== tr) body.insertBefore(tr, body.children[i] || null); });
}

function select(id, pin) {
  if (pin !== undefined) state.pinned = pin && id !== null;
  state.selected = id;
  const snap = state.snap;
  const seq = snap && snap.seqs.find((s) => s.id === id);
  for (const tr of $("#seqs tbody").children) tr.classList.toggle("sel", tr.dataset.seq === id);
  const mine = new Set(seq && seq.table ? heldBlocks(seq) : []);
  for (const cell of state.cells) {
    cell.classList.toggle("sel", seq ? (seq.table ? mine.has(+cell.dataset.block) : cell.dataset.seq === id) : false);
  }
  const view = $("#table-view");
  if (!seq) {
    view.innerHTML = '<span class="dim">No sequence selected.</span>';
    return;
  }
  const head = `<b>${seq.id}</b> · ${seq.status} · ${fmt(seq.tokens)} tokens (prompt ${fmt(seq.prompt)})` +
    (state.pinned ? " · pinned (click again to release)" : "");
  if (seq.slab) {
    const [start, size] = seq.slab;
    view.innerHTML = `${head}<div>tokens 0–${fmt(seq.tokens - 1)} → slots ${fmt(start)}–` +
      `${fmt(start + seq.tokens - 1)}; slab reserves slots ${fmt(start)}–${fmt(start + size - 1)}</div>`;
    return;
  }
  if (!seq.table.length) {
    view.innerHTML = `${head}<div>swapped out: its blocks wait in the host pool</div>`;
    return;
  }
  const tables = seq.tables || [seq.table];
  const rows = tables.map((table, g) => {
    const entries = table.map((block, logical) => {
      if (block < 0) return `<span class="entry" title="logical block ${logical}: left the window, given back">${logical}→–</span>`;
      const tokens = Math.min(snap.block_size, seq.tokens - logical * snap.block_size);
      const ref = snap.blocks.ref[block];
      return `<span class="entry${ref > 1 ? " shared" : ""}" data-logical="${logical}" ` +
        `style="background:${fill(tokens, snap.block_size, COLOR.tail)}" ` +
        `title="logical block ${logical} → physical block ${block}, ${tokens}/${snap.block_size} tokens, ref count ${ref}">` +
        `${logical}→${block}${ref > 1 ? " ×" + ref : ""}</span>`;
    });
    return (tables.length > 1 ? `<div>${groupName(snap, g)}</div>` : "") + `<div class="entries">${entries.join("")}</div>`;
  });
  view.innerHTML = `${head} · block table (logical → physical${heldBlocks(seq).some((b) => snap.blocks.ref[b] > 1)
    ? ", ×n = shared by n sequences" : ""}):${rows.join("")}`;
}

function tip(event, text) {
  const box = $("#tip");
  if (!event) { box.style.display = "none"; return; }
  box.textContent = text;
  box.style.display = "block";
  box.style.left = Math.min(event.clientX + 12, innerWidth - box.offsetWidth - 8) + "px";
  box.style.top = event.clientY + 14 + "px";
}

// -- time series ---------------------------------------------------------------------------------------

function remember(snap, previous) {
  const c = snap.counters;
  const point = {
    t: snap.time, parts: PARTS.map((p) => snap.usage[p] / snap.total_slots), ...snap.queues,
    generation: c.generation_tokens, prompt: c.prompt_tokens, preemptions: c.preemptions,
    hit: c.prefix_cache_queries ? c.prefix_cache_hits / c.prefix_cache_queries : 0, tps: 0, prompt_tps: 0,
  };
  // Token rates over the last ~3 s of snapshots (a step can take longer than one poll).
  const base = state.history.find((p) => p.t >= snap.time - 3) || state.history[state.history.length - 1];
  if (base && snap.time > base.t) {
    point.tps = (point.generation - base.generation) / (snap.time - base.t);
    point.prompt_tps = (point.prompt - base.prompt) / (snap.time - base.t);
  }
  if (!previous || snap.time > previous.time) state.history.push(point);
  if (state.history.length > HISTORY) state.history.shift();
}

function canvas(id) {
  const el = $(id);
  const ratio = window.devicePixelRatio || 1;
  el.width = el.clientWidth * ratio;
  el.height = el.clientHeight * ratio;
  const ctx = el.getContext("2d");
  ctx.scale(ratio, ratio);
  return { ctx, w: el.clientWidth, h: el.clientHeight };
}

function xOf(i, w) {
  return state.history.length < 2 ? w : (i * w) / (state.history.length - 1);
}

function stacked(id) {
  const { ctx, w, h } = canvas(id);
  const points = state.history;
  let below = points.map(() => 0);
  PARTS.forEach((part, k) => {
    const above = below.map((b, i) => b + points[i].parts[k]);
    ctx.beginPath();
    points.forEach((_, i) => ctx.lineTo(xOf(i, w), h - above[i] * h));
    for (let i = points.length - 1; i >= 0; i--) ctx.lineTo(xOf(i, w), h - below[i] * h);
    ctx.fillStyle = COLOR[part];
    ctx.fill();
    below = above;
  });
}

// Each series is [value(point), colour]; `top` is the value drawn at the top (default: the largest).
function lines(id, series, top, label) {
  const { ctx, w, h } = canvas(id);
  const points = state.history;
  top = top || Math.max(1, ...series.flatMap(([value]) => points.map(value)));
  ctx.strokeStyle = "#e3e8ee";
  ctx.strokeRect(0.5, 0.5, w - 1, h - 1);
  for (const [value, color] of series) {
    ctx.beginPath();
    points.forEach((p, i) => ctx.lineTo(xOf(i, w), h - 2 - ((h - 4) * value(p)) / top));
    ctx.strokeStyle = color;
    ctx.lineWidth = 1.5;
    ctx.stroke();
  }
  ctx.fillStyle = "#66727f";
  ctx.font = "10px system-ui";
  ctx.fillText(label || fmt(Math.round(top)), 4, 11);
}

function drawCharts() {
  stacked("#chart-kv");
  lines("#chart-queues", [[(p) => p.running, "#08306b"], [(p) => p.waiting, "#fd8d3c"], [(p) => p.swapped, "#756bb1"]]);
  lines("#chart-tps", [[(p) => p.tps, "#31a354"], [(p) => p.prompt_tps, "#9ecae1"]]);
  const most = Math.max(1, ...state.history.map((p) => p.preemptions));
  lines("#chart-pre", [[(p) => p.preemptions / most, "#de2d26"], [(p) => p.hit, "#2c7f6e"]], 1,
    `top of the chart: ${fmt(most)} preemption${most > 1 ? "s" : ""} · 100% hits`);
}

poll();
