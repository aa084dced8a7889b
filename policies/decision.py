"""The decision core: what the simulator and the optimizer service both do with a
policy's decision (issue 22).

- ``check_decision`` refuses a decision the cluster cannot hold, as a full desired
  state against node totals (the optimizer, tests, ``SimConfig.full_check``);
  ``NodeCapacity.check`` is the same rules applied incrementally (the simulator):
  only allocations that changed are checked, and capacity is free now + what
  released/changed jobs give back - what changed jobs take.
- ``diff(holding, decision)`` splits a decision into keep / preempt / start /
  reconfigure, with "the same allocation" decided once (``same_allocation``). A
  decision its policy tells as changes (``api.Changes``: the jobs it placed and left
  out, every other running job kept) is split on those jobs alone when the caller
  says the views it handed hold what ``holding`` holds (``diff(..., handed=views)``);
  ``NodeCapacity.check`` then looks at the changed and released jobs alone too.

The rules, one set for both callers: every named job is live; a placement is not
empty, names known nodes, each once, with no negative amounts; its GPUs are the
plan's; it lies on nodes of one GPU type, one the job accepts, and within one group
of the topology level it requires (``JobSpec.topology``); a job is not both
allocated and waiting; no node gives more GPUs or CPUs than it has.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.bus_schema.plan_support import plan_refusal
from gearshift.bus_schema.topology import within
from gearshift.policies.api import (
    AllocationError, Changes, Decision, JobDecision, NodeState, Placement, ShapeMemo, accepts,
)


class Holding(Protocol):
    """What a running job holds: ``JobView``, the simulator's record, ``Held``."""

    @property
    def plan(self) -> Plan | None: ...

    @property
    def placement(self) -> tuple[Placement, ...]: ...


class HasSpec(Protocol):
    """A live job as the check reads it: ``JobView``, the simulator's record."""

    @property
    def spec(self) -> JobSpec: ...


@dataclass(slots=True, frozen=True)
class Held:
    """A holding built from something else (the optimizer's ``JobRecord``)."""

    plan: Plan | None
    placement: tuple[Placement, ...]


def _pkey(p: Placement) -> tuple:
    return (p.node, p.gpus, p.cpus)


def same_allocation(d: JobDecision, held: Holding) -> bool:
    """Does decision ``d`` keep exactly what ``held`` is (same plan, same placement
    in any node order; a node's GPU type is not part of it)?"""
    if not (d.plan is held.plan or d.plan == held.plan):
        return False
    cur = held.placement
    return d.placement is cur or d.placement == cur or sorted(d.placement, key=_pkey) == sorted(cur, key=_pkey)


@dataclass(slots=True, frozen=True)
class Diff:
    """A decision against what jobs hold. ``preempt`` in holding order; ``start``,
    ``reconfigure`` and ``changed`` (both, what to grant) in the decision's order;
    ``keep`` None when the caller did not ask for it (``diff(..., keep=False)``)."""

    keep: frozenset[str] | None
    preempt: tuple[str, ...]
    start: tuple[str, ...]
    reconfigure: tuple[str, ...]
    changed: tuple[str, ...]


def diff(holding: Mapping[str, Holding], decision: Decision, handed: object = None, keep: bool = True) -> Diff:
    """Keep (same allocation), preempt (held, left out), start (not held),
    reconfigure (held, different plan or placement).

    ``handed``: the list of job views the policy was handed, when what they hold is
    ``holding`` (the caller built them from it). A decision that tells its changes
    against that very list (``Decision.changes``) is then split by looking at the jobs
    it names only: the same result, in work proportional to what changed; if its
    counts do not add up (edited since), the whole decision is looked at. ``keep``:
    also name every kept job (``Diff.keep``; a caller that applies the changes alone,
    as the simulator does, need not pay for that set: None)."""
    ch = decision.changes
    if ch is not None and handed is not None and ch.jobs is handed:
        got = _diff_changes(holding, decision.allocations, ch, keep)
        if got is not None:
            return got
    return _diff_all(holding, decision.allocations)


def _diff_all(holding: Mapping[str, Holding], allocs: Mapping[str, JobDecision]) -> Diff:
    """``diff`` looking at every allocation and every holding."""
    keep: list[str] = []
    start: list[str] = []
    reconfigure: list[str] = []
    changed: list[str] = []
    get, kept = holding.get, keep.append
    for jid, d in allocs.items():
        h = get(jid)
        if h is None:
            start.append(jid)
            changed.append(jid)
        elif (d.plan is h.plan and d.placement is h.placement) or same_allocation(d, h):  # the first: kept as is
            kept(jid)
        else:
            reconfigure.append(jid)
            changed.append(jid)
    # in holding's order; the set difference (in C) first, as most rounds preempt nothing
    preempt = tuple(jid for jid in holding if jid not in allocs) if holding.keys() - allocs.keys() else ()
    return Diff(frozenset(keep), preempt, tuple(start), tuple(reconfigure), tuple(changed))


def _diff_changes(holding: Mapping[str, Holding], allocs: Mapping[str, JobDecision], ch: Changes,
                  keep: bool = True) -> Diff | None:
    """``diff`` of a decision told as changes (``Changes``): its placed jobs looked at one by
    one, its left ones preempted, every other holding kept. None when they do not add up
    (a named job not allocated, a left one not held or allocated, or the allocations not
    the holdings less the left plus the started: the decision was edited after its policy)."""
    start: list[str] = []
    reconfigure: list[str] = []
    changed: list[str] = []
    get = holding.get
    for jid in ch.placed:
        d = allocs.get(jid)
        if d is None:
            return None
        h = get(jid)
        if h is None:
            start.append(jid)
            changed.append(jid)
        elif not same_allocation(d, h):
            reconfigure.append(jid)
            changed.append(jid)
    left = ch.left
    if len(allocs) != len(holding) - len(left) + len(start) or any(j in allocs or j not in holding for j in left):
        return None
    if len(left) > 1:  # in holding's order
        gone = set(left)
        preempt = tuple(jid for jid in holding if jid in gone)
    else:
        preempt = tuple(left)
    kept = None
    if keep:
        kept = frozenset(holding.keys() - {*left, *reconfigure} if left or reconfigure else holding.keys())
    return Diff(kept, preempt, tuple(start), tuple(reconfigure), tuple(changed))


class NodeCapacity:
    """Nodes' names, GPU types and capacity as arrays: what checking needs, built
    once by the simulator (its cluster does not change), per check otherwise."""

    __slots__ = ("names", "index", "types", "gpus", "cpus", "paths")

    def __init__(self, names: Sequence[str], types: Sequence[str], gpus: Sequence[int], cpus: Sequence[int],
                 paths: Sequence[tuple] | None = None):
        self.names = list(names)
        self.paths = list(paths) if paths is not None else [()] * len(self.names)  # topology paths
        self.index = {n: i for i, n in enumerate(self.names)}
        self.types = list(types)
        self.gpus = list(gpus)
        self.cpus = list(cpus)

    @classmethod
    def of(cls, nodes: Sequence[NodeState]) -> NodeCapacity:
        return cls([n.name for n in nodes], [n.gpu_type for n in nodes], [n.gpus_total for n in nodes],
                   [n.cpus_total for n in nodes], [n.topology for n in nodes])

    def check(self, decision: Decision, jobs: Mapping[str, HasSpec], free_g: Sequence[int], free_c: Sequence[int],
              holding: Mapping[str, Holding] | None = None, keep: Collection[str] = frozenset(),
              change: Diff | None = None, held_live: bool = False) -> None:
        """Refuse ``decision`` unless the cluster can hold it. ``free_g``/``free_c``:
        free per node now (not changed); ``holding``: what running jobs hold (their
        GPUs count as free unless the job is in ``keep``); jobs in ``keep`` hold the
        same allocation already, checked when it was granted, and are skipped.
        ``change``: ``diff(holding, decision)``, when the caller has it: its kept jobs
        are ``keep``, and only its ``changed`` allocations are looked at one by one
        (the same checks, in the same order; the kept ones only for being known, which
        ``held_live`` vouches for: every job in ``holding`` is one of ``jobs``, so the
        first job not known, in the decision's order, is among the changed ones)."""
        free_g = list(free_g)
        free_c = list(free_c)
        idx = self.index
        allocs = decision.allocations
        if change is not None:
            if not held_live and not allocs.keys() <= jobs.keys():  # a job not known: the full walk finds which first
                keep = change.keep if change.keep is not None else (
                    (holding or {}).keys() - {*change.preempt, *change.reconfigure})
                change = None
        if holding:
            for jid in (*change.preempt, *change.reconfigure) if change is not None else holding:  # = held - kept
                if change is None and jid in keep:
                    continue
                for p in holding[jid].placement:
                    i = idx[p.node]
                    free_g[i] += p.gpus
                    free_c[i] += p.cpus
        waiting = decision.waiting
        for jid in change.changed if change is not None else allocs:
            job = jobs.get(jid)
            if job is None:
                raise AllocationError(f"decision names unknown or finished job {jid!r}")
            if change is None and jid in keep:  # (the changed ones are not kept)
                continue
            if jid in waiting:
                raise AllocationError(f"job {jid}: both allocated and waiting")
            self._take(jid, allocs[jid], job.spec, free_g, free_c)
        if free_g and (min(free_g) < 0 or min(free_c) < 0):  # (in C) then the first node over, by name
            for i, name in enumerate(self.names):
                if free_g[i] < 0:
                    raise AllocationError(f"node {name}: {self.gpus[i] - free_g[i]} GPUs allocated, it has {self.gpus[i]}")
                if free_c[i] < 0:
                    raise AllocationError(f"node {name}: {self.cpus[i] - free_c[i]} CPUs allocated, it has {self.cpus[i]}")

    def _take(self, jid: str, d: JobDecision, spec: JobSpec, free_g: list[int], free_c: list[int]) -> None:
        """Check one allocation on its own and take what it uses from ``free_g``/``free_c``."""
        if not d.placement:
            raise AllocationError(f"job {jid}: empty placement")
        idx = self.index
        gpus = 0
        types = set()
        seen = set()
        for p in d.placement:
            i = idx.get(p.node)
            if i is None:
                raise AllocationError(f"job {jid}: unknown node {p.node!r}")
            if i in seen:
                raise AllocationError(f"job {jid}: a node appears twice in its placement")
            seen.add(i)
            if p.gpus < 0 or p.cpus < 0:
                raise AllocationError(f"job {jid}: negative amount on {p.node}")
            types.add(self.types[i])
            free_g[i] -= p.gpus
            free_c[i] -= p.cpus
            gpus += p.gpus
        if gpus != d.plan.gpus:
            raise AllocationError(f"job {jid}: plan {d.plan.label()} needs {d.plan.gpus} GPUs, placement has {gpus}")
        if len(types) > 1:
            raise AllocationError(f"job {jid}: placement spans GPU types {sorted(types)} (a job runs on one type)")
        kind = next(iter(types))
        if not accepts(spec, kind):
            raise AllocationError(f"job {jid}: placed on {kind!r} GPUs; it accepts {', '.join(spec.gpu_types)}")
        topo = getattr(spec, "topology", None)
        if topo is not None and topo.required and not within([self.paths[i] for i in seen], topo.required):
            raise AllocationError(f"job {jid}: placement spans more than one {topo.required}; its spec requires one")


def check_decision(decision: Decision, nodes: list[NodeState], jobs: Mapping[str, HasSpec]) -> None:
    """Refuse a decision that over-allocates any node or breaks a rule (see the module).

    Capacity is checked against totals: the decision is a full desired state,
    so what running jobs hold now does not count against it.
    """
    cap = _CAPACITY.get(nodes, NodeCapacity.of)  # once per shape of the nodes (api.NodeStates)
    cap.check(decision, jobs, cap.gpus, cap.cpus)


_CAPACITY = ShapeMemo()


def refuse_unsupported(decision: Decision, jobs: Mapping[str, HasSpec]) -> list[str]:
    """Take out of ``decision`` every allocation whose plan the job's script does
    not run (``JobSpec.plan_support``: policies that keep the user's plan scale
    its DP degree past a declared bound); the job waits, the field named. The
    jobs it took out."""
    out = []
    for job_id, d in list(decision.allocations.items()):
        job = jobs.get(job_id)
        got = plan_refusal(job.spec.plan_support, d.plan) if job is not None else None
        if got is not None:
            del decision.allocations[job_id]
            decision.changes = None
            decision.waiting[job_id] = f"plan {d.plan.label()} not supported by the job: {got[1]}"
            out.append(job_id)
    return out
