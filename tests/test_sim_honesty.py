"""Regression tests for the defects issue 10 found in the simulator and the baselines."""

from __future__ import annotations

import math

from policy_helpers import job, nodes

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import Placement
from gearshift.policies.placement import Ledger
from gearshift.policies.plans import candidate_plans
from gearshift.policies.registry import make_policy
from gearshift.sim.cli import ratios
from gearshift.sim.trace import TraceJob
from gearshift.sim.truth import GroundTruth

GPT2 = ModelSpec(name="gpt2", params=1500, layers=48, hidden=1600, seq_len=1024)


def _tjob(jid: str, step_time: float, gpus: int = 4) -> TraceJob:
    spec = JobSpec(name=jid, model=GPT2, global_batch=16, steps=100, gpus=gpus, plan=Plan(dp=gpus, ga=1),
                   step_time=step_time)
    return TraceJob(jid, 0.0, spec, truth_key="gpt2")


def test_truth_request_speed_is_each_jobs_own():
    # Defect 1: the cache key left out the job's own step time, so the second job of a
    # model running its request got the first one's speed.
    truth = GroundTruth(8, noise=0.0, tables={"gpt2": {}})
    pl = (Placement("n0", 4, 16),)
    a, b = _tjob("a", 0.5), _tjob("b", 2.0)
    assert truth.step_time(a, a.spec.plan, pl) == (0.5, "request")
    assert truth.step_time(b, b.spec.plan, pl) == (2.0, "request")


def test_tp_request_is_never_split_across_nodes():
    # Defect 3: a 5-GPU tensor-parallel request was spread 1+4 / 2+3 over two nodes.
    ns = nodes(2, gpus=8, cpus=64)
    led = Ledger(ns)
    led.take((Placement("n0", 4, 8), Placement("n1", 5, 10)))  # 4 free on n0, 3 on n1
    assert led.place(5, 2) is not None  # plain data parallel may spread
    assert led.place(5, 2, unit=5) is None  # a TP-5 group may not
    led.give((Placement("n1", 5, 10),))
    pl = led.place(5, 2, unit=5)
    assert pl is not None and [p.gpus for p in pl] == [5]


def test_fixed_plan_baselines_keep_tp_groups_on_one_node():
    plan = Plan(dp=1, tp=5, pp=1)
    blockers = [job("x", 4, running_on=(Placement("n0", 4, 8),), plan=Plan(dp=4)),
                job("y", 5, running_on=(Placement("n1", 5, 10),), plan=Plan(dp=5))]
    tp_job = job("tp", 5, plan=plan, batch=16)
    for name in ("antman", "synergy", "fifo"):
        d = make_policy(name).schedule(0.0, nodes(2, gpus=8, cpus=64), blockers + [tp_job], None)
        got = d.allocations.get("tp")
        assert got is None or len(got.placement) == 1, (name, got)


def test_pipeline_plans_exist_when_batch_is_smaller_than_stages():
    # Defect 4: llama30's global batch of 4 never gave ga >= pp, so no pipeline plan
    # (all its measured plans are 3D) was a candidate.
    plans = candidate_plans(4, 60, 64, 8)
    labels = {(p.pp, p.tp, p.dp) for p in plans}
    assert (4, 4, 4) in labels  # the measured llama30 row 444@88888888
    for p in plans:
        assert p.dp * p.tp * p.pp == 64 and 4 % (p.dp * p.ga) == 0 and p.micro_batch * p.dp * p.ga == 4
    # where the batch allows it, pipelines still get >= pp micro-batches
    assert all(p.ga >= p.pp for p in candidate_plans(64, 24, 8, 8) if p.pp > 1)


def test_no_ratio_for_a_policy_with_unfinished_jobs():
    # Defect 5: a policy that left jobs unfinished got a ratio over its finished jobs.
    s = [{"policy": "sia", "avg_jct_s": 100.0, "makespan_s": 10.0, "unfinished": 0},
         {"policy": "rubick", "avg_jct_s": 25.0, "makespan_s": 8.0, "unfinished": 51}]
    r = ratios(s)
    assert math.isnan(r["rubick"]["jct_x"]) and math.isnan(r["rubick"]["makespan_x"])
    assert r["sia"]["jct_x"] == 1.0
