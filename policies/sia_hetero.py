"""Sia's heterogeneity-aware allocation (SOSP'23): one configuration per job per
round, a configuration being (GPU type, GPU count), chosen by one 0/1 MILP over all
types, as ``sia-simulator/sia.py`` does with its per-type goodput estimates.

- configurations per type k: 1, 2, 4, ... GPUs on one node of k and whole nodes of k
  (at most ``max_scale`` x the request, at least a node), only types the job accepts;
- goodput(j, k, n) from the oracle for the job's plan scaled in data parallelism on n
  GPUs of type k (Sia's throughput model per GPU type; the global batch is fixed, so
  goodput = throughput);
- utility (goodput / the job's smallest goodput over all its configurations x the
  scale unit there; a rigid job: its GPU count on the slowest type) ^ p, p = -0.5,
  minimised, an unallocated job costing lambda_n; changing a running job's type or
  count scales its goodput by the re-allocation factor (``policies.sia_rules``);
- one constraint per type: the GPUs chosen on k <= GPUs of k;
- placement per type (running jobs kept on their nodes, the rest largest first,
  falling back to smaller configurations of the same type).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, accepts, default_plan
from gearshift.policies.candidates import oracle_key
from gearshift.policies.hetero import node_types, typed_oracle
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.placement import Ledger, describe, symmetric_shape
from gearshift.policies.plans import scaled_user_plan
from gearshift.policies.sia_rules import normalised, realloc_factor, restart_of, restoring, utility


class HeteroSia:
    """Mixin of ``policies.sia.Sia``: ``schedule_hetero``."""

    def goodput_typed(self, job: JobView, perf, gpus: int, gpn: int, gtype: str):
        plan = scaled_user_plan(job.spec, gpus)
        if plan is None:
            return 0.0, None
        cpg = job.spec.cpus_per_gpu or 1
        key = (oracle_key(job.spec, perf), gpus, cpg, gpn, gtype)
        t = self._thr.get(key)
        if t is None:
            m = -(-gpus // gpn)
            per = gpus // m
            t = perf.throughput(job, plan, symmetric_shape(per, m, cpg, gtype))
            self._thr[key] = t
        return t, plan

    def schedule_hetero(self, now: float, nodes: list[NodeState], jobs: list[JobView],
                        perf: PerfOracle | None) -> Decision:
        perf = perf or AnalyticOracle()
        types = node_types(nodes)
        by_node = {n.name: n.gpu_type for n in nodes}
        gpn = {t: max(n.gpus_total for n in nodes if n.gpu_type == t) for t in types}
        cap = {t: sum(n.gpus_total for n in nodes if n.gpu_type == t) for t in types}
        d = Decision()
        var: list[tuple[int, str, int, object, float]] = []  # (job, type, gpus, plan, goodput)
        cost: list[float] = []
        pinned: dict[int, tuple[str, int]] = {}
        for i, j in enumerate(jobs):
            cur_t = by_node.get(j.placement[0].node) if j.running else None
            cur = (cur_t, j.gpus) if cur_t is not None else None
            restart = restart_of(j, self.restart_cost, self.restart_model)
            if cur and restoring(j, now, max(restart, self.min_run_time)):
                pinned[i] = cur
            opts = []
            for t in types:
                if not accepts(j.spec, t):
                    continue
                typed = typed_oracle(perf, t) or perf
                for g in self.configs(j, gpn[t], cap[t]):
                    thr, plan = self.goodput_typed(j, typed, g, gpn[t], t)
                    if thr > 0:
                        opts.append((t, g, plan, thr))
            if cur and cur not in [(o[0], o[1]) for o in opts]:
                thr = (typed_oracle(perf, cur[0]) or perf).throughput(j, j.plan or default_plan(j.spec), j.placement)
                if thr > 0:
                    opts.append((cur[0], cur[1], j.plan or default_plan(j.spec), thr))
            if not opts:
                d.waiting[j.job_id] = "waiting: no configuration of its plan is feasible on the GPU types it accepts"
                continue
            norm = normalised([o[3] for o in opts], [o[2].tp * o[2].pp for o in opts], [o[1] for o in opts])
            factor = 1.0 if i in pinned else realloc_factor(max(now - j.submitted_at, 0.0), j.restarts, restart)
            for (t, g, plan, thr), n in zip(opts, norm):
                if i in pinned and (t, g) != pinned[i]:
                    continue
                moved = cur is not None and (t, g) != cur
                var.append((i, t, g, plan, thr))
                cost.append(utility(n, factor if moved else 1.0, self.p) - self.lambda_n)
        chosen = self._solve_typed(var, np.array(cost), cap, types, pinned)
        self._place_typed(nodes, jobs, var, chosen, d, gpn, by_node)
        return d

    def _solve_typed(self, var, cost, cap, types, pinned) -> dict[int, int]:
        if not var:
            return {}
        nv = len(var)
        rows, cols, vals, lo, hi = [], [], [], [], []
        by_job: dict[int, list[int]] = {}
        for v, x in enumerate(var):
            by_job.setdefault(x[0], []).append(v)
        r = 0
        for i, vs in by_job.items():
            rows += [r] * len(vs)
            cols += vs
            vals += [1.0] * len(vs)
            lo.append(1.0 if i in pinned else 0.0)
            hi.append(1.0)
            r += 1
        for t in types:
            for v, x in enumerate(var):
                if x[1] == t:
                    rows.append(r)
                    cols.append(v)
                    vals.append(float(x[2]))
            lo.append(0.0)
            hi.append(float(cap[t]))
            r += 1
        A = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
        res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(nv), bounds=Bounds(0, 1),
                   options={"time_limit": self.time_limit, "disp": False})
        if res.x is None:
            return {}
        return {var[v][0]: v for v in range(nv) if res.x[v] > 0.5}

    def _place_typed(self, nodes, jobs, var, chosen, d: Decision, gpn, by_node) -> None:
        ledgers = {t: Ledger([n for n in nodes if n.gpu_type == t]) for t in gpn}
        order = []
        for i, v in chosen.items():
            j = jobs[i]
            _, t, g, _, _ = var[v]
            if (j.running and g == j.gpus and by_node.get(j.placement[0].node) == t
                    and ledgers[t].fits(j.placement)):
                ledgers[t].take(j.placement)
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec),
                                                      f"sia: kept its configuration ({g} x {t})")
            else:
                order.append((i, v))
        order.sort(key=lambda iv: -var[iv[1]][2])
        for i, v in order:
            j = jobs[i]
            t = var[v][1]
            cpg = j.spec.cpus_per_gpu or 1
            opts = sorted((w for w, x in enumerate(var) if x[0] == i and x[1] == t and x[2] <= var[v][2]),
                          key=lambda w: -var[w][2])
            for w in opts:
                _, _, g, plan, thr = var[w]
                pl = ledgers[t].place(g, cpg, nodes=-(-g // gpn[t]), prefer=tuple(p.node for p in j.placement))
                if pl is None:
                    continue
                ledgers[t].take(pl)
                verb = "resized to" if j.running else "started with"
                note = "" if w == v else f" (ILP chose {var[v][2]} GPUs; placement fell back)"
                d.allocations[j.job_id] = JobDecision(
                    pl, plan, f"sia: {verb} {g} {t} GPUs ({plan.label()}) on {describe(pl)}{note}", thr)
                break
            else:
                d.waiting[j.job_id] = f"waiting: ILP gave it {var[v][2]} {t} GPUs but no placement fits (fragmentation)"
        for j in jobs:
            if j.job_id not in d.allocations and j.job_id not in d.waiting:
                lead = "preempted" if j.running else "waiting"
                d.waiting[j.job_id] = f"{lead}: the goodput ILP gave its GPUs to other jobs this round"
