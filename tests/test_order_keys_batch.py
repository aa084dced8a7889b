"""Ordering keys answered for many jobs at once (``protocols.BatchOrderKey``,
``ClassedBatchKey``): the same tuples as one job at a time."""

import msgspec

from policy_helpers import job

from gearshift.policies.classes import by_class
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.ordering import SrtfKey, las_key
from gearshift.policies.protocols import BatchOrder, BatchOrderKey, ClassedBatchKey, supports


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


def _sorted_positions(keys):
    return sorted(range(len(keys)), key=keys.__getitem__)


def test_srtf_array_order_is_the_order_of_the_tuples_round_after_round():
    """``SrtfKey.order_by_class`` (numpy columns kept across rounds, ``policies.array_order``)
    gives exactly the positions ``sorted`` gives on ``many_by_class``'s tuples: with jobs
    tied in every number (job-id order decides, and "j10" sorts before "j9"), classes,
    unknown speeds and step times, and as jobs progress, leave, arrive, change spec, and
    the oracle's answers change."""
    import random

    rng = random.Random(7)
    jobs = [job(f"j{i}", 1 + i % 3, t=float(i % 5), steps=1000 + 97 * (i % 4), done=float(13 * (i % 3)))
            for i in range(40)]
    for i in (3, 17, 29):
        jobs[i].spec = msgspec.structs.replace(jobs[i].spec, priority=2)
    jobs[7].spec = msgspec.structs.replace(jobs[7].spec, step_time=0.25)
    for perf in (Tokened(), Unknown()):
        key = SrtfKey()
        assert supports(by_class(key), BatchOrder)
        live = list(jobs)
        ties = 0
        for rnd in range(12):
            tuples = by_class(key).many(live, 0.0, perf)
            ties += len(tuples) - len({t[:3] for t in tuples})
            got = by_class(key).order(live, 0.0, perf)
            assert got.tolist() == _sorted_positions(tuples), rnd
            for j in rng.sample(live, 5):  # progress
                j.steps_done += rng.choice([0.0, 50.0, 2000.0])
            del live[rng.randrange(len(live))]  # one leaves, one arrives
            n = 40 + rnd
            live.append(job(f"j{n}", 1 + n % 3, t=float(n % 5), steps=1000, done=0.0))
            if rnd % 4 == 1:  # a job's spec replaced
                v = live[rng.randrange(len(live))]
                v.spec = msgspec.structs.replace(v.spec, steps=v.spec.steps + 500)
            if rnd % 4 == 2:  # the oracle's answers change
                perf.token += 1
        assert ties > 0  # the job-id tie-break was exercised
    # short lists and oracles that cannot vouch: no array order (the caller sorts tuples)
    assert by_class(SrtfKey()).order(jobs[:5], 0.0, Tokened()) is None
    assert by_class(SrtfKey()).order(jobs, 0.0, AnalyticOracle()) is None


def test_srtf_kernel_sorts_as_python_and_refuses_nan():
    """``array_order.srtf_order`` + ``break_ties`` against ``sorted`` on the tuples,
    with many ties (-0.0 equal to 0.0, as in Python); a NaN in seconds left, or in a
    submission time inside a tie, refused; one outside every tie compared by neither."""
    import numpy as np

    from gearshift.policies.array_order import break_ties, srtf_order

    rng = np.random.default_rng(3)
    n = 300
    rows = np.vstack([-rng.integers(0, 3, n).astype(float), rng.integers(1, 4, n).astype(float) * 100,
                      rng.integers(1, 3, n).astype(float), np.ones(n)])
    at = rng.permutation(n).astype(np.intp)
    done = rng.integers(0, 3, n).astype(float) * 100
    submitted = rng.integers(0, 4, n).astype(float)
    submitted[:9] = -0.0
    names = [f"n{int(k)}" for k in rng.permutation(n)]

    def tuples():
        out = []
        for i in range(n):
            c = at[i]
            left = rows[1, c] - done[i]
            left = left if left > 0.0 else 0.0
            out.append((rows[0, c], left * rows[2, c] / rows[3, c], submitted[i], names[i]))
        return out

    def order():
        perm, runs, ok = srtf_order(rows, at, done, np.empty(0, np.int64))
        assert ok
        # from any order to start from (a permutation, else ignored): the same order and runs
        for hint in (rng.permutation(n), perm[::-1].copy(), perm.copy(), np.arange(n + 1), np.zeros(n, np.int64)):
            p2, r2, ok2 = srtf_order(rows, at, done, hint.astype(np.int64))
            assert ok2 and p2.tolist() == perm.tolist() and r2.tolist() == runs.tolist()
        return break_ties(perm.tolist(), runs.tolist(), submitted.__getitem__, names.__getitem__)

    t = tuples()
    assert len({k[:3] for k in t}) < n  # ties in all three: job ids decide
    assert order() == _sorted_positions(t)
    submitted[5] = float("nan")  # inside a tie (every class/seconds pair repeats here)
    assert order() is None
    # a job alone in its class and seconds left: its submission time is never compared
    rows = np.hstack([rows, [[-7.0], [123.0], [1.0], [1.0]]])
    at = np.append(at, n).astype(np.intp)
    done = np.append(done, 0.0)
    submitted[5] = 1.0
    submitted = np.append(submitted, float("nan"))
    names.append("lonely")
    n += 1
    got = order()
    assert got == _sorted_positions(tuples()) and got[0] == n - 1
    rows[2, at[0]] = float("nan")  # seconds left NaN
    assert srtf_order(rows, at, done, np.arange(n))[2] is False


def test_renumber_puts_the_last_order_in_the_new_positions():
    """``array_order.renumber``: the last order less the gone positions, each moved down by
    the gone ones before it, then the joined positions; nothing when it does not add up."""
    import numpy as np

    from gearshift.policies.array_order import renumber

    rng = np.random.default_rng(5)
    for m in (0, 1, 5, 40):
        last = rng.permutation(m).astype(np.int64)
        gone = np.sort(rng.choice(m, size=m // 3, replace=False)).astype(np.int64)
        joined = int(rng.integers(0, 4))
        n = m - len(gone) + joined
        kept = [p for p in range(m) if p not in set(gone.tolist())]  # old positions, in the new order
        want = [kept.index(p) for p in last.tolist() if p in kept] + list(range(len(kept), n))
        assert renumber(last, gone, n).tolist() == want
        if kept:  # a list shorter than the jobs that stayed: it does not add up
            assert len(renumber(last, gone, len(kept) - 1)) == 0


def test_merge_order_is_lexsorts_order():
    """``array_order._merge_order``: the order of two stable sorts, last key first
    (``np.lexsort``), equals in position order, on many ties and any length."""
    import numpy as np

    from gearshift.policies.array_order import _merge_order

    rng = np.random.default_rng(11)
    for n in (0, 1, 2, 3, 7, 64, 65, 300):
        cls = -rng.integers(0, 2, n).astype(float)
        secs = rng.integers(0, 5, n).astype(float)
        secs[: n // 4] = -0.0  # equal to 0.0, as in Python
        assert _merge_order(cls, secs).tolist() == np.lexsort((secs, cls)).tolist(), n


def test_follow_finds_columns_along_the_last_list():
    """``array_order.follow``: the last list's columns for ids it still holds, in its
    order, -1 for the others, whether jobs left, arrived or the list was reordered."""
    import numpy as np

    from gearshift.policies.array_order import follow

    last = np.array([10, 11, 12, 13, 14], np.int64)
    cols = np.array([0, 1, 2, 3, 4], np.intp)
    at, missing = follow(last, cols, np.array([10, 12, 14, 99], np.int64))  # two left, one arrived
    assert at.tolist() == [0, 2, 4, -1] and missing == 1
    at, missing = follow(last, cols, np.array([14, 13, 12], np.int64))  # reordered: only the first follows
    assert at.tolist()[0] == 4 and missing == 2
    at, missing = follow(np.empty(0, np.int64), np.empty(0, np.intp), np.array([1, 2], np.int64))
    assert at.tolist() == [-1, -1] and missing == 2


class Keyed(Tokened):
    """Says its answers depend on the model and batch alone (``protocols.KeyedOracle``),
    and counts what it is asked."""

    def __init__(self):
        super().__init__()
        self.asked = 0

    def spec_key(self, spec):
        return (spec.model.name, spec.global_batch)

    def throughput(self, job, plan, placement):
        self.asked += 1
        return super().throughput(job, plan, placement)


def test_srtf_asks_a_keyed_oracle_once_per_key_and_request():
    """Specs an oracle answers alike (equal ``spec_key``) that request the same plan and
    CPUs per GPU share one answer: the same tuples as asking per job, fewer questions;
    a new token asks again."""
    from gearshift.policies.ordering import requested_throughput

    jobs = _jobs()  # 1-3 GPUs: three requests, one key
    perf = Keyed()
    key = by_class(SrtfKey())
    got = key.many(jobs, 0.0, perf)
    assert perf.asked == len({j.spec.gpus for j in jobs}) == 3
    plain = Tokened()  # the same answers, no key: asked per job
    assert got == [by_class(plain_srtf)(j, 0.0, plain) for j in jobs]
    assert [SrtfKey().throughput(j, perf) for j in jobs] == [requested_throughput(j, plain) for j in jobs]
    asked = perf.asked
    perf.token += 1  # its answers may have changed: asked again, once per key and request
    key.many(jobs, 0.0, perf)
    assert perf.asked == asked + 3


def plain_srtf(j, now, perf):
    from gearshift.policies.ordering import srtf_key

    return srtf_key(j, now, perf)
