"""Prometheus metrics and HTTP health for every gearshift process.

Each process (a service, an agent, the dashboard) calls ``serve_http(name,
role, nc)`` once it is connected. That starts a small aiohttp server with

- ``/metrics``: the families of the process's role (``ROLE_FAMILIES``) in
  the Prometheus text format (prometheus-client),
- ``/healthz``: liveness, 200 while the event loop answers,
- ``/readyz``: readiness, 200 once the process said it is ready and its NATS
  connection is up, else 503; both answer JSON with the checks.

The port comes from ``GEARSHIFT_METRICS_PORT`` (default 0: any free port, so
the many processes of ``gearshift up`` on one host never collide) and the
address from ``GEARSHIFT_METRICS_HOST`` (default 127.0.0.1; 0.0.0.0 in a
pod). The bound URL is announced in the log (``metrics serving``), in the
micro-service metadata (``nats micro info``) and, when
``GEARSHIFT_OBSERVE_DIR`` is set, in ``<dir>/<name>.json`` for tools.

The families are module-level objects; what feeds them lives next to what
happens (``job_events`` for every job event a process publishes, ``gpu_report``
for each heartbeat, ``request`` for each request handled, ``bus_error`` for
connection errors), so the services themselves only gain a line or two.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from gearshift.bus.log import get_logger

disable_created_metrics()  # no `_created` series: Prometheus does not need them, and they double the output

# ------------------------------------------------------------------ families
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_WAIT = (0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 12 * 3600)
_SWITCH = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)

# control plane (the optimizer, like Kueue's controller, knows every job)
JOBS = Gauge("gearshift_jobs", "Jobs by state and tenant (set every scheduling round)", ["state", "tenant"],
             registry=None)
ADMISSION_WAIT = Histogram("gearshift_admission_wait_seconds",
                           "Submission to first allocation (like kueue_admission_wait_time_seconds)",
                           ["tenant"], buckets=_WAIT, registry=None)
ROUND_SECONDS = Histogram("gearshift_round_duration_seconds", "Duration of one scheduling round",
                          ["policy"], buckets=_SECONDS, registry=None)
DECISIONS = Counter("gearshift_decisions_total",
                    "Allocation changes by kind (scheduled, reconfigured, preempted, requeued) and reason",
                    ["kind", "reason"], registry=None)
SWITCH_SECONDS = Histogram("gearshift_switch_duration_seconds",
                           "Plan switches: seconds by phase (checkpoint, teardown, launch, restore, first_step, total)",
                           ["phase"], buckets=_SWITCH, registry=None)
STEPS_LOST = Counter("gearshift_steps_lost_total",
                     "Training steps done but not in the checkpoint resumed from, by cause (switch, requeue, grace_expired)",
                     ["cause"], registry=None)
GPU_SECONDS = Counter("gearshift_gpu_seconds_total",
                      "GPU-seconds of finished jobs by tenant: held, and productive (held less switch downtime and "
                      "redone steps), counted as the job moves to the history store (bus_schema.usage)",
                      ["tenant", "kind"], registry=None)
REPORT_RETRIES = Counter("gearshift_report_retries_total",
                         "Agents' run reports asked back by the optimizer, by why: turn (a turn failed), "
                         "job (a job's reports failed again, alone), bus (the bus failed meanwhile)",
                         ["why"], registry=None)
ATOMIC_COMMITS = Counter("gearshift_atomic_commits_total",
                         "Atomic batches this process committed, by stream: each costs the server a disk sync "
                         "(about ten acknowledged publishes' CPU: python -m loadtest.bus_costs)", ["stream"],
                         registry=None)
ATOMIC_MESSAGES = Counter("gearshift_atomic_messages_total",
                          "Messages stored by this process's atomic batches, by stream (the commit's marker included)",
                          ["stream"], registry=None)
ROUND_CPU = Counter("gearshift_round_cpu_seconds_total",
                    "Scheduling rounds' own CPU (their steps on the event loop's thread and their policy's thread), "
                    "by whether the round changed anything (wrote a record)", ["changed"], registry=None)
ROUNDS = Counter("gearshift_rounds_total", "Scheduling rounds, by whether they changed anything (wrote a record)",
                 ["changed"], registry=None)
LEADER = Gauge("gearshift_optimizer_leader", "1 while this optimizer holds the leader lease", registry=None)
JOB_EVENTS = Counter("gearshift_job_events_total", "Job events this process published, by kind", ["kind"],
                     registry=None)
# request-reply endpoints (every micro service)
REQUESTS = Counter("gearshift_requests_total", "Requests handled, by endpoint and reply code", ["endpoint", "code"],
                   registry=None)
REQUEST_SECONDS = Histogram("gearshift_request_duration_seconds", "Time to answer a request", ["endpoint"],
                            buckets=_SECONDS, registry=None)
BUS_ERRORS = Counter("gearshift_bus_errors_total",
                     "NATS errors: connection errors, reconnections, permission violations, request timeouts, no responders",
                     ["kind"], registry=None)
PROFILE_RUNS = Counter("gearshift_profile_runs_total", "Profiling runs by result", ["result"], registry=None)
# agent: GPU telemetry named after the DCGM exporter's fields
_GPU = ["gpu", "UUID", "modelName", "Hostname"]
GPU_UTIL = Gauge("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", _GPU, registry=None)
FB_USED = Gauge("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", _GPU, registry=None)
FB_FREE = Gauge("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", _GPU, registry=None)
GPU_PROCS = Gauge("gearshift_gpu_processes", "Processes on a GPU", _GPU, registry=None)
RECONCILE_LAG = Histogram("gearshift_agent_reconcile_lag_seconds",
                          "Allocation written by the optimizer -> the agent acted on it (launch or stop)",
                          ["action"], buckets=_SECONDS, registry=None)
AGENT_RUNS = Gauge("gearshift_agent_runs", "Job processes (generations) this agent runs", registry=None)
# dashboard
DASH_CLIENTS = Gauge("gearshift_dashboard_stream_clients", "Browsers following the live event stream", registry=None)
DASH_ACTIONS = Counter("gearshift_dashboard_actions_total", "Actions asked from the page, by action and result",
                       ["action", "result"], registry=None)

_COMMON = [REQUESTS, REQUEST_SECONDS, BUS_ERRORS]
ROLE_FAMILIES: dict[str, list[Any]] = {
    "admission": [*_COMMON, JOB_EVENTS],
    "optimizer": [*_COMMON, JOB_EVENTS, JOBS, ADMISSION_WAIT, ROUND_SECONDS, DECISIONS, SWITCH_SECONDS, STEPS_LOST,
                  GPU_SECONDS, LEADER, REPORT_RETRIES, ATOMIC_COMMITS, ATOMIC_MESSAGES, ROUND_CPU, ROUNDS],
    "perfmodel": list(_COMMON),
    "profiler": [*_COMMON, JOB_EVENTS, PROFILE_RUNS],
    "agent": [*_COMMON, GPU_UTIL, FB_USED, FB_FREE, GPU_PROCS, RECONCILE_LAG, AGENT_RUNS],
    "dashboard": [BUS_ERRORS, DASH_CLIENTS, DASH_ACTIONS],
}


def family_names(role: str) -> list[str]:
    """The exposed family names of a role (counters without ``_total``, as the text format names them)."""
    return sorted(m._name for m in ROLE_FAMILIES[role])


# ------------------------------------------------------------------ feeding
_REASON_CUT = re.compile(r"[:(\[]| on | at | for |\d")


def reason_label(text: str) -> str:
    """A bounded label from a free-text reason: "FIFO first fit on node0:4"
    -> "fifo first fit", "retry 1/3: exit 1" -> "retry"."""
    head = _REASON_CUT.split(text.lower(), 1)[0].strip(" -,.")
    return head[:40] or "none"


def job_events(rec: Any, events: Iterable[Any]) -> None:
    """Count the job events a process just published (``JobStore.flush``)."""
    for ev in events:
        kind = ev.__struct_config__.tag
        JOB_EVENTS.labels(kind).inc()
        short = kind.split(".", 1)[1]
        if short in ("scheduled", "reconfigured", "preempted", "requeued"):
            DECISIONS.labels(short, reason_label(getattr(ev, "reason", "") or "")).inc()
        if short == "scheduled" and ev.generation == 1 and rec.submitted_at:
            ADMISSION_WAIT.labels(rec.spec.tenant).observe(max(0.0, ev.ts - rec.submitted_at))
        elif short == "switched":
            for phase in ("checkpoint", "teardown", "launch", "restore", "first_step", "total"):
                SWITCH_SECONDS.labels(phase).observe(max(0.0, getattr(ev, f"{phase}_s")))
            if not getattr(ev, "grace_expired", False):  # else counted by its job.grace_expired event
                STEPS_LOST.labels("switch").inc(max(0, ev.steps_lost))
        elif short == "grace_expired":
            STEPS_LOST.labels("grace_expired").inc(max(0, ev.steps_lost))
        elif short == "requeued":
            # resumes from its checkpoint: what it had done past it is redone
            STEPS_LOST.labels("requeue").inc(max(0, rec.steps_done - ev.checkpoint_step))


def atomic_commit(stream: str, messages: int) -> None:
    """An atomic batch of ``messages`` committed to ``stream`` (``services.fencing``)."""
    ATOMIC_COMMITS.labels(stream).inc()
    ATOMIC_MESSAGES.labels(stream).inc(messages)


def round_cpu(seconds: float, changed: bool) -> None:
    """A scheduling round's own CPU (``services.rounds``), and whether it changed anything:
    a round that changes nothing publishes no ``round.completed``, so its cost shows here only."""
    label = "true" if changed else "false"
    ROUNDS.labels(label).inc()
    ROUND_CPU.labels(label).inc(max(0.0, seconds))


def usage_rows(rows: Iterable[Any]) -> None:
    """Count finished jobs' accounts as the archiver writes them (``JobStore.publish_usage``):
    once per job, not per end event (a new leader publishes a dead one's events again)."""
    for row in rows:
        GPU_SECONDS.labels(row.tenant, "held").inc(row.gpu_s)
        GPU_SECONDS.labels(row.tenant, "productive").inc(row.productive_gpu_s)


def job_states(records: Iterable[Any]) -> None:
    """Set ``gearshift_jobs`` from every job record (one scheduling round's read)."""
    counts: dict[tuple[str, str], int] = {}
    for r in records:
        key = (r.state.value, r.spec.tenant)
        counts[key] = counts.get(key, 0) + 1
    job_counts(counts)


def job_counts(counts: Mapping[tuple[str, str], int]) -> None:
    """Set ``gearshift_jobs`` from the jobs per (state, tenant), kept by the caller."""
    for labels in [tuple(s.labels.values()) for m in JOBS.collect() for s in m.samples]:
        if labels not in counts:
            JOBS.labels(*labels).set(0)  # a state nobody is in any more reads 0, not its last value
    for (state, tenant), n in counts.items():
        JOBS.labels(state, tenant).set(n)


_GPU_GAUGES: dict[tuple[str, ...], list[Any]] = {}  # labels -> the four gauges' children, their last values


def gpu_report(report: Any) -> None:
    """DCGM-named gauges from an agent's ``NodeReport``. A GPU's children are
    looked up once, and set only when a value changed (``labels()`` validates
    and ``set`` locks: 32 of each a beat cost about 0.1 ms, and the fleet
    emulator's agents beat 1,000 times a second)."""
    for g in report.gpus:
        labels = (str(g.index), g.uuid, g.name, report.node)
        got = _GPU_GAUGES.get(labels)
        if got is None:
            got = _GPU_GAUGES[labels] = [tuple(m.labels(*labels) for m in (GPU_UTIL, FB_USED, FB_FREE, GPU_PROCS)),
                                         None]
        values = (g.utilization, g.memory_used / 2**20, max(0, g.memory_total - g.memory_used) / 2**20,
                  len(g.processes))
        if values == got[1]:
            continue
        got[1] = values
        for gauge, value in zip(got[0], values):
            if value is not None:  # no utilisation reading: the gauge keeps its last
                gauge.set(value)
    AGENT_RUNS.set(len(report.running))


def reconcile_lag(action: str, alloc: Any) -> None:
    if alloc.created_at:
        RECONCILE_LAG.labels(action).observe(max(0.0, time.time() - alloc.created_at))


def request(endpoint: str, code: str, seconds: float) -> None:
    REQUESTS.labels(endpoint, code).inc()
    REQUEST_SECONDS.labels(endpoint).observe(seconds)


def bus_error(kind: str) -> None:
    BUS_ERRORS.labels(kind).inc()


def bus_callbacks(error_cb: Callable | None = None, reconnected_cb: Callable | None = None) -> dict[str, Any]:
    """nats-py callbacks that count errors and reconnections (a disconnect that was not
    a shutdown: nats-py also calls ``disconnected_cb`` on close), then call the caller's own."""

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        bus_error("permission" if "permissions violation" in text else
                  "authorization" if "authorization" in text else "connection")
        if error_cb is not None:
            await error_cb(exc)

    async def on_reconnect() -> None:
        bus_error("reconnect")
        if reconnected_cb is not None:
            await reconnected_cb()

    return {"error_cb": on_error, "reconnected_cb": on_reconnect}


# ------------------------------------------------------------------ HTTP
class Observer:
    """The metrics and health server of one process."""

    def __init__(self, name: str, role: str, nc: Any = None, details: Callable[[], dict[str, Any]] | None = None):
        self.name = name
        self.role = role
        self.nc = nc
        self.details = details
        self.ready = False
        self.started = time.time()
        self.registry = CollectorRegistry(auto_describe=True)
        for metric in ROLE_FAMILIES[role]:
            self.registry.register(metric)
        ProcessCollector(registry=self.registry)
        self.url = ""
        self._runner: Any = None
        self._announced: Path | None = None
        self.extra: dict[str, Any] = {}

    def set_ready(self, ready: bool = True) -> None:
        self.ready = ready

    def health(self) -> tuple[int, dict[str, Any]]:
        connected = bool(self.nc is not None and self.nc.is_connected)
        checks: dict[str, Any] = {"started": self.ready, "nats": "connected" if connected else "disconnected"}
        if self.details is not None:
            try:
                checks.update(self.details())
            except Exception as exc:  # a detail must not break the probe
                checks["details_error"] = str(exc)
        ok = self.ready and connected
        return (200 if ok else 503), {"name": self.name, "role": self.role, "status": "ready" if ok else "not ready",
                                     "checks": checks}

    async def start(self, host: str | None = None, port: int | None = None) -> "Observer":
        from aiohttp import web

        host = host or os.environ.get("GEARSHIFT_METRICS_HOST") or "127.0.0.1"
        port = int(os.environ.get("GEARSHIFT_METRICS_PORT") or 0) if port is None else port

        async def metrics(_req: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

        async def healthz(_req: web.Request) -> web.Response:
            return web.json_response({"name": self.name, "status": "alive", "pid": os.getpid(),
                                      "uptime_s": round(time.time() - self.started, 3)})

        async def readyz(_req: web.Request) -> web.Response:
            code, body = self.health()
            return web.json_response(body, status=code)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise MetricsPortBusy(f"{self.name}: cannot serve metrics on {host}:{port}: {exc.strerror or exc} "
                                  "(set GEARSHIFT_METRICS_PORT to a free port, or 0 for any)") from None
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{'127.0.0.1' if bound_host in ('0.0.0.0', '::') else bound_host}:{bound_port}"
        self._announce()
        return self

    def announcement(self) -> dict[str, Any]:
        return {"name": self.name, "role": self.role, "pid": os.getpid(), "url": self.url,
                "metrics": self.url + "/metrics", "healthz": self.url + "/healthz", "readyz": self.url + "/readyz",
                **self.extra}

    def announce(self, **fields: Any) -> None:
        """Add fields to the announcement (the dashboard's page URL) and write it again."""
        self.extra.update(fields)
        self._announce()

    def _announce(self) -> None:
        get_logger(process=self.name).info("metrics serving", metrics=self.url + "/metrics",
                                           healthz=self.url + "/healthz", readyz=self.url + "/readyz", **self.extra)
        folder = os.environ.get("GEARSHIFT_OBSERVE_DIR")
        if folder:
            path = Path(folder) / f"{self.name}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.announcement()) + "\n")
            tmp.replace(path)  # a reader never sees half a file
            self._announced = path

    async def close(self) -> None:
        self.ready = False
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._announced is not None:
            self._announced.unlink(missing_ok=True)


class MetricsPortBusy(RuntimeError):
    pass


_current: Observer | None = None


async def serve_http(name: str, role: str, nc: Any = None, details: Callable[[], dict[str, Any]] | None = None) -> Observer:
    """Start this process's metrics and health server (not ready until ``set_ready``)."""
    global _current
    obs = await Observer(name, role, nc, details).start()
    _current = obs
    return obs


def current_url() -> str:
    """The metrics URL of this process, "" before ``serve_http`` (for micro-service metadata)."""
    return _current.url + "/metrics" if _current is not None else ""


def generate_latest_for(role: str) -> str:
    """The text a process of ``role`` would serve now (tools and tests)."""
    registry = CollectorRegistry(auto_describe=True)
    for metric in ROLE_FAMILIES[role]:
        registry.register(metric)
    return generate_latest(registry).decode()
