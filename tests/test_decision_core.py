"""The decision core (issue 22): one check, one diff, for the simulator and the
optimizer alike."""

from __future__ import annotations

import pytest

from gearshift.bus_schema.messages import (
    InvalidTransition,
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    NodePlacement,
    NodeShare,
    PinnedPlan,
    Plan,
)
from gearshift.policies.api import AllocationError, Decision, JobDecision, NodeState, Placement
from gearshift.policies.decision import Diff, Held, NodeCapacity, check_decision, diff, same_allocation
from gearshift.policies.hetero import TypedOracle
from gearshift.policies.protocols import BudgetedPolicy, KeyOrderedPolicy, PlanningOracle, TypeAwarePolicy, supports
from gearshift.policies.registry import make_policy
from gearshift.services import capacity
from gearshift.sim.engine import SimConfig, Simulator, move
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

MODEL = ModelSpec(name="toy", params=10.0, layers=2, hidden=64, seq_len=16)


def spec(gpus: int, types: tuple[str, ...] | None = None) -> JobSpec:
    return JobSpec(name="j", model=MODEL, global_batch=8, steps=100, gpus=gpus, plan=Plan(dp=gpus),
                   gpu_types=types, step_time=1.0)


class Live:
    def __init__(self, gpus: int, types: tuple[str, ...] | None = None):
        self.spec = spec(gpus, types)


def typed_nodes() -> list[NodeState]:
    return [NodeState("a0", 4, 4, 16, 16, gpu_type="a100"), NodeState("a1", 4, 4, 16, 16, gpu_type="a100"),
            NodeState("v0", 4, 4, 16, 16, gpu_type="v100")]


def alloc(*parts: tuple[str, int, int], plan: Plan | None = None) -> JobDecision:
    pl = tuple(Placement(n, g, c) for n, g, c in parts)
    return JobDecision(pl, plan or Plan(dp=sum(p.gpus for p in pl)))


@pytest.mark.parametrize("allocs,waiting,jobs,words", [
    ({"x": alloc(("a0", 1, 0))}, {}, {}, "decision names unknown or finished job 'x'"),
    ({"x": JobDecision((), Plan(dp=1))}, {}, {"x": Live(1)}, "job x: empty placement"),
    ({"x": alloc(("a0", 1, 0), ("a0", 1, 0))}, {}, {"x": Live(2)}, "job x: a node appears twice in its placement"),
    ({"x": alloc(("a0", 1, 0))}, {"x": "why"}, {"x": Live(1)}, "job x: both allocated and waiting"),
    ({"x": alloc(("zz", 1, 0))}, {}, {"x": Live(1)}, "job x: unknown node 'zz'"),
    ({"x": alloc(("a0", -1, 0), plan=Plan(dp=1))}, {}, {"x": Live(1)}, "job x: negative amount on a0"),
    ({"x": alloc(("a0", 2, 0), plan=Plan(dp=4))}, {}, {"x": Live(4)}, "job x: plan DP4 needs 4 GPUs, placement has 2"),
    ({"x": alloc(("a0", 2, 0), ("v0", 2, 0))}, {}, {"x": Live(4)},
     r"job x: placement spans GPU types \['a100', 'v100'\] \(a job runs on one type\)"),
    ({"x": alloc(("a0", 2, 0))}, {}, {"x": Live(2, ("v100",))}, "job x: placed on 'a100' GPUs; it accepts v100"),
    ({"x": alloc(("a0", 3, 0)), "y": alloc(("a0", 2, 0))}, {}, {"x": Live(3), "y": Live(2)},
     "node a0: 5 GPUs allocated, it has 4"),
    ({"x": alloc(("a0", 1, 10)), "y": alloc(("a0", 1, 10))}, {}, {"x": Live(1), "y": Live(1)},
     "node a0: 20 CPUs allocated, it has 16"),
])
def test_check_decision_refuses_each_bad_case_with_its_words(allocs, waiting, jobs, words):
    d = Decision(dict(allocs), dict(waiting))
    with pytest.raises(AllocationError, match=words):
        check_decision(d, typed_nodes(), jobs)


def test_check_decision_accepts_a_full_desired_state_and_types_the_job_accepts():
    d = Decision({"x": alloc(("a0", 4, 16)), "y": alloc(("v0", 2, 4)), "z": alloc(("a1", 2, 0), ("a0", 0, 0))})
    check_decision(d, typed_nodes(), {"x": Live(4), "y": Live(2, ("v100",)), "z": Live(2, ("a100", "h100"))})


def test_incremental_check_counts_what_changed_jobs_give_back_and_skips_kept_ones():
    cap = NodeCapacity.of(typed_nodes())
    # a holds a0:4 and b holds a1:4, nothing is free on them: they swap nodes.
    holding = {"a": Held(Plan(dp=4), (Placement("a0", 4),)), "b": Held(Plan(dp=4), (Placement("a1", 4),))}
    jobs = {"a": Live(4), "b": Live(4), "c": Live(2)}
    free_g, free_c = [0, 0, 4], [16, 16, 16]
    swap = Decision({"a": alloc(("a1", 4, 0)), "b": alloc(("a0", 4, 0))})
    cap.check(swap, jobs, free_g, free_c, holding, diff(holding, swap).keep)
    assert free_g == [0, 0, 4]  # read, not changed
    # a keeps a0 (not checked again, its GPUs are not free); c may not take them.
    grab = Decision({"a": alloc(("a0", 4, 0)), "c": alloc(("a0", 2, 0))})
    with pytest.raises(AllocationError, match="node a0: 6 GPUs allocated, it has 4"):
        cap.check(grab, jobs, free_g, free_c, holding, diff(holding, grab).keep)
    # b left out: its GPUs are free for c.
    cap.check(Decision({"a": alloc(("a0", 4, 0)), "c": alloc(("a1", 2, 0))}), jobs, free_g, free_c, holding, {"a"})


def test_diff_classifies_keep_preempt_start_reconfigure():
    holding = {
        "same": Held(Plan(dp=4), (Placement("n0", 2, 4), Placement("n1", 2, 4))),
        "moved": Held(Plan(dp=2), (Placement("n0", 2, 4),)),
        "replanned": Held(Plan(dp=2), (Placement("n0", 2, 4),)),
        "fewer_cpus": Held(Plan(dp=2), (Placement("n0", 2, 4),)),
        "left_out": Held(Plan(dp=1), (Placement("n1", 1),)),
    }
    d = Decision({
        "new": alloc(("n2", 1, 0)),
        "same": JobDecision((Placement("n1", 2, 4, "a100"), Placement("n0", 2, 4)), Plan(dp=4)),  # other node order
        "moved": alloc(("n1", 2, 4)),
        "replanned": alloc(("n0", 2, 4), plan=Plan(dp=1, tp=2)),
        "fewer_cpus": alloc(("n0", 2, 2)),
    })
    got = diff(holding, d)
    assert got == Diff(keep=frozenset({"same"}), preempt=("left_out",), start=("new",),
                       reconfigure=("moved", "replanned", "fewer_cpus"),
                       changed=("new", "moved", "replanned", "fewer_cpus"))
    assert same_allocation(d.allocations["same"], holding["same"])
    assert not same_allocation(d.allocations["moved"], holding["moved"])


def test_simulator_and_record_writer_diff_the_same_holdings_alike():
    t = Trace("toy", [TraceJob(j, 0, spec(2)) for j in ("a", "b", "c")], parse_cluster("2x4"))
    sim = Simulator(t, make_policy("fifo"), config=SimConfig(restart_cost=0))
    for r in sim.records:
        sim.live[r.job.job_id] = r
        r.state = JobState.PENDING
    sim._grant(sim.by_id["a"], (Placement("n000", 1), Placement("n001", 1)), Plan(dp=2), 0.0)
    sim._grant(sim.by_id["b"], (Placement("n000", 2),), Plan(dp=2), 0.0)
    records = {
        "a": JobRecord(job_id="a", spec=spec(2), state=JobState.RUNNING, plan=Plan(dp=2),
                       placement=[NodePlacement(node="n001", gpus=[3]), NodePlacement(node="n000", gpus=[0])]),
        "b": JobRecord(job_id="b", spec=spec(2), state=JobState.SCHEDULED, plan=Plan(dp=2),
                       placement=[NodePlacement(node="n000", gpus=[1, 2])]),
        "c": JobRecord(job_id="c", spec=spec(2)),
    }
    for d in [Decision({"a": alloc(("n000", 1, 0), ("n001", 1, 0)), "b": alloc(("n001", 2, 0))}),
              Decision({"c": alloc(("n001", 2, 0)), "b": alloc(("n000", 2, 0))}),
              Decision({"b": alloc(("n000", 2, 0), plan=Plan(dp=1, tp=2)), "a": alloc(("n001", 1, 0), ("n000", 1, 0))})]:
        assert diff(sim.running, d) == diff(capacity.holding(records.values()), d)


def test_simulator_jobs_move_along_the_bus_state_machine_and_an_illegal_move_raises():
    t = Trace("toy", [TraceJob("a", 0, spec(1))], parse_cluster("1x4"))
    sim = Simulator(t, make_policy("fifo"), config=SimConfig(restart_cost=0, noise=0))
    r = sim.records[0]
    assert r.state is None  # not arrived: no record on the bus either
    with pytest.raises(InvalidTransition, match="not submitted -> running"):
        move(r, JobState.RUNNING)
    move(r, JobState.PENDING)
    with pytest.raises(InvalidTransition, match="pending -> running"):  # a start passes SCHEDULED
        move(r, JobState.RUNNING)
    res = Simulator(t, make_policy("fifo"), config=SimConfig(restart_cost=0, noise=0)).run()
    done = res.records[0]
    assert done.state == JobState.COMPLETED
    for new in (JobState.PENDING, JobState.SCHEDULED, JobState.RUNNING):
        with pytest.raises(InvalidTransition, match=f"completed -> {new.value} is not allowed"):
            move(done, new)


def test_capabilities_are_declared_protocols_and_wrappers_offer_what_they_carry_out():
    rubick, fifo, antman = make_policy("rubick"), make_policy("fifo"), make_policy("antman")
    assert isinstance(rubick, BudgetedPolicy) and not isinstance(fifo, BudgetedPolicy)
    assert isinstance(antman, KeyOrderedPolicy) and not isinstance(rubick, KeyOrderedPolicy)
    assert isinstance(make_policy("sia"), TypeAwarePolicy) and make_policy("sia").hetero
    rubick.set_budget({"t": 8.0})  # the per-type wrapper passes it to every instance, present and future
    assert rubick.inner("a100").budget == rubick.inner("v100").budget == {"t": 8.0}
    assert rubick.inner("a100") is not rubick.inner("v100")

    class Plain:
        def throughput(self, job, plan, placement):
            return 1.0

    class Planning(Plain):
        revision = 3

        def plans(self, job, placement):
            return [Plan(dp=sum(p.gpus for p in placement))]

    assert not supports(Plain(), PlanningOracle) and supports(Planning(), PlanningOracle)
    assert not supports(TypedOracle(Plain(), "a100"), PlanningOracle)
    typed = TypedOracle(Planning(), "a100")
    assert supports(typed, PlanningOracle) and typed.revision == 3 and TypedOracle(Plain(), "a100").revision == 0


def test_operator_pins_keep_the_gpu_type_rule_the_check_enforces():
    nodes = [NodeState("a0", 4, 4, 16, 16, gpu_type="a100"), NodeState("v0", 4, 4, 16, 16, gpu_type="v100")]
    jobs = {"p": Live(2, ("v100",)), "q": Live(4)}

    def rec(jid, shares, types=("v100",)):
        pin = PinnedPlan(plan=Plan(dp=sum(g for _, g in shares) or 2), placement=[NodeShare(node=n, gpus=g) for n, g in shares])
        return JobRecord(job_id=jid, spec=spec(pin.plan.gpus, types), pinned=pin)

    # first fit goes to a type the job accepts, not to the first node by name
    d = Decision()
    capacity.apply_pins(d, {"p": rec("p", [])}, nodes, {"p"})
    assert [p.node for p in d.allocations["p"].placement] == ["v0"]
    check_decision(d, nodes, jobs)
    # an explicit pin across types waits (the check would refuse the round)
    d = Decision()
    capacity.apply_pins(d, {"q": rec("q", [("a0", 2), ("v0", 2)], None)}, nodes, {"q"})
    assert "q" not in d.allocations and "waits" in d.waiting["q"]
