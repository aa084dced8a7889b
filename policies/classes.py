"""Priority classes, read by every policy (issue 13).

``JobSpec.priority`` is a job's class: higher runs first. Two parts, shared by
all policies so none reads the class its own way:

- ``by_class(key)``: an ordering key with the class in front (the FIFO family,
  LAS/SRTF/Tiresias, AntMan, Synergy, Gavel's round order). Policies that
  preempt by walking their order from the bottom thereby take the lowest class
  first.
- ``enforce(...)``: for policies that decide by optimisation (rubick, sia),
  a check on their decision: a job of a higher class that gets less than its
  request (nothing, or shrunk) gets its request from the GPUs of lower-class jobs, this round's starts first, then running
  jobs past their minimum run time, lowest class and newest first. A job inside
  its minimum run time is never taken (only quota reclaim may, in
  ``policies.sharing``). When every job is in one class it changes nothing, so
  a cluster that does not use classes sees each policy exactly as written.

Pure: no clock, no NATS.
"""

from __future__ import annotations

from collections.abc import Sequence

from gearshift.policies import typed_place
from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.placement import Ledger, describe
from gearshift.policies.protocols import ClassedBatchKey, ClassedBatchOrder, OrderKey, supports
from gearshift.policies.victims import any_checkpoint, work_since_checkpoint


def class_rank(job: JobView) -> int:
    """Sorts higher classes first."""
    return -job.spec.priority


class ByClass:
    """``by_class(key)``: ``key`` with the class in front; ``many`` answers for many jobs
    at once (``protocols.BatchOrderKey``), through the base's own batch
    (``protocols.ClassedBatchKey``) where it declares one."""

    __slots__ = ("base", "_one", "_many", "_order")

    def __init__(self, key: OrderKey):
        self.base = key

        def keyed(j: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
            k = key(j, now, perf)
            return (-j.spec.priority,) + (k if type(k) is tuple else tuple(k))

        self._one = keyed
        self._many = key.many_by_class if supports(key, ClassedBatchKey) else None
        self._order = key.order_by_class if supports(key, ClassedBatchOrder) else None

    def __call__(self, j: JobView, now: float, perf: PerfOracle | None = None) -> tuple:
        return self._one(j, now, perf)

    def many(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> list[tuple]:
        """``[self(j, now, perf) for j in jobs]``, the same tuples."""
        if self._many is not None:
            return self._many(jobs, now, perf)
        keyed = self._one
        return [keyed(j, now, perf) for j in jobs]

    def order(self, jobs: Sequence[JobView], now: float, perf: PerfOracle | None) -> Sequence[int] | None:
        """The positions of ``jobs`` in the order of ``many``'s keys (``protocols.BatchOrder``),
        through the base's own (``protocols.ClassedBatchOrder``); None where it has none."""
        return self._order(jobs, now, perf) if self._order is not None else None


def by_class(key: OrderKey) -> ByClass:
    return ByClass(key)


def enforce(now: float, nodes: list[NodeState], jobs: list[JobView], decision: Decision, *, min_run_time: float,
            name: str) -> Decision:
    """Give waiting higher-class jobs the GPUs of lower-class ones (see the module doc)."""
    if len({j.spec.priority for j in jobs}) < 2:
        return decision
    by_id = {j.job_id: j for j in jobs}
    ledger = Ledger(nodes)
    for d in decision.allocations.values():
        ledger.take(d.placement)

    def protected(v: JobView) -> bool:
        return v.switched_at is not None and now - v.switched_at < min_run_time

    # jobs of a class above the lowest that get less than their request (nothing, or shrunk)
    short = sorted((j for j in jobs if _gpus(decision.allocations.get(j.job_id)) < default_plan(j.spec).gpus),
                   key=lambda j: (-j.spec.priority, j.submitted_at, j.job_id))
    lowest = min(j.spec.priority for j in jobs)
    for j in short:
        if j.spec.priority == lowest:
            break
        plan = default_plan(j.spec)
        have = decision.allocations.get(j.job_id)
        prefer = tuple(p.node for p in (have.placement if have else j.placement))
        if have is not None:
            ledger.give(have.placement)
        spot = typed_place.place(ledger, j, plan, prefer=prefer)
        taken: list[tuple[JobView, JobDecision]] = []
        if spot is None:
            cands = [by_id[jid] for jid in decision.allocations
                     if by_id[jid].spec.priority < j.spec.priority and not (by_id[jid].running and protected(by_id[jid]))]
            lost = work_since_checkpoint if any_checkpoint(cands) else (lambda v, now: 0.0)  # policies.victims
            cands.sort(key=lambda v: (v.running, v.spec.priority, lost(v, now), -(v.switched_at or 0.0), v.job_id))
            for v in cands:
                d = decision.allocations[v.job_id]
                ledger.give(d.placement)
                taken.append((v, d))
                spot = typed_place.place(ledger, j, plan, prefer=prefer)
                if spot is not None:
                    break
            if spot is None:
                for v, d in taken:
                    ledger.take(d.placement)
                if have is not None:
                    ledger.take(have.placement)
                continue
        ledger.take(spot)
        for v, _ in taken:
            del decision.allocations[v.job_id]
            decision.waiting[v.job_id] = (f"{'preempted' if v.running else 'waiting'}: its GPUs went to {j.job_id} "
                                          f"of a higher priority class ({j.spec.priority} > {v.spec.priority})")
        decision.waiting.pop(j.job_id, None)
        verb = "resized to" if have is not None or j.running else "started on"
        decision.allocations[j.job_id] = JobDecision(
            spot, plan, f"{name}: {verb} {describe(spot)}, its request (priority class {j.spec.priority})")
    return decision


def _gpus(d: JobDecision | None) -> int:
    return sum(p.gpus for p in d.placement) if d is not None else 0
