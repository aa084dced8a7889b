"""The optimizer's parts without NATS: lifecycle (with the state machine),
capacity and GPU assignment, the materialised jobs view's bookkeeping, and the
record writer's times, which come from the clock it is given."""

from __future__ import annotations

import msgspec
import pytest

from gearshift.bus.clock import ManualClock
from gearshift.bus.views import JobsView
from gearshift.bus_schema.messages import (
    GpuReport,
    JobPreempted,
    InvalidTransition,
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    NodePlacement,
    NodeReport,
    Plan,
    RunReport,
    RunReportKind,
)
from gearshift.policies import Placement
from gearshift.policies.api import JobDecision
from gearshift.services import capacity, lifecycle
from gearshift.services.alloc_writer import allocation_for
from gearshift.services.record_writer import RecordWriter, with_drain_agents

SPEC = JobSpec(name="a", model=ModelSpec(name="m", params=100, layers=4, hidden=64, seq_len=128),
               global_batch=8, steps=100, gpus=2, tenant="t1")


def rec(state=JobState.RUNNING, gen=1, nodes=("n0",), **kw) -> JobRecord:
    placement = [NodePlacement(node=n, gpus=[0, 1], cpus=0) for n in nodes] if state != JobState.PENDING else []
    return JobRecord(job_id="j1", spec=SPEC, state=state, generation=gen, plan=Plan(dp=2), placement=placement, **kw)


def report(kind, gen=1, node="n0", **kw) -> RunReport:
    return RunReport(job_id="j1", generation=gen, node=node, kind=kind, ts=100.0, **kw)


def test_started_moves_scheduled_to_running_and_stale_generation_changes_nothing():
    out = lifecycle.apply_report(rec(JobState.SCHEDULED), report(RunReportKind.STARTED), max_retries=3, now=1.0)
    assert out.new.state == JobState.RUNNING and out.new.outbox[-1].__struct_config__.tag == "job.running"
    stale = lifecycle.apply_report(rec(JobState.SCHEDULED, gen=2), report(RunReportKind.STARTED, gen=1),
                                   max_retries=3, now=1.0)
    assert stale.new is None and not stale.ended


def test_crash_retries_then_fails_and_other_ranks_drain():
    r = rec(nodes=("n0", "n1"))
    crash = report(RunReportKind.EXITED, node="n1", exit_code=3, rank0=False)
    out = lifecycle.apply_report(r, crash, max_retries=1, now=5.0)
    assert out.ended and out.new.state == JobState.PENDING and out.new.failures == 1
    assert [p.node for p in out.new.draining] == ["n0"] and out.new.drain_started == 5.0
    again = msgspec.structs.replace(r, failures=1)
    out = lifecycle.apply_report(again, crash, max_retries=1, now=5.0)
    assert out.new.state == JobState.FAILED and "after 1 retries" in out.new.reason


def test_drain_releases_next_generation_only_when_every_node_exited():
    r = rec(JobState.SCHEDULED, gen=2, draining=[NodePlacement(node="n0", gpus=[0], cpus=0),
                                                 NodePlacement(node="n1", gpus=[0], cpus=0)], drain_generation=1)
    first = lifecycle.apply_report(r, report(RunReportKind.EXITED, gen=1, node="n0", stopped=True, exit_code=0),
                                   max_retries=3, now=1.0)
    assert not first.released and [p.node for p in first.new.draining] == ["n1"]
    second = lifecycle.apply_report(first.new, report(RunReportKind.EXITED, gen=1, node="n1", stopped=True,
                                                      exit_code=0), max_retries=3, now=2.0)
    assert second.released and second.new.draining == []


def test_state_machine_is_enforced():
    done = rec(JobState.COMPLETED)
    with pytest.raises(InvalidTransition):
        lifecycle.check(done, msgspec.structs.replace(done, state=JobState.RUNNING))
    with pytest.raises(InvalidTransition):
        done.check_transition(JobState.PENDING)
    pending = rec(JobState.PENDING, gen=0)
    assert lifecycle.check(pending, msgspec.structs.replace(pending, state=JobState.SCHEDULED)).state == JobState.SCHEDULED


def test_allocate_running_job_is_a_gang_switch_and_back_to_queue_drains():
    r = rec()
    d = JobDecision(placement=(Placement("n1", 4, 0),), plan=Plan(dp=4), reason="grow")
    new = lifecycle.allocate(r, r, d, [NodePlacement(node="n1", gpus=[0, 1, 2, 3], cpus=0)], ts=7.0)
    assert new.generation == 2 and new.state == JobState.SCHEDULED
    assert [p.node for p in new.draining] == ["n0"] and new.switch.from_generation == 1
    assert lifecycle.allocate(new, r, d, [], ts=8.0) is None  # generation moved: skip
    from gearshift.bus_schema.messages import JobPreempted
    q = lifecycle.back_to_queue(r, 1, "preempted", JobPreempted, 9.0)
    assert q.state == JobState.PENDING and q.placement == [] and q.drain_generation == 1


def node(name, gpus=4, reserved=()):
    return NodeReport(node=name, ts=0.0, gpus=[GpuReport(index=i, uuid=f"{name}-{i}") for i in range(gpus)], cpus=8,
                      reserved=list(reserved))


def test_capacity_counts_held_gpus_and_assigns_free_indices():
    cancelling = msgspec.structs.replace(rec(JobState.CANCELLING), job_id="c")
    running = msgspec.structs.replace(rec(nodes=("n1",)), job_id="r")
    held = capacity.held_gpus([cancelling, running], [node("n0"), node("n1", reserved=[3])])
    assert held == {"n0": {0, 1}, "n1": {3}}
    states = {s.name: s.gpus_total for s in capacity.node_states([node("n0"), node("n1")], held)}
    assert states == {"n0": 2, "n1": 3}
    used = capacity.in_use([cancelling, running], held)
    pending = rec(JobState.PENDING, gen=0)
    d = JobDecision(placement=(Placement("n1", 1, 0),), plan=Plan(), reason="")
    got = capacity.assign(pending, d, used, {"n0": 4, "n1": 4})
    assert got == [NodePlacement(node="n1", gpus=[2], cpus=0)] and 2 in used["n1"]
    d2 = JobDecision(placement=(Placement("n1", 1, 0),), plan=Plan(), reason="")
    assert capacity.assign(pending, d2, used, {"n0": 4, "n1": 4}) is None  # n1 full now


def test_jobs_view_counts_live_per_tenant_and_pages_in_submission_order():
    v = JobsView(js=None, bucket="b")
    recs = [JobRecord(job_id=f"j{i:03d}", spec=SPEC, submitted_at=float(i)) for i in range(10)]
    for r in recs:
        v.entries[r.job_id] = (r, 1, 0.0)
        v.changed(r.job_id, None, r)
    assert v.tenant_live["t1"] == 10 and len(v.live) == 10
    done = msgspec.structs.replace(recs[0], state=JobState.CANCELLED)
    v.entries[done.job_id] = (done, 2, 0.0)
    v.changed(done.job_id, recs[0], done)
    assert v.tenant_live["t1"] == 9 and "j000" not in v.live
    seen, cursor = [], None
    while True:
        page, cursor = v.page(cursor, 3, lambda r: True)
        seen += [r.job_id for r in page]
        if cursor is None:
            break
    assert seen == [r.job_id for r in recs]
    live_only, _ = v.page(None, 100, lambda r: not r.terminal)
    assert [r.job_id for r in live_only] == [r.job_id for r in recs[1:]]


def test_a_cancel_no_agent_will_report_on_ends_when_its_nodes_are_lost_or_after_the_timeout():
    r = rec(JobState.CANCELLING, nodes=("n0", "n1"))
    assert lifecycle.cancel_unreported(r, {"n0", "n1"}, waiting_s=5.0, timeout=30.0, ts=9.0) is None
    assert lifecycle.cancel_unreported(r, {"n1"}, waiting_s=5.0, timeout=30.0, ts=9.0) is None  # n1 may report
    lost = lifecycle.cancel_unreported(r, set(), waiting_s=5.0, timeout=30.0, ts=9.0)
    assert lost.state == JobState.CANCELLED and lost.finished_at == 9.0 and "lost" in lost.reason
    assert lost.outbox[-1].__struct_config__.tag == "job.cancelled"
    late = lifecycle.cancel_unreported(r, {"n0", "n1"}, waiting_s=31.0, timeout=30.0, ts=9.0)
    assert late.state == JobState.CANCELLED and "within 30 s" in late.reason
    assert lifecycle.cancel_unreported(rec(JobState.RUNNING), set(), waiting_s=99.0, timeout=30.0, ts=9.0) is None


class FakeStore:
    """``JobStore``'s compare-and-set over a dict: ``update`` applies the change."""

    def __init__(self, *records: JobRecord):
        self.records = {r.job_id: r for r in records}
        self.archived: list[str] = []

    async def update(self, job_id, change, hint=None):
        new = change(self.records[job_id])
        if new is not None:
            self.records[job_id] = new
        return new

    async def archive_many(self, recs: list[JobRecord], parallel: int = 32) -> int:
        self.archived += [r.job_id for r in recs]
        return len(recs)

    async def publish_usage(self, recs: list[JobRecord]) -> None:
        self.accounted = [r.job_id for r in recs]


class FakeAllocs:
    def __init__(self):
        self.puts: list[str] = []
        self.deletes: list[str] = []

    async def put(self, r: JobRecord) -> None:
        self.puts.append(r.job_id)

    async def delete(self, job_id: str) -> None:
        self.deletes.append(job_id)


def writer(store, clock, finished=()):
    jobs = type("Jobs", (), {"entries": {}, "finished": {r.job_id: r for r in finished}})()
    return RecordWriter(store, FakeAllocs(), jobs, parallel=4, drain_timeout=120.0, archive_after=30.0, clock=clock)


def test_allocations_are_stamped_by_the_clock_given():
    assert allocation_for(rec(), ManualClock(1234.5)).created_at == 1234.5


async def test_record_writer_stamps_its_clock_and_times_out_drains_and_archives_by_it():
    clock = ManualClock(1000.0)
    store = FakeStore(rec(JobState.RUNNING, nodes=("n0", "n1"), drain_started=None))
    w = writer(store, clock)
    # preempted: its ranks drain, stamped with the manual time (not the wall clock)
    got = await w.back_to_queue(store.records["j1"], "preempted by policy", JobPreempted)
    assert got.state == JobState.PENDING and got.drain_started == 1000.0 and got.outbox[-1].ts == 1000.0
    clock.advance(120.0)  # exactly the drain timeout: not over it, the live nodes may still report
    assert await w.settle_drains({"j1": got}, {"n0", "n1"}) == 0
    clock.advance(0.5)  # past it: settled without reports, no sleep needed
    records = {"j1": got}
    assert await w.settle_drains(records, {"n0", "n1"}) == 1 and records["j1"].draining == []
    # archived archive_after (30 s) after it ended, by the same clock
    done = msgspec.structs.replace(rec(JobState.COMPLETED), finished_at=clock.now())
    w = writer(store, clock, finished=[done])
    clock.advance(29.0)
    assert await w.archive() == 0 and store.archived == []
    clock.advance(1.0)
    assert await w.archive() == 1 and store.archived == ["j1"] and store.accounted == ["j1"]


@pytest.mark.parametrize("written", [True, False])
async def test_a_drain_whose_agent_restarted_ends_on_its_heartbeat_for_any_leader(written):
    """The agent's incarnation is written into the record as the drain begins
    (``with_drain_agents``): killed and restarted before the next (paced) round looks,
    or before a new leader took over, its successor's heartbeat (it acted on the
    withdrawal, runs nothing of the job) ends the drain at once. Without it the new
    incarnation is the first one seen, and the drain would wait out the timeout."""
    clock = ManualClock(1000.0)
    old = NodeReport(node="n0", ts=0.0, gpus=[], cpus=8, started_at=1.0, alloc_rev=40, running=["j1@1"])
    draining = msgspec.structs.replace(rec(JobState.PENDING), generation=2, draining=[
        NodePlacement(node="n0", gpus=[0, 1], cpus=0)], drain_generation=1, drain_started=1000.0)
    if written:
        draining = with_drain_agents(draining, {"n0": old}.get)  # as the leader wrote the drain
        assert draining.drain_agents == {"n0": 1.0}
    store = FakeStore(draining)
    w = writer(store, clock)  # a leader that never saw the drain begin
    w.writer.view = type("View", (), {"withdrawn": {"n0.j1": 50}, "entries": {}})()
    back = msgspec.structs.replace(old, started_at=2.0, alloc_rev=51, running=[])  # restarted, acted, idle
    records = {"j1": draining}
    assert await w.settle_drains(records, {"n0"}, {"n0": back}) == (1 if written else 0)
    assert (records["j1"].draining == []) is written


def test_drain_agents_follow_the_drain():
    hb = {"n0": NodeReport(node="n0", ts=0.0, gpus=[], cpus=8, started_at=5.0),
          "n1": NodeReport(node="n1", ts=0.0, gpus=[], cpus=8, started_at=7.0)}
    r = msgspec.structs.replace(rec(), draining=[NodePlacement(node="n0", gpus=[0], cpus=0)])
    r = with_drain_agents(r, hb.get)
    assert r.drain_agents == {"n0": 5.0}
    hb["n0"] = msgspec.structs.replace(hb["n0"], started_at=9.0)  # restarted: the drain keeps the first
    r = with_drain_agents(msgspec.structs.replace(r, draining=[*r.draining, NodePlacement(node="n1", gpus=[0])]), hb.get)
    assert r.drain_agents == {"n0": 5.0, "n1": 7.0}
    assert with_drain_agents(msgspec.structs.replace(r, draining=[]), hb.get).drain_agents == {}  # over
    plain = rec()
    assert with_drain_agents(plain, hb.get) is plain  # no drain: the record as it was
