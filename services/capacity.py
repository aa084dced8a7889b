"""Capacity and GPU assignment, pure: which GPUs are held, what the policy
may hand out, which GPU indices a decision gets, and operator-pinned plans.
No I/O; the optimizer's round calls these on its materialised views."""

from __future__ import annotations

from collections.abc import Container, Iterable
from functools import lru_cache
from types import SimpleNamespace

from gearshift.bus_schema.gputypes import node_gpu_type
from gearshift.bus_schema.topology import parse_path
from gearshift.bus_schema.messages import ACTIVE_STATES, JobRecord, JobState, NodePlacement, NodeReport
from gearshift.policies import Decision, NodeState, Placement
from gearshift.policies.api import JobDecision, accepts
from gearshift.policies.decision import Held

ACTIVE = ACTIVE_STATES


def held_gpus(records: Iterable[JobRecord], nodes: Iterable[NodeReport], *,
              for_policy: bool = False) -> dict[str, set[int]]:
    """GPU indices that are not free although no decision holds them: what
    cancelling and draining jobs hold until their processes exited, the GPUs
    agents profile on, and unhealthy GPUs. ``for_policy``: what the policy
    counts as taken, which leaves out a preempted job's draining GPUs -- they
    are on their way to whoever preempted it, and a job written onto them waits
    until they are free (``assign`` reads the full set); counting them taken
    made every round of a long checkpoint grace pick another victim for the
    same job."""
    held: dict[str, set[int]] = {}
    for rec in records:
        if for_policy and rec.state == JobState.PENDING:
            continue
        if rec.state == JobState.CANCELLING:
            for p in rec.placement:
                held.setdefault(p.node, set()).update(p.gpus)
        # A switching job's old GPUs stay held until its old ranks exit, except
        # those its new placement reuses: the policy counts those as the job's
        # holding already, and counting them twice over-allocates the node.
        own = {(p.node, g) for p in rec.placement for g in p.gpus} if rec.state in ACTIVE else set()
        for p in rec.draining:
            held.setdefault(p.node, set()).update(g for g in p.gpus if (p.node, g) not in own)
    for n in nodes:
        if n.reserved:
            held.setdefault(n.node, set()).update(n.reserved)
        sick = [g.index for g in n.gpus if not g.healthy]  # lost, XID, stale...: no work
        if sick:
            held.setdefault(n.node, set()).update(sick)
    return held


def node_states(nodes: Iterable[NodeReport], held: dict[str, set[int]]) -> list[NodeState]:
    out = []
    for n in nodes:
        gpus = len(n.gpus) - len(held.get(n.node, ()))
        out.append(NodeState(name=n.node, gpus_total=gpus, gpus_free=gpus, cpus_total=n.cpus, cpus_free=n.cpus,
                             gpu_type=n.gpu_type or type_of_names(tuple(g.name for g in n.gpus)),
                             topology=topology_of(n.topology) if n.topology else ()))
    return out


@lru_cache(maxsize=4096)
def topology_of(text: str) -> tuple:
    """A node's topology path (``bus_schema.topology``); one that does not parse counts
    as none (the agent refuses to start with one, so only a foreign writer sends it)."""
    try:
        return parse_path(text)
    except ValueError:
        return ()


@lru_cache(maxsize=256)
def type_of_names(names: tuple[str, ...]) -> str:
    """``node_gpu_type`` of GPUs with these names (a report without ``gpu_type``):
    every node every round, the same few answers."""
    return node_gpu_type([SimpleNamespace(name=n) for n in names])


def in_use(records: Iterable[JobRecord], held: dict[str, set[int]]) -> dict[str, set[int]]:
    """GPU indices in use: held, and every active job's current placement (a
    job that is switched or preempted now drains first, so nobody else may
    take its GPUs this round)."""
    used: dict[str, set[int]] = {k: set(v) for k, v in held.items()}
    for rec in records:
        if rec.state in ACTIVE:
            for p in rec.placement:
                used.setdefault(p.node, set()).update(p.gpus)
    return used


def placement_of(rec: JobRecord) -> tuple[Placement, ...]:
    """A record's placement as policies see it: GPU counts, not indices."""
    return tuple(Placement(p.node, len(p.gpus), p.cpus) for p in rec.placement)


def holding(records: Iterable[JobRecord]) -> dict[str, Held]:
    """What active jobs hold, as ``policies.decision.diff`` reads it: a decision
    keeps a job whose plan and shape it repeats."""
    return {rec.job_id: Held(rec.plan, placement_of(rec)) for rec in records if rec.state in ACTIVE}


def assign(rec: JobRecord, d: JobDecision, used: dict[str, set[int]], gpu_count: dict[str, int]) -> list[NodePlacement] | None:
    """GPU indices for decision ``d`` of ``rec``, or None if the GPUs the
    policy counted are still held. Marks what it takes as used."""
    own = {p.node: set(p.gpus) for p in rec.placement} if rec.state in ACTIVE else {}
    placement: list[NodePlacement] = []
    for p in d.placement:
        # a switching job may reuse its own GPUs: its ranks stop before the new ones start
        taken = used.get(p.node, set()) - own.get(p.node, set())
        taken |= {g for q in placement if q.node == p.node for g in q.gpus}
        free = [i for i in range(gpu_count[p.node]) if i not in taken][: p.gpus]
        if len(free) < p.gpus:
            return None
        placement.append(NodePlacement(node=p.node, gpus=free, cpus=p.cpus))
    for p in placement:
        used.setdefault(p.node, set()).update(p.gpus)
    return placement


def apply_pins(decision: Decision, records: dict[str, JobRecord], nodes: list[NodeState], eligible: Container[str],
               candidates: Iterable[str] | None = None) -> None:
    """Operator-pinned plans replace the policy's choice for their jobs,
    where the GPUs the other jobs leave allow it. ``candidates``: the jobs that
    may have a pin (None: every record is looked at)."""
    recs = records.values() if candidates is None else (records[j] for j in candidates if j in records)
    pinned = [r for r in recs if r.pinned is not None and r.job_id in eligible]
    if not pinned:
        return
    decision.changes = None  # (it edits the allocations)
    policy_choice = {rec.job_id: decision.allocations.pop(rec.job_id, None) for rec in pinned}
    kind = {n.name: n.gpu_type for n in nodes}
    for rec in sorted(pinned, key=lambda r: r.submitted_at):
        pin = rec.pinned
        assert pin is not None
        free = {n.name: n.gpus_total for n in nodes}
        for d in decision.allocations.values():
            for p in d.placement:
                free[p.node] = free.get(p.node, 0) - p.gpus
        shares = [(s.node, s.gpus) for s in pin.placement]
        current = [(p.node, len(p.gpus)) for p in rec.placement]
        if (not shares and rec.state in ACTIVE and rec.plan == pin.plan
                and sum(g for _, g in current) == pin.plan.gpus):
            shares = current  # already runs the pinned plan: stay where it is
        if not shares:
            shares = _first_fit(pin.plan.gpus, free, kind, rec.spec)
        if not shares or any(free.get(n, -1) < g for n, g in shares) or not _one_accepted_type(shares, kind, rec.spec):
            if policy_choice[rec.job_id] is not None:  # keep what the policy chose meanwhile
                decision.allocations[rec.job_id] = policy_choice[rec.job_id]
            else:
                decision.waiting[rec.job_id] = f"pinned plan {pin.plan.label()} waits for {pin.plan.gpus} GPUs"
            continue
        decision.waiting.pop(rec.job_id, None)
        cur = {p.node: p.cpus for p in rec.placement}
        decision.allocations[rec.job_id] = JobDecision(
            placement=tuple(Placement(n, g, cur.get(n, 0)) for n, g in shares), plan=pin.plan,
            reason=f"pinned by operator{': ' + pin.reason if pin.reason else ''}",
        )


def _first_fit(need: int, free: dict[str, int], kind: dict[str, str], spec) -> list[tuple[str, int]]:
    """A pinned plan's GPUs: one node if possible, else fill nodes in name order, on
    nodes of one GPU type the job accepts (``policies.decision``'s rule), types tried
    in the order of their first node; [] if none holds them."""
    names = sorted(free)
    for t in dict.fromkeys(kind.get(n, "") for n in names):
        if not accepts(spec, t):
            continue
        group = [n for n in names if kind.get(n, "") == t]
        one = next((n for n in group if free[n] >= need), None)
        if one is not None:
            return [(one, need)]
        shares, left = [], need
        for n in group:
            take = min(left, max(0, free[n]))
            if take:
                shares.append((n, take))
                left -= take
        if not left:
            return shares
    return []


def _one_accepted_type(shares: list[tuple[str, int]], kind: dict[str, str], spec) -> bool:
    types = {kind.get(n, "") for n, _ in shares}
    return len(types) == 1 and accepts(spec, next(iter(types)))
