"""The bus contract: every subject, what travels on it, and who may use it.

One table read by
- serving (``gearshift.bus.server.serve`` refuses an endpoint whose subject or
  request type disagrees with it),
- calling (``gearshift.bus.client.call`` takes the reply type from it),
- authorisation (``services.auth.permissions`` derives every role's ``gs.*``
  publish and subscribe rights from it),
- ``gearshift schema`` (the ``subjects`` section of ``schema/bus.json``).

A subject pattern names its variable tokens in angle brackets: ``<node>``,
``<job>``, ``<tenant>``, ``<kind>``. For permissions ``<node>`` and
``<tenant>`` become the identity's own node or tenant (for an agent or a
tenant user) and ``*`` for everyone else; other variables become ``*``.

Roles: ``admin`` (operators), ``tools`` (outside readers), ``dashboard``
(the web dashboard: read-only; its actions run on the signed-in person's own
connection), ``tenant``, ``agent`` and the services ``admission``,
``optimizer``, ``perfmodel``, ``profiler``. ``admin`` may use everything and
is not listed. A KV route's receivers are read-only roles that watch the
bucket (the services' bucket rights are their own, see ``services.auth``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from typing import Any

from gearshift.bus_schema import messages as m
from gearshift.bus_schema import ops
from gearshift.bus_schema import perfmodel as pm
from gearshift.bus_schema import profiler as pr
from gearshift.bus_schema import subjects as s

REQUEST = "request"  # request-reply (nats micro endpoint)
PUBLISH = "publish"  # core NATS, fire and forget
STREAM = "jetstream"  # published into a JetStream stream, read through consumers
KV = "kv"  # a key-value bucket entry


@dataclass(frozen=True)
class Route:
    subject: str
    kind: str
    request: Any = None  # REQUEST: request type (None: empty body); else the message type
    reply: Any = None  # REQUEST only
    senders: tuple[str, ...] = ()  # roles that may publish / call (besides admin)
    receivers: tuple[str, ...] = ()  # roles that subscribe / serve / read (besides admin)
    stream: str = ""
    doc: str = ""

    @property
    def message(self) -> Any:
        return self.request


def _req(subject: str, request: Any, reply: Any, callers: tuple[str, ...], server: str, doc: str) -> Route:
    return Route(subject, REQUEST, request, reply, callers, (server,), doc=doc)


_EVENT_WRITERS = ("admission", "optimizer", "profiler", "perfmodel")
_EVENT_READERS = ("optimizer", "profiler", "tools", "dashboard")

ROUTES: tuple[Route, ...] = (
    # admission: the admin's subjects, and each tenant's own (admission trusts the last token)
    _req(s.ADMISSION_SUBMIT, m.SubmitRequest, m.SubmitReply, (), "admission", "submit a job"),
    _req(s.ADMISSION_CANCEL, m.JobRef, m.JobRecord, (), "admission", "cancel a job"),
    _req(s.ADMISSION_GET, m.JobRef, m.JobRecord, (), "admission", "one job (with its live progress)"),
    _req(s.ADMISSION_LIST, m.ListRequest, m.JobList, (), "admission", "jobs, filtered by tenant, state and node; paged (limit, cursor; all: the history store too)"),
    _req(s.ADMISSION_SUBMIT + ".<tenant>", m.SubmitRequest, m.SubmitReply, ("tenant",), "admission",
         "submit as <tenant> (a spec without tenant gets it)"),
    _req(s.ADMISSION_CANCEL + ".<tenant>", m.JobRef, m.JobRecord, ("tenant",), "admission", "cancel own job"),
    _req(s.ADMISSION_GET + ".<tenant>", m.JobRef, m.JobRecord, ("tenant",), "admission", "one own job"),
    _req(s.ADMISSION_LIST + ".<tenant>", m.ListRequest, m.JobList, ("tenant",), "admission", "own jobs"),
    _req(s.ADMISSION_NODES, None, m.NodeList, (), "admission", "the nodes' last reports"),
    _req(s.ADMISSION_USAGE, m.UsageRequest, m.UsageReply, (), "admission",
         "GPU-hours, waits, restarts, switches and steps lost of the jobs that finished in a window (+ live ones)"),
    _req(s.ADMISSION_USAGE + ".<tenant>", m.UsageRequest, m.UsageReply, ("tenant",), "admission", "own usage"),
    _req(s.ADMISSION_QUEUES, None, m.QueueList, (), "admission", "the tenant queues (quota, weight, cohort, usage)"),
    _req(s.ADMISSION_SET_QUEUE, m.QueueSpec, m.QueueList, (), "admission", "create or change a tenant queue"),
    # optimizer
    _req(s.OPTIMIZER_ROUND, None, m.RoundReply, (), "optimizer", "run a scheduling round now"),
    _req(s.OPTIMIZER_EXPLAIN, None, m.ExplainReply, (), "optimizer", "why each job waits or runs where it does"),
    _req(s.OPTIMIZER_RECONFIGURE, m.ReconfigureRequest, m.ReconfigureReply, (), "optimizer",
         "pin a job's plan (and placement), or unpin it with plan null"),
    _req(s.OPTIMIZER_NODE, ops.NodeModeRequest, ops.NodeModeReply, (), "optimizer",
         "cordon, drain or uncordon a node; without mode: read the modes"),
    Route(s.OPTIMIZER_KICK, PUBLISH, None, senders=("admission", "optimizer", "profiler"), receivers=("optimizer",),
          doc="wake the optimizer for a round (empty body)"),
    # perfmodel and profiler
    _req(pm.PERFMODEL_FIT, pm.FitRequest, pm.FitReply, ("profiler", "optimizer"), "perfmodel",
         "fit a model's parameters from profiling samples; stored in gs_models"),
    _req(pm.PERFMODEL_PREDICT, pm.PredictRequest, pm.PredictReply, ("profiler", "optimizer"), "perfmodel",
         "throughput of plans on offers"),
    _req(pm.PERFMODEL_CURVE, pm.CurveRequest, pm.CurveReply, ("profiler", "optimizer"), "perfmodel",
         "a job's sensitivity curve"),
    _req(pr.PROFILER_PROFILE, pr.ProfileRequest, pr.ProfileReply, ("optimizer",), "profiler",
         "profile a model now (<= 7 plans) and fit it"),
    _req(pr.PROFILER_STATUS, None, pr.ProfilerStatus, ("optimizer",), "profiler", "what the profiler is doing"),
    # agents: commands to one node
    _req(s.agent_pattern("stop"), m.StopCommand, m.AgentReply, ("optimizer", "profiler"), "agent",
         "stop a job's ranks on the node (checkpoint first)"),
    _req(s.agent_pattern("checkpoint"), m.CheckpointCommand, m.AgentReply, ("optimizer", "profiler"), "agent",
         "checkpoint a running job and go on (SIGUSR1)"),
    _req(s.agent_pattern("profile"), m.ProfileCommand, m.ProfileResult, ("optimizer", "profiler"), "agent",
         "one short profiling run of a plan"),
    _req(s.agent_pattern("logs"), ops.LogsRequest, ops.LogsReply, (), "agent", "the tail of a job's rank logs"),
    # what agents publish
    Route("gs.node.<node>.heartbeat", PUBLISH, m.NodeReport, senders=("agent",),
          doc="node heartbeat (NVML sample); also the KV entry gs_nodes.<node>"),
    Route("gs.job.<job>.progress", STREAM, m.JobProgress, senders=("agent",),
          receivers=("admission", "optimizer", "tools", "dashboard"), stream=s.PROGRESS_STREAM,
          doc="live steps and speed of a running job, a core publish (no ack) kept in GS_PROGRESS (the last line "
              "of each job): the optimizer reads it in bulk for the policy's view and the learning oracle, the "
              "admission by job for get and list; tools and the dashboard subscribe"),
    Route("gs.report.<node>.<job>", STREAM, m.RunReport, senders=("agent",), receivers=("optimizer",),
          stream=s.REPORTS_STREAM, doc="a rank started, stepped (first step of a generation) or exited"),
    # events
    Route("gs.evt.job.<job>.<kind>", STREAM, "<job event by kind>", senders=_EVENT_WRITERS, receivers=_EVENT_READERS,
          stream=s.EVENTS_STREAM, doc="job events; Nats-Msg-Id <job>:<seq>, per job gapless"),
    Route("gs.evt.node.<node>.<kind>", STREAM, "<node event by kind>", senders=("optimizer",),
          receivers=_EVENT_READERS, stream=s.EVENTS_STREAM, doc="node joined / lost"),
    Route(s.usage_subject("<tenant>"), STREAM, m.UsageBatch, senders=("optimizer",), receivers=("admission",),
          stream=s.USAGE_STREAM, doc="finished jobs' accounts, written as they move to the history store"),
    Route("gs.evt.round.<kind>", STREAM, m.RoundCompleted, senders=("optimizer",), receivers=_EVENT_READERS,
          stream=s.EVENTS_STREAM, doc="a scheduling round that changed something"),
    Route(f"{s.EVENTS_FENCE_PREFIX}.<service>", STREAM, "<holder id>", senders=("optimizer",), stream=s.EVENTS_STREAM,
          doc="a leader's epoch mark: its events expect it as the last message here (services.fencing)"),
    # state (KV buckets; permissions on these are the buckets', see services.auth)
    Route(f"$KV.{s.JOBS_BUCKET}.<job>", KV, m.JobRecord, senders=("admission", "optimizer", "profiler"),
          receivers=("dashboard",), doc="the authoritative job record"),
    Route(f"$KV.{s.ALLOC_BUCKET}.<job>", KV, m.Allocation, senders=("optimizer",),
          doc="a job's allocation (plus per-node copies <node>.<job> agents read)"),
    Route(f"$KV.{s.NODES_BUCKET}.<node>", KV, m.NodeReport, senders=("agent",),
          receivers=("dashboard",), doc="a node's last report"),
    Route(f"$KV.{s.NODE_MODES_BUCKET}.<node>", KV, ops.NodeModeEntry, senders=("optimizer",),
          doc="cordoned / draining nodes (absent: active)"),
    Route(f"$KV.{s.QUEUES_BUCKET}.<tenant>", KV, m.QueueSpec, senders=("admission", "optimizer"),
          doc="a tenant's queue (set in the cluster config or by gs.admission.setqueue)"),
    Route(f"$KV.{s.HISTORY_BUCKET}.<job>", KV, m.JobRecord, senders=("optimizer",),
          doc="a finished job's last record, moved out of gs_jobs (kept HISTORY_RETENTION_S)"),
)

STREAM_SUBJECTS = {s.EVENTS_STREAM: s.EVENTS_SUBJECTS, s.REPORTS_STREAM: s.REPORTS_SUBJECTS,
                   s.USAGE_STREAM: s.USAGE_SUBJECTS, s.PROGRESS_STREAM: s.PROGRESS_SUBJECTS}
ROLES = ("admin", "tools", "dashboard", "tenant", "agent", "admission", "optimizer", "perfmodel", "profiler")

_VAR = re.compile(r"<([a-z]+)>")


def _name(tp: Any) -> str:
    if tp is None:
        return ""
    return tp if isinstance(tp, str) else tp.__name__


@cache
def _matcher(pattern: str) -> re.Pattern:
    parts = [("[^.]+" if _VAR.fullmatch(t) else re.escape(t)) for t in pattern.split(".")]
    return re.compile(r"\.".join(parts) + r"\Z")


def route_for(subject: str, kind: str | None = None) -> Route | None:
    """The route a concrete subject (or a pattern spelled as in the table) belongs to."""
    for r in ROUTES:
        if (kind is None or r.kind == kind) and (r.subject == subject or _matcher(r.subject).match(subject)):
            return r
    return None


def reply_type(subject: str) -> Any:
    r = route_for(subject, REQUEST)
    return None if r is None else r.reply


def matches_any(subject: str) -> bool:
    """Does a subject (or a NATS wildcard pattern such as ``gs.evt.job.*.submitted``
    or ``gs.evt.>``) stay within the table?"""
    toks = subject.split(".")
    for r in ROUTES:
        rt = r.subject.split(".")
        if toks[-1] == ">" and len(toks) - 1 <= len(rt):
            head = toks[:-1]
        elif len(toks) == len(rt):
            head = toks
        else:
            continue
        # a variable token in the table matches anything; one in the code (a
        # builder's parameter, e.g. agent_command's verb) matches any table token
        if all(a == "*" or a == b or _VAR.fullmatch(a) or _VAR.fullmatch(b) for a, b in zip(head, rt)):
            return True
    return False


def _concrete(pattern: str, node: str | None, tenant: str | None, own: bool) -> str:
    def sub(mt: re.Match) -> str:
        var = mt.group(1)
        if own and var == "node" and node:
            return node
        if own and var == "tenant" and tenant:
            return tenant
        return "*"

    return _VAR.sub(sub, pattern)


def grants(role: str, node: str | None = None, tenant: str | None = None) -> tuple[list[str], list[str]]:
    """(publish, subscribe) subject rights on the bus subjects for one identity.
    KV and JetStream API rights are the buckets' and streams' (services.auth)."""
    own = role in ("agent", "tenant")
    pub: list[str] = []
    sub: list[str] = []
    for r in ROUTES:
        if r.kind == KV:
            continue
        subject = _concrete(r.subject, node, tenant, own)
        if role in r.senders and subject not in pub:
            pub.append(subject)
        # a stream's reader reads all of it (``gs.evt.>``), through consumers
        # or live with a core subscription
        read = STREAM_SUBJECTS[r.stream] if r.kind == STREAM else subject
        if role in r.receivers and read not in sub:
            sub.append(read)
    return pub, sub


def watched_buckets(role: str) -> list[str]:
    """The KV buckets a read-only role watches (the KV routes it receives)."""
    return [r.subject.split(".")[1] for r in ROUTES if r.kind == KV and role in r.receivers]


def read_streams(role: str) -> list[str]:
    """The JetStream streams a role reads through consumers (the stream routes it receives)."""
    out: list[str] = []
    for r in ROUTES:
        if r.kind == STREAM and role in r.receivers and r.stream not in out:
            out.append(r.stream)
    return out


def subject_map() -> dict[str, dict[str, Any]]:
    """The ``subjects`` section of ``gearshift schema``."""
    out: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        entry: dict[str, Any] = {"kind": r.kind, "doc": r.doc}
        if r.kind == REQUEST:
            entry.update(request=_name(r.request), reply=_name(r.reply), callers=["admin", *r.senders],
                         served_by=list(r.receivers))
        else:
            entry.update(message=_name(r.request), publishers=["admin", *r.senders] if r.kind != KV else list(r.senders))
            if r.kind != KV:
                entry["readers"] = ["admin", *r.receivers]
            elif r.receivers:
                entry["watched_by"] = list(r.receivers)
            if r.stream:
                entry["stream"] = r.stream
        out[r.subject] = entry
    out["error replies"] = {"kind": "headers", "headers": ["Nats-Service-Error-Code", "Nats-Service-Error"],
                            "message": "ErrorReply", "doc": "any request endpoint's refusal"}
    return out


def message_types() -> list[Any]:
    """Every Struct the table names (for the JSON Schema components)."""
    out: list[Any] = []
    for r in ROUTES:
        for tp in (r.request, r.reply):
            if tp is not None and not isinstance(tp, str) and tp not in out:
                out.append(tp)
    return out
