"""JSON Schema of every bus message, for outside tools (``gearshift schema``)."""

from __future__ import annotations

import msgspec

from gearshift.bus_schema import contract
from gearshift.bus_schema import messages as m
from gearshift.bus_schema import perfmodel as pm

BUS_VERSION = 1

MESSAGE_TYPES = [
    m.JobSpec, m.SubmitRequest, m.SubmitReply, m.JobRef, m.ListRequest, m.JobRecord, m.JobList,
    m.Plan, m.ModelSpec, m.Allocation, m.NodePlacement, m.NodeReport, m.NodeList, m.GpuReport,
    m.RunReport, m.JobProgress, m.StopCommand, m.AgentReply, m.ErrorReply, m.RoundReply,
    m.ExplainReply, m.QueueSpec, m.QueueList, *m.EVENT_TYPES, *pm.PERFMODEL_TYPES,
]
# and every type the contract table names (profiler, operator messages)
MESSAGE_TYPES += [t for t in contract.message_types() if t not in MESSAGE_TYPES]

# outside tools read the subjects from here; the one table is bus_schema.contract
SUBJECT_MAP = contract.subject_map()


def bus_schema() -> dict:
    (_, components) = msgspec.json.schema_components(MESSAGE_TYPES, ref_template="#/components/schemas/{name}")
    return {
        "bus_version": BUS_VERSION,
        "subjects": SUBJECT_MAP,
        "events": {m.event_kind(t): t.__name__ for t in m.EVENT_TYPES},
        "components": {"schemas": dict(sorted(components.items()))},
    }
