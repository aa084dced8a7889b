"""Baselines on hand-made scenarios whose right answer is known."""

from policy_helpers import CurveOracle, job, nodes

from gearshift.bus_schema.messages import Plan
from gearshift.policies import check_decision, make_policy
from gearshift.policies.api import Placement


def run(name, ns, js, now=10_000.0, perf=None, **opts):
    pol = make_policy(name, **opts)
    d = pol.schedule(now, ns, js, perf)
    check_decision(d, ns, {j.job_id: j for j in js})
    for j in js:  # every job is either allocated or has a reason
        assert (j.job_id in d.allocations) != (j.job_id in d.waiting)
        assert d.allocations[j.job_id].reason if j.job_id in d.allocations else d.waiting[j.job_id]
    return d


def test_fifo_head_of_line_blocks():
    ns = nodes(1)
    d = run("fifo", ns, [job("a", 4, t=0), job("big", 8, t=1), job("small", 2, t=2)])
    assert set(d.allocations) == {"a"}
    assert "behind big" in d.waiting["small"]


def test_las_preempts_job_with_more_service():
    ns = nodes(1)
    old = job("old", 8, t=0, attained=50_000, running_on=(Placement("n0", 8, 16),), since=0)
    new = job("new", 8, t=100)
    d = run("las", ns, [old, new])
    assert "new" in d.allocations and "old" in d.waiting and "preempted" in d.waiting["old"]


def test_las_respects_min_run_time():
    ns = nodes(1)
    old = job("old", 8, t=0, attained=50_000, running_on=(Placement("n0", 8, 16),), since=9_900)
    d = run("las", ns, [old, job("new", 8, t=100)], now=10_000.0, min_run_time=300)
    assert "old" in d.allocations and "new" in d.waiting


def test_tiresias_demotes_job_past_threshold():
    ns = nodes(1)
    thr = (3600.0,)
    # 'a' arrived first; while under the threshold it keeps the GPUs (FIFO in queue 0)
    a = job("a", 8, t=0, attained=3000, running_on=(Placement("n0", 8, 16),), since=0)
    b = job("b", 8, t=50)
    d = run("tiresias", ns, [a, b], thresholds=thr)
    assert "a" in d.allocations and "b" in d.waiting
    # once it passes the threshold it drops to queue 1 and 'b' (queue 0) preempts it
    a.attained_service = 3700
    d = run("tiresias", ns, [a, b], thresholds=thr)
    assert "b" in d.allocations and "a" in d.waiting
    assert "queue 1" in d.waiting["a"]


def test_antman_never_delays_guaranteed_for_opportunistic():
    ns = nodes(2)
    opp = [job(f"o{i}", 4, t=i, running_on=(Placement(f"n{i // 2}", 4, 8),), since=9_990) for i in range(4)]
    g = job("g", 8, t=100, guaranteed=True)
    d = run("antman", ns, [*opp, g], min_run_time=600)
    assert "g" in d.allocations
    assert sum(1 for o in opp if o.job_id in d.waiting) == 2  # exactly one node's worth evicted


def test_antman_guaranteed_does_not_evict_guaranteed():
    ns = nodes(1)
    g1 = job("g1", 8, t=0, guaranteed=True, running_on=(Placement("n0", 8, 16),), since=0)
    g2 = job("g2", 8, t=1, guaranteed=True)
    o = job("o", 1, t=2)
    d = run("antman", ns, [g1, g2, o])
    assert "g1" in d.allocations and "g2" in d.waiting and "o" in d.waiting


def test_synergy_best_case_then_proportional_then_shrinks_peers():
    ns = nodes(1, gpus=8, cpus=32)  # proportional share 4 CPUs/GPU
    perf = CurveOracle(cpu_knee=8)  # every job wants 8 CPUs/GPU
    hog = job("hog", 4, t=0, running_on=(Placement("n0", 4, 32),), since=0)  # holds all CPUs
    new = job("new", 4, t=1)
    d = run("synergy", ns, [hog, new], perf=perf)
    assert "new" in d.allocations
    assert d.allocations["new"].placement[0].cpus == 16  # proportional 4/GPU
    assert d.allocations["hog"].placement[0].cpus == 16  # cut back to its share
    assert "CPUs cut" in d.allocations["hog"].reason
    # alone, a job gets its best case
    d = run("synergy", nodes(1, gpus=8, cpus=64), [job("solo", 4)], perf=perf)
    assert d.allocations["solo"].placement[0].cpus == 32


def test_sia_gives_gpus_to_the_job_that_scales():
    ns = nodes(1)
    # p = -0.5: lin on 8 GPUs scores (8/1)^-0.5 - 1.1 = -0.75; lin on 4 plus flat
    # on anything scores (4)^-0.5 - 1.1 + 1 - 1.1 = -0.70: the ILP gives lin all 8.
    perf = CurveOracle({"lin": {1: 1, 2: 2, 4: 4, 8: 8}, "flat": {1: 1, 2: 1, 4: 1, 8: 1}})
    d = run("sia", ns, [job("lin", 4, cpg=1, curve="lin"), job("flat", 4, cpg=1, curve="flat")], perf=perf)
    assert d.allocations["lin"].plan.gpus == 8 and "flat" in d.waiting


def test_sia_keeps_user_plan_family():
    ns = nodes(2)
    p = Plan(dp=1, tp=2, pp=2, ga=4)
    d = run("sia", ns, [job("j", 4, plan=p, batch=64, cpg=1)], perf=CurveOracle())
    got = d.allocations["j"].plan
    assert (got.tp, got.pp) == (2, 2) and got.gpus % 4 == 0


def test_gavel_max_min_shares_and_rotation():
    ns = nodes(1)
    js = [job(f"j{i}", 4, t=0) for i in range(4)]  # 16 GPUs of demand on 8
    pol = make_policy("gavel")
    x = pol.shares(js, 8)
    assert x == __import__("pytest").approx([0.5] * 4)
    # jobs that ran less than their share come first
    for i, j in enumerate(js):
        j.attained_service = 4 * (1000 if i < 2 else 0)
    d = run("gavel", ns, js, now=4000.0)
    assert {"j2", "j3"} == set(d.allocations)


def test_sia_restart_factor_keeps_a_young_job_in_place():
    ns = nodes(1)
    perf = CurveOracle({"lin": {1: 1, 2: 2, 4: 4, 8: 8}})
    # running on 4 of 8 GPUs for 100 s with 2 restarts: (age - 2*260)/(age + 260) < 0, so
    # growing to 8 is not worth it; an old job with no restarts does grow
    young = job("y", 4, t=9_900, cpg=1, curve="lin", running_on=(Placement("n0", 4, 4),), since=9_900)
    young.restarts = 2
    d = run("sia", ns, [young], restart_cost=260, min_run_time=0)
    assert d.allocations["y"].placement == young.placement
    old = job("o", 4, t=0, cpg=1, curve="lin", running_on=(Placement("n0", 4, 4),), since=0)
    d = run("sia", ns, [old], restart_cost=260, min_run_time=0)
    assert d.allocations["o"].plan.gpus == 8


def test_gavel_round_is_at_least_four_restarts_on_one_gpu_type_too():
    """A 30B model restores for minutes: Gavel's 360 s round would preempt it before it
    trained; its round is four restarts long (as on mixed types), so at 400 s it keeps
    its GPUs although the waiting job ran less."""
    from msgspec.structs import replace

    from gearshift.bus_schema.messages import ModelSpec
    from gearshift.perfmodel.restart import restart_seconds

    ns = nodes(1)
    big = job("big", 8, t=0, running_on=(Placement("n0", 8, 16),), since=0.0, attained=8 * 400.0)
    big.spec = replace(big.spec, model=ModelSpec(name="llama30", params=30_000, layers=60, hidden=6656, seq_len=2048))
    assert 4 * restart_seconds(big.spec) > 400
    small = job("small", 8, t=0)
    d = run("gavel", ns, [big, small], now=400.0)
    assert set(d.allocations) == {"big"}
    d = run("gavel", ns, [big, small], now=4 * restart_seconds(big.spec) + 1)
    assert set(d.allocations) == {"small"}
