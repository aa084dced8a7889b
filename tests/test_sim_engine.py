"""The simulator against hand-computed schedules, and attempts to break its invariants."""

from __future__ import annotations

import pytest

from gearshift.bus_schema.messages import JobSpec, JobState, ModelSpec, Plan
from gearshift.policies.api import AllocationError, Decision, JobDecision, Placement
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import InvariantError, SimConfig, Simulator, advance, check_capacity, simulate
from gearshift.sim.metrics import per_job_csv_text, summarize
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

MODEL = ModelSpec(name="toy", params=10.0, layers=2, hidden=64, seq_len=16)


def job(jid: str, submit: float, gpus: int, steps: int, step_time: float = 1.0, guaranteed: bool = False) -> TraceJob:
    spec = JobSpec(name=jid, model=MODEL, global_batch=8, steps=steps, gpus=gpus, plan=Plan(dp=gpus),
                   step_time=step_time, guaranteed=guaranteed)
    return TraceJob(jid, submit, spec)


def trace(*jobs: TraceJob, cluster: str = "1x4") -> Trace:
    return Trace("toy", list(jobs), parse_cluster(cluster))


def finishes(res) -> dict[str, tuple[float, float]]:
    return {r.job.job_id: (r.first_start, r.finish) for r in res.records}


# ---------------------------------------------------------------- FIFO by hand
def test_fifo_event_rounds_match_hand_schedule():
    # 1 node x 4 GPUs, restart cost 10 s, rounds on arrival/completion.
    # A(2 GPUs, 100 s) starts at 0, runs from 10, ends 110. B(4 GPUs) arrives at 10 and
    # cannot fit; C(1 GPU) arrives at 20 and waits behind B (strict FIFO). At 110 B
    # starts: 110+10+50 = 170; then C: 170+10+30 = 210.
    t = trace(job("A", 0, 2, 100), job("B", 10, 4, 50), job("C", 20, 1, 30))
    res = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=10, noise=0))
    assert finishes(res) == {"A": (0, 110), "B": (110, 170), "C": (170, 210)}
    s = summarize(res)
    assert s["avg_jct_s"] == pytest.approx((110 + 160 + 190) / 3)
    assert s["makespan_s"] == pytest.approx(210)
    assert s["avg_queue_delay_s"] == pytest.approx((0 + 100 + 150) / 3)
    assert s["restart_lost_s"] == pytest.approx(30)
    assert s["preemptions"] == s["reconfigurations"] == 0


def test_fifo_interval_only_rounds_match_hand_schedule():
    # Blox semantics: decisions only every 60 s. A starts at 0 and ends at 110; B is
    # placed at the round at 120 (ends 180); C at the round at 180 (ends 220).
    t = trace(job("A", 0, 2, 100), job("B", 10, 4, 50), job("C", 20, 1, 30))
    cfg = SimConfig(interval=60, restart_cost=10, noise=0, round_on_arrival=False, round_on_completion=False)
    res = simulate(t, make_policy("fifo"), config=cfg)
    assert finishes(res) == {"A": (0, 110), "B": (120, 180), "C": (180, 220)}


def test_fifo_backfill_is_not_done_and_idle_gaps_are_skipped():
    # Two 1-GPU jobs far apart: the second starts on arrival, JCT = restart + work.
    t = trace(job("A", 0, 1, 5), job("B", 100_000, 1, 5))
    res = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=0, noise=0))
    assert finishes(res) == {"A": (0, 5), "B": (100_000, 100_005)}
    assert res.rounds <= 4  # no empty rounds over the idle gap


# ---------------------------------------------------------------- policies that try to cheat
class Scripted:
    """A policy that returns whatever the test scripts, given the live job views."""

    name = "scripted"

    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def schedule(self, now, nodes, jobs, perf):
        self.calls += 1
        return self.fn(now, nodes, {j.job_id: j for j in jobs}, self.calls)


def alloc(node: str, gpus: int, cpus: int = 0) -> JobDecision:
    return JobDecision((Placement(node, gpus, cpus),), Plan(dp=gpus))


def test_over_allocating_one_job_is_refused():
    pol = Scripted(lambda now, nodes, jobs, n: Decision({"A": alloc("n000", 5)}))
    with pytest.raises(AllocationError, match="5 GPUs allocated"):
        simulate(trace(job("A", 0, 5, 10), cluster="2x4"), pol)


def test_two_jobs_sharing_a_node_beyond_capacity_are_refused():
    pol = Scripted(lambda now, nodes, jobs, n: Decision({j: alloc("n000", 3) for j in jobs}))
    with pytest.raises(AllocationError, match="node n000"):
        simulate(trace(job("A", 0, 3, 10), job("B", 0, 3, 10), cluster="2x4"), pol)


def test_adding_a_job_onto_a_node_a_running_job_fills_is_refused():
    # Round 1 starts A on all of n000; round 2 keeps A and also puts B there.
    def fn(now, nodes, jobs, n):
        d = Decision({"A": alloc("n000", 4)})
        if "B" in jobs:
            d.allocations["B"] = alloc("n000", 1)
        return d

    with pytest.raises(AllocationError, match="n000"):
        simulate(trace(job("A", 0, 4, 1000), job("B", 30, 1, 10), cluster="2x4"), Scripted(fn))


def test_cpu_over_allocation_is_refused():
    pol = Scripted(lambda now, nodes, jobs, n: Decision({"A": alloc("n000", 1, cpus=10_000)}))
    with pytest.raises(AllocationError, match="CPUs"):
        simulate(trace(job("A", 0, 1, 10)), pol)


@pytest.mark.parametrize("bad", [
    lambda: Decision({"ghost": alloc("n000", 1)}),
    lambda: Decision({"A": alloc("nowhere", 1)}),
    lambda: Decision({"A": JobDecision((Placement("n000", 2),), Plan(dp=1))}),
    lambda: Decision({"A": JobDecision((), Plan(dp=1))}),
    lambda: Decision({"A": JobDecision((Placement("n000", -1), Placement("n000", 2)), Plan(dp=1))}),
])
def test_malformed_decisions_are_refused(bad):
    with pytest.raises(AllocationError):
        simulate(trace(job("A", 0, 1, 10)), Scripted(lambda *a: bad()))


def test_a_finished_job_cannot_be_given_gpus():
    # A finishes at 10; the policy keeps naming it afterwards.
    def fn(now, nodes, jobs, n):
        return Decision({"A": alloc("n000", 1), **({"B": alloc("n000", 1)} if "B" in jobs else {})})

    with pytest.raises(AllocationError, match="unknown or finished job 'A'"):
        simulate(trace(job("A", 0, 1, 10), job("B", 500, 1, 10)), Scripted(fn), config=SimConfig(restart_cost=0))


def test_progress_only_while_holding_an_allocation():
    # The policy runs A only in odd rounds (60 s each); A must gain steps only in those.
    seen = []

    def fn(now, nodes, jobs, n):
        seen.append((n, jobs["A"].steps_done if "A" in jobs else None))
        return Decision({"A": alloc("n000", 1)} if n % 2 == 1 else {})

    res = simulate(trace(job("A", 0, 1, 200)), Scripted(fn),
                   config=SimConfig(interval=60, restart_cost=0, noise=0, round_on_arrival=False))
    steps = dict(seen)
    for n in range(2, max(steps)):
        if steps.get(n + 1) is None or steps.get(n) is None:
            continue
        if n % 2 == 0:  # not running between round n and n+1
            assert steps[n + 1] == steps[n]
        else:
            assert steps[n + 1] == pytest.approx(steps[n] + 60)
    r = res.records[0]
    assert r.finish is not None and r.steps_done == 200
    assert r.preemptions >= 2


def test_policy_tampering_with_views_does_not_change_the_simulation():
    # A policy writes steps_done = steps into its views: the job must still take its time.
    def fn(now, nodes, jobs, n):
        for v in jobs.values():
            v.steps_done = v.spec.steps
            v.placement = ()
        return Decision({"A": alloc("n000", 1)})

    res = simulate(trace(job("A", 0, 1, 100)), Scripted(fn), config=SimConfig(restart_cost=0, noise=0))
    assert res.records[0].finish == pytest.approx(100)


def test_engine_refuses_progress_of_a_pending_job_and_steps_beyond_total():
    sim = Simulator(trace(job("A", 0, 1, 100)), make_policy("fifo"), config=SimConfig(restart_cost=0))
    r = sim.records[0]
    r.state = JobState.PENDING
    with pytest.raises(InvariantError, match="without holding"):
        advance(r, 10.0)
    sim._grant(r, (Placement("n000", 1),), Plan(dp=1), 0.0)
    r.rate = 10.0  # pretend it suddenly runs 10x faster than its completion was scheduled for
    with pytest.raises(InvariantError, match="steps done"):
        advance(r, 50.0)


def test_reconfiguring_every_round_pays_restart_cost_and_never_progresses():
    # Switch A between two nodes every 60 s with a 260 s restart: A never makes progress.
    pol = Scripted(lambda now, nodes, jobs, n: Decision({"A": alloc(f"n00{n % 2}", 1)}))
    cfg = SimConfig(interval=60, restart_cost=260, noise=0, horizon=3600)
    res = simulate(trace(job("A", 0, 1, 100), cluster="2x4"), pol, config=cfg)
    r = res.records[0]
    assert r.finish is None and r.steps_done == 0
    assert r.reconfigs >= 50
    assert r.restart_lost == pytest.approx(3600, abs=60)
    assert summarize(res)["unfinished"] == 1


def test_same_seed_same_per_job_csv_and_seed_matters_where_unmeasured():
    from gearshift.sim.loaders import load_named

    t = load_named("rubick-mt").head(80)

    def run(seed):
        return per_job_csv_text([simulate(t, make_policy("fifo"), config=SimConfig(seed=seed))])

    a, b, c = run(3), run(3), run(4)
    assert a == b
    assert a != c  # FIFO spreads some jobs over nodes; those speeds are unmeasured, hence noisy


def test_guaranteed_job_kept_when_run_as_requested():
    t = trace(job("A", 0, 2, 100, guaranteed=True), job("B", 0, 2, 100))
    res = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=10, noise=0))
    s = summarize(res)
    assert s["guaranteed_accepted"] == 1 and s["guarantees_kept"] == 1
    assert s["guaranteed_avg_jct_ratio"] == pytest.approx(1.0)


def test_guaranteed_and_best_effort_jobs_are_summarised_apart():
    # 1 node x 2 GPUs, FIFO: A (guaranteed, 100 s) runs 0-110 with a 10 s restart, B
    # (best effort, 100 s) waits for it and runs 110-220, C (best effort, 50 s) 220-280.
    t = trace(job("A", 0, 2, 100, guaranteed=True), job("B", 0, 2, 100), job("C", 0, 2, 50), cluster="1x2")
    s = summarize(simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=10, noise=0)))
    g, b = s["by_guarantee"]["guaranteed"], s["by_guarantee"]["best_effort"]
    assert (g["finished"], b["finished"]) == (1, 2)
    assert g["avg_jct_s"] == pytest.approx(110) and g["median_jct_s"] == pytest.approx(110)
    assert b["avg_jct_s"] == pytest.approx((220 + 280) / 2) and b["median_jct_s"] == pytest.approx(250)
    assert (g["avg_jct_s"] + 2 * b["avg_jct_s"]) / 3 == pytest.approx(s["avg_jct_s"])
    # with no guaranteed job there is nothing to split (and the summary keeps its keys)
    t = trace(job("B", 0, 2, 100), cluster="1x2")
    assert "by_guarantee" not in summarize(simulate(t, make_policy("fifo"), config=SimConfig(noise=0)))


# ---------------------------------------------------------------- Tiresias by hand
@pytest.mark.parametrize("restart, expect", [
    # 1 node x 2 GPUs, queue threshold 200 GPU-s, rounds every 60 s and on events.
    # A (2 GPUs, 300 s) starts at 0. B (2 GPUs, 100 s) arrives at 50: both in queue 0,
    # A ahead by arrival, B waits. A passes 200 GPU-s at 100; the round at 120 sees it
    # in queue 1, so B preempts it (B: 120 -> 220). A resumes at 220 with 180 s left.
    (0.0, {"A": (0, 400), "B": (120, 220)}),
    # With a 10 s restart: A has done 110 steps at 120; B runs 130-230; A restarts at
    # 230, trains from 240 for its last 190 steps -> 430.
    (10.0, {"A": (0, 430), "B": (120, 230)}),
])
def test_tiresias_matches_hand_schedule(restart, expect):
    policy = make_policy("tiresias", thresholds=(200.0,), min_run_time=0.0)
    t = trace(job("A", 0, 2, 300), job("B", 50, 2, 100), cluster="1x2")
    res = simulate(t, policy, config=SimConfig(interval=60, restart_cost=restart, noise=0))
    assert finishes(res) == expect
    a = next(r for r in res.records if r.job.job_id == "A")
    assert a.preemptions == 1 and a.starts == 2
    assert a.restart_lost == pytest.approx(2 * restart)


@pytest.mark.parametrize("measured", [False, True])
def test_measured_targets_tell_policies_the_request_speed(measured):
    seen = []

    def fn(now, nodes, jobs, n):
        seen.append(jobs["A"].target_throughput)
        return Decision({"A": alloc("n000", 2)})

    simulate(trace(job("A", 0, 2, 10, step_time=0.5, guaranteed=True)), Scripted(fn),
             config=SimConfig(restart_cost=0, noise=0, measured_targets=measured))
    assert seen[0] == (pytest.approx(8 / 0.5) if measured else None)  # global batch 8 / 0.5 s per step


def test_capacity_invariant_checks_the_nodes_that_changed_and_catches_bad_bookkeeping():
    # A runs on n000 and B on n001; the check of the nodes a round touched sums the jobs
    # on them (Simulator.on_node) and agrees with the whole-cluster check...
    sim = Simulator(trace(job("A", 0, 4, 10 ** 6), job("B", 0, 2, 10 ** 6), cluster="2x4"), make_policy("fifo"),
                    config=SimConfig(horizon=600))
    sim.run()
    check_capacity(sim)
    check_capacity(sim, range(2))
    held = {sim.node_names[i]: sorted(sim.on_node[i]) for i in range(2)}
    assert held == {"n000": ["A"], "n001": ["B"]}
    # ... and refuses free-capacity bookkeeping that is off on a checked node, or a job
    # listed on a node it no longer runs on
    sim.free_g[1] += 1
    with pytest.raises(InvariantError, match="n001: free-capacity bookkeeping is off"):
        check_capacity(sim, [1])
    sim.free_g[1] -= 1
    sim.records[0].state = JobState.PENDING
    with pytest.raises(InvariantError, match="job A holds GPUs there without running"):
        check_capacity(sim, [0])
