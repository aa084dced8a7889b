"""What a round reads, kept from one round to the next: work per round in
proportion to the jobs and nodes that changed (issue 24).

A round used to pass over every live job and every node several times: the
GPUs held by draining and cancelling jobs, what every active job holds (for
``policies.decision.diff``), the GPUs in use, which jobs sit on a lost node,
which drain or cancel, which wait on dependencies or are pinned, every node's
state (every GPU's health), the metrics by state. At 20,000 live jobs those
passes cost more than the decisions they fed. Here each is an index kept per
job (``JobIndex``) and per node (``NodeIndex``), updated from what changed:

- the jobs view marks every key it applies (``JobsView.dirty``), and the round's
  own writes mark theirs (``RoundRecords.touched``); the index is brought up to
  date for those only (``JobIndex.apply``), so a step reads the few jobs it
  concerns (``draining``, ``cancelling``, ``on_node`` ...), not all of them;
- the nodes view marks a node only when what the policy sees of it changed
  (``NodesView.dirty``: its GPUs' number, health or names, CPUs, type, topology,
  reserved GPUs), not at every heartbeat; with the GPUs draining and cancelling
  jobs hold, that makes each node's ``NodeState``, built again only when one of
  them moved (as the simulator's ``sim.views.NodeViews`` does).

A full rebuild still runs now and then (``Rounds``: with the full reconciliation,
every ``reconcile_every`` s, and on taking the lease): it builds both indexes from
scratch, counts any difference from the kept ones (``mismatches``; there should
be none, ``tests/test_round_state.py`` checks the two give the same decision) and
goes on from the rebuilt ones.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from gearshift.bus_schema.messages import ACTIVE_STATES, JobRecord, JobState, NodeReport
from gearshift.policies import NodeState
from gearshift.policies.api import NodeStates
from gearshift.policies.decision import Held
from gearshift.services import capacity


class RoundRecords(dict):
    """The round's records: a copy of the jobs view's live ones, which remembers
    the jobs whose record the round replaced (``touched``)."""

    __slots__ = ("touched",)

    def __init__(self, live: Mapping[str, JobRecord]):
        super().__init__(live)
        self.touched: set[str] = set()

    def __setitem__(self, job_id: str, rec: JobRecord) -> None:
        super().__setitem__(job_id, rec)
        self.touched.add(job_id)


def _holds(rec: JobRecord) -> bool:
    """Does ``rec`` hold GPUs no decision gives it (``capacity.held_gpus``'s jobs)?"""
    return bool(rec.draining) or (rec.state == JobState.CANCELLING and bool(rec.placement))


class JobIndex:
    """Per live job, what the round's steps look up (see the module's doc):
    ``recs`` the record each entry was made from; ``draining``, ``cancelling``,
    ``holders`` (jobs holding GPUs outside any decision), ``pinned``,
    ``waiting_on_deps``; ``on_node`` node -> active jobs placed there;
    ``holding`` active job -> ``Held`` (``capacity.holding``); ``counts``
    (state, tenant) -> jobs."""

    def __init__(self) -> None:
        self.recs: dict[str, JobRecord] = {}
        self.draining: set[str] = set()
        self.cancelling: set[str] = set()
        self.holders: set[str] = set()
        self.pinned: set[str] = set()
        self.waiting_on_deps: set[str] = set()
        self.on_node: dict[str, set[str]] = {}
        self.holding: dict[str, Held] = {}
        self.counts: Counter[tuple[str, str]] = Counter()

    @classmethod
    def of(cls, records: Mapping[str, JobRecord]) -> "JobIndex":
        """Built from scratch (the full round's rebuild)."""
        index = cls()
        index.apply(records, records.keys())
        return index

    def apply(self, records: Mapping[str, JobRecord], job_ids: Iterable[str]) -> None:
        """Bring the entries of ``job_ids`` up to date with ``records`` (absent: gone)."""
        for job_id in job_ids:
            rec = records.get(job_id)
            old = self.recs.get(job_id)
            if rec is old:
                continue
            if old is not None:
                self._drop(job_id, old)
            if rec is not None:
                self._add(job_id, rec)

    def _add(self, job_id: str, rec: JobRecord) -> None:
        self.recs[job_id] = rec
        self.counts[(rec.state.value, rec.spec.tenant)] += 1
        if rec.draining:
            self.draining.add(job_id)
        if rec.state == JobState.CANCELLING:
            self.cancelling.add(job_id)
        if _holds(rec):
            self.holders.add(job_id)
        if rec.pinned is not None:
            self.pinned.add(job_id)
        if rec.after and rec.waits_on_dependencies:
            self.waiting_on_deps.add(job_id)
        if rec.state in ACTIVE_STATES:
            self.holding[job_id] = Held(rec.plan, capacity.placement_of(rec))
            for p in rec.placement:
                self.on_node.setdefault(p.node, set()).add(job_id)

    def _drop(self, job_id: str, rec: JobRecord) -> None:
        del self.recs[job_id]
        key = (rec.state.value, rec.spec.tenant)
        self.counts[key] -= 1
        if not self.counts[key]:
            del self.counts[key]
        for s in (self.draining, self.cancelling, self.holders, self.pinned, self.waiting_on_deps):
            s.discard(job_id)
        if self.holding.pop(job_id, None) is not None:
            for p in rec.placement:
                jobs = self.on_node.get(p.node)
                if jobs is not None:
                    jobs.discard(job_id)
                    if not jobs:
                        del self.on_node[p.node]

    def on_nodes_not_in(self, alive: set[str]) -> set[str]:
        """Active jobs placed on a node not in ``alive``."""
        return {j for node, jobs in self.on_node.items() if node not in alive for j in jobs}

    def differences(self, other: "JobIndex") -> list[str]:
        """What differs from ``other`` (names of the parts that do)."""
        out = [name for name in ("draining", "cancelling", "holders", "pinned", "waiting_on_deps", "on_node",
                                 "holding", "counts") if getattr(self, name) != getattr(other, name)]
        if self.recs.keys() != other.recs.keys() or any(self.recs[k] is not r for k, r in other.recs.items()):
            out.append("recs")
        return out


class InUse(dict):
    """``capacity.in_use`` of the round's records, filled per node when first asked
    (``capacity.assign`` asks only about the nodes its decisions use): what is held
    there and what the active jobs placed there hold."""

    def __init__(self, records: Mapping[str, JobRecord], index: JobIndex, held: Mapping[str, set[int]]):
        super().__init__()
        self._records, self._index, self._held = records, index, held

    def _fill(self, node: str) -> set[int]:
        got = set(self._held.get(node, ()))
        for job_id in self._index.on_node.get(node, ()):
            for p in self._records[job_id].placement:
                if p.node == node:
                    got.update(p.gpus)
        dict.__setitem__(self, node, got)
        return got

    def get(self, node: str, default: Any = None) -> Any:
        return dict.get(self, node) if node in self else self._fill(node)

    def setdefault(self, node: str, default: Any = None) -> Any:
        return dict.get(self, node) if node in self else self._fill(node)

    def __missing__(self, node: str) -> set[int]:
        return self._fill(node)


def node_facts(n: NodeReport) -> tuple:
    """What the policy and the held GPUs read of a node's report: (GPUs, unhealthy
    GPU indices, reserved GPU indices, CPUs, GPU type, topology text). A heartbeat
    that changes none of it (most: utilisation, memory, time) changes nothing here."""
    return (len(n.gpus), tuple(g.index for g in n.gpus if not g.healthy), tuple(sorted(n.reserved)), n.cpus,
            n.gpu_type or capacity.type_of_names(tuple(g.name for g in n.gpus)), n.topology)


class NodeIndex:
    """Each node's facts (``node_facts``) and its ``NodeState`` as the round hands
    it to the policy, kept: a state is built again only when the node's facts or
    the number of its GPUs held outside decisions changed. ``node_type``: node ->
    GPU type (the oracle's, kept); ``holding``: nodes whose own report holds GPUs
    (reserved for profiling, unhealthy)."""

    def __init__(self) -> None:
        self.facts: dict[str, tuple] = {}
        self.states: dict[str, NodeState] = {}
        self.held_count: dict[str, int] = {}  # node -> held GPUs its state was built with
        self.node_type: dict[str, str] = {}
        self.holding: set[str] = set()
        self._order: tuple[list[str], list[NodeState], object] | None = None  # (alive names, states, shape)
        self._stale: set[str] = set()  # nodes whose facts changed since ``node_states`` last looked
        self._held_at: set[str] = set()  # nodes whose last state was built with GPUs held

    @classmethod
    def of(cls, reports: Mapping[str, NodeReport], facts: Mapping[str, tuple] | None = None) -> "NodeIndex":
        """The index of every node of ``reports``; ``facts``: as ``update``'s."""
        index = cls()
        index.update(reports, reports.keys(), facts)
        return index

    def update(self, reports: Mapping[str, NodeReport], names: Iterable[str],
               facts: Mapping[str, tuple] | None = None) -> None:
        """Read the facts of these nodes again (changed, new or gone); ``facts``: the
        facts already worked out as the reports came in (``NodesView.facts``)."""
        for name in names:
            rep = reports.get(name)
            f = None if rep is None else (facts.get(name) if facts is not None else None) or node_facts(rep)
            if self.facts.get(name) == f:
                continue
            self.states.pop(name, None)  # built again when asked
            self._stale.add(name)
            if f is None:
                for d in (self.facts, self.held_count, self.node_type):
                    d.pop(name, None)
                self.holding.discard(name)
                continue
            self.facts[name] = f
            self.node_type[name] = f[4]
            (self.holding.add if f[1] or f[2] else self.holding.discard)(name)

    def node_held(self) -> dict[str, set[int]]:
        """``capacity.held_gpus``'s node part: GPUs reserved for profiling or not healthy."""
        return {name: {*self.facts[name][1], *self.facts[name][2]} for name in self.holding}

    def gpu_count(self, name: str) -> int:
        return self.facts[name][0]

    def node_states(self, alive: list[str], seen_held: Mapping[str, set[int]]) -> list[NodeState]:
        """The states of the ``alive`` nodes (in its order), with ``seen_held``'s GPUs taken
        (``capacity.node_states``)."""
        states, held_count, facts = self.states, self.held_count, self.facts
        built = False
        if self._order is not None and self._order[0] is alive:
            # the same nodes as last time: only those whose facts or held GPUs changed
            todo: Iterable[str] = [n for n in (self._stale | self._held_at | seen_held.keys()) if n in facts]
        else:
            todo = alive
        self._stale = set()
        self._held_at = {n for n in seen_held if seen_held[n]}
        for name in todo:
            h = len(seen_held.get(name, ()))
            st = states.get(name)
            if st is None or held_count.get(name) != h:
                f = facts[name]
                gpus = f[0] - h
                states[name] = NodeState(name=name, gpus_total=gpus, gpus_free=gpus, cpus_total=f[3], cpus_free=f[3],
                                         gpu_type=f[4], topology=capacity.topology_of(f[5]) if f[5] else ())
                held_count[name] = h
                built = True
        if built or self._order is None or self._order[0] is not alive:
            # a new shape whenever any node's state is new (its free GPUs too: here free = total)
            self._order = (alive, [states[n] for n in alive], object())
        return NodeStates(self._order[1], self._order[2])

    def differences(self, other: "NodeIndex") -> list[str]:
        return [name for name in ("facts", "node_type", "holding") if getattr(self, name) != getattr(other, name)]


def held_by_jobs(records: Mapping[str, JobRecord], job_ids: Iterable[str], *,
                 for_policy: bool = False) -> dict[str, set[int]]:
    """``capacity.held_gpus``'s job part, over ``job_ids`` only (the index's ``holders``)."""
    return capacity.held_gpus((records[j] for j in sorted(job_ids) if j in records), (), for_policy=for_policy)


def merge_held(*parts: Mapping[str, set[int]]) -> dict[str, set[int]]:
    """Node -> GPUs, the union of ``parts`` (new sets: the parts are not changed)."""
    out: dict[str, set[int]] = {}
    for part in parts:
        for node, gpus in part.items():
            out.setdefault(node, set()).update(gpus)
    return out
