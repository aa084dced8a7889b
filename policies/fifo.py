"""FIFO: arrival order, the user's plan, consolidated first-fit, no preemption.

Strict FIFO: a job that does not fit blocks those behind it (head-of-line),
as in Blox's FIFO scheduler; this is what "first in, first out" promises users.
Priority classes (``JobSpec.priority``) come first: FIFO within a class.
"""

from __future__ import annotations

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.placement import first_fit, largest_block, take


class Fifo:
    name = "fifo"

    def __init__(self, default_cpus_per_gpu: int = 1):
        self.default_cpus_per_gpu = default_cpus_per_gpu

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        free_g = {n.name: n.gpus_total for n in nodes}
        free_c = {n.name: n.cpus_total for n in nodes}
        decision = Decision()
        allocations, waiting = decision.allocations, decision.waiting
        queue = []
        for j in jobs:  # every round, for every job: kept lean
            held = j.placement
            if held:
                allocations[j.job_id] = JobDecision(held, j.plan or default_plan(j.spec), "running")
                for p in held:
                    free_g[p.node] -= p.gpus
                    free_c[p.node] -= p.cpus
            else:
                queue.append(j)
        queue.sort(key=fifo_order)
        for i, j in enumerate(queue):
            cpg = j.spec.cpus_per_gpu or self.default_cpus_per_gpu
            placement = first_fit(j.spec.gpus, cpg, free_g, free_c, nodes, unit=default_plan(j.spec).tp)
            if placement is None:
                waiting[j.job_id] = (
                    f"waiting: needs {j.spec.gpus} GPUs, {sum(free_g.values())} free "
                    f"(largest free block {largest_block(free_g)})"
                )
                # head of line: everything behind it waits, for the same reason (one string)
                waiting.update(dict.fromkeys([b.job_id for b in queue[i + 1:]],
                                             f"waiting: behind {j.job_id} in FIFO order"))
                break
            take(placement, free_g, free_c)
            where = ", ".join(f"{p.node}:{p.gpus}" for p in placement)
            allocations[j.job_id] = JobDecision(placement, default_plan(j.spec), f"FIFO first fit on {where}")
        return decision


def fifo_order(j: JobView) -> tuple:
    """Priority class first (``classes.class_rank``), then arrival, then id."""
    return (-j.spec.priority, j.submitted_at, j.job_id)
