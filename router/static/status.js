// modelyard status page: one GET /v1/models, then the /v1/events stream; worker logs from
// /v1/models/{id}/logs?follow=1; a chat playground on /v1/chat/completions; this month's
// usage from /v1/usage (every 10 s, and soon after a request); the key's batches from
// /v1/batches (soon after each live "batch" event, and every 5 s while one is active),
// their lines per second and ETA reckoned here from each batch's in_progress_at and
// counts, with a Cancel for those still running. Streams are
// read with fetch (not EventSource) so the API key travels as an Authorization header,
// never in a URL. A LoRA adapter model (its object has ``parent``: its base) is a row
// under its base's; it has no events of its own, so the list is fetched again (at most
// once a second) when its base changes state, when it serves a request, and after its
// Load or Unload.
"use strict";

const KEY_ITEM = "modelyard-api-key";
const MAX_REQUEST_ROWS = 200;
const MAX_EVENT_ROWS = 300;
const MAX_LOG_LINES = 2000;
const PHASE_COLOURS = ["#7b8ea3", "#b48ead", "#88c0d0", "#a3be8c", "#ebcb8b", "#d08770"];
const INNER_PHASES = new Set(["weights", "kv_cache_and_warmup"]); // parts of "engine"

const models = new Map(); // id -> model object (the /v1/models fields, kept current)
const $ = (id) => document.getElementById(id);

// -- HTTP --------------------------------------------------------------------------------
function apiKey() { return sessionStorage.getItem(KEY_ITEM) || ""; }

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error) return body.error.message || JSON.stringify(body.error);
  } catch (e) { /* not JSON: the status says it */ }
  return "HTTP " + response.status;
}

async function api(path, body) {
  const init = { headers: headers(body ? { "Content-Type": "application/json" } : {}) };
  if (body) { init.method = "POST"; init.body = JSON.stringify(body); }
  const response = await fetch(path, init);
  if (!response.ok) throw new Error(await errorText(response));
  return response.json();
}

// Reads a server-sent event stream; calls onEvent(name, data) for each event. Resolves
// when the stream ends; rejects on an HTTP error (with its message) or a network error.
async function readEvents(path, init, onEvent) {
  const response = await fetch(path, init);
  if (!response.ok) throw new Error(await errorText(response));
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
      }
      if (data.length) onEvent(name, data.join("\n"));
    }
  }
}

function isAbort(err) { return err && err.name === "AbortError"; }

// -- formatting --------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const child of children) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function clock(seconds) {
  const d = seconds ? new Date(seconds * 1000) : new Date();
  return d.toTimeString().slice(0, 8);
}

function ago(ms) {
  if (!ms) return "–";
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 60) return s.toFixed(0) + " s ago";
  if (s < 3600) return (s / 60).toFixed(0) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}

function fixed(v, digits) { return typeof v === "number" ? v.toFixed(digits) : "–"; }

function notice(text) { $("notice").textContent = text || ""; }

// -- models table ------------------------------------------------------------------------
function phaseBar(m) {
  const phases = m.load_phases || {};
  const total = m.load_seconds || 0;
  if (!total) return el("div", { class: "phases" }, "–");
  const bar = el("div", { class: "bar" });
  const words = [];
  let i = 0;
  for (const [name, secs] of Object.entries(phases)) {
    if (INNER_PHASES.has(name)) { words.push(name + " " + secs.toFixed(2)); continue; }
    const seg = el("span", { title: name + " " + secs.toFixed(2) + " s" });
    seg.style.width = Math.min(100, (100 * secs) / total) + "%";
    seg.style.background = PHASE_COLOURS[i++ % PHASE_COLOURS.length];
    bar.append(seg);
    words.push(name + " " + secs.toFixed(2));
  }
  return el("div", { class: "load" }, total.toFixed(1) + " s", bar,
    el("div", { class: "phases" }, words.join(" · ")));
}

function rowFor(m) { return m.parent ? adapterRow(m) : modelRow(m); }

function modelRow(m) {
  const state = el("span", { class: "state state-" + m.state }, m.state);
  const idCell = el("td", { class: "id" }, el("strong", {}, m.id));
  if (m.aliases && m.aliases.length) {
    idCell.append(el("div", { class: "aliases" }, m.aliases.join(", ")));
  }
  if (m.replicas && m.replicas.length) {  // a model that may run several workers
    idCell.append(el("div", { class: "replicas" }, m.replicas.map((r) =>
      `#${r.number} ${r.state}, pid ${r.pid}, ${r.in_flight} in flight`).join("; ")));
  }
  const stateCell = el("td", {}, state);
  if (m.state === "failed" && m.error) stateCell.append(el("div", { class: "error" }, m.error));
  const placement = [m.node ? "node=" + m.node : "",
    ...Object.entries(m.placement || {}).map(([k, v]) => k + "=" + v)].filter(Boolean).join(" ");
  const tps = averageTps(m);
  const load = el("button", { type: "button", "data-action": "load" }, "Load");
  const unload = el("button", { type: "button", "data-action": "unload" }, "Unload");
  load.addEventListener("click", () => act("load", m.id));
  unload.addEventListener("click", () => act("unload", m.id));
  return el("tr", { "data-model": m.id, "data-state": m.state },
    idCell, stateCell,
    el("td", { class: "num pid" }, m.pid ? String(m.pid) : "–"),
    el("td", { class: "placement" }, placement || "–"),
    el("td", { class: "num in-flight" }, String(m.in_flight || 0)),
    el("td", { class: "num queued" }, String(m.queued || 0)),
    el("td", { class: "last-use", "data-ms": String(m.last_use_ms || 0) }, ago(m.last_use_ms)),
    el("td", { class: "load-cell" }, phaseBar(m)),
    el("td", { class: "num tps" }, fixed(tps, 1)),
    el("td", {}, load, unload));
}

function averageTps(m) {
  const tps = m.recent_tps || [];
  return tps.length ? tps.reduce((a, b) => a + b, 0) / tps.length : null;
}

// An adapter: its state in its base's engine (resident: in a batch slot; cpu: loaded,
// further back; known: not loaded) and its rank. Its Load and Unload move it into and out
// of that engine only (a Load starts the base if it is not running); the base never stops
// for it, and its in-flight, queued and pid are the base's row's.
function adapterRow(m) {
  const idCell = el("td", { class: "id adapter" }, "↳ ", el("strong", {}, m.id));
  if (m.aliases && m.aliases.length) {
    idCell.append(el("div", { class: "aliases" }, m.aliases.join(", ")));
  }
  const about = [m.rank ? "rank " + m.rank : "rank ?", m.pinned ? "pinned" : "",
    m.found ? "found in adapters_dir" : ""].filter(Boolean).join(" · ");
  const stateCell = el("td", {}, el("span", { class: "state state-" + m.state }, m.state),
    el("div", { class: "adapter-about" }, about));
  const loaded = typeof m.load_seconds === "number"
    ? m.load_seconds.toFixed(2) + " s" + (m.adapter_loads ? " · " + m.adapter_loads
      + (m.adapter_loads === 1 ? " load" : " loads") : "") : "–";
  const load = el("button", { type: "button", "data-action": "load",
    title: "load into " + m.parent + "'s engine" }, "Load");
  const unload = el("button", { type: "button", "data-action": "unload",
    title: "drop from " + m.parent + "'s engine; " + m.parent + " serves on" }, "Unload");
  load.addEventListener("click", () => act("load", m.id));
  unload.addEventListener("click", () => act("unload", m.id));
  return el("tr", { class: "adapter-row", "data-model": m.id, "data-state": m.state,
    "data-parent": m.parent },
    idCell, stateCell,
    el("td", { class: "num pid" }, "–"),
    el("td", { class: "placement" }, "LoRA on " + m.parent),
    el("td", { class: "num in-flight" }, "–"),
    el("td", { class: "num queued" }, "–"),
    el("td", { class: "last-use", "data-ms": String(m.last_use_ms || 0) }, ago(m.last_use_ms)),
    el("td", { class: "load-cell" }, el("div", { class: "load" }, loaded)),
    el("td", { class: "num tps" }, fixed(averageTps(m), 1)),
    el("td", {}, load, unload));
}

function hasAdapters(id) {
  for (const m of models.values()) if (m.parent === id) return true;
  return false;
}

function renderModel(id) {
  const m = models.get(id);
  const tbody = $("models").tBodies[0];
  const old = tbody.querySelector(`tr[data-model="${CSS.escape(id)}"]`);
  const row = rowFor(m);
  if (old) { old.replaceWith(row); return; }
  const base = m.parent ? tbody.querySelector(`tr[data-model="${CSS.escape(m.parent)}"]`) : null;
  if (!base) { tbody.append(row); return; }
  let after = base; // under its base, after the adapters already there
  while (after.nextElementSibling && after.nextElementSibling.dataset.parent === m.parent) {
    after = after.nextElementSibling;
  }
  after.after(row);
}

function renderAll() {
  $("models").tBodies[0].replaceChildren();
  const names = $("model-names");
  names.replaceChildren();
  const logSelect = $("log-model");
  const chosen = logSelect.value;
  logSelect.replaceChildren();
  for (const m of models.values()) {
    renderModel(m.id);
    names.append(el("option", { value: m.id }));
    for (const alias of m.aliases || []) names.append(el("option", { value: alias }));
    if (!m.parent) logSelect.append(el("option", { value: m.id }, m.id)); // the base's log
  }
  if (chosen && models.has(chosen)) logSelect.value = chosen;
  if (!$("chat-model").value && models.size) $("chat-model").value = models.keys().next().value;
}

function loadSnapshot(list) {
  const previous = new Map(models);
  models.clear();
  for (const m of list) {
    const before = previous.get(m.id) || {};
    m.recent_tps = before.recent_tps || [];
    m.last_use_ms = m.idle_seconds !== undefined ? Date.now() - m.idle_seconds * 1000
      : before.last_use_ms || 0;
    models.set(m.id, m);
  }
  renderAll();
}

async function act(action, id) {
  notice("");
  try {
    await api("/v1/models/" + action, action === "load" ? { model: id, wait: false } : { model: id });
  } catch (err) {
    notice(action + " " + id + ": " + err.message);
  }
  const m = models.get(id);
  if (m && m.parent) refreshModels(); // an adapter's load or unload sends no event
}

let modelsSoon = null;

function refreshModelsSoon() {
  if (modelsSoon === null) {
    modelsSoon = setTimeout(() => { modelsSoon = null; refreshModels(); }, 1000);
  }
}

// -- events ------------------------------------------------------------------------------
let live = false; // events after "hello" change the table; replayed ones only the logs
let pending = null; // live events that arrived while the snapshot was being fetched

function apply(ev) {
  const m = models.get(ev.model);
  if (ev.type === "activity" || ev.type === "hello") {
    for (const [id, counts] of Object.entries(ev.activity || {})) {
      const entry = models.get(id);
      if (entry) { Object.assign(entry, counts); renderModel(id); }
    }
    return;
  }
  if (!m) {
    // served, yet not listed: new since the list was read (an adapter found in its base's
    // adapters_dir on its first request, a model a reload added)
    if (ev.type === "request" && ev.status === 200 && ev.model) refreshModelsSoon();
    return;
  }
  if (ev.type === "state") {
    m.state = ev.state;
    if (ev.pid) m.pid = ev.pid; else delete m.pid;
    if (ev.placement) m.placement = ev.placement; else delete m.placement;
    if (ev.node) m.node = ev.node; else delete m.node;
    if (ev.state === "failed") m.error = ev.error; else delete m.error;
    if (hasAdapters(m.id)) refreshModelsSoon(); // their states follow their base's engine
  } else if (ev.type === "replica") {
    refreshModelsSoon(); // one of its replicas started, crashed or stopped: re-read them
    return;
  } else if (ev.type === "load") {
    m.load_seconds = ev.load_seconds;
    m.load_phases = ev.load_phases;
  } else if (ev.type === "request") {
    m.last_use_ms = Date.now();
    if (m.parent) refreshModelsSoon(); // it may be in its base's engine now
    if (ev.status === 200 && ev.completion_tokens > 1 && ev.decode_tps > 0) {
      m.recent_tps = (m.recent_tps || []).concat([ev.decode_tps]).slice(-5);
    }
  } else {
    return;
  }
  renderModel(m.id);
}

function describe(ev) {
  switch (ev.type) {
    case "state":
      return `${ev.model} → ${ev.state}` + (ev.pid ? ` (pid ${ev.pid})` : "")
        + (ev.reason ? `: ${ev.reason}` : "");
    case "replica":
      return `${ev.model} replica ${ev.replica} → ${ev.state}` + (ev.pid ? ` (pid ${ev.pid})` : "")
        + (ev.error ? `: ${ev.error.split("\n")[0]}` : "");
    case "load":
      return `${ev.model} ready in ${fixed(ev.load_seconds, 2)} s: `
        + Object.entries(ev.load_phases || {}).map(([k, v]) => `${k} ${v.toFixed(2)} s`).join(", ");
    case "eviction":
      return `${ev.model} ${ev.action === "yield" ? "yields" : "evicted"} for ${ev.for}: ${ev.reason}`;
    case "batch":
      return `${ev.batch} ${ev.action}: ${ev.done}/${ev.total} lines (${ev.status})`;
    case "dropped":
      return `${ev.count} event(s) dropped (this page read too slowly)`;
    default:
      return JSON.stringify(ev);
  }
}

function logEvent(ev) {
  if (ev.type === "request") {
    if (!ev.replayed) usageAfterRequest();
    const bad = ev.status >= 400;
    const row = el("tr", { "data-status": String(ev.status) },
      el("td", {}, el("time", {}, clock(ev.time))),
      el("td", {}, ev.model || "–"),
      el("td", {}, ev.endpoint),
      el("td", { class: bad ? "status-bad" : "" }, String(ev.status)),
      el("td", { class: "num" }, String(ev.prompt_tokens)),
      el("td", { class: "num" }, String(ev.completion_tokens)),
      el("td", { class: "num" }, fixed(ev.ttft_ms, 0)),
      el("td", { class: "num" }, fixed(ev.decode_tps, 1)),
      el("td", { class: "num" }, fixed(ev.total_ms, 0)),
      el("td", {}, (ev.finish || []).join(",") || "–"));
    const tbody = $("requests").tBodies[0];
    tbody.prepend(row);
    while (tbody.rows.length > MAX_REQUEST_ROWS) tbody.deleteRow(-1);
    return;
  }
  if (ev.type === "hello" || ev.type === "activity") return;
  const list = $("events");
  list.prepend(el("li", { "data-type": ev.type }, el("time", {}, clock(ev.time)),
    el("span", { class: "ev-type" }, ev.type), describe(ev)));
  while (list.children.length > MAX_EVENT_ROWS) list.lastElementChild.remove();
}

async function refreshModels() {
  pending = [];
  try {
    loadSnapshot((await api("/v1/models")).data);
    notice("");
  } catch (err) {
    notice("/v1/models: " + err.message);
  }
  const late = pending;
  pending = null;
  for (const ev of late) apply(ev); // in order: the table ends as current as the stream
}

function onEvent(name, data) {
  let ev;
  try { ev = JSON.parse(data); } catch (e) { return; }
  if (name === "hello") {
    live = true;
    setConn(true);
    apply(ev);
    refreshModels();
    refreshBatches();
    return;
  }
  logEvent(ev);
  if (!live) return;
  if (ev.type === "batch") batchesSoon();
  if (pending) pending.push(ev); else apply(ev);
}

function setConn(on, text) {
  const conn = $("conn");
  conn.className = "conn " + (on ? "conn-on" : "conn-off");
  conn.textContent = text || (on ? "events: live" : "events: reconnecting");
}

let eventsAbort = null;

async function followEvents() {
  if (eventsAbort) eventsAbort.abort();
  const abort = (eventsAbort = new AbortController());
  while (!abort.signal.aborted) {
    live = false;
    try {
      await readEvents("/v1/events",
        { headers: headers({ Accept: "text/event-stream" }), signal: abort.signal }, onEvent);
    } catch (err) {
      if (isAbort(err)) return;
      setConn(false, "events: " + err.message);
      if (/API key|401|403/.test(err.message)) notice("enter an API key above");
    }
    if (abort.signal.aborted) return;
    if (live) setConn(false);
    await new Promise((done) => setTimeout(done, 2000));
  }
}

// -- worker log --------------------------------------------------------------------------
let logAbort = null;

async function followLog() {
  if (logAbort) logAbort.abort();
  const id = $("log-model").value;
  const pre = $("log");
  pre.textContent = "";
  if (!id) return;
  const abort = (logAbort = new AbortController());
  const path = "/v1/models/" + encodeURIComponent(id).replace(/%2F/g, "/") + "/logs?follow=1&lines=200";
  while (!abort.signal.aborted) {
    try {
      await readEvents(path, { headers: headers({ Accept: "text/event-stream" }), signal: abort.signal },
        (name, data) => {
          if (name !== "line") return;
          const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
          pre.append(JSON.parse(data).line + "\n");
          while (pre.childNodes.length > MAX_LOG_LINES) pre.firstChild.remove();
          if (atBottom) pre.scrollTop = pre.scrollHeight;
        });
    } catch (err) {
      if (isAbort(err)) return;
      pre.append("[log: " + err.message + "]\n");
    }
    if (abort.signal.aborted) return;
    await new Promise((done) => setTimeout(done, 2000));
    pre.textContent = ""; // the stream starts again with the last lines
  }
}

// -- playground --------------------------------------------------------------------------
let chatAbort = null;

async function sendChat(event) {
  event.preventDefault();
  if (chatAbort) chatAbort.abort();
  const abort = (chatAbort = new AbortController());
  const out = $("chat-output");
  out.textContent = "";
  $("chat-ttft").textContent = "TTFT –";
  $("chat-tps").textContent = "– tokens/s";
  $("chat-status").textContent = "waiting…";
  $("chat-stop").disabled = false;
  const body = {
    model: $("chat-model").value.trim(),
    messages: [{ role: "user", content: $("chat-prompt").value }],
    max_tokens: Number($("chat-max").value) || 64,
    stream: true,
    stream_options: { include_usage: true },
  };
  const started = performance.now();
  let first = 0;
  let last = 0;
  let usage = null;
  try {
    await readEvents("/v1/chat/completions", {
      method: "POST", body: JSON.stringify(body), signal: abort.signal,
      headers: headers({ "Content-Type": "application/json", Accept: "text/event-stream" }),
    }, (name, data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices || []) {
        const text = (choice.delta && (choice.delta.content || choice.delta.reasoning_content)) || "";
        if (!text) continue;
        last = performance.now();
        if (!first) {
          first = last;
          $("chat-ttft").textContent = "TTFT " + (first - started).toFixed(0) + " ms";
          $("chat-status").textContent = "streaming";
        }
        out.append(text);
      }
    });
    const tokens = usage ? usage.completion_tokens : 0;
    const seconds = (last - first) / 1000;
    if (tokens > 1 && seconds > 0) {
      $("chat-tps").textContent = ((tokens - 1) / seconds).toFixed(1) + " tokens/s";
    }
    $("chat-status").textContent = "done: " + tokens + " tokens in "
      + ((performance.now() - started) / 1000).toFixed(2) + " s";
  } catch (err) {
    $("chat-status").textContent = isAbort(err) ? "stopped" : "error: " + err.message;
  } finally {
    if (chatAbort === abort) $("chat-stop").disabled = true;
  }
}

// -- usage -------------------------------------------------------------------------------
const USAGE_EVERY_MS = 10000;
let usageSoon = null;

async function refreshUsage() {
  usageSoon = null;
  try {
    const usage = await api("/v1/usage?group_by=key,model");
    const rows = usage.data.map((u) => el("tr", { "data-key": u.key, "data-model": u.model },
      el("td", {}, u.key || "(no key)"), el("td", {}, u.model),
      el("td", { class: "num" }, String(u.requests)),
      el("td", { class: "num" }, String(u.prompt_tokens)),
      el("td", { class: "num" }, String(u.cached_tokens)),
      el("td", { class: "num" }, String(u.completion_tokens)),
      el("td", { class: "num" }, fixed(u.seconds, 1))));
    $("usage").tBodies[0].replaceChildren(...rows);
    $("usage-note").textContent = rows.length ? "" : "no requests this month";
  } catch (err) {
    $("usage-note").textContent = "/v1/usage: " + err.message;
  }
}

// A finished request shows in the ledger within a second: look again shortly after.
function usageAfterRequest() {
  if (usageSoon === null) usageSoon = setTimeout(refreshUsage, 1500);
}

// -- batches -----------------------------------------------------------------------------
const BATCHES_EVERY_MS = 5000;
const RUNNING = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const CANCELLABLE = new Set(["validating", "in_progress"]);
const ENDED_AT = ["completed_at", "cancelled_at", "expired_at", "failed_at", "finalizing_at"];
let batchesTimer = null;
let anyRunning = false;

// Lines per second since the batch began running (to its end, once it has ended), and the
// seconds its pending lines will take at that rate; null where there is no rate yet.
function batchPace(b, done) {
  if (!b.in_progress_at || !done) return { rate: null, eta: null };
  const ended = ENDED_AT.map((k) => b[k]).find((t) => t);
  const end = RUNNING.has(b.status) || !ended ? Date.now() / 1000 : ended;
  const seconds = end - b.in_progress_at;
  if (seconds <= 0) return { rate: null, eta: null };
  const rate = done / seconds;
  const left = b.request_counts.total - done;
  return { rate, eta: RUNNING.has(b.status) && left > 0 ? left / rate : null };
}

function duration(seconds) {
  if (seconds === null) return "–";
  if (seconds < 60) return seconds.toFixed(0) + " s";
  if (seconds < 3600) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function batchRow(b) {
  const counts = b.request_counts || { total: 0, completed: 0, failed: 0 };
  const done = counts.completed + counts.failed;
  const total = counts.total || 0;
  const bar = el("div", { class: "bar", title: done + " of " + total + " lines" });
  for (const [part, cls] of [[counts.completed, "ok"], [counts.failed, "bad"]]) {
    const seg = el("span", { class: cls });
    seg.style.width = (total ? (100 * part) / total : 0) + "%";
    bar.append(seg);
  }
  const { rate, eta } = batchPace(b, done);
  const actions = el("td", {});
  if (CANCELLABLE.has(b.status)) {
    const cancel = el("button", { type: "button", "data-action": "cancel" }, "Cancel");
    cancel.addEventListener("click", () => cancelBatch(b.id, cancel));
    actions.append(cancel);
  }
  return el("tr", { "data-batch": b.id, "data-status": b.status },
    el("td", { class: "id" }, el("strong", {}, b.id),
      el("div", { class: "endpoint" }, b.endpoint)),
    el("td", {}, el("span", { class: "state state-" + b.status }, b.status)),
    el("td", { class: "progress-cell" },
      el("span", { class: "progress" }, done + "/" + total), bar),
    el("td", { class: "num failed" }, String(counts.failed)),
    el("td", { class: "num rate" }, fixed(rate, 1)),
    el("td", { class: "num eta" }, duration(eta)),
    el("td", {}, el("time", {}, clock(b.created_at))),
    actions);
}

async function refreshBatches() {
  try {
    const list = (await api("/v1/batches?limit=100")).data;
    $("batches").tBodies[0].replaceChildren(...list.map(batchRow));
    anyRunning = list.some((b) => RUNNING.has(b.status));
    $("batches-note").textContent = list.length ? "" : "no batches";
  } catch (err) {
    $("batches-note").textContent = "/v1/batches: " + err.message;
  }
}

// Several events in a moment (a batch's lines end together): one look after them.
function batchesSoon() {
  if (batchesTimer === null) {
    batchesTimer = setTimeout(() => { batchesTimer = null; refreshBatches(); }, 300);
  }
}

async function cancelBatch(id, button) {
  button.disabled = true;
  try {
    await api("/v1/batches/" + encodeURIComponent(id) + "/cancel", {});
  } catch (err) {
    $("batches-note").textContent = "cancel " + id + ": " + err.message;
  }
  refreshBatches();
}

// -- start -------------------------------------------------------------------------------
function start() {
  $("key").value = apiKey();
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key").value.trim();
    if (key) sessionStorage.setItem(KEY_ITEM, key); else sessionStorage.removeItem(KEY_ITEM);
    followEvents();
    followLog();
    refreshUsage();
    refreshBatches();
  });
  $("chat-form").addEventListener("submit", sendChat);
  $("chat-stop").addEventListener("click", () => chatAbort && chatAbort.abort());
  $("log-model").addEventListener("change", followLog);
  setInterval(() => { // relative times only: nothing is fetched
    for (const cell of document.querySelectorAll("td.last-use")) {
      cell.textContent = ago(Number(cell.dataset.ms));
    }
  }, 1000);
  followEvents();
  refreshUsage();
  setInterval(refreshUsage, USAGE_EVERY_MS);
  setInterval(() => { if (anyRunning) refreshBatches(); }, BATCHES_EVERY_MS); // pace, ETA
  // The log list needs the model ids: the first snapshot brings them.
  const waitForModels = setInterval(() => {
    if (models.size) { clearInterval(waitForModels); followLog(); }
  }, 100);
}

document.addEventListener("DOMContentLoaded", start);
