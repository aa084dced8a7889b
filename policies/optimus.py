"""Optimus (EuroSys'18, Peng et al.) as a gearshift policy: marginal-gain GPU allocation.

The paper's allocation (section 4.2): each job first gets one unit. Then, while GPUs are
left, the next GPU goes to the job whose remaining time falls most when it gets one more
worker. That fall is ``remaining steps x (step time on w workers - step time on w + 1)``
with the job's fitted speed function. A job stops taking GPUs when one more would not
help, or at its largest worker count. Placement (section 4.3) packs each job onto as
few servers as it can. The rules follow the Pollux artifact's Optimus+Oracle
(``petuum/adaptdl`` ``osdi21-artifact``, ``simulator/optimus.py``, rewritten here):

- jobs start with one unit, in arrival order, while GPUs are left: 1 GPU, or the fewest
  its plan splits into that the oracle can answer (the measured regime answers only
  measured rows and the request);
- gain = (step(w) - step(w+1)) x remaining steps, 0 at the job's cap or with no GPU left;
  the largest positive gain wins a GPU, until the GPUs run out or no gain is positive;
- a running job whose GPU count is unchanged keeps its placement. The others, fewest
  GPUs first, take GPUs from the node with the most free ones, then the next.

Where the speed comes from: ``step(w) = global batch / PerfOracle.throughput`` of the
job's own plan with its data-parallel degree scaled to ``w`` (``pollux.plan_for``: its own plan on its request),
packed on ``ceil(w / GPUs per node)`` nodes. In the simulator the oracle is the belief
(a fitted model). The Pollux replay (``sim.pollux_replay``) hands it the measured speed,
as the artifact's "+Oracle" baseline does. Remaining steps are ``spec.steps -
steps_done``: the declared length, as in Optimus+Oracle. Optimus's paper fits it
from the loss curve. GPU counts the plan cannot split into are skipped. The cap is
``max_gpus(job)`` if given (the replay gives the artifact's target batch / smallest
atomic batch), else the cluster.

Blox's port (``msr-fiddle/blox`` ``schedulers/optimus.py``) crashes in simulation
(``AttributeError: ... 'optimus_scale_by_gpus'``, blox.md section 4). It also does not
follow the paper. It orders jobs SRTF and spreads leftover GPUs by raising
``job_gpu_demand``, but placement reads ``num_GPUs``, so the extra GPUs are never granted.
Its speed is a table indexed by the load string. Here the marginal gain is computed
from a speed function per job, and the GPUs it hands out are the ones placed.
"""

from __future__ import annotations

import heapq

from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, Placement
from gearshift.policies.candidates import oracle_key
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.pollux import plan_for


class Optimus:
    hetero = False

    def __init__(self, restart_cost: float = 0.0, min_run_time: float = 0.0, max_gpus=None, name: str = "optimus"):
        self.name = name
        self.restart_cost = restart_cost
        self.min_run_time = min_run_time
        self.max_gpus = max_gpus
        self._step: dict = {}

    def step_time(self, job: JobView, perf: PerfOracle, w: int, gpn: int) -> float:
        """Seconds per step on ``w`` GPUs (inf where the plan cannot split into ``w``)."""
        plan = plan_for(job.spec, w)
        if plan is None:
            return float("inf")
        key = (oracle_key(job.spec, perf), w, gpn)
        t = self._step.get(key)
        if t is None:
            cpg = job.spec.cpus_per_gpu or 1
            m = -(-w // gpn)
            shape = tuple(Placement(f"_n{i}", min(gpn, w - gpn * i), min(gpn, w - gpn * i) * cpg) for i in range(m))
            thr = perf.throughput(job, plan, shape)
            t = self._step[key] = job.spec.global_batch / thr if thr > 0 else float("inf")
        return t

    def gain(self, job: JobView, perf: PerfOracle, w: int, cap: int, gpn: int) -> tuple[float, int]:
        """Fall in remaining time when ``job`` goes from ``w`` to the next splittable count."""
        nxt = w + 1
        while nxt <= cap and plan_for(job.spec, nxt) is None:
            nxt += 1
        if nxt > cap:
            return 0.0, nxt
        a, b = self.step_time(job, perf, w, gpn), self.step_time(job, perf, nxt, gpn)
        if a == float("inf") or b == float("inf"):
            return 0.0, nxt
        return (a - b) * max(job.remaining_steps, 1.0) / (nxt - w), nxt

    def allocate(self, jobs: list[JobView], perf: PerfOracle, total: int, gpn: int) -> dict[str, int]:
        """The marginal-gain allocation: job -> GPUs."""
        left = total
        count: dict[str, int] = {}
        heap: list[tuple[float, int, str, int]] = []
        for i, j in enumerate(jobs):
            # one unit first: the fewest GPUs its plan splits into and the oracle can answer
            first = next((w for w in range(1, total + 1) if self.step_time(j, perf, w, gpn) < float("inf")), total + 1)
            if first > left:
                continue
            count[j.job_id] = first
            left -= first
        by_id = {j.job_id: j for j in jobs}
        for i, j in enumerate(jobs):
            if j.job_id in count:
                cap = min(total, self.max_gpus(j) if self.max_gpus else total)
                g, nxt = self.gain(j, perf, count[j.job_id], cap, gpn)
                if g > 0:
                    heapq.heappush(heap, (-g, i, j.job_id, nxt))
        while left > 0 and heap:
            g, i, jid, nxt = heapq.heappop(heap)
            extra = nxt - count[jid]
            if extra > left:
                continue
            count[jid] = nxt
            left -= extra
            j = by_id[jid]
            cap = min(total, self.max_gpus(j) if self.max_gpus else total)
            g2, nxt2 = self.gain(j, perf, nxt, cap, gpn)
            if g2 > 0:
                heapq.heappush(heap, (-g2, i, jid, nxt2))
        return count

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        perf = perf or AnalyticOracle()
        d = Decision()
        nodes = [n for n in nodes if n.gpus_total > 0]
        total = sum(n.gpus_total for n in nodes)
        gpn = max((n.gpus_total for n in nodes), default=1)
        jobs = sorted(jobs, key=lambda j: (j.submitted_at, j.job_id))
        count = self.allocate(jobs, perf, total, gpn)
        free = {n.name: n.gpus_total for n in nodes}
        rank = {n.name: i for i, n in enumerate(nodes)}
        kind = {n.name: n.gpu_type for n in nodes}
        cpg_of = {n.name: n.cpus_total // max(n.gpus_total, 1) for n in nodes}
        kept = set()
        for j in jobs:
            if j.running and count.get(j.job_id) == j.gpus and all(free.get(p.node, 0) >= p.gpus for p in j.placement):
                for p in j.placement:
                    free[p.node] -= p.gpus
                d.allocations[j.job_id] = JobDecision(j.placement, j.plan, "optimus: kept its GPUs")
                kept.add(j.job_id)
        for j in sorted(jobs, key=lambda j: (count.get(j.job_id, 0), j.submitted_at, j.job_id)):
            w = count.get(j.job_id, 0)
            if j.job_id in kept:
                continue
            if w == 0:
                d.waiting[j.job_id] = ("preempted" if j.running else "waiting") + ": no GPU left after the marginal-gain allocation"
                continue
            parts: dict[str, int] = {}
            need = w
            while need > 0:
                node = max(free, key=lambda k: (free[k], -rank[k]))
                if free[node] <= 0:
                    break
                take = min(free[node], need)
                parts[node] = parts.get(node, 0) + take
                free[node] -= take
                need -= take
            cpg = j.spec.cpus_per_gpu
            placement = tuple(Placement(n, c, c * min(cpg or cpg_of[n], cpg_of[n]), kind[n])
                              for n, c in parts.items())
            d.allocations[j.job_id] = JobDecision(placement, plan_for(j.spec, w),
                                                  f"optimus: {w} GPUs by marginal gain in remaining time")
        return d
