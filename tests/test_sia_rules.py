"""Sia's rules as its simulator has them (policies/sia_rules.py cites the code), each
against a case computed by hand."""

import pytest
from policy_helpers import CurveOracle, job, nodes

from gearshift.bus_schema.messages import Plan
from gearshift.policies import check_decision, make_policy
from gearshift.policies.api import Placement
from gearshift.policies.sia_rules import normalised, realloc_factor, restoring, utility


def test_normalisation_is_min_goodput_times_scale_unit():
    # rows 10, 18, 30 samples/s on 8, 16, 24 GPUs of 8-GPU replicas: 10 -> 8 (its scale unit)
    assert normalised([10.0, 18.0, 30.0], [8, 8, 8], [8, 16, 24]) == pytest.approx([8.0, 14.4, 24.0])
    # data parallel (unit 1): the smallest configuration is worth 1
    assert normalised([2.0, 3.0], [1, 1], [1, 2]) == pytest.approx([1.0, 1.5])


def test_rigid_job_is_worth_its_gpu_count_on_the_slowest_type():
    assert normalised([5.0], [8], [48]) == pytest.approx([48.0])
    # two GPU types, one configuration each: the slowest (3) is 48, the other 48 x 6/3
    assert normalised([3.0, 6.0], [8, 8], [48, 48]) == pytest.approx([48.0, 96.0])


def test_realloc_factor_with_the_jobs_own_restart():
    assert realloc_factor(1000.0, 2, 100.0) == pytest.approx(800 / 1100)
    assert realloc_factor(300.0, 5, 100.0) == 0.0  # max(300 - 500, 0) / 400
    assert realloc_factor(50.0, 3, 100.0) == 1.0  # younger than one restart: not penalised
    # a 530 s restart (a 30B model) against the 99 s trace mean
    assert realloc_factor(2000.0, 1, 530.0) == pytest.approx(1470 / 2530)


def test_utility_is_rounded_and_clipped():
    assert utility(8.0, 1.0, -0.5) == 0.35  # 8^-0.5 = 0.3536
    assert utility(4.0, 0.25, -0.5) == 1.0
    assert utility(1.0, 0.0, -0.5) == 3000.0


def test_a_big_jobs_only_configuration_is_worth_its_gpus():
    """8 GPUs; a job that runs only as one 8-GPU replica, and a 1-GPU job that scales
    to 8 at 2.5x. Min-normalised to 1, the big job's utility would be 1^-0.5 = 1 (gain
    0.1) and the small job's 2.5^-0.5 = 0.63 (gain 0.47): the small one would win. With
    the scale unit, the big job's is 8^-0.5 = 0.35 (gain 0.75): it runs."""
    ns = nodes(1)
    perf = CurveOracle({"small": {1: 1, 2: 1.5, 4: 2, 8: 2.5}})
    big = job("big", 8, cpg=1, plan=Plan(tp=8), batch=64)
    small = job("small", 1, cpg=1, curve="small")
    pol = make_policy("sia", restart_cost=99)
    d = pol.schedule(10_000.0, ns, [big, small], perf)
    check_decision(d, ns, {j.job_id: j for j in (big, small)})
    assert "big" in d.allocations and "small" in d.waiting


def _running(jid, gpus, since, restarts=0):
    j = job(jid, gpus, t=0, cpg=1, curve="lin", running_on=(Placement("n0", gpus, gpus),), since=since)
    j.restarts = restarts
    return j


def test_pinned_while_it_restores_for_its_own_restart():
    """Started 300 s ago on 4 of 8 GPUs; linear scaling makes 8 better. A flat 99 s
    restart says it has restored, so it grows; its own 530 s restart says it is still
    restoring: Sia never re-allocates a job in checkpoint-restore, so it keeps its 4."""
    ns = nodes(1)
    perf = CurveOracle({"lin": {1: 1, 2: 2, 4: 4, 8: 8}})
    now = 10_000.0
    j = _running("j", 4, since=now - 300)
    assert restoring(j, now, 530.0) and not restoring(j, now, 99.0)
    flat = make_policy("sia", restart_cost=99).schedule(now, ns, [j], perf)
    assert flat.allocations["j"].plan.gpus == 8
    own = make_policy("sia", restart_cost=99, restart_model=lambda spec: 530.0).schedule(now, ns, [j], perf)
    assert own.allocations["j"].placement == j.placement


def test_no_allocation_change_term_in_the_objective():
    """The ILP's cost of each configuration is utility - lambda_n and nothing more:
    running on 4 GPUs for 10 000 s with no restarts and a 100 s restart, the factor is
    10000/10100; 8 GPUs cost round((8/4 x 4 x f)^-0.5, 2) - 1.1 (no +lambda_a)."""
    ns = nodes(1)
    perf = CurveOracle({"lin": {1: 1, 2: 2, 4: 4, 8: 8}})
    j = _running("j", 4, since=0)
    pol = make_policy("sia", restart_cost=100)
    seen = {}
    solve = pol._solve

    def spy(jobs, var, cost, total, pinned):
        seen.update({g: c for (_, g, _, _), c in zip(var, cost)})
        return solve(jobs, var, cost, total, pinned)

    pol._solve = spy
    pol.schedule(10_000.0, ns, [j], perf)
    f = 10_000 / 10_100
    assert seen[4] == pytest.approx(round(4 ** -0.5, 2) - 1.1)  # the one it holds: no factor
    assert seen[8] == pytest.approx(round((8 * f) ** -0.5, 2) - 1.1)
    assert seen[1] == pytest.approx(round((1 * f) ** -0.5, 2) - 1.1)


def test_the_simulator_tells_sia_each_jobs_own_restart():
    from gearshift.perfmodel.restart import restart_seconds
    from gearshift.sim.cli import make_named_policy

    sia = make_named_policy("sia", 0, 99.0, restart_model=restart_seconds)
    assert sia.restart_model is restart_seconds
    assert make_named_policy("fifo", 0, 99.0, restart_model=restart_seconds).name == "fifo"  # dropped where unused
