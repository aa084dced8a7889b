"""Rubick's round as arrays (``Problem``, searched by ``kernels.py``), built by ``ProblemBuilder``.

A job's part of the problem depends on its spec, its curve (the candidate cache's
list for the oracle's current answers, ``candidates.py``), its holding and its
target, and on the round only through time: its remaining steps, whether it is
pinned or held out, its utilities' restart factors. The builder keeps, per job,
what depends on the former (``_Row``: the candidate table, the request's
throughput, the candidates a guarantee allows, what staying where it runs is worth
and what it holds) and rebuilds a row only when one of them changed (a new record,
a switch, a learning oracle's new revision of its model). The rest of a round runs
over arrays, so its cost per live job is a few lookups. A job handed the same view
object as last round, in a round where the oracle's revision, the policy and the
candidate cache are the same and no curve was swept, also skips asking its candidate
key, restart and (while its steps and the learned ratio of steps hold) steps left
(``ProblemBuilder.memo``: 6-13% of the policy's CPU a round at 5,000 live jobs, 2,000
running, measured in one process against the same policy without it). Every cached value is a pure
function of what its row is checked against, so the problem is the same, bit for
bit, as one built from nothing (``tests/test_rubick_rows.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gearshift.policies.api import JobView, NodeState, PerfOracle, Placement, ShapeMemo, default_plan
from gearshift.policies.candidates import Candidate, CandidateCache, CandidateSpace, resource_cost
from gearshift.policies.protocols import RevisedOracle, supports
from gearshift.policies.placement import compact_shape, symmetric_shape
from gearshift.policies.rubick_rules import queue_keys, resume_weights, seed_groups, starved_first
from gearshift.policies.rubick_utility import restart_speed_utility


COMPLETION_SCALE_S = 600.0  # the completion weight's unit (``_assemble``): any constant orders jobs alike


@dataclass(slots=True)
class _Row:
    """One job's part of the problem and what it was built from (checked by identity).

    What it holds (``hold``, ``stay_at``, ``holds_ok``) follows its spec and view;
    the rest its curve (``cands``) too."""

    spec: Any
    placement: tuple
    plan: Any
    target_in: float | None  # JobView.target_throughput
    hold: tuple = ((), (), ())  # running: nodes, GPUs and CPUs of its parts
    stay_at: tuple | None = None  # running: (gpus, cpus/gpu, nodes spanned, cost) of staying
    stay_key: tuple = ()  # running: (plan, sorted (gpus, cpus) per node) it runs
    holds_ok: tuple = (False, False)  # running: (holds its request, trusted shape but for speed)
    cands: list | None = None  # the candidate cache's list: a new curve is a new list
    rows: list = field(default_factory=list)  # candidates (a guaranteed job's request appended)
    tab: np.ndarray | None = None  # (gpus, cpus/gpu, nodes, throughput, cost) per row
    ref: float = 0.0
    target: float = 0.0
    g_ok: np.ndarray | None = None  # guaranteed: rows the guarantee allows
    st: float = 0.0  # running: predicted throughput of staying
    ok: bool = False  # running: staying is allowed
    ix: tuple = (None, None)  # running: (the round's node index, its nodes' indexes in it or None: one is gone)

    def node_ixs(self, node_ix: dict[str, int]) -> list[int] | None:
        """The indexes of the nodes it holds (None: one is gone), kept while the nodes'
        index is the same object (``api.ShapeMemo``: while the nodes keep their shape)."""
        if self.ix[0] is not node_ix:
            try:
                self.ix = (node_ix, [node_ix[n] for n in self.hold[0]])
            except KeyError:  # a node it holds is gone
                self.ix = (node_ix, None)
        return self.ix[1]


class ProblemBuilder:
    """The caches behind ``Rubick.build_problem`` and the build itself."""

    def __init__(self):
        self.cache: CandidateCache | None = None
        self.ref: dict = {}
        self.stay: dict = {}
        self.tables: dict = {}
        self.rows: dict[str, _Row] = {}
        # job -> (view, candidates, key or None, steps done, steps left x batch, restart, spec): a
        # job handed the very view object (with the same spec) as last round, in a round where
        # nothing its entries depend on moved (``_still``), takes them as they were; its steps
        # left again only if its steps or the learned ratio moved
        self.memo: dict[str, tuple] = {}
        self.from_memo = 0  # jobs the last build took from the memo
        self._memo_of: tuple = ()  # what the memo was made under (``_still``)
        self._ratio = 1.0  # the learned ratio of steps the memo's steps left were worked out with
        self._nodes = ShapeMemo()  # node -> index, and the capacity arrays, once per shape (api.NodeStates)

    # ---------------------------------------------------------------- per curve
    def _candidates(self, job: JobView, perf: PerfOracle, space: CandidateSpace) -> list[Candidate]:
        if not job.spec.reconfigurable:
            key = ("fixed", self.cache.key(job, perf))
            got = self.cache.store.get(key)
            if got is None:
                got = fixed_candidates(job, perf, space)
                self.cache.store[key] = got
            return got
        return self.cache.get(job, perf)

    def _table(self, cands: list[Candidate], cpg_cluster: float) -> np.ndarray:
        """Candidates' (gpus, cpus/gpu, nodes, throughput, cost) rows, cached with them."""
        tab = self.tables.get(id(cands))
        if tab is None or tab[0] is not cands:
            arr = np.array(
                [(c.gpus, c.cpus_per_gpu, c.nodes, c.throughput, resource_cost(c, cpg_cluster)) for c in cands],
                float,
            ).reshape(-1, 5)
            tab = (cands, arr)
            self.tables[id(cands)] = tab
        return tab[1]

    def _with_request(self, job, perf, space, cpg_cluster, cands, tab):
        """Guaranteed jobs: their exact request (own plan, GPUs, CPUs, compact) as a candidate
        (its row's index, -1 if none), and their growth at the request's CPUs per GPU."""
        key = ("req", self.cache.key(job, perf))
        got = self.tables.get(key)
        if got is None or got[0] is not cands:
            req = fixed_candidates(job, perf, space)
            extra = req + growth_at_request_cpus(job, perf, space, cands)
            if extra:
                rows = np.array([[c.gpus, c.cpus_per_gpu, c.nodes, c.throughput, resource_cost(c, cpg_cluster)]
                                 for c in extra])
                got = (cands, cands + extra, np.vstack([tab, rows]), len(cands) if req else -1)
            else:
                got = (cands, cands, tab, -1)
            self.tables[key] = got
        return got[1], got[2], got[3]

    def requested_throughput(self, job: JobView, perf: PerfOracle, space: CandidateSpace) -> float:
        """The job's own plan on its own GPUs and CPUs, compactly placed."""
        hit = self.ref.get(id(job.spec))
        if hit is not None and hit[0] is job.spec:
            return hit[1]
        key = (self.cache.key(job, perf), job.spec.plan, job.spec.gpus, job.spec.cpus_per_gpu)
        got = self.ref.get(key)
        if got is None:
            plan = default_plan(job.spec)
            cpg = job.spec.cpus_per_gpu or max(1, min(4, space.cpus_per_node // space.gpus_per_node))
            got = perf.throughput(job, plan, compact_shape(plan.gpus, space.gpus_per_node, cpg))
            self.ref[key] = got
        self.ref[id(job.spec)] = (job.spec, got)
        return got

    def _stay_throughput(self, job: JobView, perf: PerfOracle, plan, shape) -> float:
        key = (self.cache.key(job, perf), plan, shape)
        got = self.stay.get(key)
        if got is None:
            got = perf.throughput(job, plan, tuple(Placement(f"_n{i}", g, c) for i, (g, c) in enumerate(shape)))
            self.stay[key] = got
        return got

    def _trusted(self, job: JobView, cands: list[Candidate]) -> np.ndarray:
        """Which candidates of a guaranteed job lie where the model is trusted:
        one node, data-parallel family (no TP/PP), at least the request's GPUs
        and CPUs per GPU (never a shrink), and more GPUs only where the request
        already has two or more (``growth_at_request_cpus``)."""
        key = ("trust", id(cands), job.spec.gpus, job.spec.cpus_per_gpu)
        got = self.tables.get(key)
        if got is not None and got[0] is cands:
            return got[1]
        cpg = job.spec.cpus_per_gpu or 0
        out = np.array(
            [c.nodes == 1 and c.plan.tp == 1 and c.plan.pp == 1 and c.cpus_per_gpu >= cpg
             and (c.gpus == job.spec.gpus or (c.gpus > job.spec.gpus and job.spec.gpus >= 2))
             for c in cands],
            bool,
        )
        self.tables[key] = (cands, out)
        return out

    # ---------------------------------------------------------------- per job
    def _row(self, j: JobView, space, cpg_cluster) -> _Row:
        """What a job's rows take from its view alone."""
        r = _Row(j.spec, j.placement, j.plan, j.target_throughput)
        if j.running:
            gpus, cpus = j.gpus, j.cpus
            r.hold = tuple(p.node for p in j.placement), tuple(p.gpus for p in j.placement), tuple(
                p.cpus for p in j.placement)
            r.stay_at = (gpus, max(1, cpus // max(gpus, 1)), len(j.placement), gpus + cpus / cpg_cluster)
            r.stay_key = (j.plan or default_plan(j.spec), tuple(sorted((p.gpus, p.cpus) for p in j.placement)))
            plan = r.stay_key[0]
            cpg = j.spec.cpus_per_gpu or 0
            r.holds_ok = (self._holds_request(j, space), len(j.placement) == 1 and plan.tp == 1 and plan.pp == 1
                          and gpus >= j.spec.gpus and cpus >= cpg * gpus)
        return r

    def _curve(self, pol, r: _Row, j: JobView, perf, space, cpg_cluster, cands) -> None:
        """What a job's rows take from its curve: candidates, reference, guarantee, staying."""
        tab = self._table(cands, cpg_cluster)
        rows, req_k = cands, -1
        guar = j.spec.guaranteed
        if guar:
            rows, tab, req_k = self._with_request(j, perf, space, cpg_cluster, cands, tab)
        ref = self.requested_throughput(j, perf, space)
        if ref <= 0:  # request infeasible under the model: best it could do at its size
            ref = max((c.throughput for c in rows if c.gpus <= j.spec.gpus), default=0.0) or (
                rows[0].throughput if rows else 1.0
            )
        target = float((j.target_throughput or ref) if guar else 0.0)
        # A guaranteed job may run exactly its own request (its plan, GPUs and
        # CPUs, compactly placed: what the guarantee is measured against), or
        # an alternative in the regime where the model has been validated
        # (one node, data-parallel family, at least its GPUs and CPUs per GPU)
        # that the model predicts to beat its target by the margin. Multi-node
        # and 3D-parallel predictions err by more than any margin, so they
        # never stand in for a request; a guaranteed job is never shrunk.
        need = target * (1 + pol.guarantee_margin) if guar else 0.0
        g_ok = None
        if guar:
            g_ok = np.zeros(len(rows), bool)
            if req_k >= 0:
                g_ok[req_k] = True
            trust = self._trusted(j, rows)
            n = len(trust)
            g_ok[:n] |= trust & (tab[:n, 3] >= need * (1 - 1e-9))
        r.cands, r.rows, r.tab, r.ref, r.target, r.g_ok = cands, rows, tab, ref, target, g_ok
        if r.stay_at is not None:
            st = r.st = self._stay_throughput(j, perf, *r.stay_key)
            r.ok = st > 0 and (not guar or r.holds_ok[0] or (r.holds_ok[1] and st >= need * (1 - 1e-9)))

    @staticmethod
    def _holds_request(j: JobView, space: CandidateSpace) -> bool:
        """A running job holds exactly its request: own plan on its GPUs, compact."""
        req = default_plan(j.spec)
        plan = j.plan or req
        same_plan = (plan.dp, plan.tp, plan.pp, plan.zero, plan.offload, plan.grad_ckpt) == (
            req.dp, req.tp, req.pp, req.zero, req.offload, req.grad_ckpt
        ) and (req.ga == plan.ga or j.spec.plan is None)
        return same_plan and j.gpus == j.spec.gpus and len(j.placement) == math.ceil(j.spec.gpus / space.gpus_per_node)

    # ---------------------------------------------------------------- round
    def build(self, pol, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle, space) -> "Problem":
        """The round as arrays: candidates, utilities, costs, holdings, seeds."""
        if self.cache is not None and self.cache.sweep():  # old revisions' curves (candidates.py)
            self.tables.clear(), self.stay.clear()  # pure functions of their keys: rebuilt the same
            self.ref = {k: v for k, v in self.ref.items() if type(k) is int}  # per-spec references stay
            swept = True
        else:
            swept = False
        if jobs and (self.cache is None or self.cache.space != space):
            self.cache = CandidateCache(space)
            self.tables.clear(), self.ref.clear(), self.stay.clear(), self.rows.clear()
        node_ix, cap_g, cap_c = self._nodes.get(nodes, _node_arrays)
        cpg_cluster = max(space.cpus_per_node / space.gpus_per_node, 1e-9)
        J = len(jobs)
        old, rows_now = self.rows, {}
        still = self._still(pol, perf, swept)
        memo, memo_now = (self.memo if still else {}), {}
        # steps left as last round's while the learned ratio of steps run to declared holds
        ratio = pol.declared.ratio if getattr(pol, "declared", None) is not None else 1.0
        same_ratio, self._ratio = ratio == self._ratio, ratio
        got: list[_Row] = []
        held, left, restarts = [False] * J, [0.0] * J, [0.0] * J
        taken = 0
        curves: dict[int, tuple] = {}  # id(key) -> (key, candidates): jobs of one key share them
        for i, j in enumerate(jobs):
            m = memo.get(j.job_id)
            if m is not None and m[0] is j and m[6] is j.spec:  # as last round: its candidates, restart
                cands, k, R = m[1], m[2], m[5]
                lf = m[4] if same_ratio and j.steps_done == m[3] else None
                taken += 1
                if k is not None:
                    self.cache.asked(k)  # as ``CandidateCache.get`` would note it: its ``sweep`` keeps it
            else:
                k = None
                if j.spec.reconfigurable:
                    k = self.cache.key(j, perf)
                    hit = curves.get(id(k))
                    if hit is None or hit[0] is not k:
                        hit = curves[id(k)] = (k, self._candidates(j, perf, space))
                    cands = hit[1]
                else:
                    cands = self._candidates(j, perf, space)
                lf, R = None, pol.restart_of(j)
            if lf is None:
                lf = max(pol.steps_left(j), 1.0) * j.spec.global_batch
            memo_now[j.job_id] = (j, cands, k, j.steps_done, lf, R, j.spec)
            r = old.get(j.job_id)
            if (r is None or r.spec is not j.spec or r.placement is not j.placement or r.plan is not j.plan
                    or r.target_in != j.target_throughput):
                r = self._row(j, space, cpg_cluster)
            if r.cands is not cands:
                self._curve(pol, r, j, perf, space, cpg_cluster, cands)
            rows_now[j.job_id] = r
            got.append(r)
            if r.stay_at is None and not r.spec.guaranteed:
                held[i] = pol._held_out(j, now)
            left[i], restarts[i] = lf, R
        self.rows, self.memo, self.from_memo = rows_now, memo_now, taken
        return _assemble(pol, now, jobs, got, np.array(held, bool), np.array(left, float), node_ix, (cap_g, cap_c),
                         np.array(restarts, float))

    def _still(self, pol, perf: PerfOracle, swept: bool) -> bool:
        """Whether last round's memo holds: the same policy, oracle (its revision: a learning
        oracle's answers, and so its keys and curves, move with it) and candidate cache, and
        no curve swept from the cache. A job's candidates are then the list its key gave last
        round (a pure function of the key, kept in the cache) and its restart a function of
        its spec; its steps left are a function of its steps done while the learned ratio of
        steps holds (``rubick_declared``; ``build`` checks both)."""
        rev = perf.revision if supports(perf, RevisedOracle) else 0
        last, self._memo_of = self._memo_of, (pol, perf, self.cache, rev)
        return (not swept and bool(last) and last[0] is pol and last[1] is perf and last[2] is self.cache
                and last[3] == rev)


def _assemble(pol, now: float, jobs: list[JobView], got: list[_Row], held: np.ndarray, left: np.ndarray,
              node_ix: dict[str, int], caps: tuple[np.ndarray, np.ndarray], restarts: np.ndarray) -> "Problem":
    """The arrays of one round from its jobs' rows (see ``kernels.py`` for the fields)."""
    J = len(jobs)
    nrows = np.array([len(r.rows) for r in got], np.int64)
    K = (int(nrows.max()) if J else 0) + 1
    # rows of (gpus, cpus/gpu, nodes, throughput, cost), padded; column K-1 at most is "stay"
    table = np.zeros((J, K, 5))
    table[:, :, 2] = 1
    if J and nrows.sum():
        starts = np.cumsum(nrows) - nrows
        flat = np.concatenate([r.tab for r in got])
        table[np.repeat(np.arange(J), nrows), np.arange(len(flat)) - np.repeat(starts, nrows)] = flat
    nk = nrows.copy()
    refs = np.array([r.ref for r in got], float)
    targets = np.array([r.target for r in got], float)
    guar = np.array([r.spec.guaranteed for r in got], bool)
    running = np.array([r.stay_at is not None for r in got], bool)
    thr = table[:, :, 3].copy()
    R = restarts  # pol.restart_of: its own, or the flat cost
    with np.errstate(divide="ignore", invalid="ignore"):
        T1 = left / refs  # seconds left at the request's predicted speed
        if pol.monotone_utility:  # rubick_utility.py: never lower for a faster allocation
            u = restart_speed_utility(thr, refs, left, R, running, pol.alpha, pol.start_unavoidable)
        else:
            u = (thr / refs[:, None]) ** pol.alpha
            if pol.restart_cost > 0:  # average speed over the rest of the run, restart included
                T = left[:, None] / thr
                f = T / (T + R[:, None])
                if pol.start_unavoidable:
                    # A job that does not run pays the restart whenever it starts: it
                    # cannot decide *whether* it runs first, only which allocation
                    # (a short job gains little from growing when the restart dominates).
                    f1 = T1 / (T1 + R)
                    f = np.where(~running[:, None], f / f1[:, None], f)
                u = u * f
        # Completion weight (beta = 1 by default): a job's utilities scale with its
        # completion rate at its request, 1 / (time left + restart), on one scale for
        # every job (COMPLETION_SCALE_S; only the ratios between jobs matter): among
        # equal normalised gains the job closer to done goes first (Smith's rule per
        # unit of resource). It was scaled by each job's own max(R, 60 s), which with
        # each job's own restart favoured the jobs with the longest restart (llama30).
        w = ((COMPLETION_SCALE_S / np.maximum(T1 + R, 1e-9)) ** pol.completion_weight if pol.completion_weight
             else np.ones(J))
        if pol.resume_charge:  # a preempted job pays the restart again (rubick_rules.py)
            w = w * resume_weights(running, T1, R)
        u = u * w[:, None]
    valid = np.arange(K)[None, :] < nk[:, None]
    valid &= thr > 0
    g_ok = np.zeros((J, K), bool)  # what a guarantee allows (``_Row.g_ok``)
    for i in np.flatnonzero(guar):
        g_ok[i, : len(got[i].g_ok)] = got[i].g_ok
    valid &= ~guar[:, None] | g_ok
    valid &= ~held[:, None]
    if pol.min_efficiency > 0:  # fewer GPUs than asked, for more GPU-time to finish: not for a best-effort job
        req = np.array([max(j.spec.gpus, 1) for j in jobs], float)
        with np.errstate(divide="ignore", invalid="ignore"):
            area_req = req * (T1 + R)
            area = table[:, :, 0] * (left[:, None] / thr + R[:, None])
            eff = area_req[:, None] / area
        valid &= guar[:, None] | (table[:, :, 0] >= req[:, None]) | (eff >= pol.min_efficiency)
    u = np.where(valid, u, -1.0)
    cg = table[:, :, 0].astype(np.int64)
    cc = table[:, :, 1].astype(np.int64)
    cm = table[:, :, 2].astype(np.int64)
    cost = table[:, :, 4].copy()
    # "stay": a running job's exact holding, one more candidate after its rows
    stay = np.full(J, -1, np.int64)
    pinned = np.zeros(J, bool)
    counts = np.zeros(J, np.int64)
    at, pins, su, sv, st, nh, hn, hg, hc = [], [], [], [], [], [], [], [], []
    wl, rl, alpha = w.tolist(), refs.tolist(), pol.alpha
    run_i = np.flatnonzero(running)
    pins_now = pinned_mask(pol, [jobs[i] for i in run_i.tolist()], R[run_i], now).tolist()
    for i, pin in zip(run_i.tolist(), pins_now):
        r = got[i]
        ix = r.node_ixs(node_ix)
        if ix is None:  # a node it holds is gone
            continue
        at.append(i)
        pins.append(pin)
        sv.extend(r.stay_at)
        st.append(r.st)
        nh.append(len(ix))
        # as numpy computes it for one job (C pow; the array power may differ in the last bit)
        su.append((wl[i] * (r.st / rl[i]) ** alpha if rl[i] else float(w[i] * (r.st / refs[i]) ** alpha)) if r.ok
                  else (0.0 if pin else -1.0))
        hn.extend(ix)
        hg.extend(r.hold[1])
        hc.extend(r.hold[2])
    if at:
        ia = np.array(at, np.int64)
        pinned[ia] = pins
        counts[ia] = nh
        na = nk[ia]
        sv_ = np.array(sv, float).reshape(-1, 4)
        stay[ia] = na
        cg[ia, na] = sv_[:, 0]
        cc[ia, na] = sv_[:, 1]
        cm[ia, na] = sv_[:, 2]
        cost[ia, na] = sv_[:, 3]
        thr[ia, na] = st
        u[ia, na] = su
        nk[ia] = na + 1
    hold_ptr = np.zeros(J + 1, np.int64)
    np.cumsum(counts, out=hold_ptr[1:])
    # seeds: pinned guaranteed, running guaranteed, pending guaranteed, pinned best-effort
    seed = np.full(J, -1, np.int64)
    # best-effort jobs admitted as starved keep their place like guarantees (rubick_rules.py)
    prot = np.array([j.job_id in pol.protected for j in jobs], bool) & (stay >= 0) & ~guar
    # A pinned best-effort job in a round of one class holds its place against the guarantees
    # seeded after it only within its pin window from its last (re)start, and then competes in
    # the greedy like any running job (``Rubick.guards_only``): the kernel's ``unseat``
    unseat = np.zeros(J, bool)
    if pol.guards_only:
        for i in np.flatnonzero(~guar & pinned & ~prot).tolist():
            if now - pol.run_from(jobs[i]) < pol.pin_window(jobs[i]):
                unseat[i] = True
            else:  # resized since, but (re)started longer ago than its window: no guard
                pinned[i] = False
    g0 = np.flatnonzero(guar & pinned)
    g1 = np.flatnonzero((guar | prot) & ~pinned & (stay >= 0))
    g3 = np.flatnonzero(~guar & pinned)
    seed[g0] = stay[g0]
    # A guaranteed job that grew past its request is seeded at its cheapest allowed
    # candidate (its request), not where it runs: only the request is guaranteed, the
    # growth competes with everyone else's in the greedy step (staying costs it nothing
    # there), so idle GPUs it took are handed back when a waiting job has better use.
    req_g = np.array([j.spec.gpus for j in jobs], np.int64)
    grown = guar[g1] & (cg[g1, stay[g1]] > req_g[g1])  # g1 runs: stay[g1] >= 0
    seed[g1] = np.where((u[g1, stay[g1]] >= 0) & ~grown, stay[g1], -1)
    # A best-effort job kept as starved (``keep_starved``) is kept like a guarantee: at its
    # request, its cheapest allowed candidate of at least the request's GPUs, and what it grew
    # to past that competes in the greedy. Seeded where it ran, a llama7 job held 32 GPUs for
    # its 16 while a burst of 1-8 GPU jobs, guarantees among them, waited 550 s (rubick-mt,
    # held-out, measured).
    for i in g1[prot[g1] & (cg[g1, stay[g1]] > req_g[g1])].tolist():
        ok = np.flatnonzero((u[i, :nk[i]] >= 0) & (cg[i, :nk[i]] >= req_g[i]))
        if len(ok):
            seed[i] = int(ok[np.argmin(cost[i, ok])])  # ties: the lower row, as the kernel's
    seed[g3] = stay[g3]
    # Pending guaranteed jobs: shortest predicted run at their request first
    # (fewest job-seconds spent waiting behind long ones), then by arrival.
    qkey = queue_keys(pol.queue_key, left, np.where(guar, targets, refs), R, req_g.astype(float))
    g2 = sorted(np.flatnonzero(guar & (stay < 0)).tolist(),
                key=lambda i: (qkey[i], jobs[i].submitted_at, jobs[i].job_id))
    g2 = np.array(g2, np.int64)
    if pol.starved_seed and len(g2):  # rubick_rules.py: only while a guarantee is pending
        g2, seed_any = starved_first(g2, guar, stay, held, valid, left, targets, refs, R,
                                     np.array([now - j.submitted_at for j in jobs], float), jobs,
                                     float(pol.starved_seed), qkey if pol.queue_key != "time" else None)
    else:
        seed_any = guar.copy()
    groups = seed_groups([g0, g1, g2, g3], [now - j.submitted_at for j in jobs], pol.min_run_time,
                         evicts=pol.guarantee_evicts, bound=pol.guarantee_wait_bound)  # rubick_rules.py
    groups = [np.asarray(g, np.int64) for g in groups]
    return Problem(
        cg=cg, cc=cc, cm=cm, u=u, cost=cost, nk=nk, stay=stay, hold_ptr=hold_ptr,
        hold_node=np.array(hn, np.int64), hold_g=np.array(hg, np.int64), hold_c=np.array(hc, np.int64),
        seed_order=np.concatenate(groups).astype(np.int64), seed=seed, seed_any=seed_any, pinned=pinned,
        cap_g=caps[0], cap_c=caps[1], rows=[r.rows for r in got], thr=thr, refs=refs,
        targets=targets, guaranteed=guar, running=running, nrows=nrows, left=left, restarts=R, protected=prot,
        unseat=unseat,
    )


def pinned_mask(pol, running: list[JobView], restarts: np.ndarray, now: float) -> np.ndarray:
    """``Rubick._pinned`` of each of ``running`` (running jobs; ``restarts``: their
    ``restart_of``) as one array: ``pin_window``'s comparisons in float64, without a call
    per job (``tests/test_policies_rubick.py`` holds the two to the same answers)."""
    sw = np.array([np.nan if (t := j.switched_at) is None else t for j in running], float)
    if not pol._pins_on:
        window = 0.0
    elif pol.pin_restarts > 0 and pol.restart_model is not None and pol.own_restart:
        window = np.minimum(pol.min_run_time, pol.pin_restarts * restarts)
    else:
        window = pol.min_run_time
    with np.errstate(invalid="ignore"):
        return (now - sw) < window  # no switch known (nan): not pinned


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
    running: np.ndarray | None = None
    nrows: np.ndarray | None = None  # candidates per job before "stay"
    group: np.ndarray | None = None  # per job: its budget group (-1: none); None: no budgets
    budget: np.ndarray | None = None  # GPUs per group
    left: np.ndarray | None = None  # samples left per job (steps left x global batch)
    restarts: np.ndarray | None = None  # each job's restart cost, seconds
    protected: np.ndarray | None = None  # running best-effort jobs kept like guarantees (``rubick_rules``)
    unseat: np.ndarray | None = None  # seeded jobs that then compete in the greedy (``kernels``)

    def kernel_args(self) -> tuple:
        return (
            self.cg, self.cc, self.cm, self.u, self.cost, self.nk, self.stay, self.hold_ptr, self.hold_node,
            self.hold_g, self.hold_c, self.seed_order, self.seed, self.seed_any, self.pinned, self.cap_g, self.cap_c,
            self.group, self.budget,
        )

    def unguard_losers(self, level: np.ndarray) -> bool:
        """Guarded jobs (``unseat``) that the greedy shrank or preempted lose their guard: the
        seeds after them (guarantees) could not take what they held, and other jobs did. They
        are then neither pinned nor seeded, so a search again seeds those first. Whether any did."""
        if self.unseat is None or not self.unseat.any():
            return False
        i = np.flatnonzero(self.unseat)
        lv = level[i]
        lost = i[(lv < 0) | (self.cg[i, np.maximum(lv, 0)] < self.cg[i, self.stay[i]])]
        if not len(lost):
            return False
        self.unseat[lost] = False
        self.pinned[lost] = False
        self.seed[lost] = -1
        self.seed_order = self.seed_order[~np.isin(self.seed_order, lost)]
        return True

    def objective(self, level: np.ndarray) -> float:
        i = np.flatnonzero(level >= 0)
        return float(sum(self.u[i, level[i]].tolist()))


def _node_arrays(nodes: list[NodeState]) -> tuple[dict[str, int], np.ndarray, np.ndarray]:
    return {n.name: i for i, n in enumerate(nodes)}, space_cap(nodes, "g"), space_cap(nodes, "c")


def space_cap(nodes: list[NodeState], what: str) -> np.ndarray:
    return np.array([n.gpus_total if what == "g" else n.cpus_total for n in nodes], np.int64)


def growth_at_request_cpus(job: JobView, perf: PerfOracle, space: CandidateSpace,
                           cands: list[Candidate]) -> list[Candidate]:
    """A guaranteed job's one-node data-parallel candidates with more GPUs than it asked
    for, at the CPUs per GPU it asked for. The curve keeps, per shape, the CPUs the model
    finds cheapest (often 1 per GPU), and a guarantee trusts only allocations with at
    least the request's CPUs per GPU (``ProblemBuilder._trusted``): without these rows a
    guaranteed job could never grow, however many GPUs sat idle. A 1-GPU request gets
    none: it does not communicate, so how the job scales past it is what the model knows
    least (on rubick-mt, measured, two 1-GPU guarantees grown to 2 GPUs ran slower than
    their request did)."""
    cpg = job.spec.cpus_per_gpu or 0
    out: list[Candidate] = []
    if job.spec.gpus < 2:
        return out
    seen = set()
    for c in cands:
        if (c.nodes != 1 or c.plan.tp != 1 or c.plan.pp != 1 or c.gpus <= job.spec.gpus
                or c.cpus_per_gpu >= cpg or c.gpus * cpg > space.cpus_per_node or (c.gpus, c.plan) in seen):
            continue
        seen.add((c.gpus, c.plan))
        t = perf.throughput(job, c.plan, symmetric_shape(c.gpus, 1, cpg))
        if t > 0:
            out.append(Candidate(c.gpus, cpg, 1, c.plan, t))
    return out


def fixed_candidates(job: JobView, perf: PerfOracle, space: CandidateSpace) -> list[Candidate]:
    """A job that may not be reconfigured: its own plan and GPUs, compact."""
    plan = default_plan(job.spec)
    cpg = job.spec.cpus_per_gpu or max(1, min(4, space.cpus_per_node // space.gpus_per_node))
    m = math.ceil(plan.gpus / space.gpus_per_node)
    if plan.gpus % m:
        return []
    shape = symmetric_shape(plan.gpus // m, m, cpg)
    t = perf.throughput(job, plan, shape)
    return [Candidate(plan.gpus, cpg, m, plan, t)] if t > 0 else []
