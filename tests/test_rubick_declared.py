"""rubick learns steps left from finished jobs when declarations are upper bounds."""

import math

from policy_helpers import job

from gearshift.policies.api import Decision, JobDecision, Placement
from gearshift.policies.rubick_declared import DeclaredSteps


def _round(ds, now, jobs, thr=8.0):
    ds.observe(now, jobs, lambda j: 0.0)
    d = Decision(allocations={j.job_id: JobDecision(j.placement, j.plan, "kept", thr) for j in jobs})
    ds.remember(now, jobs, d)


def test_learns_the_ratio_of_steps_run_to_steps_declared():
    ds = DeclaredSteps(min_samples=5)
    probe = job("probe", 1, steps=100, done=10)
    assert ds.remaining(probe) == 90  # nothing learned: the declaration
    for k in range(5):
        # declared 100; at t=0 done 40, 8 samples/s / batch 64 = 0.125 steps/s, gone at t=80: ran 50
        j = job(f"j{k}", 1, steps=100, done=40, running_on=(Placement("n0", 1, 2),), since=-1000)
        _round(ds, 0.0, [j])
        _round(ds, 80.0, [])
    assert math.isclose(ds.ratio, 0.5)
    assert math.isclose(ds.remaining(probe), 40.0)  # 100 x 0.5 - 10
    far = job("far", 1, steps=100, done=70)
    assert math.isclose(ds.remaining(far), 3.0)  # past the typical ratio: floor 0.1 x the 30 declared left


def test_exact_declarations_are_believed():
    ds = DeclaredSteps(min_samples=1)
    for k in range(3):
        j = job(f"j{k}", 1, steps=100, done=95, running_on=(Placement("n0", 1, 2),), since=-1000)
        _round(ds, 0.0, [j])
        _round(ds, 60.0, [])  # 95 + 0.125 x 60 > 100: capped at the declaration
    assert ds.ratio == 1.0 and ds.remaining(job("p", 1, steps=100, done=10)) == 90


def test_a_job_left_waiting_round_after_round_teaches_what_it_ran():
    """``remember`` leaves a waiting job's entry as it was while its steps do not move
    (its rate is 0: ``observe`` reads only its steps); when it leaves, it is learned from
    as if written every round: it ran the steps it had."""
    ds = DeclaredSteps(min_samples=1)
    waiting = job("w", 1, steps=1000, done=100)
    for t in (0.0, 30.0, 60.0):
        ds.observe(t, [waiting], lambda j: 0.0)
        ds.remember(t, [waiting], Decision())
        assert ds._last["w"][:4] == (0.0, 100, 1000.0, 0.0)  # written once, at its first round
    waiting.steps_done = 150  # (it ran in between, as a preempted job had)
    ds.observe(90.0, [waiting], lambda j: 0.0)
    ds.remember(90.0, [waiting], Decision())
    assert ds._last["w"][:4] == (90.0, 150, 1000.0, 0.0)
    ds.observe(120.0, [], lambda j: 0.0)  # gone
    assert math.isclose(math.exp(ds.ratios[-1]), 0.15)
