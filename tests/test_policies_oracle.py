"""The perfmodel-backed oracle agrees with perfmodel, and rubick uses its plans."""

import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies import check_decision, make_policy
from gearshift.policies.api import JobView, NodeState, Placement
from gearshift.policies.oracle import AnalyticOracle, PerfModelOracle

perfmodel = pytest.importorskip("perfmodel")

LLAMA = ModelSpec(name="llama7", params=6740, layers=32, hidden=4096, seq_len=2048)


def _job(gpus=8, plan=None):
    return JobView("j", JobSpec(name="j", model=LLAMA, global_batch=16, steps=1000, gpus=gpus, cpus_per_gpu=4,
                                plan=plan), 0.0)


def test_perfmodel_oracle_matches_perfmodel():
    o = PerfModelOracle()
    j = _job()
    plan = Plan(dp=2, tp=4, ga=2)
    pl = (Placement("a", 8, 32),)
    shape = perfmodel.shape_from_spec(LLAMA)
    params = perfmodel.params_for_shape(shape)
    want = perfmodel.plan_throughput(params, shape, 16, perfmodel.as_plan(plan, 16), perfmodel.Resources((8,), 4.0))
    assert o.throughput(j, plan, pl) == pytest.approx(want, rel=1e-9)
    assert o.throughput(j, plan, (Placement("a", 4, 16),)) == 0.0  # plan needs 8 GPUs
    plans = o.plans(j, pl)
    assert plans and all(p.gpus == 8 for p in plans)
    many = o.throughput_many(j, plans[:5], pl)
    assert list(many) == pytest.approx([o.throughput(j, p, pl) for p in plans[:5]])


def test_rubick_with_perfmodel_oracle_picks_a_feasible_plan():
    o = PerfModelOracle()
    ns = [NodeState(f"n{i}", 8, 8, 96, 96) for i in range(2)]
    j = _job(8, Plan(dp=8))  # plain DP of a 7B model does not fit 80 GB
    assert o.throughput(j, Plan(dp=8), (Placement("n0", 8, 32),)) == 0.0
    d = make_policy("rubick", min_run_time=0).schedule(0.0, ns, [j], o)
    check_decision(d, ns, {"j": j})
    a = d.allocations["j"]
    assert o.throughput(j, a.plan, a.placement) > 0


def test_analytic_oracle_shapes():
    o = AnalyticOracle()
    j = _job(8)
    one = o.throughput(j, Plan(dp=1, zero=2, offload=True, ga=4), (Placement("a", 1, 4),))
    more_cpu = o.throughput(j, Plan(dp=1, zero=2, offload=True, ga=4), (Placement("a", 1, 12),))
    assert 0 < one < more_cpu  # offload is CPU-sensitive
    near = o.throughput(j, Plan(dp=8, zero=2), (Placement("a", 8, 32),))
    far = o.throughput(j, Plan(dp=8, zero=2), (Placement("a", 4, 16), Placement("b", 4, 16)))
    assert near > far > 0  # locality matters
