"""Subject, stream and bucket names: the one place that spells them."""

from __future__ import annotations

import re

# JetStream
EVENTS_STREAM = "GS_EVENTS"
EVENTS_SUBJECTS = "gs.evt.>"
EVENTS_FENCE_PREFIX = "gs.fence"  # leaders' epoch marks, also in GS_EVENTS, outside what event readers read
REPORTS_STREAM = "GS_REPORTS"
REPORTS_SUBJECTS = "gs.report.>"
USAGE_STREAM = "GS_USAGE"  # one UsageRow per finished job, by the time it was archived (bus_schema.usage)
USAGE_SUBJECTS = "gs.usage.>"
# each running job's latest progress line (the agents' core publishes, kept: the last
# one per job, in memory, for PROGRESS_KEPT_S): read in bulk by the optimizer, by job
# by the admission, instead of a delivery of every line to every service
PROGRESS_STREAM = "GS_PROGRESS"
PROGRESS_SUBJECTS = "gs.job.*.progress"
PROGRESS_KEPT_S = 3600.0


def usage_subject(tenant: str) -> str:
    return f"gs.usage.{tenant}"

# KV buckets
JOBS_BUCKET = "gs_jobs"
NODES_BUCKET = "gs_nodes"
ALLOC_BUCKET = "gs_alloc"
MODELS_BUCKET = "gs_models"
LEASE_BUCKET = "gs_lease"
HISTORY_BUCKET = "gs_history"  # finished jobs, moved out of gs_jobs, kept for HISTORY_RETENTION_S
HISTORY_RETENTION_S = 7 * 24 * 3600.0
NODE_MODES_BUCKET = "gs_node_modes"
QUEUES_BUCKET = "gs_queues"  # tenant -> QueueSpec

# request-reply services
ADMISSION = "gs.admission"
ADMISSION_SUBMIT = "gs.admission.submit"
ADMISSION_CANCEL = "gs.admission.cancel"
ADMISSION_GET = "gs.admission.get"
ADMISSION_LIST = "gs.admission.list"
ADMISSION_NODES = "gs.admission.nodes"
ADMISSION_USAGE = "gs.admission.usage"
ADMISSION_QUEUES = "gs.admission.queues"  # -> QueueList
ADMISSION_SET_QUEUE = "gs.admission.setqueue"  # QueueSpec -> QueueList (admin only)
OPTIMIZER = "gs.optimizer"
OPTIMIZER_ROUND = "gs.optimizer.round"
OPTIMIZER_EXPLAIN = "gs.optimizer.explain"
OPTIMIZER_RECONFIGURE = "gs.optimizer.reconfigure"
OPTIMIZER_NODE = "gs.optimizer.node"
OPTIMIZER_KICK = "gs.optimizer.kick"
PERFMODEL = "gs.perfmodel"
PROFILER = "gs.profiler"

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def token(value: str) -> str:
    """A value safe to put in one subject token (ids are validated upstream)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{value!r} cannot be a subject token")
    return value


def job_event(job_id: str, kind: str) -> str:
    # kind "job.completed" -> gs.evt.job.<id>.completed
    return f"gs.evt.job.{token(job_id)}.{kind.split('.', 1)[1]}"


def node_event(node: str, kind: str) -> str:
    return f"gs.evt.node.{token(node)}.{kind.split('.', 1)[1]}"


def events_fence(writer: str) -> str:
    """The subject of a leader's epoch mark in GS_EVENTS (``services.fencing``)."""
    return f"{EVENTS_FENCE_PREFIX}.{token(writer)}"


def round_event(kind: str) -> str:
    return f"gs.evt.round.{kind.split('.', 1)[1]}"


def node_heartbeat(node: str) -> str:
    return f"gs.node.{token(node)}.heartbeat"


def job_progress(job_id: str) -> str:
    return f"gs.job.{token(job_id)}.progress"


def run_report(node: str, job_id: str) -> str:
    return f"gs.report.{token(node)}.{token(job_id)}"


def agent_command(node: str, verb: str) -> str:
    return f"gs.agent.{token(node)}.{verb}"


def agent_pattern(verb: str) -> str:
    """``gs.agent.<node>.<verb>`` as the contract table spells it."""
    return f"gs.agent.<node>.{verb}"
