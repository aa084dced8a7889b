"""Gavel (OSDI'20), max-min fairness policy on one GPU type.

1. An LP gives each job a time fraction X_j of its requested GPUs:
   maximise t subject to X_j >= t * s_j (s_j = the job's fair share of time,
   min(1, (GPUs / jobs) / its GPUs): equal GPU-time for everyone), sum_j X_j
   g_j <= GPUs, 0 <= X_j <= 1; then, at that t, maximise sum_j X_j so spare
   capacity is used (Gavel's water filling, in one step on one GPU type).
2. Rounds: jobs are ranked by X_j / (fraction of time run so far since
   arrival) and granted their GPUs in that order, skipping jobs that do not
   fit, so that the time each job runs converges to X_j.
Jobs keep their GPUs for a round of ``min_run_time`` (Gavel's 360 s rounds), or four
times their restart cost when that is longer (``round_of``, as on mixed types: a
30B model's ~530 s restore would otherwise be time-shared into never training),
before they can be preempted. The plan and GPU count are the user's.
Priority classes (``JobSpec.priority``) come before Gavel's own priority in the
round order, so a lower class is what goes without GPUs first.
Simplifications on one GPU type: no space sharing; throughput only enters
through the GPU counts (equal normalised throughput per GPU-time).

Mixed GPU types (Gavel's heterogeneity-aware max-min fairness, ``gavel_hetero.py``):
X[j,k] is the time fraction of job j on type k; effective throughput
sum_k T[j,k] X[j,k], T from the oracle (the job's plan on its GPUs of type k);
the LP maximises the smallest effective throughput normalised by the job's
throughput under an equal share (1/n of the cluster's time, spread over types in
proportion to their GPUs), then uses spare capacity; rounds grant (job, type) pairs
by priority X[j,k] / (fraction of time the job received on k).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.classes import class_rank
from gearshift.policies.gavel_hetero import HeteroGavel
from gearshift.policies.placement import Ledger, describe


class Gavel(HeteroGavel):
    hetero = True  # models GPU types itself (policies.hetero does not wrap it)

    def __init__(self, min_run_time: float = 360.0, restart_cost: float = 0.0):
        self.name = "gavel"
        self.min_run_time = min_run_time
        self._recv: dict[str, dict[str, float]] = {}
        self._last_now: float | None = None

    def shares(self, jobs: list[JobView], total: int) -> np.ndarray:
        n = len(jobs)
        if n == 0:
            return np.zeros(0)
        g = np.array([default_plan(j.spec).gpus for j in jobs], float)
        s = np.minimum(1.0, (total / n) / g)
        # variables: X_1..X_n, t ; maximise t
        c = np.zeros(n + 1)
        c[-1] = -1.0
        A = [np.append(g, 0.0)]
        b = [float(total)]
        for i in range(n):
            row = np.zeros(n + 1)
            row[i] = -1.0
            row[-1] = s[i]
            A.append(row)
            b.append(0.0)
        bounds = [(0.0, 1.0 if gi <= total else 0.0) for gi in g] + [(0.0, None)]
        r = linprog(c, A_ub=np.array(A), b_ub=np.array(b), bounds=bounds, method="highs")
        if r.status != 0:
            return np.zeros(n)
        t = r.x[-1]
        # water filling: keep everyone at >= t*s_j, use what is left
        c2 = np.append(-g / max(total, 1), 0.0)
        bounds2 = [(min(t * s[i], bounds[i][1]), bounds[i][1]) for i in range(n)] + [(0.0, 0.0)]
        r2 = linprog(c2, A_ub=np.array([np.append(g, 0.0)]), b_ub=[float(total)], bounds=bounds2, method="highs")
        return r2.x[:n] if r2.status == 0 else r.x[:n]

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        if len({n.gpu_type for n in nodes}) > 1 or any(j.spec.gpu_types for j in jobs):
            return self.schedule_hetero(now, nodes, jobs, perf)
        total = sum(n.gpus_total for n in nodes)
        x = self.shares(jobs, total)
        prio = {}
        for i, j in enumerate(jobs):
            g = default_plan(j.spec).gpus
            ran = j.attained_service / g
            elapsed = max(now - j.submitted_at, 1.0)
            prio[j.job_id] = x[i] / max(ran / elapsed, 1e-6)
        share = {j.job_id: x[i] for i, j in enumerate(jobs)}
        ledger = Ledger(nodes)
        d = Decision()
        pinned = [j for j in jobs if j.running and j.switched_at is not None and now - j.switched_at < self.round_of(j)]
        for j in pinned:
            if ledger.fits(j.placement):
                ledger.take(j.placement)
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec), "gavel: round not over")
        order = sorted((j for j in jobs if j.job_id not in d.allocations), key=lambda j: (class_rank(j), -prio[j.job_id], j.submitted_at))
        for j in order:
            plan = default_plan(j.spec)
            cpg = j.spec.cpus_per_gpu or 1
            if share[j.job_id] <= 1e-9:
                d.waiting[j.job_id] = "waiting: max-min LP gives it no time (it needs more GPUs than the cluster has)"
                continue
            if j.running and ledger.fits(j.placement):
                ledger.take(j.placement)
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan or plan, f"gavel: kept (priority {prio[j.job_id]:.2f})")
                continue
            pl = ledger.place(plan.gpus, cpg, prefer=tuple(p.node for p in j.placement), unit=plan.tp)
            if pl is None:
                lead = "preempted" if j.running else "waiting"
                d.waiting[j.job_id] = (
                    f"{lead}: time share {share[j.job_id]:.2f}, priority {prio[j.job_id]:.2f}; "
                    f"needs {plan.gpus} GPUs, largest free block {ledger.largest_block()}"
                )
                continue
            ledger.take(pl)
            d.allocations[j.job_id] = JobDecision(
                pl, plan, f"gavel: granted {describe(pl)} (time share {share[j.job_id]:.2f}, priority {prio[j.job_id]:.2f})"
            )
        return d
