"""The simulator's kept views, and the growth check of ``loadtest.sim_speed`` (no
absolute times here: those are ``python -m loadtest.sim_speed``'s to judge)."""

from __future__ import annotations

from dataclasses import replace as dc_replace

import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, Placement, make_job_view
from gearshift.policies.registry import make_policy
from gearshift.policies.views import KeptViews
from gearshift.sim.engine import SimConfig, Simulator
from gearshift.sim.trace import Trace, TraceJob, parse_cluster
from gearshift.sim.views import fresh_view
from loadtest.sim_speed import at_once, growth, in_sequence, prefix

MODEL = ModelSpec(name="toy", params=10.0, layers=2, hidden=64, seq_len=16)


def _trace(n: int = 40, cluster: str = "2x4") -> Trace:
    """Jobs of 1-4 GPUs and mixed lengths arriving faster than they finish: queues,
    preemptions (SRTF, Tiresias, LAS), restarts."""
    jobs = []
    for i in range(n):
        gpus = (1, 2, 4, 1, 3)[i % 5]
        spec = JobSpec(name=f"j{i}", model=MODEL, global_batch=8, steps=200 + 997 * i % 1500, gpus=gpus,
                       plan=Plan(dp=gpus), step_time=1.0, priority=1 if i % 7 == 3 else 0)
        jobs.append(TraceJob(f"j{i}", 37.0 * i, spec))
    return Trace("toy", jobs, parse_cluster(cluster))


def _fresh(sim: Simulator, r, now: float) -> JobView:
    """A view built afresh from record ``r``; while it runs its steps done are its row's
    (``sim.progress``: the row holds them, the record gets them back when it stops)."""
    v = fresh_view(r, now)
    i = sim.views.rows.slot.get(r.job.job_id)
    return v if i is None else dc_replace(v, steps_done=float(sim.views.rows.sd[i]))


class _Checked:
    """A policy that, every round, holds the views it is handed against views built
    afresh from the simulator's records (``make_job_view`` through ``fresh_view``)."""

    def __init__(self, inner, sim_box: list):
        self.inner = inner
        self.name = inner.name
        self.box = sim_box
        self.rounds = self.kept = self.rebuilt = 0
        self.last: dict[str, JobView] = {}

    def schedule(self, now, nodes, jobs, perf):
        sim = self.box[0]
        assert jobs == [_fresh(sim, r, now) for r in sim.live.values()]  # every field, in live's order
        for v in jobs:
            was = self.last.get(v.job_id)
            if was is v:
                self.kept += 1
            elif was is not None:
                self.rebuilt += 1
                assert was.placement != v.placement or was.restarts != v.restarts or was.plan != v.plan \
                    or was.attained_service != v.attained_service
        self.last = {v.job_id: v for v in jobs}
        self.rounds += 1
        return self.inner.schedule(now, nodes, jobs, perf)


@pytest.mark.parametrize("name", ["fifo", "srtf", "tiresias", "las", "antman"])
def test_kept_views_equal_fresh_views_at_every_round(name):
    box: list = []
    policy = _Checked(make_policy(name, min_run_time=0.0), box)
    sim = Simulator(_trace(), policy, config=SimConfig(interval=60, restart_cost=20, noise=0))
    box.append(sim)
    res = sim.run()
    assert all(r.finish is not None for r in res.records)
    assert policy.rounds > 50 and policy.kept > 0 and policy.rebuilt > 0
    if name in ("srtf", "tiresias", "las"):
        assert sum(r.preemptions for r in res.records) > 0  # views of preempted jobs were rebuilt too


def test_a_launch_that_fails_before_the_next_round_hands_its_new_view():
    """A job granted and stopped between two rounds (its plan does not fit: the launch
    fails at the end of its restart) is handed as it is after that allocation (attained
    service, start and switch times), not as the view from before it."""
    spec = JobSpec(name="a", model=MODEL, global_batch=8, steps=100, gpus=1, plan=Plan(dp=1))  # no measured speed
    trace = Trace("oom", [TraceJob("a", 0.0, spec)], parse_cluster("1x1"))
    box: list = []
    policy = _Checked(make_policy("fifo"), box)
    cfg = SimConfig(interval=60, restart_cost=10, noise=0, regime="extended", stall_limit=600)
    sim = Simulator(trace, policy, config=cfg, predictor=lambda spec, plan, per_node: 1.0,  # believed to fit
                    truth_predictor=lambda spec, plan, per_node: 0.0)  # nothing fits
    box.append(sim)
    res = sim.run()
    assert res.records[0].stalled > 3 and policy.rounds > 3 and policy.rebuilt > 0


def test_kept_views_are_the_optimizers_rules():
    """KeptViews on its own: kept while the token stands (moving parts refreshed as
    make_job_view computes them), built again when it moves, forgotten when dropped."""
    spec = JobSpec(name="a", model=MODEL, global_batch=8, steps=100, gpus=2, plan=Plan(dp=2))
    place = (Placement("n0", 2, 2),)
    kept = KeptViews()

    def build(now, steps):
        return make_job_view("a", spec, 0.0, now, steps_done=steps, placement=place, plan=Plan(dp=2),
                             attained_before=7.0, last_switch_at=10.0, started_at=5.0)

    v = kept.view("a", 1, 20.0, 3.0, 7.0, True, lambda: build(20.0, 3.0))
    again = kept.view("a", 1, 95.5, 9.0, 7.0, True, lambda: pytest.fail("kept, not built"))
    assert again is v and again == build(95.5, 9.0)
    moved = kept.view("a", 2, 96.0, 9.0, 7.0, True, lambda: build(96.0, 9.0))
    assert moved is not v and moved == build(96.0, 9.0)
    kept.drop(["a"])
    assert kept.get("a") is None and len(kept) == 0


def test_growth_check_tells_n_log_n_from_quadratic():
    sizes = [1000, 2000, 4000]
    assert growth(sizes, [1.0, 2.0, 4.0])["ok"]  # linear
    assert growth(sizes, [1.0, 2.2, 4.6], tolerance=0.0)["ok"]  # n log n itself
    assert growth(sizes, [1.0, 2.5, 5.5])["ok"]  # n log n within the noise allowance
    quad = growth(sizes, [1.0, 4.0, 16.0])
    assert not quad["ok"] and quad["ratios"] == [4.0, 16.0]
    assert growth(sizes, [2.0, 1.0, 1.0])["ok"]  # getting cheaper is fine
    with pytest.raises(ValueError):
        growth([1000], [1.0])


def test_growth_traces_are_prefixes_and_queues():
    t = _trace(20, "2x4")
    p = prefix(t, 5)
    assert [j.job_id for j in p.jobs] == [f"j{i}" for i in range(5)] and p.tracked is None
    q = at_once(p)
    assert [j.job_id for j in q.jobs] == [j.job_id for j in p.jobs] and {j.submit for j in q.jobs} == {0.0}
    assert q.cluster == t.cluster and q.tracked is None
    k = in_sequence(p, 3, 1000.0)
    assert len(k.jobs) == 15 and len({j.job_id for j in k.jobs}) == 15 and k.tracked is None
    assert [j.submit for j in k.jobs] == [j.submit + i * 1000.0 for i in range(3) for j in p.jobs]
