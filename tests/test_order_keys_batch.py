"""Ordering keys answered for many jobs at once (``protocols.BatchOrderKey``,
``ClassedBatchKey``): the same tuples as one job at a time."""

import msgspec

from policy_helpers import job

from gearshift.policies.classes import by_class
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.ordering import SrtfKey, las_key
from gearshift.policies.protocols import BatchOrderKey, ClassedBatchKey, supports


class Tokened(AnalyticOracle):
    def __init__(self):
        super().__init__()
        self.token = 0

    def answers_token(self):
        return self.token


class Unknown(Tokened):
    def throughput(self, job, plan, placement):
        return 0.0


def _jobs():
    jobs = [job(f"j{i}", 1 + i % 3, t=float(i), steps=1000 + 97 * i, done=float(13 * i % 1200)) for i in range(12)]
    jobs[3].spec = msgspec.structs.replace(jobs[3].spec, priority=2)
    jobs[5].steps_done = 5000.0  # past its steps: no time left
    jobs[7].spec = msgspec.structs.replace(jobs[7].spec, step_time=0.25)
    return jobs


def test_srtf_batch_is_the_one_at_a_time_key():
    key = SrtfKey()
    assert supports(key, ClassedBatchKey) and supports(by_class(key), BatchOrderKey)
    for perf in (None, AnalyticOracle(), Tokened(), Unknown()):
        jobs = _jobs()
        one = [by_class(SrtfKey())(j, 0.0, perf) for j in jobs]
        assert by_class(key).many(jobs, 0.0, perf) == one
        assert by_class(key).many(jobs, 0.0, perf) == one  # remembered speeds


def test_plain_keys_batch_through_by_class():
    jobs = _jobs()
    k = by_class(las_key)
    assert k.many(jobs, 0.0, None) == [k(j, 0.0, None) for j in jobs]
