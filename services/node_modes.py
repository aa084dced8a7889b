"""Cordon, drain and uncordon nodes (``gs.optimizer.node``), for the optimizer.

A node's mode lives in KV ``gs_node_modes`` (no key: active), written only by
the optimizer's leader, so it survives a restart and a failover. The optimizer
keeps the bucket in a view (``ModesView``): a round reads it with no request,
and the leader syncs it after its own write. Each round the optimizer
- holds every GPU of a cordoned or draining node that no job of it uses, so
  the policy places nothing new there (its running jobs keep theirs);
- moves the jobs of a draining node away: back to the queue with their old
  ranks checkpointing first (the plan-switch drain), so they resume elsewhere
  from the checkpoint. Once none is left the node reads ``drained``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.server import RequestError
from gearshift.bus.views import KvView
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import ACTIVE_STATES, JobRecord, NodeReport
from gearshift.bus_schema.ops import NodeMode, NodeModeEntry, NodeModeReply, NodeModeRequest


class ModesView(KvView[NodeModeEntry]):
    """``gs_node_modes`` kept current from a watch (``bus.views.KvView``)."""

    def __init__(self, js: Any):
        super().__init__(js, subj.NODE_MODES_BUCKET, lambda b: codec.decode(b, NodeModeEntry))

    def modes(self) -> dict[str, NodeModeEntry]:
        """Nodes that are not active (a small bucket: one key per such node)."""
        return {k: e[0] for k, e in self.entries.items()}


def jobs_on(records: Iterable[JobRecord], node: str) -> list[str]:
    """Active jobs placed on ``node``, and those whose old ranks still drain there."""
    return sorted(r.job_id for r in records
                  if (r.state in ACTIVE_STATES and any(p.node == node for p in r.placement))
                  or any(p.node == node for p in r.draining))


def cordon_held(nodes: list[NodeReport], records: Iterable[JobRecord],
                modes: dict[str, NodeModeEntry]) -> dict[str, set[int]]:
    """GPU indices no new job may take: every GPU of a non-active node that
    none of its active jobs uses."""
    if not modes:
        return {}
    in_use: dict[str, set[int]] = {}
    for r in records:
        if r.state in ACTIVE_STATES:
            for p in r.placement:
                in_use.setdefault(p.node, set()).update(p.gpus)
    return {n.node: {g.index for g in n.gpus} - in_use.get(n.node, set()) for n in nodes if n.node in modes}


def to_move(records: Iterable[JobRecord], modes: dict[str, NodeModeEntry]) -> list[tuple[JobRecord, str]]:
    """Active jobs on a draining node, with the reason they move."""
    draining = {n: e for n, e in modes.items() if e.mode == NodeMode.DRAINING}
    out: list[tuple[JobRecord, str]] = []
    if not draining:  # the usual case: no pass over the jobs
        return out
    for r in records:
        if r.state not in ACTIVE_STATES:
            continue
        hit = sorted({p.node for p in r.placement} & draining.keys())
        if hit:
            why = f"node {hit[0]} is draining" + (f": {draining[hit[0]].reason}" if draining[hit[0]].reason else "")
            out.append((r, why + "; resumes elsewhere from its checkpoint"))
    return out


async def set_mode(kv: Any, req: NodeModeRequest, known_nodes: set[str], clock: Clock = SYSTEM) -> None:
    """Apply one request (validated: the node must have reported); ``since`` is ``clock``'s."""
    if req.mode is None:
        return
    if req.node is None:
        raise RequestError("400", "a mode needs a node", "node")
    if req.node not in known_nodes:
        raise RequestError("404", f"no node {req.node} has reported", "node")
    if req.mode == NodeMode.ACTIVE:
        try:
            await kv.delete(req.node)
        except Exception:  # not cordoned: nothing to undo
            pass
        return
    await kv.put(req.node, codec.encode(NodeModeEntry(node=req.node, mode=req.mode, reason=req.reason, since=clock.now())))


def reply(modes: dict[str, NodeModeEntry], records: Iterable[JobRecord], node: str | None = None) -> NodeModeReply:
    recs = list(records)
    entries = [NodeModeEntry(node=e.node, mode=e.mode, reason=e.reason, since=e.since, jobs=jobs_on(recs, e.node))
               for n, e in sorted(modes.items()) if node is None or n == node]
    return NodeModeReply(nodes=entries)
