"""--declared-noise K: declared steps are an upper bound the policy sees, the truth
finishes the job (issue 21 item 4)."""

from __future__ import annotations

import math

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.registry import make_policy
from gearshift.sim.cli import build_parser
from gearshift.sim.declared import declared_factor
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

MODEL = ModelSpec(name="toy", params=10.0, layers=2, hidden=64, seq_len=16)


def _trace():
    jobs = [TraceJob(f"j{i}", 10.0 * i, JobSpec(name=f"j{i}", model=MODEL, global_batch=8, steps=100 + 10 * i, gpus=1,
                                                 plan=Plan(dp=1), step_time=1.0)) for i in range(6)]
    return Trace("toy", jobs, parse_cluster("1x2"))


class Spy:
    """FIFO that records the steps each job declares to it."""

    def __init__(self):
        self.inner = make_policy("fifo")
        self.name = "spy"
        self.seen: dict[str, int] = {}

    def schedule(self, now, nodes, jobs, perf):
        for j in jobs:
            self.seen[j.job_id] = j.spec.steps
        return self.inner.schedule(now, nodes, jobs, perf)


def test_factor_is_seeded_log_uniform_in_one_to_k():
    fs = [declared_factor(4.0, 0, f"j{i}") for i in range(2000)]
    assert all(1.0 <= f < 4.0 for f in fs)
    logs = sorted(math.log(f) / math.log(4.0) for f in fs)
    assert abs(logs[len(logs) // 2] - 0.5) < 0.05  # log-uniform: the median of log F / log K is 1/2
    assert fs == [declared_factor(4.0, 0, f"j{i}") for i in range(2000)]  # same draw for every policy
    assert declared_factor(4.0, 1, "j0") != fs[0] and declared_factor(1.0, 0, "j0") == 1.0


def test_policy_sees_the_declaration_and_the_job_finishes_at_its_true_steps():
    t = _trace()
    exact = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=0, noise=0))
    spy = Spy()
    noisy = simulate(t, spy, config=SimConfig(restart_cost=0, noise=0, declared_noise=4.0))
    truth = {j.job_id: j.spec.steps for j in t.jobs}
    assert all(truth[k] <= v < 4 * truth[k] + 1 for k, v in spy.seen.items())
    assert any(v > truth[k] for k, v in spy.seen.items())
    # FIFO does not read remaining work: the same schedule, finished at the true steps
    assert [(r.first_start, r.finish) for r in noisy.records] == [(r.first_start, r.finish) for r in exact.records]
    assert all(r.steps_done == truth[r.job.job_id] for r in noisy.records)


def test_cli_flag():
    assert build_parser().parse_args(["--trace", "x", "--declared-noise", "4"]).declared_noise == 4.0
    assert build_parser().parse_args(["--trace", "x"]).declared_noise == 1.0
