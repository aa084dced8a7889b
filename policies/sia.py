"""Sia (SOSP'23) as a gearshift policy: a goodput-maximising choice of one
configuration per job per round, solved as a 0/1 MILP with scipy's HiGHS.

Faithful to Sia's ILP (``sia-simulator/sia.py``) on one GPU type:
- configurations: 1, 2, 4, ... GPUs on one node (powers of two up to a node)
  and whole nodes (k x GPUs-per-node); at most ``max_scale`` x the request
  (and at least a node), and never below the smallest the plan allows;
- utility A[j,c] = (normalised goodput(j,c) x re-allocation factor)^p with p = -0.5,
  minimised; an unallocated job costs lambda_n = 1.1. Normalisation, re-allocation
  factor (with each job's own restart), the pin while a job restores from its
  checkpoint and the absence of an allocation-change term follow Sia's simulator
  line by line (``policies.sia_rules`` cites the code);
- total GPUs <= capacity; then a greedy placement that keeps running jobs on
  their nodes and places the rest largest first; a job that does not fit
  falls back to the largest smaller configuration that does.
Mixed GPU types: configurations are (type, count) and the ILP has one capacity
row per type (``sia_hetero.py``).
Adaptations, as Rubick ran Sia: the job's own plan is kept and only its data
parallel degree scales with the GPUs (``plans.scaled_user_plan``); the global
batch is fixed, so goodput = predicted throughput (no statistical-efficiency
term); CPUs are the job's requested CPUs per GPU. Jobs still restoring from
their last restart (started less than their own restart ago) are pinned, as
Sia pins jobs in checkpoint-restore (``scaling_underway``).
"""

from __future__ import annotations

import numpy as np

from gearshift.policies.api import (
    DEFAULT_RESTART_COST,
    Decision,
    JobDecision,
    JobView,
    NodeState,
    PerfOracle,
    default_plan,
)
from gearshift.policies.candidates import oracle_key
from gearshift.policies.classes import enforce
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.placement import Ledger, describe, symmetric_shape
from gearshift.policies.plans import scaled_user_plan
from gearshift.policies.sia_hetero import HeteroSia
from gearshift.policies.sia_rules import normalised, realloc_factor, restart_of, restoring, utility


class Sia(HeteroSia):
    hetero = True  # models GPU types itself (sia_hetero.py; policies.hetero does not wrap it)

    def __init__(self, p: float = -0.5, lambda_n: float = 1.1, max_scale: float = 2.0,
                 restart_cost: float = DEFAULT_RESTART_COST, min_run_time: float | None = None,
                 time_limit: float = 10.0, restart_model=None):
        self.name = "sia"
        self.p = p
        self.lambda_n = lambda_n
        # per-job restart (JobSpec -> s, e.g. perfmodel.restart.restart_seconds); None: restart_cost
        self.restart_model = restart_model
        self.max_scale = max_scale
        self.restart_cost = restart_cost
        self.pin_time = restart_cost if min_run_time is None else min_run_time  # priority classes' pin
        # an operator's minimum run time (gearshift's option, not Sia's) pins too; None: Sia's rule alone
        self.min_run_time = min_run_time or 0.0
        self.time_limit = time_limit
        self._thr: dict = {}

    def configs(self, job: JobView, gpn: int, total: int) -> list[int]:
        unit = default_plan(job.spec).tp * default_plan(job.spec).pp
        cap = min(total, max(gpn, int(self.max_scale * job.spec.gpus)))
        out = []
        g = 1
        while g <= min(gpn, cap):
            out.append(g)
            g *= 2
        k = 2
        while k * gpn <= cap:
            out.append(k * gpn)
            k += 1
        if job.spec.gpus <= cap and job.spec.gpus not in out and (job.spec.gpus <= gpn or job.spec.gpus % gpn == 0):
            out.append(job.spec.gpus)
        return sorted(g for g in out if g % unit == 0 and g >= unit)

    def goodput(self, job: JobView, perf: PerfOracle, gpus: int, gpn: int) -> tuple[float, object]:
        plan = scaled_user_plan(job.spec, gpus)
        if plan is None:
            return 0.0, None
        cpg = job.spec.cpus_per_gpu or 1
        key = (oracle_key(job.spec, perf), gpus, cpg, gpn)
        t = self._thr.get(key)
        if t is None:
            m = -(-gpus // gpn)
            per = gpus // m
            t = perf.throughput(job, plan, symmetric_shape(per, m, cpg))
            self._thr[key] = t
        return t, plan

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        types = {n.gpu_type for n in nodes}
        if len(types) > 1 or any(j.spec.gpu_types for j in jobs) or "" not in types:
            # GPU types (one, typed, included: the oracle must answer for it)
            return self.schedule_hetero(now, nodes, jobs, perf)
        perf = perf or AnalyticOracle()
        gpn = max((n.gpus_total for n in nodes), default=8)
        total = sum(n.gpus_total for n in nodes)
        d = Decision()
        var: list[tuple[int, int, object, float]] = []  # (job, gpus, plan, goodput)
        cost: list[float] = []
        pinned: dict[int, int] = {}
        for i, j in enumerate(jobs):
            cur = j.gpus if j.running else 0
            restart = restart_of(j, self.restart_cost, self.restart_model)
            if restoring(j, now, max(restart, self.min_run_time)):
                pinned[i] = cur
            opts = []
            for g in self.configs(j, gpn, total):
                t, plan = self.goodput(j, perf, g, gpn)
                if t > 0:
                    opts.append((g, plan, t))
            if cur and cur not in [o[0] for o in opts]:
                t = perf.throughput(j, j.plan or default_plan(j.spec), j.placement)
                if t > 0:
                    opts.append((cur, j.plan or default_plan(j.spec), t))
            if not opts:
                d.waiting[j.job_id] = "waiting: no configuration of its plan is feasible on this cluster"
                continue
            norm = normalised([o[2] for o in opts], [o[1].tp * o[1].pp for o in opts], [o[0] for o in opts])
            factor = 1.0 if i in pinned else realloc_factor(max(now - j.submitted_at, 0.0), j.restarts, restart)
            for (g, plan, t), n in zip(opts, norm):
                if i in pinned and g != pinned[i]:
                    continue
                # every configuration but the one it holds pays the factor; a first start does not
                a = utility(n, factor if (cur and g != cur) else 1.0, self.p)
                var.append((i, g, plan, t))
                cost.append(a - self.lambda_n)
        chosen = self._solve(jobs, var, np.array(cost), total, pinned)
        self._place(now, nodes, jobs, var, chosen, d, gpn)
        # priority classes: a waiting higher class takes lower classes' GPUs (policies.classes)
        return enforce(now, nodes, jobs, d, min_run_time=self.pin_time, name=self.name)

    def _solve(self, jobs, var, cost, total, pinned) -> dict[int, int]:
        """One GPU type: the typed ILP (``sia_hetero``) with a single capacity row."""
        typed = [(i, "", g, plan, t) for i, g, plan, t in var]
        return self._solve_typed(typed, cost, {"": total}, [""], {i: ("", g) for i, g in pinned.items()})

    def _place(self, now, nodes, jobs, var, chosen, d: Decision, gpn: int) -> None:
        ledger = Ledger(nodes)
        order = []
        for i, v in chosen.items():
            j = jobs[i]
            g = var[v][1]
            if j.running and g == j.gpus and ledger.fits(j.placement):
                ledger.take(j.placement)
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec), "sia: kept its configuration")
            else:
                order.append((i, v))
        order.sort(key=lambda iv: -var[iv[1]][1])
        for i, v in order:
            j = jobs[i]
            cpg = j.spec.cpus_per_gpu or 1
            opts = sorted((w for w, x in enumerate(var) if x[0] == i and x[1] <= var[v][1]), key=lambda w: -var[w][1])
            placed = False
            for w in opts:
                _, g, plan, t = var[w]
                m = -(-g // gpn)
                pl = ledger.place(g, cpg, nodes=m, prefer=tuple(p.node for p in j.placement))
                if pl is None:
                    continue
                ledger.take(pl)
                verb = "resized to" if j.running else "started with"
                note = "" if w == v else f" (ILP chose {var[v][1]} GPUs; placement fell back)"
                d.allocations[j.job_id] = JobDecision(
                    pl, plan, f"sia: {verb} {g} GPUs ({plan.label()}) on {describe(pl)}{note}", t
                )
                placed = True
                break
            if not placed:
                d.waiting[j.job_id] = f"waiting: ILP gave it {var[v][1]} GPUs but no placement fits (fragmentation)"
        for i, j in enumerate(jobs):
            if j.job_id not in d.allocations and j.job_id not in d.waiting:
                lead = "preempted" if j.running else "waiting"
                d.waiting[j.job_id] = f"{lead}: the goodput ILP gave its GPUs to other jobs this round"
