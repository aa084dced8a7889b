"""``loadtest.quiet_rounds.RoundWatch``: which rounds it calls still (nothing happened
since a round that changed nothing), on hand-made rounds."""

from __future__ import annotations

from policy_helpers import job, nodes

from gearshift.bus_schema.messages import Plan
from gearshift.policies.api import Decision, JobDecision, Placement
from loadtest.quiet_rounds import RoundWatch

ON = (Placement("n0", 1, 2),)


class Scripted:
    """Returns the decisions it is given, one per round."""

    def __init__(self, decisions):
        self.decisions = list(decisions)

    def schedule(self, now, nodes, jobs, perf):
        return self.decisions.pop(0)


def _keep(a, b=None) -> Decision:
    d = Decision({"a": JobDecision(a.placement, a.plan, "kept")})
    if b is not None:
        d.waiting["b"] = "waiting: behind a"
    return d


def test_still_rounds_are_those_after_a_round_that_changed_nothing():
    a, b = job("a", 1, running_on=ON, plan=Plan(dp=1)), job("b", 1, t=1.0)
    start_b = Decision({"a": JobDecision(ON, a.plan, "kept"), "b": JobDecision((Placement("n0", 1, 2),), Plan(dp=1), "go")})
    w = RoundWatch(Scripted([_keep(a, b), _keep(a, b), _keep(a, b), start_b, _keep(a, b)]))
    cluster = nodes(1)
    w(0.0, cluster, [a, b], None)  # the first round: nothing before it
    w(300.0, cluster, [a, b], None)  # still: the round before kept a, started nobody; same decision
    w(600.0, cluster, [a, b], None)  # still again
    w(900.0, cluster, [a, b], None)  # still, but the decision differs (b starts)
    w(1200.0, cluster, [a, b], None)  # not still: the round before started b
    r = w.report()
    assert (r["rounds"], r["still"], r["still_same_decision"], r["same_decision"]) == (5, 3, 2, 2)
    assert r["avg_live"] == 2 and r["avg_running"] == 1


def test_a_job_that_arrived_or_moved_makes_a_round_not_still():
    a, b = job("a", 1, running_on=ON, plan=Plan(dp=1)), job("b", 1, t=1.0)
    moved = job("a", 1, running_on=(Placement("n1", 1, 2),), plan=Plan(dp=1))
    w = RoundWatch(Scripted([_keep(a), _keep(a, b), _keep(moved, b)]))
    cluster = nodes(2)
    w(0.0, cluster, [a], None)
    w(300.0, cluster, [a, b], None)  # b arrived
    w(600.0, cluster, [moved, b], None)  # a holds something else than it did
    assert w.report()["still"] == 0
