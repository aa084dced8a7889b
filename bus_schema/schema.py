"""JSON Schema of every bus message, for outside tools (``gearshift schema``)."""

from __future__ import annotations

import msgspec

from . import messages as m
from . import perfmodel as pm
from . import subjects as s

BUS_VERSION = 1

MESSAGE_TYPES = [
    m.JobSpec, m.SubmitRequest, m.SubmitReply, m.JobRef, m.ListRequest, m.JobRecord, m.JobList,
    m.Plan, m.ModelSpec, m.Allocation, m.NodePlacement, m.NodeReport, m.NodeList, m.GpuReport,
    m.RunReport, m.JobProgress, m.StopCommand, m.AgentReply, m.ErrorReply, m.RoundReply,
    m.ExplainReply, m.QueueSpec, m.QueueList, *m.EVENT_TYPES, *pm.PERFMODEL_TYPES,
]

SUBJECT_MAP = {
    s.ADMISSION_SUBMIT: {"kind": "request", "request": "SubmitRequest", "reply": "SubmitReply"},
    s.ADMISSION_CANCEL: {"kind": "request", "request": "JobRef", "reply": "JobRecord"},
    s.ADMISSION_GET: {"kind": "request", "request": "JobRef", "reply": "JobRecord"},
    s.ADMISSION_LIST: {"kind": "request", "request": "ListRequest", "reply": "JobList"},
    s.ADMISSION_NODES: {"kind": "request", "request": "", "reply": "NodeList"},
    s.ADMISSION_QUEUES: {"kind": "request", "request": "", "reply": "QueueList"},
    s.ADMISSION_SET_QUEUE: {"kind": "request", "request": "QueueSpec", "reply": "QueueList"},
    s.OPTIMIZER_ROUND: {"kind": "request", "request": "", "reply": "RoundReply"},
    s.OPTIMIZER_EXPLAIN: {"kind": "request", "request": "", "reply": "ExplainReply"},
    pm.PERFMODEL_FIT: {"kind": "request", "request": "FitRequest", "reply": "FitReply"},
    pm.PERFMODEL_PREDICT: {"kind": "request", "request": "PredictRequest", "reply": "PredictReply"},
    pm.PERFMODEL_CURVE: {"kind": "request", "request": "CurveRequest", "reply": "CurveReply"},
    "gs.agent.<node>.stop": {"kind": "request", "request": "StopCommand", "reply": "AgentReply"},
    "gs.node.<node>.heartbeat": {"kind": "publish", "message": "NodeReport"},
    "gs.job.<job>.progress": {"kind": "publish", "message": "JobProgress"},
    "gs.report.<node>.<job>": {"kind": "jetstream", "stream": s.REPORTS_STREAM, "message": "RunReport"},
    "gs.evt.job.<job>.<kind>": {"kind": "jetstream", "stream": s.EVENTS_STREAM, "message": "<job event by kind>"},
    "gs.evt.node.<node>.<kind>": {"kind": "jetstream", "stream": s.EVENTS_STREAM, "message": "<node event by kind>"},
    "gs.evt.round.<kind>": {"kind": "jetstream", "stream": s.EVENTS_STREAM, "message": "RoundCompleted"},
    f"$KV.{s.JOBS_BUCKET}.<job>": {"kind": "kv", "message": "JobRecord"},
    f"$KV.{s.ALLOC_BUCKET}.<job>": {"kind": "kv", "message": "Allocation"},
    f"$KV.{s.NODES_BUCKET}.<node>": {"kind": "kv", "message": "NodeReport"},
    f"$KV.{s.QUEUES_BUCKET}.<tenant>": {"kind": "kv", "message": "QueueSpec"},
    "error replies": {"kind": "headers", "headers": ["Nats-Service-Error-Code", "Nats-Service-Error"],
                      "message": "ErrorReply"},
}


def bus_schema() -> dict:
    (_, components) = msgspec.json.schema_components(MESSAGE_TYPES, ref_template="#/components/schemas/{name}")
    return {
        "bus_version": BUS_VERSION,
        "subjects": SUBJECT_MAP,
        "events": {m.event_kind(t): t.__name__ for t in m.EVENT_TYPES},
        "components": {"schemas": dict(sorted(components.items()))},
    }
