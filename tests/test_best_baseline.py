"""synergy-srtf and the best-of list the comparison reports against (issue 21)."""

from policy_helpers import job, nodes

from gearshift.policies import check_decision, make_policy
from gearshift.policies.registry import policy_names
from gearshift.sim.baselines import BEST_OF, best_baselines


def test_synergy_srtf_runs_the_shortest_remaining_job_first():
    ns = nodes(1)
    long_, short = job("long", 8, t=0, steps=100_000), job("short", 8, t=10, steps=100)
    for name, first in (("synergy", "long"), ("synergy-srtf", "short")):
        pol = make_policy(name)
        assert pol.name == name
        d = pol.schedule(100.0, ns, [long_, short], None)
        check_decision(d, ns, {j.job_id: j for j in (long_, short)})
        assert set(d.allocations) == {first}, (name, d.allocations)


def test_best_of_list_is_what_is_registered():
    got = best_baselines()
    assert "synergy-srtf" in got and "sia" in got
    assert got == [n for n in BEST_OF if n in set(policy_names())]  # order kept, missing names left out
