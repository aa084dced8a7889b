"""The oracle learns from what runs: observed OOM and observed speed change decisions
(rubick and sia, the same ``LearningOracle`` the simulator and the optimizer use)."""

from __future__ import annotations

from policy_helpers import nodes

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, Placement
from gearshift.policies.learning import LearningOracle, plan_family
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

MODEL = ModelSpec(name="toy", params=100, layers=8, hidden=512, seq_len=128)


class PlanOracle:
    """Believes ZeRO-Offload is twice as fast as anything else; linear in GPUs."""

    def __init__(self):
        self.calls = 0

    def throughput(self, job, plan, placement):
        self.calls += 1
        g = sum(p.gpus for p in placement)
        if g != plan.gpus or g == 0:
            return 0.0
        return (200.0 if plan.offload else 100.0) * g


def _job(gpus: int = 1, plan: Plan | None = None) -> JobView:
    spec = JobSpec(name="j", model=MODEL, global_batch=64, steps=10_000, gpus=gpus, cpus_per_gpu=2, plan=plan)
    return JobView("j", spec, submitted_at=0.0)


def _chosen(policy, oracle, job, n=1, gpus=1):
    d = policy.schedule(0.0, nodes(n, gpus=gpus, cpus=16), [job], oracle)
    return d.allocations["j"]


def test_observed_oom_stops_rubick_choosing_that_plan():
    oracle = LearningOracle(PlanOracle())
    job = _job()
    first = _chosen(make_policy("rubick", restart_cost=0), oracle, job)
    assert first.plan.offload  # believed best
    oracle.observe(job, first.plan, first.placement, oom=True)
    assert oracle.throughput(job, first.plan, first.placement) == 0.0
    # on any placement: memory per GPU depends on the plan
    assert oracle.throughput(job, first.plan, (Placement("other", 1, 8),)) == 0.0
    again = _chosen(make_policy("rubick", restart_cost=0), oracle, job)
    assert not (again.plan == first.plan)
    # a fresh policy object and the same policy object both see it (cache keyed on revision)
    pol = make_policy("rubick", restart_cost=0)
    oracle2 = LearningOracle(PlanOracle())
    a = _chosen(pol, oracle2, job)
    oracle2.observe(job, a.plan, a.placement, oom=True)
    assert _chosen(pol, oracle2, job).plan != a.plan


def test_observed_slow_configuration_changes_rubicks_next_decision():
    oracle = LearningOracle(PlanOracle())
    job = _job()
    pol = make_policy("rubick", restart_cost=0)
    first = _chosen(pol, oracle, job)
    assert first.plan.offload
    # it ran at a quarter of the believed speed: 50 samples/s, step = 64/50 s
    oracle.observe(job, first.plan, first.placement, step_time=64 / 50.0)
    assert abs(oracle.throughput(job, first.plan, first.placement) - 50.0) < 1e-6
    nxt = _chosen(pol, oracle, job)
    assert not nxt.plan.offload
    # the family's scale was refitted too: an unobserved offload plan is believed slower now
    other = Plan(dp=1, zero=2, offload=True, grad_ckpt=True, micro_batch=64)
    assert oracle.throughput(job, other, first.placement) < 200.0
    assert plan_family(other) == "zero-offload"


def test_observed_slow_configuration_changes_sias_next_decision():
    # Sia scales the user's plan; it prefers 2 GPUs (believed 2x). Observed: 2 GPUs
    # run no faster than 1, so its next decision takes 1 GPU.
    oracle = LearningOracle(PlanOracle())
    job = _job(gpus=1, plan=Plan(dp=1))
    pol = make_policy("sia", restart_cost=0)
    d = pol.schedule(0.0, nodes(1, gpus=2, cpus=16), [job], oracle)
    assert d.allocations["j"].plan.gpus == 2
    two = d.allocations["j"]
    oracle.observe(job, two.plan, two.placement, step_time=64 / 40.0)  # 40 samples/s: slower than 1 GPU (100)
    d = make_policy("sia", restart_cost=0).schedule(0.0, nodes(1, gpus=2, cpus=16), [job], oracle)
    assert d.allocations["j"].plan.gpus == 1
    d = pol.schedule(0.0, nodes(1, gpus=2, cpus=16), [job], oracle)  # same object: its cache follows
    assert d.allocations["j"].plan.gpus == 1


def test_repeated_identical_observations_do_not_invalidate_caches():
    oracle = LearningOracle(PlanOracle())
    job = _job()
    pl = (Placement("n0", 1, 2),)
    assert oracle.observe(job, Plan(dp=1), pl, step_time=0.5)
    rev = oracle.revision
    assert not oracle.observe(job, Plan(dp=1), pl, step_time=0.5)
    assert oracle.revision == rev


# ------------------------------------------------------------ in the simulator (defect 2)
def _belief(spec, plan, per_node):  # seconds/step: offload believed 2x faster
    return 0.5 if plan.offload else 1.0


def _truth(spec, plan, per_node):  # offload fits in memory only with checkpointing
    return 0.0 if plan.offload and not plan.grad_ckpt else 1.0


def _oom_trace():
    spec = JobSpec(name="a", model=MODEL, global_batch=64, steps=600, gpus=1, cpus_per_gpu=2, plan=Plan(dp=1),
                   step_time=1.0)
    return Trace("oom", [TraceJob("a", 0.0, spec)], parse_cluster("1x1:8"))


def test_sim_oom_is_learned_and_the_job_finishes():
    cfg = SimConfig(restart_cost=10, noise=0, regime="extended", stall_limit=6 * 3600, systematic=0,
                    distance_slowdown=0, headroom=0.0)
    res = simulate(_oom_trace(), make_policy("rubick", restart_cost=10), config=cfg, predictor=_belief,
                   truth_predictor=_truth)
    r = res.records[0]
    assert r.finish is not None
    # one failed launch per micro-batch size at most (GA 1/2/4/8), never one plan twice
    assert 1 <= r.stalled <= 4


def test_sim_without_learning_retries_the_oom_forever():
    # Defect 2 as it was: nobody tells the policy, it relaunches the plan it believes in.
    cfg = SimConfig(restart_cost=10, noise=0, regime="extended", stall_limit=6 * 3600, systematic=0,
                    distance_slowdown=0, headroom=0.0, learn=False)
    res = simulate(_oom_trace(), make_policy("rubick", restart_cost=10), config=cfg, predictor=_belief,
                   truth_predictor=_truth)
    r = res.records[0]
    assert r.finish is None and r.stalled > 10


def test_spec_key_separates_models_and_follows_learning():
    oracle = LearningOracle(PlanOracle())  # a base oracle without spec_key
    a = _job().spec
    b = JobSpec(name="k", model=ModelSpec(name="other", params=1, layers=1, hidden=8, seq_len=8), global_batch=16,
                steps=1, gpus=1, cpus_per_gpu=2)
    assert oracle.spec_key(a) != oracle.spec_key(b)
    before = oracle.spec_key(a)
    oracle.observe(a, Plan(dp=1), (Placement("n0", 1, 2),), oom=True)
    assert oracle.spec_key(a) != before and oracle.spec_key(b) == oracle.spec_key(b)
