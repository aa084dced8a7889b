"""Gavel's heterogeneity-aware max-min fairness (OSDI'20, section 4 and its
``max_min_fairness_perf`` policy), for clusters with more than one GPU type.

1. Throughput matrix T[j,k]: samples/s of job j's own plan on its requested GPUs of
   type k, compactly placed (the oracle; Gavel measures or estimates the same
   matrix), 0 where the type is not accepted, too small or out of memory.
2. LP over X[j,k] (time fraction of j on k): sum_k X[j,k] <= 1; sum_j g_j X[j,k]
   <= GPUs of k; maximise min_j sum_k T[j,k] X[j,k] / eq_j, where eq_j is j's
   throughput under an equal share (1/n of the cluster's time, at most one, spread
   over the types it can use in proportion to their GPUs). Then, keeping every job
   at that level, maximise the sum of normalised effective throughputs (spare
   capacity goes where it is most effective; one step of water filling).
3. Rounds of ``min_run_time`` (360 s; ``round_of``: at least 4x the job's restart
   cost): (job, type) pairs are granted in order of
   priority X[j,k] / (fraction of its time since arrival the job ran on k), each
   job at most once, on nodes of that type only; a job keeps its nodes when it is
   granted its current type again.
The received time per type is the policy's own record, updated every round from
where the jobs ran since the last one (the same live and in simulation).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog

from gearshift.perfmodel.restart import restart_seconds
from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, accepts, default_plan
from gearshift.policies.classes import class_rank
from gearshift.policies.hetero import node_types, typed_oracle
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.placement import Ledger, compact_shape, describe


class HeteroGavel:
    """Mixin of ``policies.gavel.Gavel``: ``schedule_hetero``."""

    def throughput_matrix(self, jobs: list[JobView], nodes: list[NodeState], perf, types: list[str]) -> np.ndarray:
        perf = perf or AnalyticOracle()
        T = np.zeros((len(jobs), len(types)))
        for k, t in enumerate(types):
            tn = [n for n in nodes if n.gpu_type == t]
            cap, gpn = sum(n.gpus_total for n in tn), max(n.gpus_total for n in tn)
            cpn = max(n.cpus_total for n in tn)
            typed = typed_oracle(perf, t) or perf
            for i, j in enumerate(jobs):
                plan = default_plan(j.spec)
                if not accepts(j.spec, t) or plan.gpus > cap or plan.tp > gpn:
                    continue
                cpg = j.spec.cpus_per_gpu or max(1, min(4, cpn // max(gpn, 1)))
                T[i, k] = max(0.0, float(typed.throughput(j, plan, compact_shape(plan.gpus, gpn, cpg, t))))
        return T

    def hetero_shares(self, T: np.ndarray, g: np.ndarray, cap: np.ndarray) -> np.ndarray:
        n, m = T.shape
        if n == 0:
            return np.zeros((0, m))
        usable = T > 0
        total = float(cap.sum())
        eq = np.zeros(n)
        for i in range(n):
            if not usable[i].any():
                continue
            share = cap * usable[i] / float((cap * usable[i]).sum())
            eq[i] = float((T[i] * share).sum()) * min(1.0, (total / n) / g[i])
        live = eq > 0
        # variables: X (n*m, row-major), z
        nv = n * m + 1
        A, b = [], []
        for i in range(n):  # sum_k X[i,k] <= 1
            row = np.zeros(nv)
            row[i * m:(i + 1) * m] = 1.0
            A.append(row)
            b.append(1.0)
        for k in range(m):  # GPUs of type k
            row = np.zeros(nv)
            row[k:n * m:m] = g
            A.append(row)
            b.append(float(cap[k]))
        fair = []
        for i in np.flatnonzero(live):  # z - sum_k T X / eq <= 0
            row = np.zeros(nv)
            row[i * m:(i + 1) * m] = -T[i] / eq[i]
            row[-1] = 1.0
            fair.append(row)
        bounds = [(0.0, 1.0 if usable[i, k] else 0.0) for i in range(n) for k in range(m)] + [(0.0, None)]
        c = np.zeros(nv)
        c[-1] = -1.0
        r = linprog(c, A_ub=np.array(A + fair), b_ub=np.array(b + [0.0] * len(fair)), bounds=bounds, method="highs")
        if r.status != 0:
            return np.zeros((n, m))
        z = r.x[-1] * (1 - 1e-6)
        # water filling (one step): everyone keeps >= z, the rest goes where it is most effective
        c2 = np.zeros(nv)
        for i in np.flatnonzero(live):
            c2[i * m:(i + 1) * m] = -T[i] / eq[i]
        A2 = A + [np.append(row[:-1], 0.0) for row in fair]
        b2 = b + [-z] * len(fair)
        r2 = linprog(c2, A_ub=np.array(A2), b_ub=np.array(b2), bounds=bounds[:-1] + [(0.0, 0.0)], method="highs")
        x = r2.x if r2.status == 0 else r.x
        return x[:n * m].reshape(n, m)

    def round_of(self, job: JobView) -> float:
        """A job's round: ``min_run_time`` (Gavel's 360 s), or four times the job's
        checkpoint-restore cost when that is longer. Gavel's rounds assume a
        preemption costs seconds; with a 30B model's ~530 s restore, 360 s rounds
        would time-share it into never training (each grant restarts it)."""

        return max(self.min_run_time, 4.0 * restart_seconds(job.spec))

    def _account(self, now: float, jobs: list[JobView], by_node: dict[str, str]) -> None:
        dt = 0.0 if self._last_now is None else max(0.0, now - self._last_now)
        self._last_now = now
        live = {j.job_id for j in jobs}
        for jid in [k for k in self._recv if k not in live]:
            del self._recv[jid]
        for j in jobs:
            if j.running and dt > 0 and j.placement[0].node in by_node:
                rec = self._recv.setdefault(j.job_id, {})
                t = by_node[j.placement[0].node]
                rec[t] = rec.get(t, 0.0) + dt

    def schedule_hetero(self, now: float, nodes: list[NodeState], jobs: list[JobView],
                        perf: PerfOracle | None) -> Decision:
        types = node_types(nodes)
        by_node = {n.name: n.gpu_type for n in nodes}
        self._account(now, jobs, by_node)
        cap = np.array([sum(n.gpus_total for n in nodes if n.gpu_type == t) for t in types], float)
        g = np.array([default_plan(j.spec).gpus for j in jobs], float)
        T = self.throughput_matrix(jobs, nodes, perf, types)
        X = self.hetero_shares(T, g, cap)
        prio: list[tuple] = []  # (class, priority, share, arrival, job, type)
        for i, j in enumerate(jobs):
            elapsed = max(now - j.submitted_at, 1.0)
            rec = self._recv.get(j.job_id, {})
            for k, t in enumerate(types):
                if X[i, k] > 1e-9:
                    frac = rec.get(t, 0.0) / elapsed
                    prio.append((class_rank(j), -X[i, k] / max(frac, 1e-6), -X[i, k], j.submitted_at, i, k))
        prio.sort()
        ledgers = {t: Ledger([n for n in nodes if n.gpu_type == t]) for t in types}
        d = Decision()
        for j in jobs:  # a round is not over: keep
            if j.running and j.switched_at is not None and now - j.switched_at < self.round_of(j):
                t = by_node.get(j.placement[0].node)
                if t is not None and ledgers[t].fits(j.placement):
                    ledgers[t].take(j.placement)
                    d.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec),
                                                          "gavel: round not over")
        for _, p, _, _, i, k in prio:
            j, t = jobs[i], types[k]
            if j.job_id in d.allocations:
                continue
            plan = default_plan(j.spec)
            led = ledgers[t]
            if j.running and by_node.get(j.placement[0].node) == t and led.fits(j.placement):
                led.take(j.placement)
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan or plan,
                                                      f"gavel: kept on {t} (share {X[i, k]:.2f}, priority {-p:.2f})")
                continue
            pl = led.place(plan.gpus, j.spec.cpus_per_gpu or 1, prefer=tuple(q.node for q in j.placement),
                           unit=plan.tp)
            if pl is None:
                continue
            led.take(pl)
            d.allocations[j.job_id] = JobDecision(
                pl, plan, f"gavel: granted {describe(pl)} of {t} (share {X[i, k]:.2f}, priority {-p:.2f})",
                float(T[i, k]))
        for i, j in enumerate(jobs):
            if j.job_id in d.allocations:
                continue
            lead = "preempted" if j.running else "waiting"
            if not (T[i] > 0).any():
                d.waiting[j.job_id] = f"{lead}: no accepted GPU type can run its plan on its GPUs"
            else:
                shares = ", ".join(f"{t} {X[i, k]:.2f}" for k, t in enumerate(types) if X[i, k] > 1e-9) or "none"
                d.waiting[j.job_id] = f"{lead}: max-min LP time shares {shares}; no room on those types this round"
        return d
