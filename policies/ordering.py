"""Ordering parts: the priority in which jobs are considered (Blox's
"scheduling policy" box). Each returns a sort key; smaller runs first."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from gearshift.policies.api import JobView, PerfOracle, default_plan
from gearshift.policies.array_order import SpecRows, break_ties, renumber, srtf_order
from gearshift.policies.placement import compact_shape
from gearshift.policies.protocols import KeyedOracle, TokenedOracle, supports


def fifo_key(job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
    return (job.submitted_at, job.job_id)


def las_key(job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
    """Least attained service (GPU-seconds) first, as Blox's LAS."""
    return (job.attained_service, job.submitted_at, job.job_id)


def requested_throughput(job: JobView, perf: PerfOracle | None, gpus_per_node: int = 8) -> float | None:
    """Predicted samples/s of the job's own plan on its own GPUs, compactly placed."""
    if perf is None:
        return None
    plan = default_plan(job.spec)
    thr = perf.throughput(job, plan, compact_shape(plan.gpus, gpus_per_node, job.spec.cpus_per_gpu or 1))
    return thr if thr > 0 else None


def remaining_time(job: JobView, perf: PerfOracle | None) -> float:
    """Seconds left at the requested allocation; steps left if no speed is known."""
    return seconds_left(job, requested_throughput(job, perf))


def seconds_left(job: JobView, thr: float | None) -> float:
    """``remaining_time`` at ``thr`` samples/s (None: not known)."""
    left = job.remaining_steps
    if thr:
        return left * job.spec.global_batch / thr
    if job.spec.step_time:
        return left * job.spec.step_time
    return left


def srtf_key(job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
    """Shortest remaining time first (Blox's SRTF uses the true remaining
    iterations; we use the steps left and the predicted speed)."""
    return (remaining_time(job, perf), job.submitted_at, job.job_id)


class RequestSpeeds:
    """``requested_throughput`` per job, remembered while the oracle vouches that
    none of its answers changed (``answers_token``, ``policies.api``): the same
    numbers, asked once per job and oracle state instead of every round. An oracle
    that cannot tell is asked every time."""

    def __init__(self) -> None:
        # id(spec) -> (spec, samples/s or None, ...): _row; and ("speed", key, plan, CPUs/GPU) -> (samples/s,)
        self._memo: dict = {}
        self._perf: object = None
        self._own = None  # the oracle's answers_token
        self._keyed = None  # the oracle's spec_key (protocols.KeyedOracle), if it says one
        self._token: object = None

    def _memo_for(self, perf: PerfOracle | None) -> dict | None:
        """The memo that stands for ``perf``'s answers now (None: the oracle cannot tell)."""
        if perf is not self._perf:
            self._perf, self._own, self._token, self._memo = perf, (perf.answers_token if supports(perf, TokenedOracle) else None), None, {}
            self._keyed = perf.spec_key if supports(perf, KeyedOracle) else None
        token = self._own() if self._own is not None else None
        if token is None:
            return None
        memo = self._memo
        if token != self._token or len(memo) > 100_000:
            memo = self._memo = {}
            self._token = token
        return memo

    def _row(self, job: JobView, perf: PerfOracle | None, memo: dict) -> tuple:
        """``memo``'s entry for ``job``'s spec: (spec, samples/s or None, -class, steps,
        global batch, step time), the spec's parts the keys read."""
        spec = job.spec
        row = memo[id(spec)] = (spec, self._speed(job, perf, memo), -spec.priority, spec.steps, spec.global_batch,
                                spec.step_time)
        return row

    def _speed(self, job: JobView, perf: PerfOracle | None, memo: dict) -> float | None:
        """``requested_throughput``, asked once for the specs an oracle says it answers
        alike (``protocols.KeyedOracle``: equal ``spec_key``) that request the same plan
        with the same CPUs per GPU (the request and its shape: what is asked)."""
        if self._keyed is None:
            return requested_throughput(job, perf)
        spec = job.spec
        k = ("speed", self._keyed(spec), default_plan(spec), spec.cpus_per_gpu)
        got = memo.get(k)
        if got is None:
            got = memo[k] = (requested_throughput(job, perf),)
        return got[0]

    def throughput(self, job: JobView, perf: PerfOracle | None) -> float | None:
        memo = self._memo_for(perf)
        if memo is None:
            return requested_throughput(job, perf)
        spec = job.spec
        hit = memo.get(id(spec))
        if hit is not None and hit[0] is spec:
            return hit[1]
        return self._row(job, perf, memo)[1]

    def srtf_key(self, job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
        """``srtf_key``, with the remembered speed."""
        return (seconds_left(job, self.throughput(job, perf)), job.submitted_at, job.job_id)


_STEPS_DONE = attrgetter("steps_done")
_NO_HINT = np.empty(0, np.int64)


class SrtfKey(RequestSpeeds):
    """``RequestSpeeds.srtf_key`` as an ordering key of its own, which also answers for
    every job of a round at once (``many_by_class``, ``protocols.ClassedBatchKey``): the
    oracle's ``answers_token`` read once for them all (its answers do not change while
    a policy asks them), each job's key computed inline, the same numbers from the
    same float expressions as ``seconds_left``."""

    ARRAY_MIN = 24  # fewer jobs than this: the tuples cost less than the arrays

    def __init__(self) -> None:
        super().__init__()
        self._rows = SpecRows(4)  # per spec: -class, steps, seconds left's factor and divisor
        self._last: np.ndarray | None = None  # the last order (positions in the last list)

    def __call__(self, job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
        return self.srtf_key(job, now, perf)

    @staticmethod
    def keeps_steady() -> bool:
        """``protocols.SteadyKey``: (-class, seconds left at the request's speed, submitted
        at, job id). A waiting job's steps do not move; a running job's only grow, so its
        seconds left only fall; the speed is the oracle's, which the caller holds still."""
        return True

    def order_by_class(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> np.ndarray | None:
        """The positions of ``jobs`` sorted by ``many_by_class``'s tuples (``protocols.ClassedBatchOrder``),
        as an integer array, on arrays (``policies.array_order``): seconds left as ``(left x global
        batch) / samples/s``, or ``(left x step time) / 1`` and ``(left x 1) / 1`` when the speed is
        not known (``_no_speed``), the same float64 operations. None (the caller sorts the
        tuples) for a short list, an oracle that cannot vouch for its answers, or a NaN."""
        n = len(jobs)
        if n < self.ARRAY_MIN:
            return None
        memo = self._memo_for(perf)
        if memo is None:
            return None
        get, make = memo.get, self._row

        def numbers(i: int) -> tuple:
            spec = jobs[i].spec
            h = get(id(spec))
            if h is None or h[0] is not spec:
                h = make(jobs[i], perf, memo)
            return (h[2], h[3], h[4], h[1]) if h[1] else (h[2], h[3], h[5] or 1.0, 1.0)

        rows = self._rows
        at = rows.at(jobs, numbers, memo)
        done = np.fromiter(map(_STEPS_DONE, jobs), float, n)
        # the last order, in this list's positions, to sort from (a list that says how it follows)
        last, self._last = self._last, None
        told = rows.told
        if told is None or last is None:
            hint = _NO_HINT
        elif not told.gone and len(last) == n:  # (the same positions: nothing left, nothing joined)
            hint = last
        else:
            hint = renumber(last, np.array(told.gone, np.int64), n)
        perm, runs, ok = srtf_order(rows.rows, at, done, hint)
        if not ok:
            return None
        if len(runs):  # jobs equal in class and seconds left (about one a round): submitted at, then job id
            perm = break_ties(perm, runs.tolist(), lambda i: jobs[i].submitted_at, lambda i: jobs[i].job_id)
        self._last = perm
        return perm

    def many_by_class(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> list[tuple]:
        """``[by_class(self)(j, now, perf) for j in jobs]``: (-class, seconds left,
        submitted at, job id)."""
        memo = self._memo_for(perf)
        if memo is None:
            return [(-j.spec.priority, seconds_left(j, requested_throughput(j, perf)), j.submitted_at, j.job_id)
                    for j in jobs]
        get, row = memo.get, self._row
        # each job's memo entry (spec, samples/s, -class, steps, global batch, step time)
        rows = [hit if (hit := get(id(spec := j.spec))) is not None and hit[0] is spec else row(j, perf, memo)
                for j in jobs]
        # left = JobView.remaining_steps, max(0.0, steps - steps done); then seconds_left's expressions
        return [(h[2], (left if (left := h[3] - j.steps_done) > 0.0 else 0.0) * h[4] / h[1], j.submitted_at, j.job_id)
                if h[1] else (h[2], self._no_speed(j, h), j.submitted_at, j.job_id) for j, h in zip(jobs, rows)]

    @staticmethod
    def _no_speed(j: JobView, h: tuple) -> float:
        """``seconds_left`` of a job whose speed is not known (memo entry ``h``)."""
        left = h[3] - j.steps_done
        if not left > 0.0:
            left = 0.0
        return left * h[5] if h[5] else left


class TiresiasQueues:
    """Discretised two-dimensional LAS (Tiresias, NSDI'19).

    A job's service is GPUs x time (``attained_service``). Queue i holds jobs
    whose service lies in [thresholds[i-1], thresholds[i]); a job is demoted
    when it passes a threshold. Within a queue jobs are FIFO by arrival, which
    is what keeps preemptions rare. Optional starvation knob: a job that has
    waited longer than ``starvation_factor`` x its last run is promoted to
    queue 0 (off by default, as in the Pollux simulator's Tiresias).
    """

    def __init__(self, thresholds: tuple[float, ...] = (16 * 3600.0,), starvation_factor: float | None = None):
        self.thresholds = tuple(sorted(thresholds))
        self.starvation_factor = starvation_factor
        self.promoted: dict[str, float] = {}  # job -> attained service at promotion
        self.last_run: dict[str, float] = {}  # job -> seconds of its last run
        self.wait_since: dict[str, float] = {}

    def queue_of(self, job: JobView) -> int:
        service = job.attained_service - self.promoted.get(job.job_id, 0.0)
        q = 0
        for t in self.thresholds:
            if service >= t:
                q += 1
        return q

    def observe(self, job: JobView, now: float) -> None:
        """Track run/wait spells for the starvation knob."""
        if self.starvation_factor is None:
            return
        if job.running:
            self.wait_since.pop(job.job_id, None)
            if job.last_switch_at is not None:
                self.last_run[job.job_id] = now - job.last_switch_at
        else:
            since = self.wait_since.setdefault(job.job_id, now)
            ran = self.last_run.get(job.job_id)
            if ran and now - since >= self.starvation_factor * ran:
                self.promoted[job.job_id] = job.attained_service
                self.wait_since[job.job_id] = now

    def key(self, job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
        return (self.queue_of(job), job.submitted_at, job.job_id)
