"""Sharing parts composed around any policy (Blox-style; issue 13).

``Shared(inner, cfg)`` is a policy: each round it
1. updates every tenant's decayed usage (``FairShare``) and ranks jobs by
   *standing*: priority class (higher first), then starved (waited past
   ``starvation_wait``), then the tenant's decayed usage / weight, then
   arrival. Ordering policies (the priority family, FIFO) use this rank
   ahead of their own key (``order_key``);
2. **make room** (preemption choice), in standing order, for pending jobs
   that have a right to run now:
   - *reclaim*: the job fits its tenant's nominal quota and cohort members
     borrow: borrowers' jobs are preempted, lowest priority first, a job
     past its minimum run time before one that is not (only reclaim may take
     a job inside its minimum run time), each from a tenant still borrowing
     when it is chosen (Kueue's rule; whole jobs, so a borrower may end
     below its quota);
   - *priority*: jobs of a lower priority class past their minimum run time;
   - *starvation*: jobs of no higher priority, of tenants better served by
     fair share, past their minimum run time;
3. **admission filter**: the inner policy sees running jobs (minus the
   victims) and only the pending jobs their tenant's quota (+ what the cohort
   may lend) admits; owners' demand within quota is claimed before anything
   is lent; for an inner policy that plans within budgets (rubick), a job past
   its tenant's borrowing room only because the tenant's running jobs hold GPUs
   past their requests is admitted against that growth;
4. checks the inner decision: a job made room for is placed if the inner
   policy did not; a job inside its minimum run time that the inner policy
   dropped is kept where it fits; a cohort never borrows more than it lends
   (when it starts a job admitted against its growth, the over-borrowing
   tenant's running jobs kept past their requests go back to them first; then
   its newest starts are undone).

Everything is a function of the job views and ``now``, so the optimizer and
the simulator decide the same way. ``log`` (off by default) records rounds
and preemptions for ``loadtest.fairness``.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import replace as dc_replace

from gearshift.policies import typed_place
from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, PerfOracle, Policy, default_plan
from gearshift.policies.fairshare import Rebalancer, round_entitlement
from gearshift.policies.placement import Ledger, describe
from gearshift.policies.protocols import BudgetedPolicy, KeyOrderedPolicy
from gearshift.policies.queues import FairShare, QuotaBook, ShareConfig


@dataclass(slots=True)
class Victim:
    job: JobView
    kind: str  # reclaim | priority | starvation
    for_job: str


def _place(ledger: Ledger, job: JobView, plan) -> tuple | None:
    """Room for ``plan`` (a TP group never spans nodes, a job one GPU type it accepts),
    preferring the job's own nodes."""
    return typed_place.place(ledger, job, plan, prefer=tuple(p.node for p in job.placement))


def _clear_for(j: JobView, decision: Decision, ledger: Ledger, by_id: dict, must: dict, standing: dict,
               protected) -> None:
    """The inner policy gave a protected job's GPUs away (a type-aware policy may
    move others onto them): its new starts on those nodes wait instead (lowest
    standing first), a start made room for moves elsewhere, then running jobs moved
    or grown there go back to what they hold, until the protected job fits where it runs."""
    nodes = {p.node for p in j.placement}

    def on(jid):
        return any(p.node in nodes for p in decision.allocations[jid].placement)
    starts = [k for k in decision.allocations if not by_id[k].running and k not in must and on(k)]
    starts.sort(key=lambda k: standing.get(k, ()) + (by_id[k].submitted_at, k), reverse=True)
    for k in starts:
        if ledger.fits(j.placement):
            return
        ledger.give(decision.allocations.pop(k).placement)
        decision.waiting[k] = f"waiting: {j.job_id} is inside its minimum run time on these GPUs"
    # a start made room for (reclaim, priority) may start elsewhere; the protected job cannot move
    for k in [k for k in decision.allocations if not by_id[k].running and k in must and on(k)]:
        if ledger.fits(j.placement):
            return
        d = decision.allocations[k]
        ledger.give(d.placement)
        spot = None
        if ledger.fits(j.placement):
            ledger.take(j.placement)
            spot = _place(ledger, by_id[k], d.plan)
            ledger.give(j.placement)
        if spot is None:
            ledger.take(d.placement)
            continue
        ledger.take(spot)
        decision.allocations[k] = JobDecision(spot, d.plan, f"{d.reason}; moved to {describe(spot)}: "
                                                            f"{j.job_id} is inside its minimum run time")
    # running jobs moved or grown onto them go back to what they hold; one that cannot
    # and is past its own minimum run time waits (the protected job has the right)
    for k in [k for k in decision.allocations if by_id[k].running and k not in must and on(k)]:
        if ledger.fits(j.placement):
            return
        v, d = by_id[k], decision.allocations[k]
        if d.placement == v.placement:
            continue
        ledger.give(d.placement)
        if ledger.fits(v.placement):
            ledger.take(v.placement)
            decision.allocations[k] = JobDecision(v.placement, v.plan or default_plan(v.spec),
                                                  f"kept: {j.job_id} is inside its minimum run time")
        elif not protected(v):
            decision.allocations.pop(k)
            decision.waiting[k] = f"preempted: {j.job_id} is inside its minimum run time on these GPUs"
        else:
            ledger.take(d.placement)


def _borrow_over_growth(book: QuotaBook, j: JobView, growth: dict[str, int], credited: set[str]) -> bool:
    """A waiting job past what its tenant may borrow only because the tenant's running jobs
    hold GPUs past their requests is admitted against that growth (``_shrink_growth`` takes
    it back if the inner policy starts the job and keeps the growth): growth never keeps
    the tenant's own request out."""
    t, gpus = j.spec.tenant, j.spec.gpus
    g = growth.get(t, 0)
    if g <= 0:
        return False
    book.add(t, -g)
    ok = book.borrow(t, gpus)
    book.add(t, g)
    if ok:
        growth[t] = max(0, g - gpus)
        credited.add(j.job_id)
    return ok


def _shrink_growth(t: str, decision: Decision, ledger: Ledger, book: QuotaBook, by_id: dict, must: dict) -> None:
    """Tenant ``t`` would borrow more than its cohort lends and starts a job admitted against
    its growth (``_borrow_over_growth``): its running jobs kept past their requests go back
    to their requests (largest growth first; the minimum run time protects
    a request, not growth) before any of its starts is undone."""
    grown = [(sum(p.gpus for p in d.placement) - by_id[k].spec.gpus, k) for k, d in decision.allocations.items()
             if by_id[k].running and by_id[k].spec.tenant == t and k not in must]
    for extra, jid in sorted(grown, key=lambda x: (-x[0], x[1])):
        if extra <= 0 or t not in book.over_limit():
            continue
        j, d = by_id[jid], decision.allocations[jid]
        plan = default_plan(j.spec)
        ledger.give(d.placement)
        spot = _place(ledger, j, plan)
        if spot is None:
            ledger.take(d.placement)
            continue
        ledger.take(spot)
        decision.allocations[jid] = JobDecision(spot, plan, f"back to its request on {describe(spot)}: tenant {t} "
                                                            "would borrow more than its cohort lends")
        book.add(t, -extra)


class Shared:
    def __init__(self, inner: Policy, cfg: ShareConfig | None = None, *, log: bool = False):
        self.inner = inner
        self.cfg = cfg or ShareConfig()
        self.name = inner.name
        self._budgeted = isinstance(inner, BudgetedPolicy)  # plans within budgets: told them (``_budget``)
        self.fair = FairShare(self.cfg.half_life)
        self.standing: dict[str, tuple] = {}
        self.wait_since: dict[str, float] = {}
        self.log: list[dict] | None = [] if log else None
        self.last_stats: dict = {}
        self.entitled: dict[str, float] = {}
        self.fairness = Rebalancer(self.cfg, self.name, self._protected, self.standing)
        if isinstance(inner, KeyOrderedPolicy):  # the priority family and EASY FIFO order by a key: put standing first
            base = inner.key
            inner.key = lambda j, now, perf, _b=base: self.standing.get(j.job_id, ()) + tuple(_b(j, now, perf))

    def set_config(self, cfg: ShareConfig) -> None:
        """Queues changed at run time (admission's ``set queue``)."""
        self.cfg = cfg
        self.fair.half_life = cfg.half_life
        self.fairness.cfg = cfg

    def memory(self) -> dict:
        """What a new leader must go on from: decayed usage and since when each job waits
        (the starvation timer), as plain data (kept in ``gs_queues``)."""
        return {**self.fair.state(), "waiting_since": dict(self.wait_since)}

    def restore(self, state: dict) -> None:
        self.fair.load(state)
        self.wait_since = {str(k): float(v) for k, v in (state.get("waiting_since") or {}).items()}

    # ------------------------------------------------------------ parts
    def _protected(self, j: JobView, now: float) -> bool:
        return j.switched_at is not None and now - j.switched_at < self.cfg.min_run_time

    def _rank(self, now: float, jobs: list[JobView]) -> list[JobView]:
        for j in jobs:
            if j.running:
                self.wait_since.pop(j.job_id, None)
            else:
                self.wait_since.setdefault(j.job_id, now)
        live = {j.job_id for j in jobs}
        for jid in [k for k in self.wait_since if k not in live]:
            del self.wait_since[jid]
        sw = self.cfg.starvation_wait
        for j in jobs:
            q = self.cfg.queue(j.spec.tenant)
            starved = (not j.running and sw is not None and now - self.wait_since[j.job_id] >= sw)
            self.standing[j.job_id] = (-j.spec.priority, not starved, self.fair.standing(q.tenant, q.weight))
        for jid in [k for k in self.standing if k not in live]:
            del self.standing[jid]
        return sorted(jobs, key=lambda j: self.standing[j.job_id] + (j.submitted_at, j.job_id))

    def _make_room(self, now: float, j: JobView, kind: str, ledger: Ledger, book: QuotaBook,
                   holding: dict[str, JobView]) -> list[JobView] | None:
        """Victims whose GPUs let ``j`` be placed (taken from ``ledger``), or None."""
        t, prio = j.spec.tenant, j.spec.priority
        if kind == "reclaim":
            cohort = set(book.members(self.cfg.queue(t).cohort)) - {t}
            cands = [v for v in holding.values() if v.spec.tenant in cohort and book.borrowed(v.spec.tenant) > 0]
            cands.sort(key=lambda v: (v.spec.priority, self._protected(v, now), -(v.switched_at or 0.0), v.job_id))
        elif kind == "priority-own":
            cands = [v for v in holding.values() if v.spec.tenant == t and v.spec.priority < prio
                     and not self._protected(v, now)]
            cands.sort(key=lambda v: (v.spec.priority, -(v.switched_at or 0.0), v.job_id))
        else:
            mine = self.standing[j.job_id][-1]
            cands = [v for v in holding.values() if not self._protected(v, now) and (
                v.spec.priority < prio if kind == "priority"
                else v.spec.priority <= prio and self.standing[v.job_id][-1] > mine and v.spec.tenant != t)]
            cands.sort(key=lambda v: (v.spec.priority, -self.standing[v.job_id][-1], -(v.switched_at or 0.0), v.job_id))
        plan = default_plan(j.spec)
        # on a mixed cluster, victims on one GPU type first: freed GPUs of another type
        # cannot join them, and whole-job victims from a borrower may stop it borrowing
        for group in typed_place.per_type(ledger, j, cands):
            taken: list[JobView] = []
            for v in group:
                if kind == "reclaim" and book.borrowed(v.spec.tenant) <= 0:
                    continue  # no longer borrowing (Kueue's rule: a victim's queue must borrow when chosen)
                ledger.give(v.placement)
                book.add(v.spec.tenant, -v.gpus)
                taken.append(v)
                quota_ok = kind != "priority-own" or book.within_quota(t, j.spec.gpus) or (
                    book.borrowable(t) >= book.use.get(t, 0) + j.spec.gpus - book.quota(t) - book.borrowed(t))
                if quota_ok and _place(ledger, j, plan) is not None:
                    return taken
            for v in taken:  # not enough: undo
                ledger.take(v.placement)
                book.add(v.spec.tenant, v.gpus)
        return None

    # ------------------------------------------------------------ a round
    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        held: dict[str, int] = {}
        for j in jobs:
            if j.running:
                held[j.spec.tenant] = held.get(j.spec.tenant, 0) + j.gpus
        self.fair.update(now, held)
        order = self._rank(now, jobs)
        ledger = Ledger(nodes)
        holding = {j.job_id: j for j in order if j.running}
        for j in holding.values():
            ledger.take(j.placement)
        book = QuotaBook(self.cfg, held)
        victims: list[Victim] = []
        visible: list[JobView] = []
        must: dict[str, str] = {}
        spots: dict[str, tuple] = {}  # where a job made room for goes
        owed: list[str] = []  # within quota, no room, cohort borrowing: reclaim is due
        pending = [j for j in order if not j.running]
        # owners' demand within quota is claimed first; then borrowing, in standing order
        claimed = {j.job_id for j in pending if book.claim(j.spec.tenant, j.spec.gpus)}
        # GPUs running jobs hold past their requests, per tenant: an inner policy that plans
        # within budgets (``_budget``) trades that growth for the tenant's waiting job itself;
        # others are not shown such a job (the repair would restart the grown jobs instead)
        growth: dict[str, int] = {}
        credited: set[str] = set()  # jobs admitted against that growth
        for v in holding.values() if self._budgeted else ():
            growth[v.spec.tenant] = growth.get(v.spec.tenant, 0) + max(0, v.gpus - v.spec.gpus)
        for j in pending:
            if j.job_id not in claimed and not book.borrow(j.spec.tenant, j.spec.gpus) \
                    and not _borrow_over_growth(book, j, growth, credited):
                # over quota: only its own tenant's lower classes may make room (Kueue's withinClusterQueue)
                taken = self._make_room(now, j, "priority-own", ledger, book, holding)
                if not taken:
                    continue
                for v in taken:
                    del holding[v.job_id]
                    victims.append(Victim(v, "priority", j.job_id))
                must[j.job_id] = "priority"
                book.add(j.spec.tenant, j.spec.gpus)
                visible.append(j)
                spots[j.job_id] = _place(ledger, j, default_plan(j.spec))
                ledger.take(spots[j.job_id])
                continue
            visible.append(j)
            plan = default_plan(j.spec)
            spot = _place(ledger, j, plan)
            if spot is None:
                if j.job_id in claimed and any(book.borrowed(m) for m in book.members(self.cfg.queue(j.spec.tenant).cohort)):
                    owed.append(j.job_id)
                for kind in self._rights(now, j, book, claimed):
                    taken = self._make_room(now, j, kind, ledger, book, holding)
                    if taken:
                        for v in taken:
                            del holding[v.job_id]
                            victims.append(Victim(v, kind, j.job_id))
                        spot = spots[j.job_id] = _place(ledger, j, plan)
                        must[j.job_id] = kind
                        break
            if spot is not None:
                ledger.take(spot)
        gone = {v.job.job_id for v in victims}
        # a job made room for is shown holding its room, so the inner policy cannot give it away
        view = [j for j in order if j.running and j.job_id not in gone] + [
            dc_replace(j, placement=spots[j.job_id], plan=default_plan(j.spec)) if j.job_id in spots else j
            for j in visible]
        self._budget(nodes, jobs)
        decision = self.inner.schedule(now, nodes, view, perf)
        decision.changes = None  # told against the views shown the inner policy; edited below
        self._repair(now, nodes, jobs, decision, must, gone, claimed, credited)
        # each tenant's weighted max-min share, imposed on whatever the inner policy chose
        self.fairness.perf = perf
        unfair, self.entitled = self.fairness.rebalance(now, nodes, jobs, decision, set(must), claimed, gone)
        for v in victims:
            decision.allocations.pop(v.job.job_id, None)
            decision.waiting[v.job.job_id] = (f"preempted ({v.kind}) for {v.for_job}"
                                              + (f" of tenant {self._tenant(jobs, v.for_job)}" if v.kind == "reclaim" else ""))
        victims += [Victim(v, "fair-share", "") for v in unfair]
        shown = {j.job_id for j in visible}
        for j in pending:
            if j.job_id not in decision.allocations and j.job_id not in shown:
                q = self.cfg.queue(j.spec.tenant)
                decision.waiting[j.job_id] = (f"waiting: tenant {q.tenant} holds {held.get(q.tenant, 0)} GPUs, "
                                              f"quota {q.quota} + what cohort {q.cohort or '-'} lends now")
        self._record(now, jobs, decision, victims, owed)
        return decision

    def _budget(self, nodes: list[NodeState], jobs: list[JobView]) -> None:
        """An inner policy that plans within budgets (``protocols.BudgetedPolicy``: rubick) is told
        each tenant's share before it decides: its entitlement (what ``rebalance`` will
        impose) plus the GPUs no tenant is entitled to now (demand below the cluster),
        so it does not give a tenant at its share what the rebalance takes back."""
        if not self._budgeted:
            return
        _, ent = round_entitlement(self.cfg, nodes, jobs)
        spare = max(0.0, sum(n.gpus_total for n in nodes) - sum(ent.values()))
        self.inner.set_budget({t: e + spare for t, e in ent.items()})

    @staticmethod
    def _tenant(jobs: list[JobView], jid: str) -> str:
        return next((j.spec.tenant for j in jobs if j.job_id == jid), "?")

    def _rights(self, now: float, j: JobView, book: QuotaBook, claimed: set[str]) -> list[str]:
        kinds = []
        if j.job_id in claimed and any(book.borrowed(m) for m in book.members(self.cfg.queue(j.spec.tenant).cohort)):
            kinds.append("reclaim")
        kinds.append("priority")
        if not self.standing[j.job_id][1]:
            kinds.append("starvation")
        return kinds

    def _repair(self, now: float, nodes: list[NodeState], jobs: list[JobView], decision: Decision,
                must: dict[str, str], gone: set[str], claimed: set[str], credited: set[str] = frozenset()) -> None:
        by_id = {j.job_id: j for j in jobs}
        ledger = Ledger(nodes)
        for d in decision.allocations.values():
            ledger.take(d.placement)
        # jobs made room for: place them if the inner policy did not
        for jid in must:
            if jid not in decision.allocations:
                j = by_id[jid]
                plan = default_plan(j.spec)
                spot = _place(ledger, j, plan)
                if spot is not None:
                    ledger.take(spot)
                    decision.allocations[jid] = JobDecision(spot, plan, f"{self.name}+sharing: {must[jid]} on {describe(spot)}")
                    decision.waiting.pop(jid, None)
        # the inner policy may not take a job inside its minimum run time (only reclaim may)
        for j in jobs:
            if j.running and j.job_id not in gone and j.job_id not in decision.allocations and self._protected(j, now):
                if not ledger.fits(j.placement):
                    _clear_for(j, decision, ledger, by_id, must, self.standing, lambda v: self._protected(v, now))
                if ledger.fits(j.placement):
                    ledger.take(j.placement)
                    decision.allocations[j.job_id] = JobDecision(j.placement, j.plan or default_plan(j.spec),
                                                                 "kept: inside its minimum run time")
                    decision.waiting.pop(j.job_id, None)
        # a cohort lends only what its members do not use: undo the newest starts of over-borrowers
        held: dict[str, int] = {}
        for jid, d in decision.allocations.items():
            t = by_id[jid].spec.tenant
            held[t] = held.get(t, 0) + sum(p.gpus for p in d.placement)
        for jid in claimed:  # an owner's waiting demand within quota is not lendable
            if jid not in decision.allocations:
                t = by_id[jid].spec.tenant
                held[t] = held.get(t, 0) + by_id[jid].spec.gpus
        book = QuotaBook(self.cfg, held)
        for t in book.over_limit():
            if any(k in decision.allocations and by_id[k].spec.tenant == t for k in credited):
                _shrink_growth(t, decision, ledger, book, by_id, must)
            starts = [jid for jid in decision.allocations if not by_id[jid].running and by_id[jid].spec.tenant == t]
            starts.sort(key=lambda jid: self.standing.get(jid, ()) + (by_id[jid].submitted_at, jid), reverse=True)
            for jid in starts:
                if t not in book.over_limit():
                    break
                d = decision.allocations.pop(jid)
                ledger.give(d.placement)
                book.add(t, -sum(p.gpus for p in d.placement))
                decision.waiting[jid] = f"waiting: tenant {t} would borrow more than its cohort lends"
            # then the inner policy's growth of its running jobs is reverted
            for jid in [k for k in decision.allocations if by_id[k].running and by_id[k].spec.tenant == t]:
                j, d = by_id[jid], decision.allocations[jid]
                extra = sum(p.gpus for p in d.placement) - j.gpus
                if t not in book.over_limit():
                    break
                if extra <= 0:
                    continue
                ledger.give(d.placement)
                if not ledger.fits(j.placement):
                    ledger.take(d.placement)
                    continue
                ledger.take(j.placement)
                decision.allocations[jid] = JobDecision(j.placement, j.plan or default_plan(j.spec),
                                                        f"kept: tenant {t} would borrow more than its cohort lends")
                book.add(t, -extra)

    def _record(self, now: float, jobs: list[JobView], decision: Decision, victims: list[Victim],
                owed: list[str]) -> None:
        kinds = {v.job.job_id: v.kind for v in victims}
        preempted = [j for j in jobs if j.running and j.job_id not in decision.allocations]
        self.last_stats = {"victims": len(victims), "preempted": len(preempted)}
        if self.log is None:
            return
        held: dict[str, int] = {}
        demand: dict[str, int] = {}
        by_id = {j.job_id: j for j in jobs}
        for jid, d in decision.allocations.items():
            t = by_id[jid].spec.tenant
            held[t] = held.get(t, 0) + sum(p.gpus for p in d.placement)
        for j in jobs:
            demand[j.spec.tenant] = demand.get(j.spec.tenant, 0) + j.spec.gpus
        self.log.append({
            "t": now, "held": held, "demand": demand,
            "quota": {t: self.cfg.queue(t).quota for t in demand},
            "preempted": [{"job": j.job_id, "tenant": j.spec.tenant, "kind": kinds.get(j.job_id, "policy"),
                           "ran_s": now - j.switched_at if j.switched_at is not None else None,
                           "priority": j.spec.priority} for j in preempted],
            "started": [jid for jid in decision.allocations if not by_id[jid].running],
            "owed": owed,
        })
