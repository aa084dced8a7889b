"""Ordering parts: the priority in which jobs are considered (Blox's
"scheduling policy" box). Each returns a sort key; smaller runs first."""

from __future__ import annotations

from gearshift.policies.api import JobView, PerfOracle, default_plan
from gearshift.policies.placement import compact_shape


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
    thr = requested_throughput(job, perf)
    if thr:
        return job.remaining_steps * job.spec.global_batch / thr
    if job.spec.step_time:
        return job.remaining_steps * job.spec.step_time
    return job.remaining_steps


def srtf_key(job: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
    """Shortest remaining time first (Blox's SRTF uses the true remaining
    iterations; we use the steps left and the predicted speed)."""
    return (remaining_time(job, perf), job.submitted_at, job.job_id)


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
