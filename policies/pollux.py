"""Pollux (OSDI'21, Qiao et al.) as a gearshift policy: co-adaptive GPU allocation by goodput.

Every round it searches allocation matrices (jobs x nodes -> GPUs) with Pollux's genetic
algorithm (``policies.pollux_search``) for the best power mean (p = -1) of each job's
speedup, with Pollux's restart factor; a job's speedup on (nodes, GPUs) is its best
goodput there (``policies.pollux_goodput``: throughput x statistical efficiency over
adaptive batch sizes) over its goodput at a fair share (``ceil(GPUs / jobs)`` GPUs on one
node), as ``simulator/pollux.py`` ``Problem.__init__`` builds it. The returned state is a
``Decision`` like every other policy's (checked by ``check_decision``).

What it knows of a job, and where that comes from:
- **Jobs with Pollux statistics** (``stats(job)`` returns ``PolluxJobStats``): the job's
  own fitted throughput parameters (fitted from the configurations it ran, as AdaptDL's
  agent does), its current gradient statistics (grad_sqr, grad_var), its batch limits and
  its largest replica count (twice the most replicas it has run on, as the authors'
  simulator's ``get_pollux_job_info``). Its plan is ``DP<r>`` with the best atomic batch as
  ``micro_batch`` and accumulation as ``ga``. Before any fit (a job that never ran) the
  speedup is linear, ``r / fair share`` (AdaptDL: ``lambda n, r: r``). The Pollux workload
  replay (``sim.pollux_replay``) supplies these from the measured profiles.
- **Every other job** (no ``stats``, or ``stats`` returns None: the rubick, Blox, Philly
  traces and live jobs, which report no gradient-noise statistics): its batch is the
  spec's global batch and never adapts, so its statistical efficiency is 1 and its goodput
  is the ``PerfOracle``'s predicted throughput of its own plan with the data-parallel degree
  scaled (``plans.scaled_user_plan``) on that many nodes; the largest replica count is
  twice its request (Pollux caps a job at twice the most replicas it has measured; a
  request is the one such point), and GPU counts its plan cannot split into are worth 0.
  Its speedup is over its goodput at the fair share; where the belief cannot answer that
  shape (the measured regime answers only measured rows and the request), over its request;
  a job the belief answers 0 everywhere is worth 1 on its request, packed (it asked for it).

A job whose row of the chosen matrix equals its current allocation keeps its plan and
placement exactly (Pollux re-tunes the batch inside an allocation without a restart; here
the job's agent does that). ``restart_cost`` is the restart factor's delay (Pollux's
simulator: 30 s). Priority classes then take GPUs for waiting higher classes
(``policies.classes.enforce``), as in Sia's port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gearshift.bus_schema.messages import Plan
from gearshift.policies.api import (
    DEFAULT_RESTART_COST,
    Decision,
    JobDecision,
    JobView,
    NodeState,
    PerfOracle,
    Placement,
    default_plan,
)
from gearshift.policies.candidates import oracle_key
from gearshift.policies.classes import enforce
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.plans import scaled_user_plan
from gearshift.policies.pollux_goodput import BatchLimits, GoodputModel, PerfParams
from gearshift.policies.pollux_search import GENERATIONS, POP_SIZE, AllocationSearch, carry_population
from gearshift.policies.protocols import TokenedOracle, supports


@dataclass(slots=True)
class PolluxJobStats:
    """What a Pollux job reports: fitted throughput (None before any fit), gradient statistics."""

    limits: BatchLimits
    params: PerfParams | None
    grad_sqr: float
    grad_var: float
    max_replicas: int
    fixed_batch: int | None = None  # a job that does not adapt its batch (Pollux's ncf)

    def model(self) -> GoodputModel | None:
        if self.params is None:
            return None
        return GoodputModel(self.params, self.grad_sqr, self.grad_var, self.limits)


def fixed_batch_split(batch: int, replicas: int, limits: BatchLimits) -> tuple[int, int]:
    """(atomic batch, accumulation steps) of a fixed global batch on ``replicas`` GPUs
    (the authors' ``Job.update_local_bsz`` for a target batch size)."""
    local = math.ceil(batch / replicas - 1e-8)
    accum = math.ceil(local / limits.max_atomic - 1e-8) - 1
    if replicas == 1 and batch > limits.init_batch:
        accum = max(1, accum)
    atomic = math.ceil(local / (accum + 1) - 1e-8)
    return min(atomic, int(limits.max_batch / (replicas * (accum + 1)))), accum


def plan_for(spec, gpus: int) -> Plan | None:
    """The job's own plan on its requested GPUs, else that plan with its data-parallel degree scaled."""
    own = default_plan(spec)
    return own if gpus == own.gpus else scaled_user_plan(spec, gpus)


def spread(replicas: int, nodes: int) -> list[int]:
    """``replicas`` GPUs over ``nodes`` nodes as evenly as possible."""
    q, r = divmod(replicas, nodes)
    return [q + (1 if i < r else 0) for i in range(nodes)]


class Pollux:
    hetero = False  # one GPU type per run; policies.hetero runs it per type

    def __init__(self, restart_cost: float = DEFAULT_RESTART_COST, min_run_time: float = 0.0, seed: int = 0,
                 pop_size: int = POP_SIZE, generations: int = GENERATIONS, p: float = -1.0, stats=None, name: str = "pollux"):
        self.name = name
        self.restart_cost = restart_cost
        self.min_run_time = min_run_time  # Pollux pins nothing; the restart factor stands in (enforce uses it)
        self.pop_size = pop_size
        self.generations = generations
        self.p = p
        self.stats = stats
        self.rng = np.random.default_rng(seed)
        self._prev: np.ndarray | None = None
        self._prev_jobs: list[str] = []
        self._thr: dict = {}
        self._tables: dict = {}
        self._used: dict = {}
        self._token = None

    # ---------------------------------------------------------------- speedups
    def _oracle_goodput(self, job: JobView, perf: PerfOracle, r: int, n: int) -> float:
        plan = plan_for(job.spec, r)
        if plan is None:
            return 0.0
        key = (oracle_key(job.spec, perf), r, n)
        t = self._thr.get(key)
        if t is None:
            cpg = job.spec.cpus_per_gpu or 1
            shape = tuple(Placement(f"_n{i}", c, c * cpg) for i, c in enumerate(spread(r, n)) if c)
            t = self._thr[key] = float(perf.throughput(job, plan, shape))
        return t

    def _table(self, job: JobView, st: PolluxJobStats | None, perf: PerfOracle, fair: int, nodes: int,
               gpn: int, total: int) -> tuple[np.ndarray, int]:
        if st is not None:
            max_r = max(1, min(st.max_replicas, total))
        else:
            max_r = max(1, min(total, 2 * job.spec.gpus))
        if st is not None:  # the same statistics give the same table (most rounds change nothing)
            key = (st.params, st.grad_sqr, st.grad_var, st.limits, fair, nodes, max_r)
            hit = self._tables.get(job.job_id)
            if hit is not None and hit[0] == key:
                self._used[job.job_id] = hit
                return hit[1], max_r
        t = np.zeros((nodes + 1, max_r + 1))
        rr, nn = np.meshgrid(np.arange(1, max_r + 1), np.arange(1, nodes + 1))
        ok = nn <= rr
        model = st.model() if st is not None else None
        if st is not None and model is None:
            t[1:, 1:] = np.where(ok, rr / fair, 0.0)
        elif model is not None:
            base = model.best(1, fair)[0]
            g = model.best(np.where(ok, nn, 1), rr)[0]
            t[1:, 1:] = np.where(ok, g / base if base > 0 else 0.0, 0.0)
        if st is not None:
            self._used[job.job_id] = (key, t)
        else:
            for r in range(1, max_r + 1):
                for n in range(1, min(r, nodes) + 1):
                    t[n, r] = self._oracle_goodput(job, perf, r, n)
            # base: the fair share packed, else (a shape the belief cannot answer) the request, else the best
            unit = default_plan(job.spec).tp * default_plan(job.spec).pp
            f = max(unit, fair - fair % unit)
            req = default_plan(job.spec).gpus
            base = (self._oracle_goodput(job, perf, f, -(-f // gpn))
                    or self._oracle_goodput(job, perf, req, -(-req // gpn)) or float(t.max()))
            t = t / base if base > 0 else t
            if not t.any() and req <= max_r:  # the belief answers nothing: trust the request runs
                t[min(nodes, -(-req // gpn)), req] = 1.0
        return t, max_r

    # ---------------------------------------------------------------- round
    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        perf = perf or AnalyticOracle()
        if supports(perf, TokenedOracle):
            tok = perf.answers_token()
            if tok is None or tok != self._token:
                self._thr.clear()
            self._token = tok
        d = Decision()
        nodes = [n for n in nodes if n.gpus_total > 0]
        if not jobs or not nodes:
            for j in jobs:
                d.waiting[j.job_id] = "waiting: no GPUs"
            return d
        jobs = sorted(jobs, key=lambda j: (j.attained_service, j.submitted_at, j.job_id))
        ids = [j.job_id for j in jobs]
        index = {n.name: i for i, n in enumerate(nodes)}
        cap = np.array([n.gpus_total for n in nodes])
        total, gpn = int(cap.sum()), int(cap.max())
        fair = max(1, math.ceil(total / len(jobs)))
        stats = [self.stats(j) if self.stats is not None else None for j in jobs]
        self._used = {}
        tables, max_rs = zip(*(self._table(j, s, perf, fair, len(nodes), gpn, total) for j, s in zip(jobs, stats)))
        self._tables = self._used  # only this round's jobs: the cache never outgrows the queue
        mins = [min_replicas(t) for t in tables]
        if any(mins):  # adaptdl's optimize sorts by min_replicas first (policies.pollux_search)
            order = sorted(range(len(jobs)), key=lambda i: mins[i])
            jobs, stats, tables, max_rs, mins = ([xs[i] for i in order] for xs in (jobs, stats, tables, max_rs, mins))
            ids = [j.job_id for j in jobs]
        width = max(max_rs) + 1
        speed = np.zeros((len(jobs), len(nodes) + 1, width))
        for i, t in enumerate(tables):
            speed[i, :, : t.shape[1]] = t
        base = np.zeros((len(jobs), len(nodes)), dtype=np.int64)
        for i, j in enumerate(jobs):
            for p in j.placement:
                if p.node in index:
                    base[i, index[p.node]] += p.gpus
        search = AllocationSearch(speed, base, cap, np.array(max_rs), np.array([max(now - j.submitted_at, 0.0) for j in jobs]),
                                  np.array([j.restarts for j in jobs], dtype=float), self.rng, delay=self.restart_cost, p=self.p,
                                  min_replicas=np.array(mins, dtype=np.int64))
        init = carry_population(self._prev, self._prev_jobs, ids, len(nodes))
        best, pop = search.run(base[None] if init is None else init, self.pop_size, self.generations)
        self._prev, self._prev_jobs = pop, ids
        for i, j in enumerate(jobs):
            self._decide(j, stats[i], best[i], base[i], nodes, d)
        return enforce(now, nodes, jobs, d, min_run_time=self.min_run_time, name=self.name)

    def _decide(self, j: JobView, st: PolluxJobStats | None, row: np.ndarray, cur: np.ndarray, nodes: list[NodeState],
                d: Decision) -> None:
        counts = [int(c) for c in row]
        if j.running and j.plan is not None and counts == [int(c) for c in cur]:
            d.allocations[j.job_id] = JobDecision(j.placement, j.plan, "pollux: kept its allocation")
            return
        r = sum(counts)
        if st is None and r:  # the largest GPU count its plan splits into
            while r and plan_for(j.spec, r) is None:
                r -= 1
            counts = _trim(counts, sum(counts) - r)
        if r == 0:
            d.waiting[j.job_id] = ("preempted" if j.running else "waiting") + ": the goodput search gave it no GPUs"
            return
        used = [(nodes[k], c) for k, c in enumerate(counts) if c]
        placement = tuple(Placement(n.name, c, c * _cpus_per_gpu(j, n), n.gpu_type) for n, c in used)
        if st is None:
            plan = plan_for(j.spec, r)
        else:
            model = st.model()
            if st.fixed_batch is not None:
                atomic, accum = fixed_batch_split(st.fixed_batch, r, st.limits)
            elif model is None:
                atomic, accum = fixed_batch_split(max(st.limits.init_batch, st.limits.min_atomic * r), r, st.limits)
            else:
                _, atomic, accum = model.best(len(used), r)
            plan = Plan(dp=r, micro_batch=max(1, int(atomic)), ga=int(accum) + 1)
        verb = "moved to" if j.running else "started on"
        d.allocations[j.job_id] = JobDecision(placement, plan, f"pollux: {verb} {r} GPUs on {len(used)} node(s) ({plan.label()})")


def min_replicas(table: np.ndarray) -> int:
    """The fewest GPUs a job's speedup table (nodes x GPUs) gives any speed at, when that is
    more than one (0: it runs on one GPU, or nowhere), as adaptdl's ``min_replicas``."""
    cols = np.flatnonzero(table.any(axis=0))
    first = int(cols[0]) if len(cols) else 0
    return first if first > 1 else 0


def _cpus_per_gpu(j: JobView, n: NodeState) -> int:
    """The job's CPUs per GPU, at most the node's share per GPU (so CPUs never over-fill)."""
    share = n.cpus_total // max(n.gpus_total, 1)
    return min(j.spec.cpus_per_gpu or share, share)


def _trim(counts: list[int], drop: int) -> list[int]:
    """``counts`` less ``drop`` GPUs, taken from the smallest holdings first."""
    out = list(counts)
    for k in sorted((k for k, c in enumerate(out) if c), key=lambda k: out[k]):
        if drop <= 0:
            break
        take = min(out[k], drop)
        out[k] -= take
        drop -= take
    return out
