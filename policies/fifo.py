"""FIFO: arrival order, the user's plan, consolidated first-fit, no preemption.

Strict FIFO: a job that does not fit blocks those behind it (head-of-line),
as in Blox's FIFO scheduler; this is what "first in, first out" promises users.
Priority classes (``JobSpec.priority``) come first: FIFO within a class.
"""

from __future__ import annotations

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.classes import class_rank
from gearshift.policies.placement import first_fit, largest_block, take


class Fifo:
    name = "fifo"

    def __init__(self, default_cpus_per_gpu: int = 1):
        self.default_cpus_per_gpu = default_cpus_per_gpu

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        free_g = {n.name: n.gpus_total for n in nodes}
        free_c = {n.name: n.cpus_total for n in nodes}
        decision = Decision()
        for j in jobs:
            if j.running:
                plan = j.plan or default_plan(j.spec)
                decision.allocations[j.job_id] = JobDecision(j.placement, plan, "running")
                take(j.placement, free_g, free_c)
        blocked_by: str | None = None
        for j in sorted((j for j in jobs if not j.running), key=lambda j: (class_rank(j), j.submitted_at, j.job_id)):
            if blocked_by is not None:
                decision.waiting[j.job_id] = f"waiting: behind {blocked_by} in FIFO order"
                continue
            cpg = j.spec.cpus_per_gpu or self.default_cpus_per_gpu
            placement = first_fit(j.spec.gpus, cpg, free_g, free_c, nodes, unit=default_plan(j.spec).tp)
            if placement is None:
                decision.waiting[j.job_id] = (
                    f"waiting: needs {j.spec.gpus} GPUs, {sum(free_g.values())} free "
                    f"(largest free block {largest_block(free_g)})"
                )
                blocked_by = j.job_id
                continue
            take(placement, free_g, free_c)
            where = ", ".join(f"{p.node}:{p.gpus}" for p in placement)
            decision.allocations[j.job_id] = JobDecision(placement, default_plan(j.spec), f"FIFO first fit on {where}")
        return decision
