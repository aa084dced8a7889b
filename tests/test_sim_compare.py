"""sim/compare.py: the per-row figures against the best baseline, recomputed by hand."""

import math
import statistics

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.registry import make_policy
from gearshift.sim.compare import compare
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.metrics import summarize
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

M = {n: ModelSpec(name=n, params=10.0, layers=2, hidden=64, seq_len=16) for n in ("a", "b")}


def test_compare_against_the_best_baseline():
    jobs = [TraceJob(f"{'ab'[i % 2]}-{i}", 5.0 * i, JobSpec(name=f"j{i}", model=M["ab"[i % 2]], global_batch=8,
                                                           steps=[300, 20, 100, 10][i], gpus=2, plan=Plan(dp=2),
                                                           step_time=1.0)) for i in range(4)]
    t = Trace("toy", jobs, parse_cluster("1x2"))
    cfg = SimConfig(restart_cost=0, noise=0)
    res = [simulate(t, make_policy(p), config=cfg) for p in ("fifo", "srtf", "fifo")]
    res[2].policy = "rubick"  # a stand-in named like the policy compared
    sums = [summarize(r) for r in res]
    for r, s in zip(res, sums):
        s["policy"] = r.policy
    out = compare(res, sums)
    best = min(sums[:2], key=lambda s: s["avg_jct_s"])
    assert best["policy"] == "srtf"  # short jobs first: the lower average
    row = out["rubick"]
    jr = {r.job.job_id: r.finish - r.job.submit for r in res[2].records}
    jb = {r.job.job_id: r.finish - r.job.submit for r in res[1].records}
    assert row["best_baseline"] == "srtf"
    assert math.isclose(row["avg_jct_ratio"], statistics.mean(jb.values()) / statistics.mean(jr.values()))
    assert math.isclose(row["median_jct_ratio"], statistics.median(jb.values()) / statistics.median(jr.values()))
    assert math.isclose(row["per_job_geomean_ratio"],
                        math.exp(statistics.mean(math.log(jb[j] / jr[j]) for j in jr)))
    a = [j for j in jr if j.startswith("a-")]
    assert math.isclose(row["per_model"]["a"]["ratio"],
                        statistics.mean(jb[j] for j in a) / statistics.mean(jr[j] for j in a))
    assert row["worst_model_ratio"] == min(v["ratio"] for v in row["per_model"].values())
    assert math.isclose(row["makespan_ratio"], sums[1]["makespan_s"] / sums[2]["makespan_s"])
