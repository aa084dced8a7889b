"""Operator messages: node cordon/drain (``gs.optimizer.node``) and rank logs
(``gs.agent.<node>.logs``)."""

from __future__ import annotations

import enum
from typing import Annotated

from msgspec import Meta, Struct

from gearshift.bus_schema.messages import JobId, Label, NodeName

MAX_LOG_BYTES = 64 * 1024  # a logs reply stays well under the 256 KiB message limit


class NodeMode(str, enum.Enum):
    """What the optimizer may do with a node.

    ``active``: anything. ``cordoned``: its jobs keep running, no new job
    lands there. ``draining``: cordoned, and its jobs are moved away (back to
    the queue, resuming from their checkpoints elsewhere); once none is left
    it reads ``drained``."""

    ACTIVE = "active"
    CORDONED = "cordoned"
    DRAINING = "draining"


class NodeModeRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``gs.optimizer.node``: set a node's mode; ``mode`` omitted: only read them."""

    node: NodeName | None = None
    mode: NodeMode | None = None
    reason: Label = ""


class NodeModeEntry(Struct, kw_only=True, frozen=True):
    node: str
    mode: NodeMode
    reason: str = ""
    since: float = 0.0
    jobs: list[str] = []  # active jobs still placed on it


class NodeModeReply(Struct, kw_only=True, frozen=True):
    nodes: list[NodeModeEntry]


class LogsRequest(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``gs.agent.<node>.logs``: the tail of a job's rank logs on that node
    (its latest generation there, or ``generation``)."""

    job_id: JobId
    rank: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None
    generation: Annotated[int, Meta(ge=1)] | None = None
    tail_bytes: Annotated[int, Meta(ge=1, le=MAX_LOG_BYTES)] = 16 * 1024


class RankLog(Struct, kw_only=True, frozen=True):
    rank: int
    generation: int
    text: str
    truncated: bool = False  # only the tail is here
    size: int = 0  # the whole file's bytes


class LogsReply(Struct, kw_only=True, frozen=True):
    node: str
    logs: list[RankLog]


OPS_TYPES = [NodeModeRequest, NodeModeEntry, NodeModeReply, LogsRequest, RankLog, LogsReply]
