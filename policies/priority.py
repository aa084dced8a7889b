"""A Blox-style priority scheduler: order jobs, then place them in order.

Parts: an ordering key (``ordering.py``) and Blox's default placement loop:
walk jobs from highest priority; a running job keeps its GPUs; a waiting job
is placed consolidated if it fits; if not, running jobs are preempted from the
bottom of the order until it fits; the first job that still cannot be placed
stops the walk (strict priority). Every job keeps the plan and GPU count it
asked for, as these schedulers do.

One deviation, documented: a job that (re)started less than ``min_run_time``
ago is not preempted (Blox's rounds are 300 s leases, so no job there runs
less than a round; with shorter rounds this keeps the same guarantee).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from heapq import heappop, heappush
from itertools import takewhile
from operator import attrgetter, countOf
from typing import Callable

import numpy as np

from gearshift.policies.api import Changes, Decision, JobDecision, JobView, NodeState, PerfOracle, default_plan
from gearshift.policies.classes import ByClass, by_class
from gearshift.policies.ordering import SrtfKey, TiresiasQueues, fifo_key, las_key
from gearshift.policies.placement import Ledgers, describe
from gearshift.policies.protocols import BatchOrder, BatchOrderKey, SteadyKey, supports
from gearshift.policies.victims import work_since_checkpoint
from gearshift.policies.views import Carried, split

OrderKey = Callable[[JobView, float, PerfOracle | None], tuple]
_CHECKPOINT_AT = attrgetter("checkpoint_at")
_NODE = attrgetter("node")


def _no_words(j: JobView) -> str:
    """The default ``describe_key``: nothing to add to a job's reason."""
    return ""


class PriorityPolicy:
    def __init__(
        self,
        name: str,
        key: OrderKey,
        *,
        preemptive: bool = True,
        head_of_line: bool = True,
        min_run_time: float = 300.0,
        restart_cost: float = 0.0,  # accepted for a uniform interface; ordering ignores it
        default_cpus_per_gpu: int = 1,
        describe_key: Callable[[JobView], str] | None = None,
        victim_ok: Callable[[JobView, JobView], bool] | None = None,
        blocks: Callable[[JobView, JobView], bool] | None = None,
    ):
        self.name = name
        self.key = by_class(key)  # priority classes first: preemption walks up from the lowest
        self.preemptive = preemptive
        self.head_of_line = head_of_line
        self.min_run_time = min_run_time
        self.default_cpus_per_gpu = default_cpus_per_gpu
        self.describe_key = describe_key or _no_words
        # victim_ok(victim, job): may ``job`` evict ``victim``? (None: any lower
        # job outside its minimum run time). blocks(blocked, job): does the
        # blocked job hold ``job`` back? (None: everything behind it waits).
        self.victim_ok = victim_ok
        self.blocks = blocks
        self._kept: dict[str, JobDecision] = {}  # last round's "kept" decisions, by job
        self._kept_for: str | None = None  # the name _kept_reason was made for
        self._kept_reason = ""
        self._ledgers = Ledgers()
        # after the last round: (free GPUs, free CPUs, kept words), None if a placement it kept had a
        # negative amount (the shortcut's argument needs them all >= 0); _kept then holds all its
        # allocations as kept decisions
        self._after: tuple[dict, dict, str] | None = None
        self._steady_until = -math.inf  # protocols.SteadyPolicy, for the last decision
        self._carried = Carried()  # job ids and who runs, by position in the lists handed (policies.views)
        self._changed: set[str] = set()  # the jobs the last decision placed or left out
        self._behind: tuple = (None, None, {})  # the last jobs waiting behind a blocked one: (ids, words, dict)

    def _protected(self, j: JobView, now: float) -> bool:
        return j.switched_at is not None and now - j.switched_at < self.min_run_time

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        key = self.key
        # sharing.Shared may put a plain key in place of by_class's
        ranked = key.order(jobs, now, perf) if supports(key, BatchOrder) else None
        if ranked is None:
            keys = key.many(jobs, now, perf) if supports(key, BatchOrderKey) else [key(j, now, perf) for j in jobs]
            ranked = _sorted_by(keys)
        perm = None
        if isinstance(ranked, np.ndarray):  # (an array order: positions as an array too)
            perm, ranked = ranked, ranked.tolist()
        # the job at place k in the order is jobs[ranked[k]] (order: the list of them, made where a pass needs it)
        order: list[JobView] | None = None
        fresh = self._carried.follow(jobs)  # the views built anew, if jobs says how it follows the last list
        ledger = self._ledgers.fresh(nodes)  # = Ledger(nodes)
        kept = self._kept_words()
        got = None
        after = self._after
        if after is not None and after[2] is kept and self._ledgers.same:
            if fresh is None:
                got = _keep_as_before(order := list(map(jobs.__getitem__, ranked)), self._kept)
            else:
                got = _keep_told(jobs, ranked if perm is None else perm, fresh, self._carried, self._kept,
                                 self._changed)
        if got is not None:
            # every running job holds what the last round decided: they all fit (see _keep_as_before),
            # and what is free is what the last round left plus what its jobs that stopped held
            holding, held_at, walk, stopped = got
            # (the last round's free GPUs handed over, not copied: _after is set anew below)
            free_g, free_c = ledger.free_g, ledger.free_c = after[0], after[1]
            self._after = None
            last = self._kept
            for jid in last.keys() - holding.keys() if stopped is None else stopped:
                for p in last[jid].placement:
                    free_g[p.node] += p.gpus
                    free_c[p.node] += p.cpus
            signed = True
            replanned = walked = ()
        else:
            if order is None:
                order = list(map(jobs.__getitem__, ranked))  # = sorted(jobs, key=...)
            holding, held_at, walk, signed, replanned = _keep_pass(order, ledger.free_g, ledger.free_c,
                                                                   self._kept.get, kept)
            walked = [order[k].job_id for k in walk if order[k].placement]  # running, not kept as they hold
        ck_after: int | None = None  # the last position with a checkpoint (-1: none), found once when asked
        placed = False  # the walk placed a job (the decision changed something)
        expires = math.inf  # the first protection that ends among the victims refused for it
        decision = Decision()
        preempted: dict[str, str] = {}
        blocked: JobView | None = None
        behind: dict[str, str] = {}  # the same words for every job behind the blocked one
        describe_key, waiting = self.describe_key, decision.waiting
        while walk:
            at = heappop(walk)
            j = jobs[ranked[at]]
            if j.job_id in holding:
                continue
            if blocked is not None and self.head_of_line and self.blocks is None:
                # everything after the blocked job waits behind it: the rest of the walk, in its order
                if describe_key is _no_words:  # the same words for them all (no job walked is held)
                    walk.sort()
                    walk.insert(0, at)
                    rest = list(map(self._carried.ids.__getitem__, map(ranked.__getitem__, walk)))
                    msg = f"waiting: behind {blocked.job_id} in {self.name} order"
                    same = self._behind  # (the last round's, when the same jobs wait behind the same words)
                    if same[0] != rest or same[1] != msg:
                        same = self._behind = (rest, msg, dict.fromkeys(rest, msg))
                    waiting.update(same[2])
                    break
                for at in (at, *sorted(walk)):
                    j = jobs[ranked[at]]
                    if j.job_id not in holding:
                        why = describe_key(j)
                        msg = behind.get(why)
                        if msg is None:
                            msg = behind[why] = f"waiting: behind {blocked.job_id} in {self.name} order{why}"
                        waiting[j.job_id] = msg
                break
            why = describe_key(j)
            if blocked is not None and self.head_of_line and self.blocks(blocked, j):
                msg = behind.get(why)
                if msg is None:
                    msg = behind[why] = f"waiting: behind {blocked.job_id} in {self.name} order{why}"
                waiting[j.job_id] = msg
                continue
            cpg = j.spec.cpus_per_gpu or self.default_cpus_per_gpu
            plan = default_plan(j.spec)
            gpus = plan.gpus
            prefer = tuple(map(_NODE, j.placement)) if j.placement else ()
            placement = ledger.place(gpus, cpg, prefer=prefer, unit=plan.tp)
            victims: list[tuple[int, JobView, JobDecision]] = []
            # a job preempted this round does not preempt its peers to come back (with victims taken
            # from the bottom of the order nothing is below them; policies.victims may take them higher)
            if placement is None and self.preemptive and j.job_id not in preempted:
                victim_ok, min_run = self.victim_ok, self.min_run_time
                # running jobs after j in the order, from the bottom (walked as far as needed)
                cands = takewhile(at.__lt__, reversed(held_at))
                if ck_after is None and held_at and held_at[-1] > at:
                    ck_after = -1 if countOf(map(_CHECKPOINT_AT, jobs), None) == len(jobs) else max(
                        k for k, i in enumerate(ranked) if jobs[i].checkpoint_at is not None)
                if ck_after is not None and ck_after > at:  # any_checkpoint(order[at + 1:]): among equals,
                    cands = sorted(cands, key=lambda vat: (  # least work lost first (victim_order)
                        jobs[ranked[vat]].spec.priority, work_since_checkpoint(jobs[ranked[vat]], now)))
                for vat in cands:
                    v = jobs[ranked[vat]]
                    if v.job_id not in holding:  # (only those already passed leave holding here)
                        continue
                    if victim_ok is not None:
                        if not victim_ok(v, j):
                            continue
                    elif (since := v.switched_at) is not None and now - since < min_run:  # _protected, inlined
                        expires = min(expires, since + min_run)
                        continue
                    ledger.give(v.placement)
                    victims.append((vat, v, holding.pop(v.job_id)))
                    placement = ledger.place(gpus, cpg, prefer=prefer, unit=plan.tp)
                    if placement is not None:
                        break
                if placement is None:  # preempting did not help: undo
                    for _, v, d in victims:
                        ledger.take(v.placement)
                        holding[v.job_id] = d
                    victims = []
            if placement is None:
                decision.waiting[j.job_id] = (
                    f"waiting: needs {gpus} GPUs, {ledger.total_free()} free "
                    f"(largest free block {ledger.largest_block()}){why}"
                )
                if blocked is None:
                    blocked = j
                continue
            ledger.take(placement)
            for vat, v, _ in victims:
                preempted[v.job_id] = f"preempted by {j.job_id}, ahead in {self.name} order{self.describe_key(v)}"
                heappush(walk, vat)  # it is walked in its turn, as a job not kept
            placed = True
            verb = "moved to" if j.running else "started on"
            decision.allocations[j.job_id] = JobDecision(
                placement, plan, f"{self.name}: {verb} {describe(placement)}{why}"
            )
        allocs = decision.allocations
        # as changes (decision.diff): the walk's placements, and the kept jobs given a plan they did not hold
        moved = (*allocs, *(jid for jid in replanned if jid in holding))
        allocs.update(holding)  # the kept jobs after those the walk placed, in order
        left = tuple(jid for jid in (*walked, *preempted) if jid not in allocs)
        decision.changes = Changes(jobs, moved, left)
        self._changed = {*moved, *left}
        for jid, d in decision.allocations.items():  # the walk's, as kept decisions for the next round
            if jid in holding:
                break
            holding[jid] = JobDecision(d.placement, d.plan, kept)
            signed = signed and all(p.gpus >= 0 and p.cpus >= 0 for p in d.placement)
        self._kept = holding
        self._after = (ledger.free_g, ledger.free_c, kept) if signed else None  # (the ledger is not used again)
        for jid, why in preempted.items():
            if jid not in decision.allocations:  # a victim placed again later in the walk is not waiting
                decision.waiting[jid] = why
        # every running job held the last round's decision; and this one changed nothing, or it changed
        # what the walk up to the blocked job placed and preempted, the blocked one not preempted itself
        settles = not placed and not preempted or self.head_of_line and (
            blocked is None or blocked.job_id not in preempted or ck_after == -1)
        self._steady_until = expires if got is not None and settles and self._steady() else -math.inf
        return decision

    def _steady(self) -> bool:
        """Does a decision that changed nothing stand while nothing moves (``steady_until``)?
        With a steady key and the default victims, blocking and words, yes."""
        key = self.key
        return (isinstance(key, ByClass) and supports(key.base, SteadyKey) and key.base.keeps_steady()
                and self.victim_ok is None and self.blocks is None and self.describe_key is _no_words)

    def steady_until(self) -> float:
        """``protocols.SteadyPolicy``. With a steady key (``protocols.SteadyKey``) and the
        default victims, blocking and words, after a round in which every running job held
        the last decision: once this decision is applied, the same jobs, on the same nodes,
        with the oracle's answers standing, get a decision that changes nothing (every
        running job kept, none placed, none preempted) until a victim it refused for its
        minimum run time may be taken. When this decision changed nothing:

        - the waiting jobs keep their keys and order, and the running ones' only fall, so
          the jobs behind a waiting one are a subset of those behind it then;
        - every waiting job was refused (none placed) on the same free GPUs, after
          freeing every victim behind it it could take (``Ledger.place`` finds room
          whenever room grew: a node's or the sum of the nodes' room), so on a subset it
          is refused again; the first one blocks the rest with the same words;
        - the kept decisions are the same objects, and ``_after`` the same free GPUs.

        When it placed or preempted jobs, with head-of-line blocking: the walk placed every
        job before the first it refused (the blocked one) and nothing after it, so the next
        round's first waiting job is the blocked one, on the free GPUs it was refused on;
        the jobs it placed are ahead of it (their keys only fall), and the running jobs
        behind it are a subset of the candidates it freed then. If it was a victim of this
        round itself it freed none (a victim does not preempt), but its preemptor took
        victims from the bottom of the order up to it, so every running job behind it
        was taken or refused for its minimum run time; not when victims were ordered by
        their checkpoints instead (not vouched for). What follows it waits.

        -inf otherwise (a job held something else; another key; custom victims)."""
        return self._steady_until

    def _kept_words(self) -> str:
        """A kept job's reason, made once per name (its decisions carry the same string)."""
        if self._kept_for is not self.name:
            self._kept_for, self._kept_reason = self.name, f"{self.name}: kept"
        return self._kept_reason


def _keep_as_before(order: list[JobView], last: dict[str, JobDecision]) -> tuple | None:
    """The keep pass (``_keep_pass``) when every running job holds what the last round
    decided (``last``: its allocations as kept decisions, same nodes): (holding,
    positions held, positions to walk, None: the jobs of ``last`` that stopped are not
    known), or None if one does not. Every running job
    then fits, in any order: they hold a subset of the last round's allocations, which
    fit the same totals, and every amount is >= 0, so each prefix of them fits too."""
    get = last.get
    holding: dict[str, JobDecision] = {}
    held_at: list[int] = []
    walk: list[int] = []
    walk_append, held_append = walk.append, held_at.append
    at = -1
    for j in order:
        at += 1
        held = j.placement
        if not held:
            walk_append(at)
            continue
        d = get(j.job_id)
        if d is None or d.placement is not held or d.plan is not j.plan:
            return None
        holding[j.job_id] = d
        held_append(at)
    return holding, held_at, walk, None


def _keep_told(jobs: list[JobView], at: Sequence[int], fresh: Sequence[int], carried: Carried,
               last: dict[str, JobDecision], changed: set[str]) -> tuple | None:
    """``_keep_as_before`` on ``jobs`` in the order ``at`` (positions: a list or an array)
    for a list that says how it follows the last round's (``policies.views.RoundJobs``),
    looking at what changed alone: a view not built anew is the last round's, holding
    what it held, so a job the last decision kept (every running job it did not place
    or leave out) holds that decision still. The views built anew (``fresh``: positions
    in ``jobs``) are looked at one by one; when every job the last decision placed or
    left out has one, or is gone (the decision was applied), the rest is read off the
    carried columns (``carried``: ids, who runs, by position), and the jobs of ``last``
    that stopped are known (the fourth part: those of them that hold nothing);
    otherwise, the full ``_keep_as_before``."""
    get = last.get
    for p in fresh:
        j = carried.last[p]
        if j.placement:
            d = get(j.job_id)
            if d is None or d.placement is not j.placement or d.plan is not j.plan:
                return None
    ids = carried.ids
    moved = {ids[p] for p in fresh}.union(carried.gone)
    if changed and not changed <= moved:
        return _keep_as_before(list(map(jobs.__getitem__, at)), last)
    held, held_at, walk = split(at if isinstance(at, np.ndarray) else np.array(at, np.intp),
                                np.frombuffer(bytes(carried.running), bool))
    try:
        holding = {jid: last[jid] for jid in map(ids.__getitem__, held.tolist())}
    except KeyError:  # (a list that does not say truly)
        return _keep_as_before(list(map(jobs.__getitem__, at)), last)
    # the last decision's jobs that hold nothing now: each one's view was built anew, or it is gone
    return holding, held_at.tolist(), walk.tolist(), [jid for jid in moved if jid in last and jid not in holding]


def _keep_pass(order: list[JobView], free_g: dict, free_c: dict, last_get, kept: str) -> tuple:
    """One pass over the order: running jobs keep what they hold while it fits (ledger.fits,
    take; inlined), each with its decision made here (last round's for a job that keeps the
    same placement and plan: the same values, and nothing changes a JobDecision once made);
    the positions of the others are what the walk visits. (holding, positions held,
    positions to walk, whether every kept amount is >= 0, the kept jobs that held no plan
    and are given their request's)."""
    holding: dict[str, JobDecision] = {}
    replanned: list[str] = []
    held_at: list[int] = []  # positions of the kept jobs: preemption's candidates
    walk: list[int] = []  # positions of the jobs not kept, in order (a heap: victims join it)
    walk_append, held_append = walk.append, held_at.append
    signed = True
    at = -1
    for j in order:
        at += 1
        held = j.placement
        if not held:
            walk_append(at)
            continue
        if len(held) == 1:  # one node: the same test and take, without the loops
            p = held[0]
            node = p.node
            g = free_g.get(node)
            if g is not None and g >= p.gpus and free_c[node] >= p.cpus:
                free_g[node] = g - p.gpus
                free_c[node] -= p.cpus
            else:
                walk_append(at)
                continue
        else:
            fits = True
            for p in held:
                if p.node not in free_g or free_g[p.node] < p.gpus or free_c[p.node] < p.cpus:
                    fits = False
                    break
            if not fits:
                walk_append(at)
                continue
            for p in held:
                free_g[p.node] -= p.gpus
                free_c[p.node] -= p.cpus
        if signed:
            signed = all(p.gpus >= 0 and p.cpus >= 0 for p in held)
        jid = j.job_id
        d = last_get(jid)
        if d is None or d.placement is not held or d.plan is not j.plan or d.reason is not kept:
            d = JobDecision(held, j.plan or default_plan(j.spec), kept)
            if j.plan is None:
                replanned.append(jid)
        holding[jid] = d
        held_append(at)
    return holding, held_at, walk, signed, replanned


def _sorted_by(keys: list) -> list[int]:
    """``sorted(range(len(keys)), key=keys.__getitem__)``, faster for many tuple keys whose
    second parts are numbers (the class first, then the ordering's own: seconds left,
    attained service, arrival): a stable sort on those numbers alone (cheap comparisons)
    first, and the full sort then finds its input nearly in order. The same result:
    the second sort is the whole one and stable, and the first keeps the input's order
    among equal numbers, so among equal keys too. Not for NaN (no order to agree on)."""
    idx = range(len(keys))
    if len(keys) > 16 and type(keys[0]) is tuple:
        try:
            second = [k[1] for k in keys]
            total = sum(second)  # TypeError if they are not numbers; NaN if one is (or inf - inf)
        except (TypeError, IndexError):
            second, total = None, None
        if second is not None and total == total:
            idx = sorted(idx, key=second.__getitem__)
    return sorted(idx, key=keys.__getitem__)


def make_fifo_priority(**kw) -> PriorityPolicy:
    return PriorityPolicy("fifo", fifo_key, **kw)


def make_las(**kw) -> PriorityPolicy:
    return PriorityPolicy("las", las_key, describe_key=lambda j: f"; attained {j.attained_service / 3600:.2f} GPU-h", **kw)


def make_srtf(**kw) -> PriorityPolicy:
    # srtf_key, each job's requested speed remembered while the oracle's answers stand
    return PriorityPolicy("srtf", SrtfKey(), **kw)


class Tiresias(PriorityPolicy):
    """Tiresias 2D-LAS: ``TiresiasQueues`` ordering, consolidated placement."""

    def __init__(self, thresholds: tuple[float, ...] = (16 * 3600.0,), starvation_factor: float | None = None, **kw):
        self.queues = TiresiasQueues(thresholds, starvation_factor)
        super().__init__(
            "tiresias",
            self.queues.key,
            describe_key=lambda j: f"; queue {self.queues.queue_of(j)}",
            **kw,
        )

    def schedule(self, now, nodes, jobs, perf):
        if self.queues.starvation_factor is not None:  # observe() does nothing without it
            for j in jobs:
                self.queues.observe(j, now)
        return super().schedule(now, nodes, jobs, perf)


def make_antman(**kw) -> PriorityPolicy:
    """AntMan (OSDI'20) as Rubick evaluates it: guaranteed (resource-guarantee)
    jobs first, FIFO among them and strict; opportunistic jobs fill what is
    left, FIFO with backfill. A guaranteed job evicts opportunistic jobs when
    it needs their GPUs, whatever their run time, so it is never delayed by
    one. Simplification: no fractional GPU sharing (the interface allocates
    whole GPUs), so opportunistic jobs run only on GPUs nobody guaranteed uses.
    """
    kw.setdefault("min_run_time", 0.0)
    return PriorityPolicy(
        "antman",
        lambda j, now, perf: (not j.spec.guaranteed, j.submitted_at, j.job_id),
        victim_ok=lambda v, j: j.spec.guaranteed and not v.spec.guaranteed and v.spec.priority <= j.spec.priority,
        blocks=lambda blocked, j: blocked.spec.guaranteed and j.spec.guaranteed,
        describe_key=lambda j: "; guaranteed" if j.spec.guaranteed else "; opportunistic",
        **kw,
    )
