"""Topology-aware gangs (issue 23 item 1), applied after every policy's round.

``arrange(decision, nodes, jobs)`` is the one topology step the optimizer
(``services.policy_bridge``) and the simulator both run on a policy's decision,
so no policy needs to know about topology:

- a job whose spec *requires* a level (``JobSpec.topology.required``) gets a
  placement inside one group of that level; every generation of it (a start, a
  resize, a plan switch) is moved there, the finest level that has room first;
  where none has room it keeps what it holds (if that still fits and lies in one
  group), else it waits and ``Decision.waiting`` says it waits for topology;
- a job that *prefers* a level (``preferred``; or every job, with ``prefer``:
  the simulator's topology-aware mode) is moved into the
  finest level that has room, from the preferred one up, when the policy placed
  it wider; if none has room it keeps the policy's placement;
- an allocation the decision keeps unchanged is not moved (it was arranged when
  granted), unless it breaks its required level.

The policy's shape is kept (GPUs and CPUs per node, the plan): only the nodes
change, to nodes of the same GPU type, preferring the job's current nodes, then
the nodes the policy chose, then the tightest fit. Moves use only capacity no
other allocation of the decision uses, so the result holds whenever the
decision did. Without topology on any node and no job asking for it, the
decision is returned untouched (every policy's decisions stay as they were).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gearshift.bus_schema.topology import CLUSTER, NODE, Path, group_key, levels_of, span_level, within
from gearshift.policies.api import Decision, JobDecision, NodeState, Placement
from gearshift.policies.decision import same_allocation

WAITS = "waits for topology"


def wants(spec: Any, default: str | None = None) -> tuple[str | None, str | None]:
    """(required, preferred) level names of a job's spec; ``default``: what a job
    without a preference prefers (``NODE``: the finest level)."""
    topo = getattr(spec, "topology", None)
    req = topo.required if topo is not None else None
    pref = topo.preferred if topo is not None else None
    return req, pref if pref is not None else default


def span(placement: Sequence[Placement], paths: Mapping[str, Path]) -> str:
    """The finest level a placement's nodes share (``bus_schema.topology.span_level``)."""
    return span_level([paths.get(p.node, ()) for p in placement])


class _Free:
    """Free GPUs/CPUs per node while ``arrange`` moves gangs."""

    def __init__(self, nodes: Sequence[NodeState]):
        self.g = {n.name: n.gpus_total for n in nodes}
        self.c = {n.name: n.cpus_total for n in nodes}

    def add(self, placement: Sequence[Placement], sign: int) -> None:
        for p in placement:
            if p.node in self.g:
                self.g[p.node] += sign * p.gpus
                self.c[p.node] += sign * p.cpus

    def fits(self, placement: Sequence[Placement]) -> bool:
        return all(self.g.get(p.node, -1) >= p.gpus and self.c.get(p.node, -1) >= p.cpus for p in placement)


class Arranger:
    """One round's topology step; see the module."""

    def __init__(self, nodes: Sequence[NodeState], prefer: str | None = None):
        self.nodes = list(nodes)
        self.order = {n.name: i for i, n in enumerate(self.nodes)}
        self.paths = {n.name: tuple(n.topology) for n in self.nodes if n.topology}
        self.types = {n.name: n.gpu_type for n in self.nodes}
        self.levels = levels_of(self.paths.values())
        self.prefer = prefer

    def arrange(self, decision: Decision, jobs: Mapping[str, Any]) -> list[str]:
        """Move (or hold back) the allocations of ``decision`` in place; the jobs changed."""
        todo: list[tuple[str, str | None, str | None]] = []
        for jid, d in decision.allocations.items():
            job = jobs.get(jid)
            if job is None:
                continue
            req, pref = wants(job.spec, self.prefer)
            if req is None and pref is None:
                continue
            kept = bool(job.placement) and same_allocation(d, job)
            ok = req is None or self._within(d.placement, req)
            if ok and (kept or self._fine_enough(d.placement, pref or req)):
                continue
            todo.append((jid, req, pref))
        if not todo:
            return []
        free = _Free(self.nodes)
        for d in decision.allocations.values():
            free.add(d.placement, -1)
        todo.sort(key=lambda t: -sum(p.gpus for p in decision.allocations[t[0]].placement))
        changed = []
        for jid, req, pref in todo:
            d = decision.allocations[jid]
            job = jobs[jid]
            free.add(d.placement, +1)
            if req is not None and req != NODE and req not in self.levels:
                del decision.allocations[jid]  # no group of it anywhere: it cannot run here
                decision.waiting[jid] = self.unknown(req)
                changed.append(jid)
                continue
            # a placement that meets its requirement is only moved to a finer level than it spans
            stop = span(d.placement, self.paths) if self._within(d.placement, req) else None
            got = self._place(d.placement, req, pref, free, tuple(p.node for p in job.placement), stop)
            if got is None and d.plan.tp == 1 and d.plan.pp == 1 and len(d.placement) > 1:
                # a data-parallel plan runs on any shape: its GPUs packed (an operator's pin
                # fills nodes in name order, which no group may hold as it is)
                got = self._place(self._packed(d.placement), req, pref, free, tuple(p.node for p in job.placement),
                                  stop)
            if got is None and req is None:
                got = d.placement  # a preference only: where the policy put it
            if got is None and job.placement and job.plan is not None and free.fits(job.placement) \
                    and self._within(job.placement, req):
                decision.allocations[jid] = JobDecision(tuple(job.placement), job.plan, f"{d.reason}; kept: {WAITS}")
                free.add(job.placement, -1)
                changed.append(jid)
                continue
            if got is None:
                del decision.allocations[jid]
                shape = "+".join(str(p.gpus) for p in sorted(d.placement, key=lambda p: -p.gpus))
                decision.waiting[jid] = f"{WAITS}: no {req} has room for {d.plan.gpus} GPUs as {shape}"
                changed.append(jid)
                continue
            if got is not d.placement:
                decision.allocations[jid] = JobDecision(got, d.plan, d.reason, d.predicted_throughput,
                                                        d.predicted_gain)
                changed.append(jid)
            free.add(got, -1)
        return changed

    def unknown(self, req: str) -> str:
        """Why a job requiring a level no node reports waits."""
        return f"{WAITS}: topology.required {req!r} is a level no node reports (they report: " \
               f"{', '.join(self.levels)})"

    def _packed(self, placement: Sequence[Placement]) -> tuple[Placement, ...]:
        """``placement``'s GPUs packed onto as few nodes of its type as hold them (full first)."""
        kind = self.types.get(placement[0].node, "")
        per_node = max((n.gpus_total for n in self.nodes if n.gpu_type == kind), default=1)
        gpus = sum(p.gpus for p in placement)
        cpus = sum(p.cpus for p in placement)
        out, left = [], gpus
        while left > 0:
            g = min(per_node, left)
            out.append(Placement(placement[0].node, g, cpus * g // gpus, placement[0].gpu_type))
            left -= g
        return tuple(out)

    # ---- rules
    def _within(self, placement: Sequence[Placement], level: str | None) -> bool:
        if level is None:
            return True
        return within([self.paths.get(p.node, ()) for p in placement], level)

    def _fine_enough(self, placement: Sequence[Placement], level: str) -> bool:
        """Does the placement lie within ``level`` or a finer one already?"""
        got = span(placement, self.paths)
        if got == NODE:
            return True
        if got == CLUSTER or level == NODE:
            return False
        if level not in self.levels or got not in self.levels:
            return False
        return self.levels.index(got) >= self.levels.index(level)

    def _candidates(self, req: str | None, pref: str | None) -> list[str]:
        """Levels to try, finest first: from the preferred one (else the finest) up to
        the required one (else the coarsest)."""
        levels = self.levels
        top = levels.index(req) if req in levels else (len(levels) if req is not None else 0)
        start = len(levels) - 1 if pref in (None, NODE) or pref not in levels else levels.index(pref)
        if req is not None and start < top:
            start = top
        out = [NODE] if pref == NODE or (pref is None and req is not None) else []
        out += [levels[i] for i in range(start, top - 1, -1)]
        return out

    def _place(self, placement: Sequence[Placement], req: str | None, pref: str | None, free: _Free,
               held: tuple[str, ...], stop: str | None = None) -> tuple[Placement, ...] | None:
        parts = sorted(placement, key=lambda p: (-p.gpus, -p.cpus))
        kind = self.types.get(placement[0].node, "") if placement else ""
        chosen = {p.node for p in placement}
        nodes = [n.name for n in self.nodes if n.gpu_type == kind]
        for level in self._candidates(req, pref):
            if level == stop:
                break
            if level == NODE:
                if len(parts) != 1:
                    continue
                groups = {(n,): [n] for n in nodes if req in (None, NODE) or group_key(self.paths.get(n, ()), req)}
            else:
                groups = {}
                for n in nodes:
                    k = group_key(self.paths.get(n, ()), level)
                    if k is not None:
                        groups.setdefault(k, []).append(n)
            need = sum(p.gpus for p in parts)

            def score(members: list[str]) -> tuple:
                return (not any(n in held for n in members), not any(n in chosen for n in members),
                        sum(free.g[n] for n in members) - need, self.order[members[0]])

            for members in sorted(groups.values(), key=score):
                got = self._fill(parts, members, free, held, chosen)
                if got is not None:
                    return got
        return None

    def _fill(self, parts: Sequence[Placement], members: list[str], free: _Free, held: tuple[str, ...],
              chosen: set[str]) -> tuple[Placement, ...] | None:
        out = []
        used: set[str] = set()
        for p in parts:
            ok = [n for n in members if n not in used and free.g[n] >= p.gpus and free.c[n] >= p.cpus]
            if not ok:
                return None
            n = min(ok, key=lambda n: (n not in held, n not in chosen, free.g[n] - p.gpus, self.order[n]))
            used.add(n)
            out.append(Placement(n, p.gpus, p.cpus, p.gpu_type or self.types.get(n, "")))
        return tuple(out)


def arrange(decision: Decision, nodes: Sequence[NodeState], jobs: Mapping[str, Any], *,
            prefer: str | None = None) -> list[str]:
    """Keep every gang of ``decision`` within its job's topology (see the module), in
    place; the jobs whose allocation it changed. ``jobs``: job id -> view (``spec``,
    ``placement``, ``plan``: ``JobView`` or the simulator's record). ``prefer``: the
    level a job without its own preference prefers (``"node"``: the finest)."""
    decision.changes = None  # (it edits the allocations)
    prefer_finest = prefer is not None
    if not prefer_finest and not any(getattr(getattr(jobs.get(j), "spec", None), "topology", None) is not None
                                     for j in decision.allocations):
        return []
    if not any(n.topology for n in nodes) and not prefer_finest:
        out = []  # no node reports a topology: a job that requires a level cannot run
        for jid in list(decision.allocations):
            req, _ = wants(jobs[jid].spec) if jid in jobs else (None, None)
            if req is not None:
                del decision.allocations[jid]
                decision.waiting[jid] = f"{WAITS}: topology.required {req!r}: no node reports a topology"
                out.append(jid)
        return out
    return Arranger(nodes, prefer).arrange(decision, jobs)
