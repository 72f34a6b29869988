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

async function api(path, options) {
  const o = Object.assign({}, options || {});
  o.headers = Object.assign({ "X-Twinkle-Key": localStorage.getItem("twinkle_key") || "" }, o.headers || {});
  const res = await fetch("/api/v1" + path, o);
  const body = await res.json().catch(() => ({ error: res.statusText }));
  if (!res.ok) throw new Error(body.error || res.statusText);
  return body;
}

function when(t) { return t ? new Date(t * 1000).toLocaleString() : "-"; }

// Shows the view that route() number `mine` made, unless a newer route() started meanwhile.
function show(mine, ...nodes) {
  if (mine !== generation) return;
  const main = document.getElementById("main");
  main.replaceChildren(...nodes);
}

async function cluster(mine) {
  const c = await api("/cluster");
  const nodes = c.nodes.map((n) => [n.id, n.host, el("span", { class: "state-" + n.state }, n.state),
    n.heartbeat_age_s.toFixed(1) + " s", `${n.cpus - n.cpus_free} / ${n.cpus}`,
    `${n.gpus.filter((g) => g.run).length} / ${n.gpus.length}` +
      (n.gpus.length ? " (" + [...new Set(n.gpus.map((g) => g.name))].join(", ") + ")" : ""),
    (n.memory / 2 ** 30).toFixed(1) + " GiB",
    Object.entries(n.labels).map(([k, v]) => `${k}=${v}`).join(", ")]);
  const res = c.reservations.map((r) => [r.run, r.job, r.owner,
    r.bundles.map((b) => `${b.node}: ${b.cpus} CPUs` + (b.gpus.length ? `, GPUs ${b.gpus.join(",")}` : "")).join("; ")]);
  show(mine, el("h2", {}, `Nodes (${c.nodes.length})`),
    table(["node", "host", "state", "heartbeat", "CPUs used", "GPUs used", "memory", "labels"], nodes),
    el("h2", {}, `Reservations (${c.reservations.length})`),
    table(["run", "job", "user", "devices"], res));
}

async function jobs(mine, params) {
  const q = new URLSearchParams(params);
  const list = await api("/jobs?" + q.toString());
  const filters = el("form", { class: "filters", onsubmit: (e) => {
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
  const rows = list.jobs.map((j) => [el("a", { href: `#/job/${j.id}` }, String(j.id)) ,
    j.name + (j.kind === "interactive" ? " *" : ""), j.user,
    el("span", { class: "state-" + j.state }, j.state), `${j.nodes} / ${j.gpus}`,
    when(j.submitted), when(j.started), j.retries, j.exit_code === undefined ? "-" : j.exit_code,
    j.reason || ""]);
  const pages = Math.max(1, Math.ceil(list.total / list.per_page));
  show(mine, filters, el("h2", {}, `Jobs (${list.total}; page ${list.page} of ${pages})`),
    table(["id", "name", "user", "state", "nodes / GPUs", "submitted", "started", "retries", "exit", "why"], rows),
    list.page > 1 ? el("a", { href: "#/jobs?" + new URLSearchParams({ ...Object.fromEntries(params), page: list.page - 1 }) }, "« newer") : "",
    " ",
    list.page < pages ? el("a", { href: "#/jobs?" + new URLSearchParams({ ...Object.fromEntries(params), page: list.page + 1 }) }, "older »") : "");
}

let log = { job: 0, offset: 0, text: "" };

async function job(mine, id) {
  const j = await api(`/jobs/${id}`);
  if (log.job !== id) log = { job: id, offset: 0, text: "" };
  const pre = el("pre", { class: "log", id: "log" }, log.text);
  const stop = async (now) => {
    try {
      const r = await api(`/jobs/${id}/stop`, { method: "POST", headers: {
        "Content-Type": "application/json", "X-CSRF-Token": session.csrf },
        body: JSON.stringify({ now }) });
      alert(r.text);
    } catch (e) { alert(e.message); }
    route();
  };
  const active = j.state === "QUEUED" || j.state === "RUNNING";
  const placement = (j.placement || []).map((p) => [p.group + ":" + p.rank, p.node, (p.gpus || []).join(",") || "-"]);
  show(mine, el("h2", {}, `Job ${j.id}: ${j.name}`),
    table(["user", "state", "submitted", "started", "ended", "exit", "retries", "GPU-seconds"],
      [[j.user, el("span", { class: "state-" + j.state }, j.state), when(j.submitted), when(j.started),
        when(j.ended), j.exit_code === undefined ? "-" : j.exit_code, j.retries, (j.gpu_seconds || 0).toFixed(0)]]),
    active && j.kind === "submitted" ? el("p", {}, el("button", { onclick: () => stop(false) }, "Stop"),
      el("button", { onclick: () => stop(true) }, "Stop now")) : "",
    j.reason ? el("p", {}, j.reason) : "",
    el("h2", {}, "Where every rank ran"), table(["rank", "node", "GPUs"], placement),
    el("h2", {}, "Log"), pre);
  if (mine === generation) await more_log(id);
}

async function more_log(id) {
  for (let i = 0; i < 20; ++i) {
    const from = log.offset;
    const c = await api(`/jobs/${id}/logs?offset=${from}`);
    if (log.job !== id || log.offset !== from) return;  // another view read it meanwhile
    log.text += c.text;
    log.offset = c.offset;
    const pre = document.getElementById("log");
    if (pre) { pre.textContent = log.text; pre.scrollTop = pre.scrollHeight; }
    if (!c.more) break;
  }
}

async function route() {
  clearTimeout(timer);
  const mine = ++generation;
  const [path, query] = (location.hash.slice(1) || "/cluster").split("?");
  const params = new URLSearchParams(query || "");
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("here", path.startsWith(a.getAttribute("href").slice(1)));
  try {
    if (!session) session = await api("/session");
    document.getElementById("who").textContent = session.user + (session.admin ? " (admin)" : "");
    const m = path.match(/^\/job\/(\d+)$/);
    if (m) await job(mine, Number(m[1]));
    else if (path === "/jobs") await jobs(mine, params);
    else await cluster(mine);
  } catch (e) {
    if (mine !== generation) return;
    session = null;
    show(mine, el("p", { class: "error" }, e.message));
    return;
  }
  if (mine === generation) timer = setTimeout(route, 1000);
}

window.addEventListener("hashchange", route);
route();
