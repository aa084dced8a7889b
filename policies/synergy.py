"""Synergy (OSDI'22) with Synergy-TUNE, as a gearshift policy.

Parts: a base ordering (FIFO by default, as Rubick ran it; LAS or SRTF by
option; ``synergy-srtf`` is the SRTF order the Synergy paper also evaluates, its
remaining work read from the job's declared steps) and TUNE placement. Like Synergy's round-based scheduler, jobs are
taken in order and a job whose GPUs do not fit is skipped (backfill). GPU
count and plan are the user's. CPUs:
1. give the job its best-case CPU demand (the fewest CPU threads per GPU
   within 1% of its best throughput at its GPU count, from the oracle:
   Synergy's optimistic profile) if some node holds it;
2. else its GPU-proportional share (node CPUs x job GPUs / node GPUs), or
   its best case if that is smaller;
3. else shrink co-located jobs that hold more than their proportional share
   back to it, then place at the proportional share;
4. else skip the job this round.
No job gets less than min(best case, proportional share). Running jobs keep
their GPUs (FIFO does not preempt); step 3 may reduce their CPUs, which in
gearshift is a reconfiguration (the caller charges it).
Simplification: memory and storage bandwidth are not modelled (the interface
carries GPUs and CPUs only).
"""

from __future__ import annotations

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, Placement, default_plan
from gearshift.policies.candidates import oracle_key
from gearshift.policies.classes import by_class
from gearshift.policies.ordering import fifo_key, las_key, srtf_key
from gearshift.policies.placement import Ledger, compact_shape, describe

ORDERS = {"fifo": fifo_key, "las": las_key, "srtf": srtf_key}


class Synergy:
    def __init__(self, order: str = "fifo", cpu_levels: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24),
                 restart_cost: float = 0.0, min_run_time: float = 0.0, name: str = "synergy"):
        self.name = name
        self.key = by_class(ORDERS[order])  # priority classes first
        self.cpu_levels = cpu_levels
        self._best: dict = {}

    def best_case_cpus(self, job: JobView, perf: PerfOracle | None, per_node_gpus: int, cpus_per_node: int) -> int:
        """Fewest CPUs per GPU within 1% of the best throughput (optimistic profile)."""
        plan = default_plan(job.spec)
        key = (oracle_key(job.spec, perf), per_node_gpus, cpus_per_node)
        got = self._best.get(key)
        if got is not None:
            return got
        fallback = job.spec.cpus_per_gpu or max(1, cpus_per_node // max(per_node_gpus, 1) // 2)
        if perf is None:
            self._best[key] = fallback
            return fallback
        g = plan.gpus
        levels = [c for c in self.cpu_levels if c * min(g, per_node_gpus) <= cpus_per_node] or [1]
        thr = []
        for c in levels:
            thr.append(perf.throughput(job, plan, compact_shape(g, per_node_gpus, c)))
        best = max(thr)
        got = fallback if best <= 0 else next(c for c, t in zip(levels, thr) if t >= 0.99 * best)
        self._best[key] = got
        return got

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        gpn = max((n.gpus_total for n in nodes), default=8)
        cpn = max((n.cpus_total for n in nodes), default=8 * gpn)
        prop = {n.name: n.cpus_total // max(n.gpus_total, 1) for n in nodes}
        ledger = Ledger(nodes)
        holding: dict[str, list[Placement]] = {}
        views = {j.job_id: j for j in jobs}
        d = Decision()
        for j in jobs:
            if j.running and all(p.node in ledger.free_g for p in j.placement) and ledger.fits(j.placement):
                ledger.take(j.placement)
                holding[j.job_id] = list(j.placement)
        shrunk: dict[str, str] = {}
        started: dict[str, str] = {}
        for j in sorted(jobs, key=lambda j: self.key(j, now, perf)):
            if j.job_id in holding:
                continue
            plan = default_plan(j.spec)
            g = plan.gpus
            best = self.best_case_cpus(j, perf, min(g, gpn), cpn)
            pl = ledger.place(g, best, unit=plan.tp)
            how = f"best-case {best} CPUs/GPU"
            if pl is None:
                fair = min(best, min(prop.values()))
                pl = ledger.place(g, fair, unit=plan.tp)
                how = f"proportional {fair} CPUs/GPU"
                if pl is None and g <= gpn:
                    pl, victims = self._shrink_peers(g, fair, ledger, holding, prop, views)
                    for v in victims:
                        shrunk[v] = f"CPUs cut to the proportional share so {j.job_id} fits"
                    how = f"proportional {fair} CPUs/GPU after shrinking co-located jobs"
            if pl is None:
                d.waiting[j.job_id] = (
                    f"waiting: needs {g} GPUs, {ledger.total_free()} free (largest free block "
                    f"{ledger.largest_block()}); skipped this round"
                )
                continue
            ledger.take(pl)
            holding[j.job_id] = list(pl)
            verb = "moved to" if j.running else "started on"
            started[j.job_id] = f"synergy: {verb} {describe(pl)} with {how}"
        for jid, pl in holding.items():
            j = views[jid]
            why = started.get(jid, "synergy: kept")
            if jid in shrunk:
                why += "; " + shrunk[jid]
            plan = default_plan(j.spec) if jid in started else (j.plan or default_plan(j.spec))
            d.allocations[jid] = JobDecision(tuple(pl), plan, why)
        return d

    def _shrink_peers(self, g, fair, ledger: Ledger, holding, prop, views):
        """Synergy-TUNE step 3 on one node: cut peers above their
        proportional share back to it until the job fits. Returns
        (placement or None, ids of jobs shrunk)."""
        for n in sorted(ledger.free_g, key=lambda n: ledger.free_g[n]):
            if ledger.free_g[n] < g:
                continue
            need = g * fair - ledger.free_c[n]
            excess = []
            for jid, pl in holding.items():
                for i, p in enumerate(pl):
                    if p.node == n and p.cpus > p.gpus * prop[n]:
                        excess.append((p.cpus - p.gpus * prop[n], jid, i))
            if sum(e for e, _, _ in excess) < need:
                continue
            victims = []
            for e, jid, i in sorted(excess, reverse=True):
                if need <= 0:
                    break
                p = holding[jid][i]
                cut = min(e, need)
                holding[jid][i] = Placement(p.node, p.gpus, p.cpus - cut)
                ledger.free_c[n] += cut
                need -= cut
                victims.append(jid)
            return ledger.place(g, fair, prefer=(n,)), victims
        return None, []
