"""Rubick: co-optimise each job's plan with its GPUs, CPUs and placement.

One round:
1. Every job's candidates (``candidates.py``): its sensitivity curve over
   GPUs x CPU threads per GPU x nodes spanned, best plan at each point.
2. Utility of a candidate = (predicted throughput / throughput of the job's
   own request) ** alpha (so 1.0 = what it asked for; jobs are compared by
   *normalised* gains). alpha = 0.5 (``utility_exponent``) makes the value
   of growing concave: running one more job at its request beats doubling
   another job past its own, so a job is not starved or preempted just so a
   newcomer can run at twice its request (alpha = 1 maximises the plain sum
   of normalised throughputs). A candidate that differs from what a running job
   holds now (and every start) is charged the restart cost: its utility is
   scaled by T/(T+R), the job's average speed over the rest of its run
   (T = time to finish at that speed, R = restart cost), so switching a job
   that is about to finish never pays. A job that is not running pays R
   whenever it starts, so for it the factor is taken relative to its
   request's, T/(T+R) / (T1/(T1+R)) (T1 = time to finish at the request's
   speed; ``start_unavoidable``): the restart decides which allocation it
   gets (a short job gains little from growing when the restart dominates
   its run), never *whether* it runs before a longer job. Charged in full,
   it ranked a pending job's start by its length, longest first: on
   rubick-base, 40 llama30 jobs with a few minutes of work waited hours
   behind long ones. ``completion_weight`` (beta, default 0: off) further
   scales every utility of a job by (R0/(T1+R0))^beta, its completion rate
   at its request relative to R0 = max(R, 60 s) (Smith's rule: shorter
   remaining work first among equal normalised gains). ``resume_charge``
   (on): every utility of a running job is divided by its request's
   T1/(T1+R), since a preempted job pays R again to resume
   (``rubick_rules.py``): a job minutes from done is not displaced.
3. Guarantees: a guaranteed job runs exactly its own request (its plan on
   its GPUs and CPUs, compactly placed) unless an alternative lies where the
   model has been validated (one node, data-parallel family, at least the
   request's GPUs and CPUs per GPU) and the model predicts it to beat the
   target (the request's predicted throughput, or
   ``JobView.target_throughput``) by ``guarantee_margin`` (20%). Multi-node
   and 3D-parallel predictions err by more than any margin (the request does
   not), so they never replace a request. Running guaranteed jobs are seeded
   first and are never shrunk below their request; a pending one is admitted
   (at its request when nothing else is trusted) only if it fits, so an
   accepted guarantee can be kept.
4. Jobs that (re)started less than ``min_run_time`` ago keep their
   allocation (pinned); pending guaranteed jobs are seeded after pinned
   best-effort ones (so a guarantee waits at most ``min_run_time`` for them:
   now that a guarantee is admitted at its full request, evicting freshly
   (re)started best-effort jobs for it costs them two restarts in a window)
   and before every other job, shortest predicted run first. One that has
   waited ``min_run_time`` goes before them (``guarantee_wait_bound``, on:
   jobs pinned anew at every switch kept 40-GPU guarantees out for hours).
   ``guarantee_evicts=True`` seeds them before pinned best-effort jobs (a
   guarantee may then evict one inside the minimum run time).
5. Everything else: greedy by normalised marginal gain per unit of resource
   (GPUs plus CPUs weighed by their scarcity), along each job's curve. A
   running job competes from zero, its current allocation being its cheapest
   way up (no restart charge): it is shrunk or preempted exactly when its
   resources give more normalised throughput elsewhere, net of restart
   costs; leftovers go to the highest marginal gains.
The search runs in numba (``kernels.py``) with a numpy reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .api import Decision, JobDecision, JobView, NodeState, PerfOracle, Placement, DEFAULT_MIN_RUN_TIME, DEFAULT_RESTART_COST, default_plan
from .candidates import Candidate, CandidateCache, CandidateSpace, resource_cost
from .classes import enforce
from .kernels import greedy_allocate
from .oracle import AnalyticOracle
from .placement import describe
from .rubick_rules import resume_weights, seed_groups


class Rubick:
    def __init__(
        self,
        *,
        name: str = "rubick",
        vary_plan: bool = True,
        vary_cpu: bool = True,
        vary_locality: bool = True,
        restart_cost: float = DEFAULT_RESTART_COST,
        min_run_time: float = DEFAULT_MIN_RUN_TIME,
        guarantee_evicts: bool = False,
        guarantee_margin: float = 0.2,
        max_scale: float = 2.0,
        utility_exponent: float = 0.5,
        start_unavoidable: bool = True,
        completion_weight: float = 0.0,
        resume_charge: bool = True,
        guarantee_wait_bound: bool = True,
        use_numba: bool = True,
    ):
        self.name = name
        self.vary_plan = vary_plan
        self.vary_cpu = vary_cpu
        self.vary_locality = vary_locality
        self.restart_cost = restart_cost
        self.min_run_time = min_run_time
        self.guarantee_evicts = guarantee_evicts
        self.guarantee_margin = guarantee_margin
        self.max_scale = max_scale
        self.alpha = utility_exponent
        self.start_unavoidable = start_unavoidable
        self.completion_weight = completion_weight
        self.resume_charge = resume_charge
        self.guarantee_wait_bound = guarantee_wait_bound
        self.use_numba = use_numba
        self._cache: CandidateCache | None = None
        self._ref: dict = {}
        self._stay: dict = {}
        self._fallback = AnalyticOracle()
        self._preempted: dict[str, float] = {}
        self._tables: dict[int, tuple] = {}  # job -> when this policy last preempted it
        self.last_stats: dict = {}

    # ---------------------------------------------------------------- helpers
    def _space(self, nodes: list[NodeState]) -> CandidateSpace:
        g = max((n.gpus_total for n in nodes), default=8)
        c = max((n.cpus_total for n in nodes), default=8 * g)
        return CandidateSpace(
            gpus_per_node=g, cpus_per_node=c, total_gpus=sum(n.gpus_total for n in nodes), n_nodes=len(nodes),
            vary_plan=self.vary_plan, vary_cpu=self.vary_cpu, vary_locality=self.vary_locality,
            max_scale=self.max_scale,
        )

    def _candidates(self, job: JobView, perf: PerfOracle, space: CandidateSpace) -> list[Candidate]:
        if self._cache is None or self._cache.space != space:
            self._cache = CandidateCache(space)
            self._tables.clear()
            self._ref.clear()
            self._stay.clear()
        if not job.spec.reconfigurable:
            key = ("fixed", self._cache.key(job, perf))
            got = self._cache.store.get(key)
            if got is None:
                got = _fixed_candidates(job, perf, space)
                self._cache.store[key] = got
            return got
        return self._cache.get(job, perf)

    def _candidate_table(self, job: JobView, perf: PerfOracle, space: CandidateSpace, cpg_cluster: float):
        """Candidates and their (gpus, cpus/gpu, nodes, throughput, cost) rows, cached with them."""
        cands = self._candidates(job, perf, space)
        tab = self._tables.get(id(cands))
        if tab is None or tab[0] is not cands:
            arr = np.array(
                [(c.gpus, c.cpus_per_gpu, c.nodes, c.throughput, resource_cost(c, cpg_cluster)) for c in cands],
                float,
            ).reshape(-1, 5)
            tab = (cands, arr)
            self._tables[id(cands)] = tab
        return cands, tab[1]

    def _with_request(self, job, perf, space, cpg_cluster, cands, tab):
        """Guaranteed jobs: their exact request (own plan, GPUs, CPUs, compact) as a candidate."""
        key = ("req", self._cache.key(job, perf))
        got = self._tables.get(key)
        if got is None or got[0] is not cands:
            extra = _fixed_candidates(job, perf, space)
            if extra:
                c = extra[0]
                row = np.array([[c.gpus, c.cpus_per_gpu, c.nodes, c.throughput, resource_cost(c, cpg_cluster)]])
                got = (cands, cands + extra, np.vstack([tab, row]))
            else:
                got = (cands, cands, tab)
            self._tables[key] = got
        return got[1], got[2]

    def requested_throughput(self, job: JobView, perf: PerfOracle, space: CandidateSpace) -> float:
        """The job's own plan on its own GPUs and CPUs, compactly placed."""
        hit = self._ref.get(id(job.spec))
        if hit is not None and hit[0] is job.spec:
            return hit[1]
        key = (self._cache.key(job, perf), job.spec.plan, job.spec.gpus, job.spec.cpus_per_gpu)
        got = self._ref.get(key)
        if got is None:
            plan = default_plan(job.spec)
            cpg = job.spec.cpus_per_gpu or max(1, min(4, space.cpus_per_node // space.gpus_per_node))
            got = perf.throughput(job, plan, _compact(plan.gpus, cpg, space.gpus_per_node))
            self._ref[key] = got
        self._ref[id(job.spec)] = (job.spec, got)
        return got

    def _stay_throughput(self, job: JobView, perf: PerfOracle) -> float:
        plan = job.plan or default_plan(job.spec)
        shape = tuple(sorted((p.gpus, p.cpus) for p in job.placement))
        key = (self._cache.key(job, perf), plan, shape)
        got = self._stay.get(key)
        if got is None:
            got = perf.throughput(job, plan, tuple(Placement(f"_n{i}", g, c) for i, (g, c) in enumerate(shape)))
            self._stay[key] = got
        return got

    def _trusted(self, job: JobView, cands: list[Candidate], space: CandidateSpace) -> np.ndarray:
        """Which candidates of a guaranteed job lie where the model is trusted:
        one node, data-parallel family (no TP/PP), at least the request's GPUs
        and CPUs per GPU (never a shrink)."""
        key = ("trust", id(cands), job.spec.gpus, job.spec.cpus_per_gpu)
        got = self._tables.get(key)
        if got is not None and got[0] is cands:
            return got[1]
        cpg = job.spec.cpus_per_gpu or 0
        out = np.array(
            [c.nodes == 1 and c.plan.tp == 1 and c.plan.pp == 1 and c.gpus >= job.spec.gpus and c.cpus_per_gpu >= cpg
             for c in cands],
            bool,
        )
        self._tables[key] = (cands, out)
        return out

    def _holds_request(self, j: JobView, space: CandidateSpace) -> bool:
        """A running job holds exactly its request: own plan on its GPUs, compact."""
        req = default_plan(j.spec)
        plan = j.plan or req
        same_plan = (plan.dp, plan.tp, plan.pp, plan.zero, plan.offload, plan.grad_ckpt) == (
            req.dp, req.tp, req.pp, req.zero, req.offload, req.grad_ckpt
        ) and (req.ga == plan.ga or j.spec.plan is None)
        return same_plan and j.gpus == j.spec.gpus and len(j.placement) == math.ceil(j.spec.gpus / space.gpus_per_node)

    def _holds_trusted(self, j: JobView, st: float, need: float, space: CandidateSpace) -> bool:
        plan = j.plan or default_plan(j.spec)
        cpg = j.spec.cpus_per_gpu or 0
        return (
            len(j.placement) == 1 and plan.tp == 1 and plan.pp == 1 and j.gpus >= j.spec.gpus
            and j.cpus >= cpg * j.gpus and st >= need * (1 - 1e-9)
        )

    def _pinned(self, j: JobView, now: float) -> bool:
        return j.running and j.switched_at is not None and now - j.switched_at < self.min_run_time

    def _held_out(self, j: JobView, now: float) -> bool:
        """A best-effort job preempted less than min_run_time ago stays out:
        preempting and restarting it would be two switches in that window."""
        if j.running or j.spec.guaranteed:
            return False
        last = max(self._preempted.get(j.job_id, -math.inf), j.last_switch_at if j.started_at is not None and j.last_switch_at is not None else -math.inf)
        return now - last < self.min_run_time

    # ---------------------------------------------------------------- round
    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        if not nodes:  # every node gone (the kernel cannot size an empty cluster): all wait
            return Decision(waiting={j.job_id: f"{self.name}: no live node" for j in jobs})
        pb = self.build_problem(now, nodes, jobs, perf)
        level, out_nodes = self.solve(pb)
        live = {j.job_id for j in jobs}
        self._preempted = {k: v for k, v in self._preempted.items() if k in live and now - v < self.min_run_time}
        for i, j in enumerate(jobs):
            if j.running and level[i] < 0:
                self._preempted[j.job_id] = now
        self.last_stats = {"jobs": len(jobs), "candidates": int(pb.nk.sum()), "objective": pb.objective(level)}
        d = self._decide(jobs, nodes, pb.rows, level, out_nodes, pb.stay, pb.thr, pb.refs, pb.targets, pb.u, pb.pinned, now)
        return enforce(now, nodes, jobs, d, min_run_time=self.min_run_time, name=self.name)  # priority classes

    def solve(self, pb: "Problem"):
        return greedy_allocate(*pb.kernel_args(), use_numba=self.use_numba)

    def build_problem(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> "Problem":
        """The round as arrays: candidates, utilities, costs, holdings, seeds."""
        perf = perf or self._fallback
        space = self._space(nodes)
        if self._cache is not None and self._cache.sweep():  # old revisions' curves (candidates.py)
            self._tables.clear(), self._stay.clear()  # pure functions of their keys: rebuilt the same
            self._ref = {k: v for k, v in self._ref.items() if type(k) is int}  # per-spec references stay
        node_ix = {n.name: i for i, n in enumerate(nodes)}
        cpg_cluster = max(space.cpus_per_node / space.gpus_per_node, 1e-9)
        J = len(jobs)
        rows: list[list[Candidate]] = []
        tabs: list[np.ndarray] = []
        refs = np.zeros(J)
        targets = np.zeros(J)
        guar = np.zeros(J, bool)
        held = np.zeros(J, bool)
        left = np.zeros(J)
        is_req = []
        for i, j in enumerate(jobs):
            cands, tab = self._candidate_table(j, perf, space, cpg_cluster)
            if j.spec.guaranteed:
                n0 = len(cands)
                cands, tab = self._with_request(j, perf, space, cpg_cluster, cands, tab)
                if len(cands) > n0:
                    is_req.append((i, len(cands) - 1))
            rows.append(cands)
            tabs.append(tab)
            ref = self.requested_throughput(j, perf, space)
            if ref <= 0:  # request infeasible under the model: best it could do at its size
                ref = max((c.throughput for c in cands if c.gpus <= j.spec.gpus), default=0.0) or (
                    cands[0].throughput if cands else 1.0
                )
            refs[i] = ref
            guar[i] = j.spec.guaranteed
            targets[i] = (j.target_throughput or ref) if guar[i] else 0.0
            held[i] = self._held_out(j, now)
            left[i] = max(j.remaining_steps, 1.0) * j.spec.global_batch
        K = max((len(r) for r in rows), default=0) + 1
        # rows of (gpus, cpus/gpu, nodes, throughput, cost), padded; column K-1 at most is "stay"
        table = np.zeros((J, K, 5))
        table[:, :, 2] = 1
        nk = np.zeros(J, np.int64)
        for i, tab in enumerate(tabs):
            n = tab.shape[0]
            if n:
                table[i, :n] = tab
            nk[i] = n
        thr = table[:, :, 3].copy()
        with np.errstate(divide="ignore", invalid="ignore"):
            u = (thr / refs[:, None]) ** self.alpha
            R = self.restart_cost
            T1 = left / refs  # seconds left at the request's predicted speed
            if R > 0:  # average speed over the rest of the run, restart included
                T = left[:, None] / thr
                f = T / (T + R)
                if self.start_unavoidable:
                    # A job that does not run pays the restart whenever it starts: it
                    # cannot decide *whether* it runs first, only which allocation
                    # (a short job gains little from growing when the restart dominates).
                    pend = np.array([not j.running for j in jobs], bool)
                    f1 = T1 / (T1 + R)
                    f = np.where(pend[:, None], f / f1[:, None], f)
                u = u * f
            # Completion weight (off by default): a job's utilities scale with its
            # completion rate at its request, 1 / (time left + restart), relative to
            # the restart cost: among equal normalised gains the job closer to done
            # goes first (Smith's rule per unit of resource).
            R0 = max(R, 60.0)
            w = (R0 / (T1 + R0)) ** self.completion_weight if self.completion_weight else np.ones(J)
            if self.resume_charge:  # a preempted job pays the restart again (rubick_rules.py)
                w = w * resume_weights(np.array([j.running for j in jobs], bool), T1, R)
            u = u * w[:, None]
        valid = np.arange(K)[None, :] < nk[:, None]
        valid &= thr > 0
        # A guaranteed job may run exactly its own request (its plan, GPUs and
        # CPUs, compactly placed: what the guarantee is measured against), or
        # an alternative in the regime where the model has been validated
        # (one node, data-parallel family, at least its GPUs and CPUs per GPU)
        # that the model predicts to beat its target by the margin. Multi-node
        # and 3D-parallel predictions err by more than any margin, so they
        # never stand in for a request; a guaranteed job is never shrunk.
        need = np.where(guar, targets * (1 + self.guarantee_margin), 0.0)
        g_ok = np.zeros((J, K), bool)
        for i, k in is_req:
            g_ok[i, k] = True
        for i in np.flatnonzero(guar):
            trust = self._trusted(jobs[i], rows[i], space)
            n = len(trust)
            g_ok[i, :n] |= trust & (thr[i, :n] >= need[i] * (1 - 1e-9))
        valid &= ~guar[:, None] | g_ok
        valid &= ~held[:, None]
        u = np.where(valid, u, -1.0)
        cg = table[:, :, 0].astype(np.int64)
        cc = table[:, :, 1].astype(np.int64)
        cm = table[:, :, 2].astype(np.int64)
        cost = table[:, :, 4].copy()
        stay = np.full(J, -1, np.int64)
        hold_ptr = np.zeros(J + 1, np.int64)
        hold_node: list[int] = []
        hold_g: list[int] = []
        hold_c: list[int] = []
        for i, j in enumerate(jobs):
            if j.running and all(p.node in node_ix for p in j.placement):
                n = nk[i]
                st = self._stay_throughput(j, perf)
                ok = st > 0 and (not guar[i] or self._holds_request(j, space) or self._holds_trusted(j, st, need[i], space))
                gpus, cpus = j.gpus, j.cpus
                stay[i] = n
                cg[i, n] = gpus
                cc[i, n] = max(1, cpus // max(gpus, 1))
                cm[i, n] = len(j.placement)
                thr[i, n] = st
                cost[i, n] = gpus + cpus / cpg_cluster
                u[i, n] = w[i] * (st / refs[i]) ** self.alpha if ok else (0.0 if self._pinned(j, now) else -1.0)
                nk[i] = n + 1
                for p in j.placement:
                    hold_node.append(node_ix[p.node])
                    hold_g.append(p.gpus)
                    hold_c.append(p.cpus)
            hold_ptr[i + 1] = len(hold_node)
        # seeds: pinned guaranteed, running guaranteed, pending guaranteed, pinned best-effort
        pinned = np.array([self._pinned(j, now) and stay[i] >= 0 for i, j in enumerate(jobs)], bool)
        seed = np.full(J, -1, np.int64)
        seed_any = np.zeros(J, bool)
        groups: list[list[int]] = [[], [], [], []]
        for i, j in enumerate(jobs):
            if j.spec.guaranteed:
                seed_any[i] = True
                if pinned[i]:
                    seed[i] = stay[i]
                    groups[0].append(i)
                elif stay[i] >= 0:
                    seed[i] = stay[i] if u[i, stay[i]] >= 0 else -1
                    groups[1].append(i)
                else:
                    groups[2].append(i)
            elif pinned[i]:
                seed[i] = stay[i]
                groups[3].append(i)
        # Pending guaranteed jobs: shortest predicted run at their request first
        # (fewest job-seconds spent waiting behind long ones), then by arrival.
        groups[2].sort(key=lambda i: (left[i] / max(targets[i], 1e-9), jobs[i].submitted_at, jobs[i].job_id))
        groups = seed_groups(groups, [now - j.submitted_at for j in jobs], self.min_run_time,
                            evicts=self.guarantee_evicts, bound=self.guarantee_wait_bound)  # rubick_rules.py
        seed_order = np.array([i for g in groups for i in g], np.int64)
        return Problem(
            cg=cg, cc=cc, cm=cm, u=u, cost=cost, nk=nk, stay=stay, hold_ptr=hold_ptr,
            hold_node=np.array(hold_node, np.int64), hold_g=np.array(hold_g, np.int64),
            hold_c=np.array(hold_c, np.int64), seed_order=seed_order, seed=seed, seed_any=seed_any, pinned=pinned,
            cap_g=space_cap(nodes, "g"), cap_c=space_cap(nodes, "c"), rows=rows, thr=thr, refs=refs, targets=targets,
            guaranteed=np.array([j.spec.guaranteed for j in jobs], bool),
        )

    # ---------------------------------------------------------------- output
    def _decide(self, jobs, nodes, rows, level, out_nodes, stay, thr, refs, targets, u, pinned, now=0.0) -> Decision:
        d = Decision()
        used = {n.name: 0 for n in nodes}
        for i, j in enumerate(jobs):
            k = int(level[i])
            if k < 0:
                continue
            if k == stay[i]:
                plan = j.plan or default_plan(j.spec)
                why = "kept (within minimum run time)" if pinned[i] else "kept: no better use of its resources net of the restart cost"
                d.allocations[j.job_id] = JobDecision(j.placement, plan, f"{self.name}: {why}", float(thr[i, k]), 0.0)
                for p in j.placement:
                    used[p.node] += p.gpus
                continue
            c = rows[i][k]
            per = c.per_node
            placement = tuple(
                Placement(nodes[int(out_nodes[i, q])].name, per, per * c.cpus_per_gpu) for q in range(c.nodes)
            )
            for p in placement:
                used[p.node] += p.gpus
            if j.running:
                old = thr[i, stay[i]] if stay[i] >= 0 else 0.0
                gain = float(c.throughput / old - 1.0) if old > 0 else None  # a numpy float does not encode
                verb = "grew" if c.gpus > j.gpus else "shrunk" if c.gpus < j.gpus else "switched"
                g = f"{gain:+.0%} predicted throughput" if gain is not None else "new allocation"
                why = f"{verb} to {c.describe()}: {g} (was {j.plan.label() if j.plan else '?'} on {j.gpus} GPUs)"
                if verb == "shrunk":
                    why += "; its GPUs give more normalised throughput to others"
            else:
                gain = None
                why = f"started with {c.describe()}: {c.throughput / refs[i]:.2f}x its request's predicted throughput"
            if j.spec.guaranteed:
                why += f"; guarantee {targets[i]:.3g} samples/s kept ({c.throughput:.3g})"
            d.allocations[j.job_id] = JobDecision(placement, c.plan, f"{self.name}: {why} on {describe(placement)}", float(c.throughput), None if gain is None else float(gain))
        free = {n.name: n.gpus_total - used[n.name] for n in nodes}
        block = max(free.values(), default=0)
        total_free = sum(free.values())
        for i, j in enumerate(jobs):
            if j.job_id in d.allocations:
                continue
            row = rows[i]
            allowed = [row[k] for k in np.flatnonzero(u[i, : len(row)] >= 0)]
            if j.spec.guaranteed:
                if allowed:
                    c = min(allowed, key=lambda c: (c.gpus, c.cpus_per_gpu))
                    d.waiting[j.job_id] = (
                        f"waiting: guarantee {targets[i]:.3g} samples/s needs at least {c.describe()}; "
                        f"largest free block is {block} GPUs ({total_free} free)"
                    )
                else:
                    d.waiting[j.job_id] = "waiting: no allocation in this cluster reaches its guaranteed throughput"
            elif not allowed and self._held_out(j, now):
                d.waiting[j.job_id] = (
                    f"waiting: preempted less than the minimum run time ({self.min_run_time:.0f} s) ago; "
                    "not restarted yet so it does not thrash"
                )
            elif not allowed:
                d.waiting[j.job_id] = "waiting: no plan of this job fits this cluster's GPUs"
            else:
                c = min(allowed, key=lambda c: c.gpus)
                lead = "preempted" if j.running else "waiting"
                if c.per_node > block:
                    d.waiting[j.job_id] = (
                        f"{lead}: needs {c.gpus} GPUs within {c.nodes} node(s) ({c.per_node} per node), "
                        f"largest free block is {block}"
                    )
                else:
                    d.waiting[j.job_id] = (
                        f"{lead}: lower normalised marginal gain ({c.throughput / refs[i]:.2f}x request on "
                        f"{c.gpus} GPUs) than the jobs given resources this round"
                    )
        return d


@dataclass
class Problem:
    """One round's allocation problem (see ``kernels.py`` for the fields)."""

    cg: np.ndarray
    cc: np.ndarray
    cm: np.ndarray
    u: np.ndarray
    cost: np.ndarray
    nk: np.ndarray
    stay: np.ndarray
    hold_ptr: np.ndarray
    hold_node: np.ndarray
    hold_g: np.ndarray
    hold_c: np.ndarray
    seed_order: np.ndarray
    seed: np.ndarray
    seed_any: np.ndarray
    pinned: np.ndarray
    cap_g: np.ndarray
    cap_c: np.ndarray
    rows: list = field(default_factory=list)
    thr: np.ndarray | None = None
    refs: np.ndarray | None = None
    targets: np.ndarray | None = None
    guaranteed: np.ndarray | None = None

    def kernel_args(self) -> tuple:
        return (
            self.cg, self.cc, self.cm, self.u, self.cost, self.nk, self.stay, self.hold_ptr, self.hold_node,
            self.hold_g, self.hold_c, self.seed_order, self.seed, self.seed_any, self.pinned, self.cap_g, self.cap_c,
        )

    def objective(self, level: np.ndarray) -> float:
        return float(sum(self.u[i, k] for i, k in enumerate(level) if k >= 0))


def space_cap(nodes: list[NodeState], what: str) -> np.ndarray:
    return np.array([n.gpus_total if what == "g" else n.cpus_total for n in nodes], np.int64)


def _compact(gpus: int, cpg: int, per_node: int) -> tuple[Placement, ...]:
    out = []
    i = 0
    while gpus > 0:
        g = min(gpus, per_node)
        out.append(Placement(f"_n{i}", g, g * cpg))
        gpus -= g
        i += 1
    return tuple(out)


def _fixed_candidates(job: JobView, perf: PerfOracle, space: CandidateSpace) -> list[Candidate]:
    """A job that may not be reconfigured: its own plan and GPUs, compact."""
    plan = default_plan(job.spec)
    cpg = job.spec.cpus_per_gpu or max(1, min(4, space.cpus_per_node // space.gpus_per_node))
    m = math.ceil(plan.gpus / space.gpus_per_node)
    if plan.gpus % m:
        return []
    shape = tuple(Placement(f"_n{i}", plan.gpus // m, plan.gpus // m * cpg) for i in range(m))
    t = perf.throughput(job, plan, shape)
    return [Candidate(plan.gpus, cpg, m, plan, t)] if t > 0 else []
