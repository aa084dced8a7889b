"""The simulator's and SRTF's array shortcuts give what the one-at-a-time code gives,
bit for bit, on random inputs: ``sim.progress.RunningRows.advance`` against
``sim.engine.advance`` on each record, and ``SrtfKey.order_by_class`` against sorting
its tuples (``sorted_by(many_by_class)``), ties and all."""

from __future__ import annotations

import random

import msgspec
import pytest

from policy_helpers import job

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.classes import by_class
from gearshift.policies.ordering import SrtfKey, sorted_by
from gearshift.policies.protocols import BatchOrder, supports
from gearshift.sim.engine import InvariantError, SimJob, advance
from gearshift.sim.progress import RunningRows
from gearshift.sim.trace import TraceJob
from gearshift.bus_schema.messages import JobState
from gearshift.policies.api import JobView


class Tokened:
    """An oracle with random speeds (None for some jobs), vouching for its answers."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.speeds: dict[str, float] = {}

    def answers_token(self):
        return 1

    def throughput(self, job, plan, placement):
        return self.speeds.setdefault(job.spec.name, self.rng.choice([0.0, 3.0, 7.5, self.rng.uniform(0.1, 50)]))


def _record(rng: random.Random, i: int) -> SimJob:
    spec = JobSpec(name=f"j{i}", model=job("x", 1).spec.model, global_batch=8, steps=rng.randint(1, 5000), gpus=1,
                   plan=Plan(dp=1))
    r = SimJob(TraceJob(f"j{i}", 0.0, spec), JobView(f"j{i}", spec, 0.0))
    r.state = JobState.RUNNING
    r.rate = rng.choice([0.0, rng.uniform(0.01, 3.0), 1 / 3])
    r.updated_at = rng.choice([0.0, rng.uniform(0, 500)])
    r.productive_from = r.updated_at + rng.choice([0.0, -10.0, rng.uniform(0, 900)])
    r.steps_done = rng.uniform(0, spec.steps * 0.5)
    r.attained = rng.uniform(0, 1e5)
    r.gpu_seconds = r.attained
    r.run_time = rng.uniform(0, 1e4)
    r.gpus_held = rng.randint(1, 8)
    return r


@pytest.mark.parametrize("seed", range(5))
def test_rows_advance_as_each_record_would(seed):
    rng = random.Random(seed)
    recs = [_record(rng, i) for i in range(40)]
    twins = [_copy(r) for r in recs]  # advanced one at a time
    rows = RunningRows(check=False, size=4)  # grows as jobs attach
    for r in recs:
        rows.attach(r)
    t = 0.0
    for step in range(30):
        t += rng.choice([0.0, 300.0, rng.uniform(0, 700)])
        sd = rows.advance(t).tolist()
        for tw in twins:
            advance(tw, t, check=False)
        by_row = {r.job.job_id: s for r, s in zip(rows.recs, sd)}
        assert [by_row[tw.job.job_id] for tw in twins] == [tw.steps_done for tw in twins]
        if step % 7 == 3:  # one leaves (a release): its record gets everything back, exactly
            gone = recs.pop(rng.randrange(len(recs)))
            rows.detach(gone)
            tw = next(x for x in twins if x.job.job_id == gone.job.job_id)
            twins.remove(tw)
            assert _fields(gone) == _fields(tw)
    rows.detach_all()
    assert [_fields(r) for r in recs] == [_fields(tw) for tw in twins] and rows.n == 0


def test_rows_refuse_steps_beyond_a_jobs_total_as_advance_does():
    rng = random.Random(1)
    r = _record(rng, 0)
    r.rate, r.productive_from, r.updated_at = 10.0, 0.0, 0.0
    rows = RunningRows(check=True, error=InvariantError)
    rows.attach(r)
    with pytest.raises(InvariantError, match="j0: .* steps done of"):
        rows.advance(1e6)


def _copy(r: SimJob) -> SimJob:
    c = SimJob(r.job, r.view)
    for f in SimJob.__slots__:
        setattr(c, f, getattr(r, f))
    return c


def _fields(r: SimJob) -> tuple:
    return (r.steps_done, r.attained, r.gpu_seconds, r.run_time, r.updated_at)


@pytest.mark.parametrize("seed", range(8))
def test_srtf_order_on_arrays_is_the_tuples_order(seed):
    rng = random.Random(seed)
    perf = Tokened(rng)
    key = SrtfKey()
    assert supports(by_class(key), BatchOrder)
    for _ in range(6):  # one key across rounds: its memo and columns kept, specs added
        jobs = []
        for i in range(rng.randint(0, 300)):
            j = job(f"j{rng.randint(0, 400)}-{i}", rng.choice([1, 2, 4]), t=float(rng.choice([0, 5, rng.randint(0, 50)])),
                    steps=rng.choice([100, 1000, rng.randint(1, 10_000)]), done=float(rng.choice([0, 50, 100, 2000])))
            if rng.random() < 0.2:
                j.spec = msgspec.structs.replace(j.spec, priority=rng.choice([1, 2]))
            if rng.random() < 0.2:
                j.spec = msgspec.structs.replace(j.spec, step_time=rng.choice([0.25, 1.0]))
            jobs.append(j)
        want = sorted_by(key.many_by_class(jobs, 0.0, perf))
        assert key.order_by_class(jobs, 0.0, perf) == want
        assert by_class(key).order(jobs, 0.0, perf) == want
        assert want == sorted(range(len(jobs)), key=lambda i: by_class(SrtfKey())(jobs[i], 0.0, perf))
