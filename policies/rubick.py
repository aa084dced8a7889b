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
   behind long ones. ``completion_weight`` (beta, default 1) further
   scales every utility of a job by (C/(T1+R))^beta, its completion rate
   at its request, restart included, on one scale C for every job (Smith's
   rule: shorter remaining work first among equal normalised gains; it was
   off, and relative to each job's own max(R, 60 s), which with per-job
   restarts favoured llama30's 530 s ones). ``resume_charge``
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
   not), so they never replace a request. The one-node growth is also offered
   at the request's CPUs per GPU (the curve keeps the model's cheapest CPUs,
   below what a guarantee trusts), and never to a 1-GPU request, whose
   scaling past one GPU nothing at the request observes
   (``rubick_problem.growth_at_request_cpus``). Running guaranteed jobs are
   seeded first and are never shrunk below their request; one that grew is
   seeded at its request, its growth competing with everyone else's in the
   greedy step; a pending one is admitted
   (at its request when nothing else is trusted) only if it fits, so an
   accepted guarantee can be kept.
4. Jobs that (re)started less than ``pin_restarts`` (10) times their own
   restart ago, and less than ``min_run_time`` (600 s), keep their allocation
   (pinned; ``pin_window``: the restart is then at most a tenth of the time
   between two switches of a job; one flat 600 s pin held a bert job whose
   restart takes 15 s, and the GPUs that waiting jobs could use, for 40
   restarts' worth of time; ``pin_restarts=0``, or one flat restart price
   for every job, pins every job for ``min_run_time``). Pins hold only in
   rounds where something may outrank a running best-effort job: a guaranteed
   job or a second priority class (``pins_needed``; ``pin_always`` pins in
   every round, as before, and so does ``resume_charge=False``, where
   preempting would be free). Among best-effort jobs of one class the restart
   charges alone decide: on rubick-base, three long jobs switched minutes
   before a burst of short arrivals held all 64 GPUs while 25 jobs of a few
   minutes waited, and without those pins the measured median JCT fell from
   133 s to about 100 s, for about three times the restarts. In a round
   pinned for a guarantee alone (one class; ``pin_scope="guarantees"``), a
   pinned best-effort job is guarded only against the seeds after it (pending
   guarantees, starved jobs), and only within its window from its last
   (re)start, not from a resize (``run_from``); it competes with the other
   best-effort jobs in the greedy on the restart charges (the kernel's
   ``unseat``), and one that loses its place there loses the guard, so the
   guarantees are seeded before whoever would take it
   (``Problem.unguard_losers``). Pins renewed at every resize and fixed
   against every job kept 40- and 48-GPU guarantees out for hours on
   rubick-mt; with guards the guaranteed jobs' mean wait fell 3-42% on its
   measured, extended and held-out runs, for 40-70% more restarts
   (``pin_scope="all"``: fixed, as before). Pending guaranteed
   jobs are seeded after pinned best-effort ones (so a guarantee waits at
   most ``min_run_time`` for them: now that a guarantee is admitted at its
   full request, evicting freshly (re)started best-effort jobs for it costs
   them two restarts in a window)
   and before every other job, shortest predicted run first. With
   ``guarantee_wait_bound`` (off) one that has waited ``min_run_time`` goes
   before them (jobs pinned anew at every switch kept 40-GPU guarantees out
   for hours on rubick-mt; but with OOM learning it preempts best-effort jobs
   more than twice as often in the extended regime: ``rubick_rules.py``).
   ``guarantee_evicts=True`` seeds them before pinned best-effort jobs (a
   guarantee may then evict one inside the minimum run time). While any
   guarantee is pending, a best-effort job that has never started and has
   waited ``starved_seed`` (1) times its own predicted run (restart included)
   joins the pending guarantees' queue at its cheapest allowed candidate
   (``rubick_rules.starved_first``; 0: off) and, admitted, is kept like a
   guarantee until it ends (``keep_starved``): at its request, its growth past
   that competing in the greedy as a guarantee's does. The queue goes by predicted
   GPU-time, GPUs x (run at the request + restart), least first
   (``queue_key="area"``; "time": the run alone, as before). When its head
   cannot start, the GPUs it will need are held for it: only work predicted
   to end before it can start may take them (``reserve``,
   ``rubick_reserve.py``: EASY backfilling on the seeds).
5. Everything else: greedy by normalised marginal gain per unit of resource
   (GPUs plus CPUs weighed by their scarcity), along each job's curve. A
   running job competes from zero, its current allocation being its cheapest
   way up (no restart charge): it is shrunk or preempted exactly when its
   resources give more normalised throughput elsewhere, net of restart
   costs; leftovers go to the highest marginal gains. A best-effort job is
   not given fewer GPUs than it asked for where finishing there needs more
   than 1/``min_efficiency`` (0.9) times the GPU-time its request would,
   restart included (``rubick_rules.py``).
The search runs in numba (``kernels.py``) with a numpy reference.
"""

from __future__ import annotations

import math

import numpy as np

from gearshift.policies.api import (
    DEFAULT_MIN_RUN_TIME,
    DEFAULT_RESTART_COST,
    Decision,
    JobDecision,
    JobView,
    NodeState,
    PerfOracle,
    Placement,
    ShapeMemo,
    default_plan,
)
from gearshift.policies.candidates import CandidateSpace
from gearshift.policies.classes import enforce
from gearshift.policies.kernels import greedy_allocate
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.placement import describe
from gearshift.policies.rubick_declared import DeclaredSteps
from gearshift.policies.rubick_moves import give_back_moves
from gearshift.policies.rubick_problem import Problem, ProblemBuilder
from gearshift.policies.rubick_reserve import reserve_room


GUARD_PASSES = 3  # searches again after guarded jobs lost their place (``Problem.unguard_losers``)


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
        completion_weight: float = 1.0,
        resume_charge: bool = True,
        guarantee_wait_bound: bool = False,
        starved_seed: float = 1.0,
        use_numba: bool = True,
        restart_model=None,
        own_restart: bool = True,
        monotone_utility: bool = True,
        learn_steps: bool = True,
        reserve: bool = True,
        keep_starved: bool = True,
        queue_key: str = "area",
        min_efficiency: float = 0.9,
        pin_restarts: float = 10.0,
        pin_always: bool = False,
        pin_scope: str = "guarantees",
        give_back: bool = True,
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
        self.starved_seed = starved_seed
        self.use_numba = use_numba
        # each job's own restart (JobSpec -> s, perfmodel.restart) when the run has one;
        # own_restart=False charges every job restart_cost (the trace mean), as before
        self.restart_model = restart_model
        self.own_restart = own_restart
        # rubick_utility.py: the utility never falls for a faster allocation (False: the
        # earlier (thr/ref)^alpha x f/f1, for ablation)
        self.monotone_utility = monotone_utility
        # rubick_declared.py: steps left learned from finished jobs (declared steps may be an
        # upper bound); False: the declaration as it is
        self.declared = DeclaredSteps() if learn_steps else None
        self.reserve = reserve  # rubick_reserve.py: room held for the head of the seed queue
        # rubick_rules.py: a best-effort job admitted as starved keeps its place like a guarantee
        self.keep_starved = keep_starved
        self.protected: set[str] = set()  # those jobs, while they run
        self.queue_key = queue_key  # rubick_rules.queue_keys: order of the pending seeds
        # rubick_rules.py: a best-effort job is not given fewer GPUs than it asked for where that
        # needs more than 1 / min_efficiency times the GPU-time its request would (0: off)
        self.min_efficiency = min_efficiency
        # a job is pinned for pin_restarts x its own restart, at most min_run_time (0, or no
        # restart_model: every job min_run_time, as before): ``pin_window``
        self.pin_restarts = pin_restarts
        # pin_window: pins only in rounds with a guaranteed job or more than one priority class
        # (``pins_needed``); True: in every round, as before
        self.pin_always = pin_always
        # where pins are on only for guarantees: a pinned best-effort job holds its place against
        # them, within its window from its last (re)start, and competes with its peers on the
        # restart charges ("guarantees"); "all": pinned jobs are fixed, as before (``guards_only``)
        if pin_scope not in ("guarantees", "all"):
            raise ValueError(f"pin_scope: {pin_scope!r} is not 'guarantees' or 'all'")
        self.pin_scope = pin_scope
        self.give_back = give_back  # rubick_moves.py: moves that buy nothing, undone
        self._pins_on = True  # this round's
        self.guards_only = False  # this round's (``schedule``)
        self.held_for: tuple | None = None  # the last round's reservation: (job, seconds to its start)
        self.problems = ProblemBuilder()  # candidates, per-job rows: cached across rounds
        self._sizes = ShapeMemo()  # the nodes' sizes, once per shape (api.NodeStates): ``_sizes``
        self._fallback = AnalyticOracle()
        self._preempted: dict[str, float] = {}  # job -> when this policy last preempted it
        self._run_from: dict[str, float] = {}  # running job -> when this policy last (re)started it
        self.last_stats: dict = {}
        # tenant -> the most GPUs its jobs may hold this round (the sharing part's fair
        # shares, ``Shared``): the greedy plans within each tenant's share; None: no budgets
        self.budget: dict[str, float] | None = None

    def set_budget(self, budget: dict[str, float] | None) -> None:
        """``protocols.BudgetedPolicy``: each tenant's GPUs this round (``Shared`` tells it)."""
        self.budget = budget

    # ---------------------------------------------------------------- helpers
    def _space(self, nodes: list[NodeState]) -> CandidateSpace:
        g, c, total, _, _ = self._sizes.get(nodes, _sizes)
        return CandidateSpace(
            gpus_per_node=g, cpus_per_node=c, total_gpus=total, n_nodes=len(nodes),
            vary_plan=self.vary_plan, vary_cpu=self.vary_cpu, vary_locality=self.vary_locality,
            max_scale=self.max_scale,
        )

    def restart_of(self, j: JobView) -> float:
        if self.restart_model is not None and self.own_restart:
            return float(self.restart_model(j.spec))
        return float(self.restart_cost)

    def pin_window(self, j: JobView) -> float:
        """How long after a (re)start ``j`` keeps its allocation (and a preempted ``j`` stays
        out): ``pin_restarts`` times its own restart, at most ``min_run_time``. The pin is
        there so that a switch pays for itself; a job that restarts in 15 s has done so long
        before 600 s, and held the GPUs a waiting job could use (docstring, point 4). Only
        where each job pays its own restart (``restart_model``); with one flat price for
        every job (``restart_cost``), every job is pinned for ``min_run_time``."""
        if not self._pins_on:
            return 0.0
        if self.pin_restarts > 0 and self.restart_model is not None and self.own_restart:
            return min(self.min_run_time, self.pin_restarts * self.restart_of(j))
        return self.min_run_time

    def _pinned(self, j: JobView, now: float) -> bool:
        return j.running and j.switched_at is not None and now - j.switched_at < self.pin_window(j)

    def run_from(self, j: JobView, unknown: float = -math.inf) -> float:
        """When running job ``j`` last (re)started: as this policy started it, else (a job it
        did not start, e.g. under a new leader) its last switch, which a resize also moves;
        ``unknown`` for a job shown running with neither (``Shared``'s room for a job)."""
        t = self._run_from.get(j.job_id)
        if t is None:
            t = j.switched_at
        return t if t is not None else unknown

    def _held_out(self, j: JobView, now: float) -> bool:
        """A best-effort job preempted less than its pin window (``pin_window``) ago stays
        out: preempting and restarting it would be two switches in that window."""
        out = self._preempted.get(j.job_id)
        if j.running or j.spec.guaranteed or (out is None and j.started_at is None):  # (never ran nor preempted)
            return False
        last = max(-math.inf if out is None else out, j.last_switch_at if j.started_at is not None and j.last_switch_at is not None else -math.inf)
        return now - last < self.pin_window(j)

    # ---------------------------------------------------------------- round
    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        if not nodes:  # every node gone (the kernel cannot size an empty cluster): all wait
            return Decision(waiting={j.job_id: f"{self.name}: no live node" for j in jobs})
        if self.declared is not None:
            self.declared.observe(now, jobs, self.restart_of)
        # without the resume charge preempting is free and the pin is the only guard against
        # a job displaced and restarted round after round: pins in every round then
        self._pins_on = self.pin_always or not self.resume_charge or pins_needed(jobs)
        # pins on for a guarantee alone (one class): they guard best-effort jobs against it only
        self.guards_only = (self._pins_on and self.pin_scope == "guarantees" and not self.pin_always
                            and self.resume_charge and one_class(jobs))
        pb = self.build_problem(now, nodes, jobs, perf)
        level, out_nodes = self.solve(pb, jobs, now)
        if self.give_back:  # rubick_moves.py: a move with no change of shape, undone
            give_back_moves(pb, level, out_nodes, jobs, nodes)
        if self.keep_starved:  # kept while they run: admitted as starved now, or before and still running
            keep = ~pb.guaranteed & (level >= 0) & (pb.seed_any | (pb.protected & (pb.stay >= 0)))
            self.protected = {jobs[i].job_id for i in np.flatnonzero(keep).tolist()}
        if self._preempted:
            live = {j.job_id for j in jobs}
            self._preempted = {k: v for k, v in self._preempted.items() if k in live and now - v < self.min_run_time}
        for i in np.flatnonzero(pb.running & (level < 0)).tolist():
            self._preempted[jobs[i].job_id] = now
        self._run_from = {jobs[i].job_id: self.run_from(jobs[i], now) if pb.running[i] else now
                          for i in np.flatnonzero(level >= 0).tolist()}
        self.last_stats = {"jobs": len(jobs), "candidates": int(pb.nk.sum()), "objective": pb.objective(level)}
        d = self._decide(jobs, nodes, pb, level, out_nodes, now)
        d = enforce(now, nodes, jobs, d, min_run_time=self.min_run_time, name=self.name)  # priority classes
        if self.declared is not None:
            self.declared.remember(now, jobs, d)
        return d

    def steps_left(self, j: JobView) -> float:
        """Belief of the steps left: learned from finished jobs (``rubick_declared``), else declared."""
        return self.declared.remaining(j) if self.declared is not None else j.remaining_steps

    def solve(self, pb: "Problem", jobs: list[JobView] | None = None, now: float = 0.0):
        """The kernel's search; with ``reserve``, searched again keeping room for the head of
        the seed queue when it waits (``rubick_reserve.py``)."""
        got = search(pb, use_numba=self.use_numba)
        self.held_for = None
        if not self.reserve or jobs is None:
            return got
        room = reserve_room(self, pb, *got, jobs, now)
        if room is None:
            return got
        *args, head, T = room
        self.held_for = (jobs[head].job_id, T)
        return search(pb, *args, use_numba=self.use_numba)

    def build_problem(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Problem:
        """The round as arrays: candidates, utilities, costs, holdings, seeds (``rubick_problem.py``)."""
        pb = self.problems.build(self, now, nodes, jobs, perf or self._fallback, self._space(nodes))
        if self.budget is not None:
            tenants = sorted(self.budget)
            ix = {t: i for i, t in enumerate(tenants)}
            pb.group = np.array([ix.get(j.spec.tenant, -1) for j in jobs], np.int64)
            pb.budget = np.array([self.budget[t] for t in tenants], float)
        return pb

    # ---------------------------------------------------------------- output
    def _free_block(self, nodes: list[NodeState], used: dict[str, int]) -> tuple[int, int]:
        """(the most GPUs free on one node, GPUs free in all) after ``used``: a look at the
        nodes placed on and at the largest node not placed on, not at every node."""
        _, _, total, gpus, by_size = self._sizes.get(nodes, _sizes)
        block = max((gpus[n] - g for n, g in used.items()), default=0)
        for size, name in by_size:
            if name not in used:
                block = max(block, size)
                break
        return block, total - sum(used.values())

    def _decide(self, jobs, nodes, pb: Problem, level, out_nodes, now=0.0) -> Decision:
        rows, stay, thr, refs, targets, u, pinned = pb.rows, pb.stay, pb.thr, pb.refs, pb.targets, pb.u, pb.pinned
        d = Decision()
        used: dict[str, int] = {}  # GPUs placed per node, on the nodes placed on
        for i in np.flatnonzero(level >= 0).tolist():
            j, k = jobs[i], int(level[i])
            if k == stay[i]:
                plan = j.plan or default_plan(j.spec)
                why = ("kept: no better use of its resources net of the restart cost" if not pinned[i] or pb.unseat[i]
                       else f"kept (within minimum run time: pinned {self.pin_window(j):.0f} s after a switch)")
                if pb.unseat[i]:
                    why += f"; its place held against guarantees for {self.pin_window(j):.0f} s after its start"
                d.allocations[j.job_id] = JobDecision(j.placement, plan, f"{self.name}: {why}", float(thr[i, k]), 0.0)
                for p in j.placement:
                    used[p.node] = used.get(p.node, 0) + p.gpus
                continue
            c = rows[i][k]
            per = c.per_node
            placement = tuple(
                Placement(nodes[int(out_nodes[i, q])].name, per, per * c.cpus_per_gpu) for q in range(c.nodes)
            )
            for p in placement:
                used[p.node] = used.get(p.node, 0) + p.gpus
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
        block, total_free = self._free_block(nodes, used)
        # per waiting job, its allowed candidate with the fewest GPUs (a guaranteed
        # job's: then the fewest CPUs per GPU), the first in its row on ties
        wait = np.flatnonzero(level < 0)
        allowed = (u[wait] >= 0) & (np.arange(u.shape[1])[None, :] < pb.nrows[wait, None])
        size = np.where(pb.guaranteed[wait, None], pb.cg[wait] * (1 << 20) + pb.cc[wait], pb.cg[wait])
        least = np.where(allowed, size, np.iinfo(np.int64).max).argmin(axis=1)
        held = ""
        if self.held_for is not None:  # rubick_reserve.py
            held = (f"; room held for {self.held_for[0]} (can start in {self.held_for[1]:.0f} s): "
                    "only work that ends by then may start there")
        for i, any_, k in zip(wait.tolist(), allowed.any(axis=1).tolist(), least.tolist()):
            j = jobs[i]
            c = rows[i][k] if any_ else None
            note = held if self.held_for is not None and j.job_id != self.held_for[0] else ""
            if j.spec.guaranteed:
                if any_:
                    d.waiting[j.job_id] = (
                        f"waiting: guarantee {targets[i]:.3g} samples/s needs at least {c.describe()}; "
                        f"largest free block is {block} GPUs ({total_free} free){note}"
                    )
                else:
                    d.waiting[j.job_id] = "waiting: no allocation in this cluster reaches its guaranteed throughput"
            elif not any_ and self._held_out(j, now):
                d.waiting[j.job_id] = (
                    f"waiting: preempted less than its pin window ({self.pin_window(j):.0f} s) ago; "
                    "not restarted yet so it does not thrash"
                )
            elif not any_:
                d.waiting[j.job_id] = "waiting: no plan of this job fits this cluster's GPUs"
            else:
                lead = "preempted" if j.running else "waiting"
                if c.per_node > block or c.gpus > total_free:  # the smallest it may run on does not fit
                    d.waiting[j.job_id] = (
                        f"{lead}: needs {c.gpus} GPUs within {c.nodes} node(s) ({c.per_node} per node), "
                        f"largest free block is {block} GPUs ({total_free} free){note}"
                    )
                else:
                    d.waiting[j.job_id] = (
                        f"{lead}: lower normalised marginal gain ({c.throughput / refs[i]:.2f}x request on "
                        f"{c.gpus} GPUs) than the jobs given resources this round{note}"
                    )
        return d


def pins_needed(jobs: list[JobView]) -> bool:
    """Whether this round pins jobs (``pin_window``): only where something may outrank a
    running best-effort job, a guaranteed job (a pending one waits for pinned jobs, so its
    wait is bounded) or a higher priority class (which never preempts a job inside its
    minimum run time, ``classes.enforce``). Among best-effort jobs of one class the restart
    charges alone decide (each switch's T/(T+R), the resume charge): a pin on top of them
    held every GPU through a burst of short arrivals (docstring, point 4)."""
    prio = None
    for j in jobs:
        if j.spec.guaranteed:
            return True
        if prio is None:
            prio = j.spec.priority
        elif j.spec.priority != prio:
            return True
    return False


def search(pb: Problem, *room, use_numba: bool = True):
    """One kernel search; again while guarded jobs lost their place in it, without their
    guard (``Problem.unguard_losers``), at most ``GUARD_PASSES`` more times."""
    got = greedy_allocate(*pb.kernel_args(), *room, unseat=pb.unseat, use_numba=use_numba)
    for _ in range(GUARD_PASSES):
        if not pb.unguard_losers(got[0]):
            break
        got = greedy_allocate(*pb.kernel_args(), *room, unseat=pb.unseat, use_numba=use_numba)
    return got


def one_class(jobs: list[JobView]) -> bool:
    """Whether every job is of one priority class."""
    return len({j.spec.priority for j in jobs}) <= 1


def _sizes(nodes: list[NodeState]) -> tuple[int, int, int, dict[str, int], list[tuple[int, str]]]:
    """(most GPUs on a node, most CPUs on a node, GPUs in all: the candidate space's sizes;
    node -> its GPUs, and (GPUs, node) largest first: ``_free_block``'s)."""
    gpus = {n.name: n.gpus_total for n in nodes}
    g = max(gpus.values(), default=8)
    by_size = sorted(((k, n) for n, k in gpus.items()), key=lambda x: -x[0])
    return g, max((n.cpus_total for n in nodes), default=8 * g), sum(gpus.values()), gpus, by_size
