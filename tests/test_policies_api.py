import pytest
from policy_helpers import job, nodes

from gearshift.bus_schema.messages import Plan
from gearshift.policies import make_policy, policy_names
from gearshift.policies.api import AllocationError, Decision, JobDecision, Placement
from gearshift.policies.decision import check_decision


def _jobs(*js):
    return {j.job_id: j for j in js}


def test_check_decision_refuses_gpu_over_allocation():
    ns = nodes(1, gpus=8)
    a, b = job("a", 6), job("b", 4)
    d = Decision({"a": JobDecision((Placement("n0", 6, 6),), Plan(dp=6)),
                  "b": JobDecision((Placement("n0", 4, 4),), Plan(dp=4))})
    with pytest.raises(AllocationError, match="GPUs allocated"):
        check_decision(d, ns, _jobs(a, b))


def test_check_decision_refuses_cpu_over_allocation():
    ns = nodes(1, gpus=8, cpus=16)
    a, b = job("a", 2), job("b", 2)
    d = Decision({"a": JobDecision((Placement("n0", 2, 12),), Plan(dp=2)),
                  "b": JobDecision((Placement("n0", 2, 8),), Plan(dp=2))})
    with pytest.raises(AllocationError, match="CPUs allocated"):
        check_decision(d, ns, _jobs(a, b))


@pytest.mark.parametrize("bad", ["plan", "node", "dup", "both"])
def test_check_decision_refuses_inconsistent(bad):
    ns = nodes(2)
    a = job("a", 4)
    pl = (Placement("n0", 4, 4),)
    plan = Plan(dp=4)
    d = Decision()
    if bad == "plan":
        d.allocations["a"] = JobDecision(pl, Plan(dp=8))
    elif bad == "node":
        d.allocations["a"] = JobDecision((Placement("nX", 4, 4),), plan)
    elif bad == "dup":
        d.allocations["a"] = JobDecision((Placement("n0", 2, 2), Placement("n0", 2, 2)), plan)
    else:
        d.allocations["a"] = JobDecision(pl, plan)
        d.waiting["a"] = "waiting"
    with pytest.raises(AllocationError):
        check_decision(d, ns, _jobs(a))


def test_registry_has_every_named_policy_and_accepts_common_options():
    names = set(policy_names())
    assert {"fifo", "las", "srtf", "tiresias", "synergy", "antman", "sia", "rubick", "rubick-n", "rubick-r"} <= names
    for n in names:
        p = make_policy(n, restart_cost=30.0, min_run_time=120.0)
        assert p.name == n
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
