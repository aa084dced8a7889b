"""Rounds that do only what changed (issue 24): the optimizer's kept indexes and
views (``services.round_state``, ``PolicyStep.kept_views``), updated round after
round from what changed, equal a rebuild from scratch, and the policy decides the
same on either: random live jobs (pending, running, draining, cancelling, pinned,
waiting on dependencies) on random nodes (some unhealthy GPUs, GPUs reserved for
profiling, nodes lost and back), changed a few at a time."""

from __future__ import annotations

import random

import msgspec
import pytest

from gearshift.bus_schema.messages import (
    Dependency,
    GpuHealth,
    GpuReport,
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    NodePlacement,
    NodeReport,
    PinnedPlan,
    Plan,
)
from gearshift.policies.oracle import PerfModelOracle
from gearshift.policies.registry import make_policy
from gearshift.services import capacity
from gearshift.services.policy_bridge import PolicyStep
from gearshift.services.round_state import InUse, JobIndex, NodeIndex, RoundRecords, held_by_jobs, merge_held

MODEL = ModelSpec(name="gpt2", params=1560, layers=24, hidden=1920, seq_len=1024)
NODES = [f"n{i:02d}" for i in range(12)]


class _NoModels:
    """The oracle part ``PolicyStep`` needs when no round asks gs_models."""

    def observe_progress(self, *a) -> bool:
        return False


def _report(rng: random.Random, node: str) -> NodeReport:
    gpus = [GpuReport(index=i, uuid=f"{node}-{i}", name="NVIDIA A100-SXM4-80GB",
                      health=GpuHealth.XID if rng.random() < 0.05 else GpuHealth.OK,
                      utilization=rng.randint(0, 100)) for i in range(8)]
    return NodeReport(node=node, ts=rng.random(), gpus=gpus, cpus=64,
                      reserved=[rng.randrange(8)] if rng.random() < 0.1 else [])


def _record(rng: random.Random, i: int, jobs: dict[str, JobRecord]) -> JobRecord:
    gpus = rng.choice([1, 2, 4, 8])
    spec = JobSpec(name=f"s{i}", model=MODEL, global_batch=16, steps=500, gpus=gpus, step_time=1.0)
    rec = JobRecord(job_id=f"j{i:04d}", spec=spec, submitted_at=float(i))
    kind = rng.random()
    if kind < 0.35:
        node = rng.choice(NODES)
        rec = msgspec.structs.replace(
            rec, state=rng.choice([JobState.RUNNING, JobState.SCHEDULED]), generation=1, plan=Plan(dp=gpus),
            placement=[NodePlacement(node=node, gpus=sorted(rng.sample(range(8), gpus)), cpus=gpus)],
            scheduled_at=float(i), started_at=float(i), last_switch_at=float(i) + 1, steps_done=rng.randint(0, 400))
        if rng.random() < 0.15:  # switching: its old ranks drain elsewhere
            rec = msgspec.structs.replace(rec, draining=[NodePlacement(node=rng.choice(NODES), gpus=[0, 1], cpus=2)],
                                          drain_started=float(i))
    elif kind < 0.42:
        rec = msgspec.structs.replace(rec, state=JobState.CANCELLING, generation=1, plan=Plan(dp=gpus),
                                      placement=[NodePlacement(node=rng.choice(NODES), gpus=list(range(gpus)), cpus=1)])
    elif kind < 0.5:  # preempted: pending, its old ranks still draining
        rec = msgspec.structs.replace(rec, draining=[NodePlacement(node=rng.choice(NODES), gpus=[2, 3], cpus=2)],
                                      generation=1, drain_started=float(i))
    elif kind < 0.56 and jobs:
        parent = rng.choice(sorted(jobs))
        rec = msgspec.structs.replace(rec, after=[Dependency(job=parent)])
    if rng.random() < 0.05:
        rec = msgspec.structs.replace(rec, pinned=PinnedPlan(plan=Plan(dp=gpus)))
    return rec


def _full(records: dict[str, JobRecord], reports: dict[str, NodeReport], alive: list[str]):
    """What a round used to compute from every record and every live node."""
    live = [reports[n] for n in alive]
    held = capacity.held_gpus(records.values(), live)
    seen = capacity.held_gpus(records.values(), live, for_policy=True)
    return held, seen, capacity.node_states(live, seen), capacity.in_use(records.values(), held), \
        capacity.holding(records.values())


def _only(d: dict, keys) -> dict:
    return {k: v for k, v in d.items() if k in keys and v}


@pytest.mark.parametrize("seed", range(6))
def test_kept_state_equals_a_rebuild_and_decides_the_same(seed):
    rng = random.Random(seed)
    records: dict[str, JobRecord] = {}
    for i in range(60):
        records[f"j{i:04d}"] = _record(rng, i, records)
    reports = {n: _report(rng, n) for n in NODES}
    jobs_index, nodes_index = JobIndex(), NodeIndex()
    jobs_index.apply(records, set(records))
    nodes_index.update(reports, set(reports))
    kept, fresh = PolicyStep(make_policy("fifo"), _NoModels()), PolicyStep(make_policy("fifo"), _NoModels())
    policy_kept, policy_full = make_policy("rubick"), make_policy("rubick")
    n, now = 60, 1000.0
    dead: set[str] = set()
    changed: set[str] = set(records)
    decided = 0
    alive_names: list[str] = []
    for rnd in range(12):
        if alive_names != sorted(n_ for n_ in NODES if n_ not in dead):  # the same list while nobody came or
            alive_names = sorted(n_ for n_ in NODES if n_ not in dead)  # went (NodesView.live_names): kept states
        alive = set(alive_names)
        # the round's copy, and a write of its own (``RoundRecords.touched``) folded into the index
        round_records = RoundRecords(records)
        victim = rng.choice(sorted(round_records))
        round_records[victim] = msgspec.structs.replace(round_records[victim], reason=f"round {rnd}")
        jobs_index.apply(round_records, round_records.touched)
        changed |= round_records.touched

        assert not jobs_index.differences(JobIndex.of(round_records))
        assert not nodes_index.differences(NodeIndex.of(reports))
        held_full, seen_full, states_full, used_full, holding_full = _full(round_records, reports, alive_names)
        held = merge_held(held_by_jobs(round_records, jobs_index.holders), nodes_index.node_held())
        seen = merge_held(held_by_jobs(round_records, jobs_index.holders, for_policy=True), nodes_index.node_held())
        assert _only(held, alive) == _only(held_full, alive) and _only(seen, alive) == _only(seen_full, alive)
        states = nodes_index.node_states(alive_names, seen)
        assert states == states_full
        used = InUse(round_records, jobs_index, held)
        assert {node: used.get(node, set()) for node in alive} == {node: used_full.get(node, set()) for node in alive}
        assert dict(jobs_index.holding) == holding_full
        assert jobs_index.on_nodes_not_in(alive) == {
            r.job_id for r in round_records.values()
            if r.state in (JobState.SCHEDULED, JobState.RUNNING) and any(p.node not in alive for p in r.placement)}

        skip = {j for j in sorted(round_records)[:3]}  # e.g. waiting on dependencies
        views_full = fresh.views(round_records, alive, now, skip)
        fresh.order.forget()
        views = kept.kept_views(round_records, now, changed, jobs_index.holding.keys(),
                                skip | jobs_index.on_nodes_not_in(alive))
        assert [v.job_id for v in views] == [v.job_id for v in views_full]
        assert [(v.steps_done, v.attained_service, v.placement, v.plan) for v in views] == \
            [(v.steps_done, v.attained_service, v.placement, v.plan) for v in views_full]
        d_kept = policy_kept.schedule(now, states, views, PerfModelOracle())
        d_full = policy_full.schedule(now, states_full, views_full, PerfModelOracle())
        assert {k: (a.plan, a.placement) for k, a in d_kept.allocations.items()} == \
            {k: (a.plan, a.placement) for k, a in d_full.allocations.items()}
        assert d_kept.waiting == d_full.waiting
        decided += len(d_full.allocations)

        # between rounds: some records change, some jobs end, some arrive; a node changes
        records = dict(round_records)
        changed = set()
        for job_id in rng.sample(sorted(records), 5):
            rec = records[job_id]
            if rec.state == JobState.RUNNING and rng.random() < 0.5:
                del records[job_id]  # ended (left the live jobs)
            else:
                records[job_id] = msgspec.structs.replace(_record(rng, int(job_id[1:]), records), job_id=job_id)
            changed.add(job_id)
        for _ in range(3):
            records[f"j{n:04d}"] = _record(rng, n, records)
            changed.add(f"j{n:04d}")
            n += 1
        node = rng.choice(NODES)
        reports[node] = _report(rng, node)  # a heartbeat: its facts may or may not change
        nodes_index.update(reports, {node})
        if rng.random() < 0.3:
            dead ^= {rng.choice(NODES)}  # a node lost, or back
        jobs_index.apply(records, changed)
        now += 5.0
    assert decided > 100  # the policy placed jobs round after round: the comparison meant something


def test_shape_memo_works_out_once_per_shape_and_always_for_a_plain_list():
    from gearshift.policies.api import NodeState, NodeStates, ShapeMemo

    memo, calls = ShapeMemo(), []

    def make(nodes):
        calls.append(len(nodes))
        return sum(n.gpus_total for n in nodes)

    a = [NodeState("a", 8, 8, 64, 64), NodeState("b", 4, 4, 32, 32)]
    shape = object()
    assert memo.get(NodeStates(a, shape), make) == 12
    assert memo.get(NodeStates(list(a), shape), make) == 12  # the same shape named again: kept
    assert calls == [2]
    assert memo.get(NodeStates(a[:1], object()), make) == 8  # a new shape: worked out again
    assert memo.get(a, make) == 12 and memo.get(a, make) == 12  # a plain list names none: every time
    assert calls == [2, 1, 2, 2]


def test_node_states_name_a_new_shape_only_when_a_state_changes():
    reports = {n: NodeReport(node=n, ts=1.0, cpus=32, gpus=[GpuReport(index=i, uuid=f"{n}-{i}") for i in range(4)])
               for n in ("a", "b", "c")}
    index = NodeIndex.of(reports)
    alive = sorted(reports)
    first = index.node_states(alive, {})
    again = index.node_states(alive, {})
    assert again.shape is first.shape and again == first
    held = index.node_states(alive, {"b": {0, 1}})  # two of b's GPUs held outside any decision
    assert held.shape is not first.shape and [s.gpus_total for s in held] == [4, 2, 4]
    back = index.node_states(alive, {})
    assert back.shape is not held.shape and [s.gpus_total for s in back] == [4, 4, 4]
    index.update(reports, {"c"})  # a heartbeat with the same facts: nothing new
    assert index.node_states(alive, {}).shape is back.shape
