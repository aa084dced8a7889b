// gearshift dashboard: renders /api/state and follows /api/stream (server-sent events).
"use strict";
const PHASES = ["checkpoint", "teardown", "launch", "restore", "first_step"];
let token = sessionStorage.getItem("gs-token");
let requireLogin = true;

const $ = (sel) => document.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
function colour(job) {  // one stable colour per job
  let h = 0;
  for (const c of job) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 60%, 42%)`;
}
function dur(s) {
  if (s == null) return "-";
  if (s < 120) return `${s.toFixed(0)}s`;
  if (s < 7200) return `${(s / 60).toFixed(0)}m`;
  return `${(s / 3600).toFixed(1)}h`;
}
function cancelButton(job) {
  return `<button class="cancel" data-job="${esc(job)}" onclick="cancelJob('${esc(job)}')">cancel</button>`;
}

function renderNodes(nodes) {
  let gpus = 0, busy = 0;
  $("#nodes").innerHTML = nodes.map((n) => {
    const cells = n.gpus.map((g) => {
      gpus++;
      const job = g.job || g.draining;
      if (job) busy++;
      const style = job ? `style="background:${colour(job)}"` : "";
      const cls = ["gpu", job ? "busy" : "", g.draining ? "draining" : ""].join(" ");
      const util = g.util == null ? "" : `${g.util.toFixed(0)}%`;
      return `<div class="${cls}" ${style} data-node="${esc(n.node)}" data-gpu="${g.index}" data-job="${esc(job || "")}"
        title="${esc(n.node)} GPU ${g.index}: ${esc(job || "free")}, ${g.mem_used_mib}/${g.mem_total_mib} MiB">
        <div>${g.index} ${util}</div><div class="job">${esc(job || "")}</div></div>`;
    }).join("");
    return `<div class="node" data-node="${esc(n.node)}"><div class="node-name">${esc(n.node)}
      <small>${n.probe}, ${n.cpus} CPUs, heartbeat ${n.heartbeat_age_s}s ago</small></div><div class="gpus">${cells}</div></div>`;
  }).join("") || "<p>no node has reported</p>";
  $("#cluster-summary").textContent = `${nodes.length} nodes, ${busy}/${gpus} GPUs allocated`;
}

function renderRunning(rows, total) {
  $("#running tbody").innerHTML = rows.map((j) => `<tr data-job="${esc(j.job_id)}" data-state="${j.state}">
    <td><span class="dot" style="color:${colour(j.job_id)}">&#9632;</span> ${esc(j.job_id)} <small>${esc(j.name)}</small></td>
    <td>${esc(j.tenant)}</td><td class="state">${j.state}${j.switching ? " (switching)" : ""}</td>
    <td class="plan">${esc(j.plan)} <small>g${j.generation}</small></td><td>${j.gpus} <small>${esc(j.placement.join(" "))}</small></td>
    <td class="speed">${j.samples_per_s == null ? "-" : j.samples_per_s + " samples/s"}</td>
    <td class="progress"><span class="bar"><div style="width:${(100 * j.progress).toFixed(1)}%"></div></span>
      ${j.steps_done}/${j.steps}</td><td>${dur(j.run_time_s)}</td>
    <td>${j.state === "cancelling" ? "" : cancelButton(j.job_id)}</td></tr>`).join("");
  $("#running-total").textContent = `${total}`;
}

function renderQueue(rows, total) {
  $("#queue tbody").innerHTML = rows.map((j) => `<tr data-job="${esc(j.job_id)}">
    <td>${esc(j.job_id)} <small>${esc(j.name)}</small></td><td>${esc(j.tenant)}</td><td>${j.gpus}</td>
    <td>${dur(j.waiting_s)}</td><td class="reason">${esc(j.reason)}</td><td>${cancelButton(j.job_id)}</td></tr>`).join("");
  $("#queue-total").textContent = `${total}`;
}

function renderSwitches(rows) {
  $("#switches").innerHTML = rows.slice().reverse().map((s) => {
    const total = s.total_s || 0;
    let bar;
    if (s.phases) {
      bar = PHASES.map((p) => {
        const w = total > 0 ? (100 * s.phases[p]) / total : 0;
        return `<div class="phase ph-${p}" data-phase="${p}" style="width:${w}%" title="${p} ${s.phases[p]}s">${w > 8 ? p : ""}</div>`;
      }).join("");
    } else {
      bar = `<div class="phase ph-pending" style="width:100%">in progress</div>`;
    }
    const when = s.started ? new Date(s.started * 1000).toLocaleTimeString() : "";
    return `<div class="switch" data-job="${esc(s.job_id)}" data-generation="${s.generation}" data-done="${s.phases ? 1 : 0}">
      <div><b>${esc(s.job_id)}</b> g${s.generation} <small>${when}</small><br>${esc(s.from_plan || "?")} &rarr; ${esc(s.plan || "?")}</div>
      <div class="timeline">${bar}</div>
      <div>${s.phases ? `${total.toFixed(2)}s, ${s.steps_lost} steps lost` : "switching…"}</div></div>`;
  }).join("") || "<p>no plan switch yet</p>";
}

function renderTenants(rows) {
  $("#tenants tbody").innerHTML = rows.map((t) => `<tr data-tenant="${esc(t.tenant)}"><td>${esc(t.tenant)}</td>
    <td>${t.gpus}</td><td><span class="bar"><div style="width:${(100 * t.share).toFixed(1)}%"></div></span>
    ${(100 * t.share).toFixed(0)}%</td><td>${t.running}</td><td>${t.pending}</td><td>${t.finished}</td></tr>`).join("");
}

function renderFinished(rows) {
  $("#finished tbody").innerHTML = rows.slice().reverse().map((j) => `<tr data-job="${esc(j.job_id)}" data-state="${j.state}">
    <td>${esc(j.job_id)} <small>${esc(j.name)}</small></td><td>${esc(j.tenant)}</td><td class="state">${j.state}</td>
    <td>${j.steps_done}/${j.steps}</td><td class="reason">${esc(j.reason)}</td></tr>`).join("");
}

function eventLine(e) {
  const t = new Date(e.ts * 1000).toLocaleTimeString();
  const who = e.job_id || e.node || (e.round != null ? `round ${e.round}` : "");
  const extra = e.reason || (e.kind === "job.switched" ? `${e.total_s.toFixed(2)}s` : "");
  return `<li data-kind="${esc(e.kind)}" data-job="${esc(e.job_id || "")}">${t} ${esc(e.kind)} ${esc(who)} ${esc(extra)}</li>`;
}

function render(s) {
  renderNodes(s.nodes);
  renderRunning(s.running, s.running_total);
  renderQueue(s.queue, s.queue_total);
  renderSwitches(s.switches);
  renderTenants(s.tenants);
  renderFinished(s.finished);
}

function addEvent(e) {
  const list = $("#events");
  list.insertAdjacentHTML("afterbegin", eventLine(e));
  const li = list.firstElementChild;
  li.classList.add("new");
  setTimeout(() => li.classList.remove("new"), 1500);
  while (list.children.length > 200) list.lastElementChild.remove();
}

function showResult(ok, text) {
  const el = $("#action-result");
  el.className = ok ? "ok" : "refused";
  el.textContent = text;
}

async function cancelJob(job) {
  if (requireLogin && !token) { showResult(false, `cancel ${job}: sign in first`); return; }
  const headers = token ? {Authorization: `Bearer ${token}`} : {};
  const r = await fetch(`/api/jobs/${encodeURIComponent(job)}/cancel`, {method: "POST", headers});
  const body = await r.json().catch(() => ({error: r.statusText}));
  if (r.status === 401 && token) { token = null; sessionStorage.removeItem("gs-token"); showWho(null); }
  showResult(r.ok, r.ok ? `cancel ${job}: ${body.state} (by ${body.by})` : `cancel ${job} refused: ${body.error}`);
}

function showWho(info) {
  $("#who").textContent = info ? `signed in as ${info.user}${info.tenant ? ` (tenant ${info.tenant})` : ""}` :
    (requireLogin ? "not signed in" : "no authorisation: anyone may act");
}

async function login() {
  const r = await fetch("/api/login", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({creds: $("#creds").value})});
  const body = await r.json().catch(() => ({error: r.statusText}));
  if (!r.ok) { showResult(false, `sign-in refused: ${body.error}`); return; }
  token = body.token;
  sessionStorage.setItem("gs-token", token);
  sessionStorage.setItem("gs-who", JSON.stringify(body));
  $("#creds").value = "";
  $("#login-box").open = false;
  showWho(body);
  showResult(true, `signed in as ${body.user}`);
}

async function start() {
  $("#legend").innerHTML = PHASES.map((p) => `<span class="ph-${p}">${p}</span>`).join("");
  $("#login").onclick = login;
  const s = await (await fetch("/api/state")).json();
  requireLogin = s.require_login;
  showWho(token ? JSON.parse(sessionStorage.getItem("gs-who") || "null") : null);
  render(s);
  s.events.slice().reverse().forEach(addEvent);
  const es = new EventSource("/api/stream");
  es.onopen = () => { $("#conn").textContent = "live"; $("#conn").classList.add("live"); };
  es.onerror = () => { $("#conn").textContent = "reconnecting…"; $("#conn").classList.remove("live"); };
  es.addEventListener("state", (m) => render(JSON.parse(m.data)));
  es.addEventListener("bus", (m) => addEvent(JSON.parse(m.data)));
}
start();
