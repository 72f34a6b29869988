// The dashboard's page: views of the head's JSON API (/api/v1/, twinkle-dashboard(1)). Every value
// the head sends is shown as text (textContent), never as HTML.
"use strict";

let session = null;
let timer = null;
let generation = 0;  // of route(): a view from an older one is not shown

// The session's key: the login link's redirect brings it in the fragment once; it lives in this
// origin's localStorage and goes with every API request (X-Twinkle-Key).
if (location.hash.startsWith("#key=")) {
  localStorage.setItem("twinkle_key", location.hash.slice(5));
  history.replaceState(null, "", "/#/cluster");
}

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function table(headers, rows) {
  return el("table", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h))),
    ...rows.map((r) => el("tr", {}, ...r.map((c) => el("td", {}, c)))));
}

function auth() { return { "X-Twinkle-Key": localStorage.getItem("twinkle_key") || "" }; }

// The error a refused response carries ({"error": ...}), or its status line.
async function refusal(res) {
  const body = await res.json().catch(() => ({}));
  return new Error(body.error || res.statusText || `HTTP ${res.status}`);
}

async function api(path, options) {
  const o = Object.assign({}, options || {});
  o.headers = Object.assign(auth(), o.headers || {});
  const res = await fetch("/api/v1" + path, o);
  const body = await res.json().catch(() => ({ error: res.statusText }));
  if (!res.ok) {
    const e = new Error(body.error || res.statusText);
    e.status = res.status;
    throw e;
  }
  return body;
}

// A change: JSON with the session's CSRF token (the browser adds the page's Origin itself).
function post(path, body) {
  return api(path, { method: "POST", headers: {
    "Content-Type": "application/json", "X-CSRF-Token": session.csrf }, body: JSON.stringify(body) });
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : "-"; }

// How long a job ran (or has run so far): "1 h 02 min", "3 min 07 s", "12 s"; "-" before it started.
function duration(j) {
  if (!j.started) return "-";
  const s = Math.max(0, Math.round((j.ended || Date.now() / 1000) - j.started));
  const two = (n) => String(n).padStart(2, "0");
  if (s >= 3600) return `${Math.floor(s / 3600)} h ${two(Math.floor(s / 60) % 60)} min`;
  if (s >= 60) return `${Math.floor(s / 60)} min ${two(s % 60)} s`;
  return `${s} s`;
}

function bytes(n) {
  const units = ["bytes", "KiB", "MiB", "GiB"];
  let i = 0;
  for (; n >= 1024 && i + 1 < units.length; ++i) n /= 1024;
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} bytes`;
}

function plural(n, word) { return `${n} ${word}${n === 1 ? "" : "s"}`; }

function sleep(ms) { return new Promise((done) => setTimeout(done, ms)); }

// Shows the view that route() number `mine` made, unless a newer route() started meanwhile.
function show(mine, ...nodes) {
  if (mine !== generation) return;
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

// A node's GPU use as its agent last sampled it through NVML; said so where nothing samples it.
function gpu_use(n) {
  if (!n.gpus.length) return "-";
  const sampled = n.gpus.filter((g) => g.util !== undefined);
  if (!sampled.length) return n.state === "ALIVE" ? "not sampled (no NVML on this node)" : "-";
  return sampled.map((g) => `GPU ${g.index}: ${g.util}%, ${bytes(g.memory_used || 0)}` +
    (g.memory ? ` of ${bytes(g.memory)}` : "")).join("; ");
}

// The use of a rank's GPUs now: "37%, 5%" (the cluster's last samples), or "-".
function rank_gpu_use(c, r) {
  const n = c && c.nodes.find((x) => x.id === r.node);
  if (!n || !(r.gpus || []).length) return "-";
  return r.gpus.map((i) => {
    const g = n.gpus.find((x) => x.index === i);
    return g && g.util !== undefined ? `GPU ${i}: ${g.util}%, ${bytes(g.memory_used || 0)}` : `GPU ${i}: not sampled`;
  }).join("; ");
}

async function cluster(mine) {
  const c = await api("/cluster");
  const nodes = c.nodes.map((n) => [n.id, n.host, el("span", { class: "state-" + n.state }, n.state),
    n.heartbeat_age_s.toFixed(1) + " s", `${n.cpus - n.cpus_free} / ${n.cpus}`,
    `${n.gpus.filter((g) => g.run).length} / ${n.gpus.length}` +
      (n.gpus.length ? " (" + [...new Set(n.gpus.map((g) => g.name))].join(", ") + ")" : ""),
    gpu_use(n), (n.memory / 2 ** 30).toFixed(1) + " GiB",
    Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(", "), n.isolation || "-",
    n.users || "-"]);
  const res = c.reservations.map((r) => [r.run, r.job, r.owner,
    r.bundles.map((b) => `${b.node}: ${b.cpus} CPUs` + (b.gpus.length ? `, GPUs ${b.gpus.join(",")}` : "")).join("; ")]);
  show(mine, el("h2", {}, `Nodes (${c.nodes.length})`),
    table(["node", "host", "state", "heartbeat", "CPUs used", "GPUs used", "GPU use (NVML)", "memory", "labels",
      "isolation", "users"], nodes),
    el("h2", {}, `Reservations (${c.reservations.length})`),
    table(["run", "job", "user", "devices"], res));
}

// The filter form is built once per route, so what is being typed in it survives the refresh.
let jobs_view = null;  // {hash, root, filters, list}

async function jobs(mine, params) {
  const q = new URLSearchParams(params);
  const list = await api("/jobs?" + q.toString());
  if (mine !== generation) return;
  if (!jobs_view || jobs_view.hash !== location.hash || !jobs_view.root.isConnected) {
    jobs_view = { hash: location.hash, filters: jobs_filters(params), list: el("div", {}) };
    jobs_view.root = el("section", { id: "jobs" }, jobs_view.filters, jobs_view.list);
    show(mine, jobs_view.root);
  }
  jobs_list(jobs_view, params, list);
}

function jobs_filters(params) {
  return el("form", { class: "filters", onsubmit: (e) => {
    e.preventDefault();
    const f = new FormData(e.target);
    location.hash = "#/jobs?" + new URLSearchParams([...f.entries()].filter(([, v]) => v)).toString();
  } },
  el("input", { name: "user", placeholder: "user", value: params.get("user") || "" }),
  el("input", { name: "state", placeholder: "state", value: params.get("state") || "" }),
  el("input", { name: "name", placeholder: "name", value: params.get("name") || "" }),
  el("label", {}, el("input", Object.assign({ type: "checkbox", name: "all", value: "1" },
    params.get("all") ? { checked: "" } : {})), " history"),
  el("button", { type: "submit" }, "Filter"));
}

// "alice (vision)": a job's user and, on a cluster of teams, its team.
function team_of(j) {
  return j.team && j.team !== "default" ? `${j.user} (${j.team})` : j.user;
}

function jobs_list(v, params, list) {
  const rows = list.jobs.map((j) => [el("a", { href: `#/job/${j.id}` }, String(j.id)) ,
    j.name + (j.kind === "interactive" ? " *" : ""), team_of(j),
    el("span", { class: "state-" + j.state }, j.state), `${j.nodes} / ${j.gpus}`,
    when(j.submitted), when(j.started), duration(j), j.retries, j.exit_code === undefined ? "-" : j.exit_code,
    j.reason || ""]);
  const pages = Math.max(1, Math.ceil(list.total / list.per_page));
  v.list.replaceChildren(el("h2", {}, `Jobs (${list.total}; page ${list.page} of ${pages})`),
    table(["id", "name", "user", "state", "nodes / GPUs", "submitted", "started", "duration", "retries", "exit", "why"], rows),
    list.page > 1 ? el("a", { href: "#/jobs?" + new URLSearchParams({ ...Object.fromEntries(params), page: list.page - 1 }) }, "« newer") : "",
    " ",
    list.page < pages ? el("a", { href: "#/jobs?" + new URLSearchParams({ ...Object.fromEntries(params), page: list.page + 1 }) }, "older »") : "");
}

// ---- A job's page ----------------------------------------------------------------------------
// Built once per job id: the 1 s refresh redraws only its info part, so the live log, the filter
// and a search in progress stay as they are. `stream` aborts the log's event stream.
let job_page = null;  // {id, root, info, rank, ranks, pre, status, stream, offset, last, ...}

function close_job() {
  if (job_page && job_page.stream) job_page.stream.abort();
  job_page = null;
}

async function job(mine, id) {
  const j = await api(`/jobs/${id}`);
  // A running job's GPUs: their use now, from the nodes' last samples.
  if (j.state === "RUNNING" && (j.placement || []).some((r) => (r.gpus || []).length))
    j.gpu_use = await api("/cluster").catch(() => null);
  if (mine !== generation) return;
  if (!job_page || job_page.id !== id || !job_page.root.isConnected) {
    close_job();
    job_page = job_layout(id);
    show(mine, job_page.root);
    follow_log(job_page);
  }
  job_info(job_page, j);
}

function job_layout(id) {
  const p = { id, stream: null, offset: 0, last: "", which: "", ranks: "", searches: 0 };
  p.summary = el("div", {});
  p.buttons = el("p", { class: "buttons" });
  p.details = el("div", {});
  p.topology = el("pre", { id: "job-topology", class: "topology" });
  p.drawn = "";  // the placement the topology shows
  p.info = el("div", { id: "job-info" }, p.summary, p.buttons, p.details,
    el("details", { id: "job-topology-box" }, el("summary", {}, "Topology (as twinkle topology draws it)"), p.topology));
  p.rank = el("select", { id: "log-rank", onchange: () => follow_log(p) },
    el("option", { value: "" }, "all"), el("option", { value: "driver" }, "driver"));
  p.status = el("span", { id: "log-status" });
  p.pre = el("pre", { class: "log", id: "log" });
  p.query = el("input", { id: "log-search", placeholder: "text to find", size: 30 });
  p.context = el("input", { type: "number", id: "log-context", value: 2, min: 0, max: 20 });
  p.count = el("p", { id: "search-count" });
  p.matches = el("div", { id: "search-results" });
  p.root = el("section", { id: "job", "data-id": String(id) }, p.info,
    el("h2", {}, "Log"),
    el("div", { class: "tools" }, el("label", {}, "Lines of ", p.rank),
      el("button", { id: "log-download", onclick: () => download_log(p) }, "Download"), p.status),
    p.pre,
    el("h2", {}, "Search the log"),
    el("form", { class: "tools", onsubmit: (e) => { e.preventDefault(); search_log(p); } },
      p.query, el("label", {}, "lines around ", p.context), el("button", { type: "submit" }, "Search")),
    p.count, p.matches);
  return p;
}

// The info part: redrawn only when the job changed. The buttons have a part of their own, redrawn
// only when which of them apply changes, so one under the pointer stays put while a job runs.
function job_info(p, j) {
  const placement = (j.placement || []).map((r) => [r.group + ":" + r.rank, r.node, (r.gpus || []).join(",") || "-",
    j.gpu_use ? rank_gpu_use(j.gpu_use, r) : "-"]);
  // What is shown, without what changes on every refresh and is not (the log's last lines, the
  // nodes' heartbeats).
  const { summary, audit, gpu_use, ...shown } = j;
  const text = JSON.stringify([shown, placement]);
  if (text === p.last) return;
  p.last = text;
  const about = [j.job_file ? `job file ${j.job_file}` : "",
    j.kind === "submitted" ? `driver on ${j.driver_node ? "node " + j.driver_node : "the head's machine"}` : "",
    (j.overrides || []).length ? "overrides " + j.overrides.join(" ") : "",
    j.sha256 ? `sha256 ${j.sha256}` : ""].filter((s) => s);
  p.summary.replaceChildren(el("h2", {}, `Job ${j.id}: ${j.name}`),
    table(["user", "state", "submitted", "started", "ended", "exit", "retries", "restarts", "preempted",
      "GPU-seconds"],
      [[team_of(j), el("span", { class: "state-" + j.state }, j.state), when(j.submitted), when(j.started),
        when(j.ended), j.exit_code === undefined ? "-" : j.exit_code, j.retries, j.restarts || 0,
        j.preemptions ? `${j.preemptions} (last for job ${j.preempted_by})` : "-",
        j.ended ? (j.gpu_seconds || 0).toFixed(0) : "-"]]));
  job_buttons(p, j);
  p.details.replaceChildren(j.reason ? el("p", {}, j.reason) : "",
    about.length ? el("p", { class: "dim" }, about.join("; ")) : "",
    el("h2", {}, "Where every rank ran"), table(["rank", "node", "GPUs", "GPU use now"], placement));
  draw_topology(p, j);
  rank_options(p, placement.map((r) => r[0]));
}

// The job's topology where it ran: asked again only when its placement changed (a retry).
async function draw_topology(p, j) {
  const key = JSON.stringify(j.placement || []);
  if (!j.job_text || !(j.placement || []).length || key === p.drawn) return;
  p.drawn = key;
  try {
    const t = await api(`/jobs/${j.id}/topology`);
    if (p.drawn !== key) return;  // its placement changed meanwhile: a newer drawing comes
    p.topology.textContent = t.text;
    p.topology.className = "topology";
  } catch (e) {
    if (p.drawn !== key) return;
    p.topology.textContent = e.message;
    p.topology.className = "topology error";
    if (!e.status || e.status >= 500) p.drawn = "";  // the head did not answer: ask again
  }
}

// Stop and Stop now while a submitted job is active; Re-run for a submitted job the head kept
// the job file of (whoever may: the head refuses another member's job to a non-admin).
function job_buttons(p, j) {
  const stoppable = j.kind === "submitted" && (j.state === "QUEUED" || j.state === "RUNNING" || j.state === "PREEMPTED");
  const rerunnable = j.kind === "submitted" && Boolean(j.job_text);
  const resumable = j.kind === "submitted" && (j.state === "STOPPED" || j.state === "FAILED");
  const which = `${stoppable} ${rerunnable} ${resumable}`;
  if (which === p.which) return;
  p.which = which;
  p.buttons.replaceChildren(
    ...(stoppable ? [el("button", { onclick: () => stop(j.id, false) }, "Stop"),
      el("button", { onclick: () => stop(j.id, true) }, "Stop now")] : []),
    resumable ? el("button", { id: "resume", onclick: () => resume(j.id) }, "Resume") : "",
    rerunnable ? el("button", { id: "rerun", onclick: () => { location.hash = `#/submit?rerun=${j.id}`; } }, "Re-run") : "");
  p.buttons.hidden = !stoppable && !rerunnable && !resumable;
}

// The filter's ranks follow the placement (empty while queued) and keep the chosen one.
function rank_options(p, ranks) {
  const names = [...new Set(ranks)];
  if (names.join(" ") === p.ranks) return;
  p.ranks = names.join(" ");
  const chosen = p.rank.value;
  p.rank.replaceChildren(el("option", { value: "" }, "all"), el("option", { value: "driver" }, "driver"),
    ...names.map((n) => el("option", { value: n }, n)));
  p.rank.value = chosen;
  if (p.rank.value !== chosen) { p.rank.value = ""; follow_log(p); }  // its rank is gone: all of it
}

// Queued again, to go on from its newest checkpoint (the head says why not).
async function resume(id) {
  try {
    const r = await post(`/jobs/${id}/resume`, {});
    alert(r.text);
  } catch (e) { alert(e.message); }
  if (job_page && job_page.id === id) route();
}

async function stop(id, now) {
  try {
    const r = await post(`/jobs/${id}/stop`, { now });
    alert(r.text);
  } catch (e) { alert(e.message); }
  if (job_page && job_page.id === id) route();  // still on its page: show what changed
}

// The query of the chosen filter: one rank's lines, the driver's, or all.
function log_filter(p) {
  const v = p.rank.value;
  return v === "driver" ? { driver: "1" } : v ? { rank: v } : {};
}

function log_status(p, state, text) {
  p.status.dataset.state = state;
  p.status.className = state === "error" ? "error" : "dim";
  p.status.textContent = text;
}

// (Re)starts the live log from its beginning with the chosen filter; the stream before stops.
function follow_log(p) {
  if (p.stream) p.stream.abort();
  const ctl = new AbortController();
  p.stream = ctl;
  p.offset = 0;
  p.pre.textContent = "";
  log_status(p, "connecting", "Connecting…");  // not the stream before's "ended"
  read_events(p, ctl, log_filter(p));
}

// Reads the stream until it ends; one that drops without its `end` (the network, a restarted
// head) resumes after 1 s from the last offset. A refusal (4xx) or an `error` event stops.
async function read_events(p, ctl, filter) {
  for (let fails = 0; !ctl.signal.aborted; ++fails) {
    let outcome, why = "The log's stream dropped";
    try {
      outcome = await stream_events(p, ctl, filter);
      if (outcome === "live") fails = 0;  // it was up: the next wait is short again
    } catch (e) {
      if (ctl.signal.aborted) return;
      if (e.refused) { log_status(p, "error", e.message); return; }
      outcome = "dropped";
      if (e.message) why = e.message;  // a 503's reason (too many live logs open)
    }
    if (outcome !== "dropped" && outcome !== "live") return;
    const wait = Math.min(30, 2 ** Math.min(fails, 5));  // 1 s, doubling to 30 s
    log_status(p, "reconnecting", `${why}; reconnecting in ${wait} s…`);
    await sleep(wait * 1000);
  }
}

// One connection to the event stream (fetch, not EventSource: it must send X-Twinkle-Key).
// Frames are separated by a blank line; returns "end", "error" or "dropped".
async function stream_events(p, ctl, filter) {
  const q = new URLSearchParams(Object.assign({ offset: String(p.offset) }, filter));
  const res = await fetch(`/api/v1/jobs/${p.id}/events?${q}`, { headers: auth(), signal: ctl.signal });
  if (!res.ok) {
    const e = await refusal(res);
    e.refused = res.status < 500;
    throw e;
  }
  log_status(p, "live", "Following the log as it grows.");
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  let seen = false;  // anything came: the connection was up
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return seen ? "live" : "dropped";
    seen = true;
    buf += decoder.decode(value, { stream: true });
    for (let m; (m = /\r?\n\r?\n/.exec(buf));) {
      const frame = buf.slice(0, m.index);
      buf = buf.slice(m.index + m[0].length);
      if (ctl.signal.aborted) return "aborted";  // a newer stream owns the log now
      const outcome = on_event(p, parse_frame(frame));
      if (outcome) { ctl.abort(); return outcome; }
    }
  }
}

// An SSE frame: `event: NAME` and `data: ...` lines (several data lines join with newlines);
// lines starting with ':' are comments (keep-alives).
function parse_frame(frame) {
  let event = "message";
  const data = [];
  for (const line of frame.split(/\r?\n/)) {
    if (!line || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "event") event = value;
    else if (field === "data") data.push(value);
  }
  try {
    return { event, body: data.length ? JSON.parse(data.join("\n")) : {} };
  } catch (e) {
    return { event: "error", body: { error: `an unreadable ${event} event: ${e.message}` } };
  }
}

// Applies one event; returns what ended the stream, if it did.
function on_event(p, { event, body }) {
  if (event === "log") {
    append_log(p, body.text || "");
    if (typeof body.offset === "number") p.offset = body.offset;
  } else if (event === "end") {
    if (typeof body.offset === "number") p.offset = body.offset;
    log_status(p, "ended", "The job has ended: this is its whole log.");
    return "end";
  } else if (event === "error") {
    log_status(p, "error", body.error || "the log's stream failed");
    return "error";
  }
  return "";
}

const kLogKept = 8 << 20;  // characters of log the page holds at most

// Appends, and keeps following the end only if the reader was there (not scrolled up to read).
function append_log(p, text) {
  if (!text) return;
  const pre = p.pre;
  const at_end = pre.scrollHeight - pre.scrollTop - pre.clientHeight < 4;
  pre.append(text);
  // The page keeps the last few MB; Download has all of it.
  if (pre.textContent.length > kLogKept) {
    pre.textContent = "[… the start is cut here: Download has the whole log]\n" + pre.textContent.slice(-kLogKept / 2);
  }
  if (at_end) pre.scrollTop = pre.scrollHeight;
}

async function search_log(p) {
  const q = p.query.value;
  if (!q) return;
  const mine = ++p.searches;  // only the newest search's answer is shown
  p.count.className = "dim";
  p.count.textContent = "Searching…";
  p.matches.replaceChildren();
  try {
    const context = String(Math.max(0, Math.floor(Number(p.context.value) || 0)));
    const r = await api(`/jobs/${p.id}/search?` + new URLSearchParams(Object.assign({ q, context }, log_filter(p))));
    if (mine !== p.searches) return;
    p.count.className = "";
    p.count.textContent = `${r.count} matching ${r.count === 1 ? "line" : "lines"} of ${r.lines}` +
      (r.shown < r.count ? `; showing the first ${r.shown}` : "");
    p.matches.replaceChildren(...r.matches.map(match_block));
  } catch (e) {
    if (mine !== p.searches) return;
    p.count.className = "error";
    p.count.textContent = e.message;
  }
}

// One match: its context lines dim, the matching line highlighted, each with its line number.
function match_block(m) {
  const before = m.before || [], after = m.after || [];
  return el("div", { class: "match" },
    ...before.map((t, i) => match_line(m.line - before.length + i, t, "dim")),
    match_line(m.line, m.text, "hit"),
    ...after.map((t, i) => match_line(m.line + 1 + i, t, "dim")));
}

function match_line(n, text, cls) {
  return el("div", { class: cls }, el("span", { class: "ln" }, String(n)), text);
}

// The whole filtered log as a file: fetched with the key (a plain link could not send it).
async function download_log(p) {
  try {
    const res = await fetch(`/api/v1/jobs/${p.id}/log?` + new URLSearchParams(log_filter(p)), { headers: auth() });
    if (!res.ok) throw await refusal(res);
    const url = URL.createObjectURL(await res.blob());
    const a = el("a", { href: url, download: `job-${p.id}.log` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 10000);  // after the download has started
  } catch (e) { alert(e.message); }
}

// ---- Submit and re-run -----------------------------------------------------------------------
// Never redrawn by the refresh (it would wipe the form): built once per route().

const CHOOSE = "Choose the job's working directory (the folder with its job file) to see its topology.";

async function submit(mine, params) {
  const rerun = Number(params.get("rerun")) || 0;
  const s = { mine, rerun, files: [], seq: 0, debounce: null };
  const j = rerun ? await api(`/jobs/${rerun}`) : null;
  if (mine !== generation) return;
  s.topology = el("pre", { id: "topology", "data-state": "none" });
  s.overrides = el("textarea", { id: "overrides", rows: 4, cols: 60, spellcheck: "false",
    placeholder: "one SECTION.KEY=VALUE a line, e.g. group.model.ranks=2", oninput: () => preview_soon(s) });
  if (j) s.overrides.value = (j.overrides || []).join("\n");
  s.name = el("input", { id: "job-name", size: 30, placeholder: j ? j.name : "the job file's" });
  s.button = el("button", { id: "submit-job", type: "submit" }, "Submit");
  s.status = el("span", { id: "submit-status", class: "dim" });
  s.error = el("p", { class: "error", id: "submit-error" });
  const fields = j ? rerun_fields(s, j) : folder_fields(s);
  show(mine, el("h2", {}, j ? "Re-run a job" : "Submit a job"),
    el("form", { class: "submit", onsubmit: (e) => { e.preventDefault(); send(s); } },
      ...fields,
      el("label", { for: "job-name" }, "Name"), el("div", {}, s.name),
      el("label", { for: "overrides" }, "Overrides"), el("div", {}, s.overrides),
      ...(j ? [] : [el("label", { for: "max-retries" }, "Max retries"), el("div", {}, s.retries)]),
      el("span", {}), el("div", {}, s.button, s.status)),
    s.error,
    el("h2", {}, "Topology"), s.topology);
  if (j) preview_soon(s);
  else s.topology.textContent = CHOOSE;
}

function folder_fields(s) {
  s.folder = el("input", { type: "file", id: "folder", webkitdirectory: "", multiple: "",
    onchange: () => pick_folder(s) });
  s.job_file = el("select", { id: "job-file", onchange: () => preview_soon(s) });
  s.picked = el("span", { id: "folder-info", class: "dim" });
  s.retries = el("input", { type: "number", id: "max-retries", value: 0, min: 0, max: 100 });
  return [el("label", { for: "folder" }, "Working directory"), el("div", {}, s.folder, " ", s.picked),
    el("label", { for: "job-file" }, "Job file"), el("div", {}, s.job_file)];
}

function rerun_fields(s, j) {
  return [el("span", {}), el("p", { id: "rerun-what" },
    `Re-run job ${j.id} (${j.name}) with its working directory` + (j.job_file ? `: ${j.job_file}` : ""))];
}

// A picked file's path inside the folder: webkitRelativePath less its first part (the folder).
function relative_path(f) {
  const p = f.webkitRelativePath || f.name;
  const cut = p.indexOf("/");
  return cut < 0 ? p : p.slice(cut + 1);
}

function pick_folder(s) {
  s.files = [...s.folder.files].map((file) => ({ file, path: relative_path(file) }));
  const tomls = s.files.map((f) => f.path).filter((p) => p.endsWith(".toml")).sort();
  s.job_file.replaceChildren(...tomls.map((t) => el("option", { value: t }, t)));
  s.job_file.value = tomls.includes("job.toml") ? "job.toml" : tomls[0] || "";
  const total = s.files.reduce((n, f) => n + f.file.size, 0);
  s.picked.textContent = `${plural(s.files.length, "file")} (${bytes(total)}) will be uploaded`;
  preview_soon(s);
}

function override_lines(s) {
  return s.overrides.value.split("\n").map((l) => l.trim()).filter((l) => l);
}

// Every change asks for a new preview 300 ms after the last one; only the newest answer shows.
function preview_soon(s) {
  const mine = ++s.seq;
  s.topology.dataset.state = "pending";
  clearTimeout(s.debounce);
  s.debounce = setTimeout(() => preview(s, mine), 300);
}

async function preview(s, mine) {
  if (s.mine !== generation || mine !== s.seq) return;
  const pre = s.topology;
  const show_preview = (state, text) => {
    if (s.mine !== generation || mine !== s.seq) return;
    pre.dataset.state = state;
    pre.dataset.seq = String(mine);  // which change this answers (the browser test waits on it)
    pre.className = state === "error" ? "error" : "";
    pre.textContent = text;
  };
  try {
    let body;
    if (s.rerun) body = { job: s.rerun, overrides: override_lines(s) };
    else {
      const f = s.files.find((x) => x.path === s.job_file.value);
      if (!f) return show_preview("none", s.files.length ? "The folder has no .toml job file." : CHOOSE);
      body = { job_file: f.path, job_text: await f.file.text(), overrides: override_lines(s) };
    }
    const r = await post("/topology", body);
    show_preview("ok", r.text);
  } catch (e) {
    show_preview("error", e.message);
  }
}

function max_retries(s) {
  const n = Number(s.retries.value);
  if (!Number.isInteger(n) || n < 0 || n > 100) throw new Error("Max retries: a whole number from 0 to 100.");
  return n;
}

// Submits (the folder's files, multipart) or re-runs, then follows the new job to its page.
async function send(s) {
  s.error.textContent = "";
  s.button.disabled = true;
  try {
    const overrides = override_lines(s), name = s.name.value.trim();
    let r;
    if (s.rerun) {
      s.status.textContent = "submitting…";
      r = await post(`/jobs/${s.rerun}/rerun`, { overrides, name });
    } else {
      if (!s.files.length) throw new Error("Choose the job's working directory first.");
      if (!s.job_file.value) throw new Error("The folder has no .toml job file.");
      const meta = { job_file: s.job_file.value, name, overrides, max_retries: max_retries(s),
        paths: s.files.map((f) => f.path) };
      const form = new FormData();
      form.append("meta", JSON.stringify(meta));  // first: the server reads it before the files
      for (const f of s.files) form.append("file", f.file);
      s.status.textContent = `uploading ${plural(s.files.length, "file")}…`;
      // No Content-Type: the browser writes multipart/form-data with its boundary.
      r = await api("/submit", { method: "POST", headers: { "X-CSRF-Token": session.csrf }, body: form });
    }
    location.hash = `#/job/${r.job}`;
  } catch (e) {
    s.error.textContent = e.message;
    s.status.textContent = "";
    s.button.disabled = false;
  }
}

let submit_hash = null;  // the route of the submit view on show: a late route() keeps its form

async function route() {
  if (location.hash === submit_hash && document.getElementById("topology")) return;
  submit_hash = null;
  clearTimeout(timer);
  const mine = ++generation;
  const [path, query] = (location.hash.slice(1) || "/cluster").split("?");
  const params = new URLSearchParams(query || "");
  const m = path.match(/^\/job\/(\d+)$/);
  if (!m || !job_page || job_page.id !== Number(m[1])) close_job();  // left the job: its stream stops
  for (const a of document.querySelectorAll("nav a")) {
    const own = a.getAttribute("href").slice(1);
    a.classList.toggle("here", path.startsWith(own) || (own === "/jobs" && path.startsWith("/job/")));
  }
  try {
    if (!session) session = await api("/session");
    document.getElementById("who").textContent = session.user + (session.admin ? " (admin)" : "");
    if (path === "/submit") {  // no refresh: it keeps its form
      submit_hash = location.hash;
      await submit(mine, params);
      return;
    }
    if (m) await job(mine, Number(m[1]));
    else if (path === "/jobs") await jobs(mine, params);
    else await cluster(mine);
  } catch (e) {
    if (mine !== generation) return;
    if (e.status === 401 || e.status === 403 || e.status === 404 || !document.getElementById("main").firstChild ||
        !session) {
      // Logged out, or nothing to keep showing: say so (a 401 says how to log in again).
      if (e.status === 401) session = null;
      close_job();
      jobs_view = null;
      show(mine, el("p", { class: "error" }, e.message));
    } else {
      // The head did not answer (restarting?): keep the view and its live log, and try again.
      document.getElementById("who").textContent = `${session.user}: ${e.message}; retrying`;
    }
    refresh_fails = Math.min(refresh_fails + 1, 5);
    if (mine === generation) timer = setTimeout(route, 1000 * 2 ** refresh_fails);
    return;
  }
  refresh_fails = 0;
  if (mine === generation) timer = setTimeout(route, 1000);
}

let refresh_fails = 0;  // refreshes that failed in a row: the next waits longer (to 32 s)

window.addEventListener("hashchange", route);
route();
