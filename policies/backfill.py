"""FIFO with EASY backfill (Lifka 1995; Mu'alem & Feitelson 2001).

Jobs go in ``key`` order (arrival by default; ``Shared`` puts priority and
fair share in front). The first job that does not fit is the *head*: it gets
a reservation, the earliest time enough GPUs free up on the nodes if running
jobs end when predicted (``ordering.remaining_time`` plus what is left of
their restart). A later job may start now ("backfill") when it fits now and
either ends before the reservation or fits beside the head in what will be
free at the reservation; either way the head's start is not delayed as long
as the predictions hold. ``backfill=False`` is strict FIFO (head-of-line).
Jobs keep the plan and GPUs they asked for; nothing is preempted.

``reservations``: head job -> reserved start (s), as last computed, so a
caller (``loadtest.fairness``) can check that backfilled jobs never delayed it.
"""

from __future__ import annotations

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.classes import by_class
from gearshift.policies.ordering import fifo_key, remaining_time
from gearshift.policies.placement import Ledger, describe


def _place(ledger: Ledger, job: JobView, cpg: int):
    plan = default_plan(job.spec)
    return ledger.place(plan.gpus, cpg, unit=plan.tp)


class EasyFifo:
    def __init__(self, *, backfill: bool = True, restart_cost: float = 0.0, min_run_time: float = 0.0,
                 default_cpus_per_gpu: int = 1, name: str | None = None, record: bool = False):
        self.name = name or ("fifo-easy" if backfill else "fifo")
        self.backfill = backfill
        self.restart_cost = restart_cost
        self.default_cpus_per_gpu = default_cpus_per_gpu
        self.key = by_class(fifo_key)  # priority classes first, then arrival
        self.reservations: dict[str, float] = {}
        # record=True (loadtest.fairness): head -> (when, reserved start) of its first reservation, kept
        self.record = record
        self.first_reservation: dict[str, tuple[float, float]] = {}
        self.backfill_log: dict[str, tuple[str, str, float]] = {}  # job -> (head, rule, predicted end)
        self.backfilled: dict[str, str] = {}  # job -> head it was backfilled past

    @staticmethod
    def runtime(j: JobView, perf: PerfOracle | None) -> float:
        """Seconds left at its request: the user's step time if given (as a
        batch system's wall-time estimate), else the model's prediction."""
        if j.spec.step_time:
            return j.remaining_steps * j.spec.step_time
        return remaining_time(j, perf)

    def _end(self, j: JobView, now: float, perf: PerfOracle | None) -> float:
        since = j.switched_at if j.switched_at is not None else now
        restart_left = max(0.0, self.restart_cost - (now - since))
        return now + restart_left + self.runtime(j, perf)

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        decision = Decision()
        live = {j.job_id for j in jobs}
        for d in (self.reservations, self.backfilled):
            for jid in [k for k in d if k not in live]:
                del d[jid]
        ledger = Ledger(nodes)
        ends: list[tuple[float, str, tuple]] = []
        for j in jobs:
            if j.running:
                ledger.take(j.placement)
                decision.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec), "running")
                ends.append((self._end(j, now, perf), j.job_id, j.placement))
        head: JobView | None = None
        shadow: Ledger | None = None  # free capacity at the head's reservation, head placed
        reserve_at = 0.0
        for j in sorted((j for j in jobs if not j.running), key=lambda j: self.key(j, now, perf)):
            cpg = j.spec.cpus_per_gpu or self.default_cpus_per_gpu
            if head is not None and not self.backfill:
                decision.waiting[j.job_id] = f"waiting: behind {head.job_id} in FIFO order"
                continue
            spot = _place(ledger, j, cpg)
            if spot is not None and head is not None:
                end = now + self.restart_cost + self.runtime(j, perf)
                beside = shadow is not None and _place(shadow, j, cpg)
                rule = "ends-before"
                if end > reserve_at and not beside:
                    spot = None
                elif end > reserve_at and beside:
                    shadow.take(beside)  # it will still hold these at the reservation
                    rule = "beside"
            if spot is None:
                if head is None:
                    head = j
                    reserve_at, shadow = self._reserve(now, ledger, ends, j, cpg)
                    self.reservations[j.job_id] = reserve_at
                    if self.record:
                        self.first_reservation.setdefault(j.job_id, (now, reserve_at))
                    decision.waiting[j.job_id] = (f"waiting: head of FIFO, needs {j.spec.gpus} GPUs, "
                                                  f"{ledger.total_free()} free; reserved from t={reserve_at:.0f}s")
                else:
                    decision.waiting[j.job_id] = f"waiting: behind {head.job_id}, no backfill hole"
                continue
            ledger.take(spot)
            ends.append((now + self.restart_cost + self.runtime(j, perf), j.job_id, spot))
            why = f"FIFO first fit on {describe(spot)}"
            if head is not None:
                self.backfilled[j.job_id] = head.job_id
                if self.record:
                    self.backfill_log[j.job_id] = (head.job_id, rule, end)
                why = f"backfilled past {head.job_id} on {describe(spot)}"
            decision.allocations[j.job_id] = JobDecision(spot, default_plan(j.spec), why)
        return decision

    @staticmethod
    def _reserve(now: float, ledger: Ledger, ends: list, head: JobView, cpg: int) -> tuple[float, Ledger | None]:
        """Earliest predicted time the head fits, and what is free then beside it."""
        shadow = Ledger(ledger.nodes)
        shadow.free_g = dict(ledger.free_g)
        shadow.free_c = dict(ledger.free_c)
        for end, _, placement in sorted(ends, key=lambda e: (e[0], e[1])):
            shadow.give(placement)
            spot = _place(shadow, head, cpg)
            if spot is not None:
                shadow.take(spot)
                return end, shadow
        return float("inf"), None
