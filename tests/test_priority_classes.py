"""Priority classes are read by every policy, with or without the sharing parts (issue 13)."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from gearshift.policies import Placement, check_decision, make_policy
from tests.policy_helpers import CurveOracle, job, nodes

PREEMPTIVE = ["las", "srtf", "tiresias", "rubick", "sia", "gavel"]
ALL = PREEMPTIVE + ["fifo", "fifo-easy", "antman", "synergy"]


def cj(jid, gpus, prio, **kw):
    j = job(jid, gpus, **kw)
    j.spec = replace(j.spec, priority=prio, step_time=1.0)
    return j


def decide(name, now, jobs, n=1):
    ns = nodes(n)
    pol = make_policy(name, restart_cost=0.0, min_run_time=600.0)
    d = pol.schedule(now, ns, jobs, CurveOracle())
    check_decision(d, ns, {j.job_id: j for j in jobs})
    return d


@pytest.mark.parametrize("name", ALL)
def test_higher_class_is_ordered_first(name):
    """Two waiting jobs that cannot both run: the later one of the higher class starts."""
    low = cj("low", 8, 0, t=0.0)
    high = cj("high", 8, 3, t=50.0)
    d = decide(name, 100.0, [low, high])
    assert "high" in d.allocations and "low" not in d.allocations, (name, d.waiting)


@pytest.mark.parametrize("name", PREEMPTIVE)
def test_higher_class_preempts_the_lowest_class_past_its_minimum_run_time(name):
    mid = cj("mid", 4, 1, running_on=(Placement("n0", 4, 8),), since=0.0)
    low = cj("low", 4, 0, running_on=(Placement("n0", 4, 8),), since=0.0)
    high = cj("high", 4, 5, t=900.0)
    d = decide(name, 1000.0, [mid, low, high])
    assert "high" in d.allocations and "mid" in d.allocations and "low" not in d.allocations, (name, d.waiting)


@pytest.mark.parametrize("name", PREEMPTIVE)
def test_a_job_inside_its_minimum_run_time_is_not_taken_for_a_higher_class(name):
    low = cj("low", 8, 0, running_on=(Placement("n0", 8, 16),), since=900.0)  # ran 100 s of 600
    high = cj("high", 8, 5, t=950.0)
    d = decide(name, 1000.0, [low, high])
    assert "low" in d.allocations and "high" not in d.allocations, (name, d.allocations)


def test_one_class_leaves_every_decision_as_the_policy_made_it():
    from gearshift.policies.api import Decision
    from gearshift.policies.classes import enforce

    jobs = [cj("a", 8, 2, t=0.0), cj("b", 8, 2, t=1.0)]
    d = Decision(waiting={"a": "x", "b": "y"})
    assert enforce(0.0, nodes(1), jobs, d, min_run_time=0.0, name="p") is d and not d.allocations


def test_repairs_place_a_job_on_one_gpu_type_it_accepts():
    """On a mixed cluster the sharing and class repairs keep a job on one accepted type."""
    from dataclasses import dataclass

    from gearshift.policies import typed_place
    from gearshift.policies.api import NodeState, default_plan
    from gearshift.policies.placement import Ledger

    @dataclass(slots=True)
    class TypedNode(NodeState):  # NodeState with its GPU type (field of its own once types are merged)
        gpu_type: str = ""

    ns = [TypedNode("a0", 4, 4, 32, 32, gpu_type="a100"), TypedNode("v0", 4, 4, 32, 32, gpu_type="v100"),
          TypedNode("v1", 4, 4, 32, 32, gpu_type="v100")]
    j = cj("j", 8, 0)
    spot = typed_place.place(Ledger(ns), j, default_plan(j.spec))
    assert {p.node for p in spot} == {"v0", "v1"}  # only the v100 nodes hold 8; never across types
    small = cj("s", 4, 0)
    assert {p.node for p in typed_place.place(Ledger(ns), small, default_plan(small.spec), prefer=("a0",))} == {"a0"}
    if "gpu_types" in type(j.spec).__struct_fields__:  # a job that accepts only a100 does not fit 8
        j.spec = replace(j.spec, gpu_types=("a100",))
        assert typed_place.place(Ledger(ns), j, default_plan(j.spec)) is None
