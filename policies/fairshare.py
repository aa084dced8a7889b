"""Per-tenant fair share imposed on any inner policy's decision (issue 13).

Each round every tenant is entitled to its weighted max-min share of the
cluster's GPUs over what its live jobs ask for (``queues.fair_entitlement``:
water-filling by queue weight, each tenant capped by its demand and by the
most its queue may hold). The inner policy (rubick, sia, gavel, FIFO...)
decides freely; ``rebalance`` then moves GPUs from tenants above their
entitlement to tenants below it, one job at a time, so an elastic policy still
chooses plans, placements and who gets spare capacity, but within each
tenant's entitlement:

- *beneficiary*: the tenant furthest below its entitlement (GPUs short per
  unit of weight), its jobs in standing order: a running job the inner policy
  shrinks keeps what it holds; a job below its request (pending, or held
  shrunk) gets its request, where it runs if it can;
- *room* comes from free GPUs first, then from tenants above their
  entitlement, cheapest first: their starts this round are undone, then
  changes that grow their running jobs are reverted, then their running jobs
  are preempted (kind ``fair-share``), never one inside its minimum run time,
  of a higher priority class, or made room for by reclaim/priority;
- a move happens only when it lifts the beneficiary without pushing a donor
  down to where the beneficiary was (every donor ends above the beneficiary's
  old position) and without leaving the beneficiary better placed than the
  donor was (no overshoot): each move raises the lowest position, so moves
  cannot undo each other round after round;
- *speed*: a lift the performance model predicts to run the job slower than
  what the inner policy gave it (fewer GPUs, e.g. on one node instead of two:
  ``slower``) goes after the tenant's other jobs, and is made only if the
  tenant is still below its share then: its GPUs go to work first, and the
  inner policy is not made to pack the job again next round (a restart each way);
- a move never takes a tenant past its quota plus what its cohort lends
  (``QuotaBook.over_limit``), so quota and borrowing rules still hold;
- *reservation*: a waiting job of a tenant below its share that found no room
  keeps it from being handed out: starts and growths this round of tenants above
  their share go back where a move could take them (the donor ends above the
  job's tenant; ``_reserve``), so a
  stream of small jobs of a tenant at its share cannot hold a larger job of a
  tenant below it off for good (kueue#534); the room fills as donors pass their
  minimum run time.

Position = (GPUs held - entitlement) / weight. Pure: no clock, no NATS.
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.policies import typed_place
from gearshift.policies.api import Decision, JobDecision, JobView, NodeState, default_plan
from gearshift.policies.placement import Ledger, describe
from gearshift.policies.queues import QuotaBook, ShareConfig, fair_entitlement

_EPS = 1e-6


@dataclass(slots=True)
class Move:
    """A change to one job's decision: ``new`` None = not running."""

    job: JobView
    old: JobDecision | None
    new: JobDecision | None
    why: str | None = None  # the waiting reason it replaced


def _gpus(d: JobDecision | None) -> int:
    return sum(p.gpus for p in d.placement) if d is not None else 0


def slower(perf, j: JobView, got: JobDecision, have: JobDecision) -> bool:
    """The performance model (None: no opinion) predicts ``j`` slower on ``got`` (a lift to
    more GPUs) than on ``have`` (what the inner policy gave it): more GPUs for less work, as
    a data-parallel job spread over nodes can be, which the inner policy would pack again
    next round (a restart each way)."""
    if perf is None:
        return False
    try:
        return perf.throughput(j, got.plan, got.placement) < perf.throughput(j, have.plan, have.placement) * (1 - 1e-9)
    except Exception:  # an oracle that cannot answer for a shape: no opinion
        return False


def round_entitlement(cfg: ShareConfig, nodes: list[NodeState], jobs: list[JobView]) -> tuple[dict, dict]:
    """Each tenant's GPU demand (its live jobs' requests) and its entitlement this round
    (``queues.fair_entitlement`` over the cluster's GPUs): what ``rebalance`` imposes
    and what ``Shared`` tells a policy that plans within budgets."""
    demand: dict[str, int] = {}
    for j in jobs:
        demand[j.spec.tenant] = demand.get(j.spec.tenant, 0) + j.spec.gpus
    return demand, fair_entitlement(cfg, demand, sum(n.gpus_total for n in nodes))


def could_fit(ledger, by_id: dict, j: JobView, decision: Decision, fixed: set[str], types: set[str], pos) -> bool:
    """Free GPUs plus what other tenants above their share hold (not made room for, of no
    higher class) on one of ``types`` cover ``j``'s request: room it could get once those
    donors' minimum run times pass."""
    need = default_plan(j.spec).gpus
    for ty in types:
        room = sum(ledger.free_g[n.name] for n in ledger.nodes if typed_place.node_type(n) == ty)
        for jid, d in decision.allocations.items():
            v = by_id[jid]
            if v.spec.tenant != j.spec.tenant and jid not in fixed and v.spec.priority <= j.spec.priority \
                    and pos(v.spec.tenant) > _EPS and typed_place.type_of(ledger, d.placement) == ty:
                room += _gpus(d)
        if room >= need:
            return True
    return False


class Rebalancer:
    def __init__(self, cfg: ShareConfig, name: str, protected, standing: dict[str, tuple]):
        self.cfg = cfg
        self.name = name
        self.protected = protected  # (job, now) -> inside its minimum run time
        self.standing = standing
        self.perf = None  # the round's performance oracle (``Shared`` sets it), None: not consulted
        self._was_slower = False
        self._last: set[str] = set()

    def rebalance(self, now: float, nodes: list[NodeState], jobs: list[JobView], decision: Decision,
                  fixed: set[str], claimed: set[str], skip: set[str] = frozenset()) -> tuple[list[JobView], dict[str, float]]:
        """Change ``decision`` in place; returns the running jobs preempted for fair share
        and the entitlements. ``fixed``: jobs whose decision must not be taken away
        (made room for by reclaim/priority); ``claimed``: owners' jobs within their
        quota, whose GPUs are not lendable while they wait; ``skip``: jobs this round
        already preempted (they count in demand, but are not lifted)."""
        by_id = {j.job_id: j for j in jobs}
        demand, ent = round_entitlement(self.cfg, nodes, jobs)
        self.held: dict[str, int] = {t: 0 for t in demand}
        self.ledger = Ledger(nodes)
        for jid, d in decision.allocations.items():
            self.held[by_id[jid].spec.tenant] += _gpus(d)
            self.ledger.take(d.placement)
        self.ent, self.claimed, self.by_id = ent, claimed, by_id
        self._no_room = False
        self.over_before = (set(self._over_limit(decision)), set(self._over_limit(decision, claims=False)))
        weight = {t: self.cfg.queue(t).weight for t in demand}
        pos = lambda t: (self.held[t] - ent[t]) / weight[t]  # noqa: E731
        order = sorted(jobs, key=lambda j: self.standing.get(j.job_id, ()) + (j.submitted_at, j.job_id))
        queue = {t: [j for j in order if j.spec.tenant == t and j.job_id not in skip] for t in demand}
        at = {t: 0 for t in demand}
        # (tenant, class) -> the smallest waiting request that found no room: larger ones need not try
        no_room: dict[tuple[str, int], int] = {}
        preempted: list[JobView] = []
        blocked: list[JobView] = []  # waiting jobs of tenants below their share that found no room
        self._last = set()  # jobs whose lift would slow them: tried again after the tenant's others, then made
        while True:
            short = sorted((t for t in demand if self.held[t] < ent[t] - _EPS), key=pos)
            pick = None
            for t in short:
                q = queue[t]
                while pick is None and at[t] < len(q):
                    j = q[at[t]]
                    at[t] += 1
                    want = self._want(j, decision)
                    big = no_room.get((t, j.spec.priority))
                    if want is not None and (j.running or big is None or want.plan.gpus < big):
                        pick = j
                if pick is not None:
                    break
            if pick is None:
                self._reserve(decision, fixed, blocked, pos)
                return preempted, ent
            moves = self._lift(now, pick, decision, fixed, by_id, pos)
            if self._was_slower:  # a lift that would slow its job goes after the tenant's other jobs
                self._last.add(pick.job_id)
                queue[pick.spec.tenant].append(pick)
            elif moves is None and not pick.running:
                key = (pick.spec.tenant, pick.spec.priority)
                no_room[key] = min(no_room.get(key, 1 << 30), default_plan(pick.spec).gpus)
                if self._no_room:
                    blocked.append(pick)
            for m in moves or ():
                if m.new is None and m.job.running:
                    preempted.append(m.job)

    # ------------------------------------------------------------ one move
    def _want(self, j: JobView, decision: Decision) -> JobDecision | None:
        """What lifting ``j`` means: keep what it holds if the inner policy shrinks it
        below that (up to its request), else its request if it gets less (placement
        filled in by ``_lift``)."""
        have = decision.allocations.get(j.job_id)
        plan = default_plan(j.spec)
        if j.running and plan.gpus >= j.gpus > _gpus(have):
            return JobDecision(j.placement, j.plan or plan, f"{self.name}+fair-share: kept, tenant below its share")
        if plan.gpus > _gpus(have):
            return JobDecision((), plan, "")
        return None

    def _lift(self, now, j: JobView, decision: Decision, fixed: set[str], by_id, pos) -> list[Move] | None:
        t = j.spec.tenant
        want = self._want(j, decision)
        have = decision.allocations.get(j.job_id)
        slow: list[JobDecision] = []  # room found, but predicted slower than ``have``
        gain = want.plan.gpus - _gpus(have)
        before = pos(t)
        w_t = self.cfg.queue(t).weight
        after = before + gain / w_t
        if have is not None:
            self.ledger.give(have.placement)
        done: list[Move] = []

        def try_place() -> JobDecision | None:
            got = _try_place()
            if got is not None and have is not None and _gpus(have) and j.job_id not in self._last \
                    and slower(self.perf, j, got, have):
                slow.append(got)
                return None
            return got

        def _try_place() -> JobDecision | None:
            if want.placement:
                if self.ledger.fits(want.placement):
                    return want
                # the inner policy resized it (a restart either way): its size anywhere on its type
                spot = typed_place.place(self.ledger, j, want.plan, prefer=tuple(p.node for p in j.placement))
                if spot is None or typed_place.type_of(self.ledger, spot) != typed_place.type_of(self.ledger, j.placement):
                    return None
                return JobDecision(spot, want.plan, f"{self.name}+fair-share: kept its size on {describe(spot)}, "
                                                    f"tenant {t} below its share")
            spot = typed_place.place(self.ledger, j, want.plan, prefer=tuple(p.node for p in j.placement))
            return None if spot is None else JobDecision(
                spot, want.plan, f"{self.name}+fair-share: {'resized to' if j.running else 'started on'} "
                                 f"{describe(spot)}, tenant {t} below its share")

        got = try_place()
        borrows = self.held[t] + gain > self.cfg.queue(t).quota
        donors = self._donors(now, j, decision, fixed, by_id, pos, borrows)
        # on a mixed cluster, donors on one GPU type first: room freed on two types
        # does not add up for a job that runs on one
        groups = typed_place.per_type(self.ledger, j, donors,
                                      node_of=lambda vk: decision.allocations[vk[0].job_id].placement)
        for group in groups if got is None else ():
            if done:
                self._undo(decision, done, by_id)
                done = []
            for v, kind in group:
                u = v.spec.tenant
                old = decision.allocations[v.job_id]
                keep = {"undo": 0, "preempt": 0, "revert": v.gpus, "shrink": default_plan(v.spec).gpus}[kind]
                final_u = pos(u) - (_gpus(old) - keep) / self.cfg.queue(u).weight
                if pos(u) <= _EPS or final_u <= before + _EPS or \
                        max(abs(final_u), abs(after)) >= max(pos(u), -before) - _EPS:
                    continue  # a donor stays above the beneficiary's old position; the pair's larger gap shrinks
                self.ledger.give(old.placement)
                new = self._smaller(v, kind, old)
                if keep and new is None:
                    self.ledger.take(old.placement)
                    continue
                if new is not None:
                    self.ledger.take(new.placement)
                self._apply(decision, Move(v, old, new), by_id)
                done.append(Move(v, old, new))
                got = try_place()
                if got is not None:
                    break
            if got is not None:
                break
        self._was_slower = got is None and bool(slow)
        self._no_room = got is None and not slow
        if got is not None:
            self.ledger.take(got.placement)
            self._apply(decision, Move(j, have, got), by_id)
            if not self._quota_ok(decision, by_id):
                self._undo(decision, [Move(j, have, got)], by_id)
                got = None
        if got is None:  # no room, or past what the cohort lends: undo everything
            self._undo(decision, done, by_id)
            if have is not None:
                self.ledger.take(have.placement)
            return None
        decision.waiting.pop(j.job_id, None)
        return done

    def _reserve(self, decision: Decision, fixed: set[str], blocked: list[JobView], pos) -> None:
        """A waiting job of a tenant below its share found no room (whole jobs: what a
        donor could give now was not enough): this round's starts and growths of tenants
        above their share go back where a move could take them (the donor still ends above
        the job's tenant; a start made room for keeps its request), on the GPU types the job
        accepts, so the room it waits for is not handed to a stream of small jobs of a
        tenant already at its share (kueue#534). Only while the
        job could get room once its donors' minimum run times pass: free GPUs plus what
        tenants above their share hold on one accepted type cover its request."""
        for j in sorted(blocked, key=lambda j: pos(j.spec.tenant)):
            t, types = j.spec.tenant, typed_place.accepted_types(self.ledger, j)
            if self.held[t] >= self.ent[t] - _EPS or not could_fit(self.ledger, self.by_id, j, decision, fixed, types, pos):
                continue
            back = []
            for jid, d in decision.allocations.items():
                v = self.by_id[jid]
                u = v.spec.tenant
                if u == t or v.spec.priority > j.spec.priority or \
                        typed_place.type_of(self.ledger, d.placement) not in types:
                    continue
                worst_first = tuple(-x if isinstance(x, (int, float)) else x for x in self.standing.get(jid, ()))
                if jid in fixed:  # made room for: its request, not more
                    if not v.running and _gpus(d) > default_plan(v.spec).gpus:
                        back.append(((False,) + worst_first + (jid,), v))
                elif not v.running or _gpus(d) > v.gpus:
                    back.append(((v.running,) + worst_first + (jid,), v))
            for _, v in sorted(back, key=lambda x: x[0]):
                u, old = v.spec.tenant, decision.allocations[v.job_id]
                shrink = v.job_id in fixed
                gain = _gpus(old) - (default_plan(v.spec).gpus if shrink else v.gpus if v.running else 0)
                if abs(self.held[u] - gain - self.ent[u]) >= abs(self.held[u] - self.ent[u]) - _EPS:
                    continue  # as for a move: the donor is above its share and ends above the job's tenant
                self.ledger.give(old.placement)
                new = self._smaller(v, "shrink", old) if shrink else self._smaller(v, "revert") if v.running else None
                if (v.running or shrink) and new is None:
                    self.ledger.take(old.placement)
                    continue
                if new is not None:
                    self.ledger.take(new.placement)
                self._apply(decision, Move(v, old, new), self.by_id,
                            f"waiting (fair-share): tenant {u} is at or above its share while {j.job_id} of "
                            f"tenant {t}, below its share, waits for room")

    def _donors(self, now, j: JobView, decision: Decision, fixed: set[str], by_id, pos,
                borrows: bool = False) -> list[tuple[JobView, str]]:
        """Jobs to take room from, cheapest first, of the tenants furthest above their
        share: starts this round (undo), growths of running jobs (revert), running jobs
        above their request (shrink to it: the minimum run time protects a job's request,
        not GPUs it grew into), then running jobs (preempt, never inside the job's minimum
        run time). When ``j`` would borrow, an
        owner's start within its quota (claimed) is not undone: its claim comes before
        any borrowing, so its GPUs would not be lent to ``j`` anyway."""
        prio, t = j.spec.priority, j.spec.tenant
        out = []
        for jid, d in decision.allocations.items():
            v = by_id[jid]
            u = v.spec.tenant
            if u == t or v.spec.priority > prio or pos(u) <= _EPS:
                continue
            worst_first = tuple(-x if isinstance(x, (int, float)) else x for x in self.standing.get(jid, ()))
            if jid in fixed:  # made room for (reclaim, priority): it has a right to its request, not more
                if not v.running and _gpus(d) > default_plan(v.spec).gpus:
                    out.append(((2, -pos(u)) + worst_first, v, "shrink"))
                continue
            if not v.running:
                if not (borrows and jid in self.claimed):
                    out.append(((0, -pos(u)) + worst_first, v, "undo"))
            elif _gpus(d) > v.gpus:
                out.append(((1, -pos(u)) + worst_first, v, "revert"))
            elif _gpus(d) > default_plan(v.spec).gpus:
                # the minimum run time protects a job's request, not what it grew into
                out.append(((2, -pos(u)) + worst_first, v, "shrink"))
            elif self.protected(v, now):
                continue
            else:
                out.append(((3, -pos(u), v.spec.priority, -(v.switched_at or 0.0), jid), v, "preempt"))
        out.sort(key=lambda x: x[0])
        return [(v, kind) for _, v, kind in out]

    def _smaller(self, v: JobView, kind: str, old: JobDecision | None = None) -> JobDecision | None:
        """The donor's new decision (its old one given back to the ledger): None to stop it."""
        if kind == "revert":
            if self.ledger.fits(v.placement):
                return JobDecision(v.placement, v.plan or default_plan(v.spec), "kept: growth reverted for fair share")
            # others were moved onto its GPUs: it restarts this round anyway (it was resized),
            # so at the size it holds wherever that fits on its type
            plan = v.plan or default_plan(v.spec)
            spot = typed_place.place(self.ledger, v, plan, prefer=tuple(p.node for p in v.placement))
            if spot is None or typed_place.type_of(self.ledger, spot) != typed_place.type_of(self.ledger, v.placement):
                return None
            return JobDecision(spot, plan, f"{self.name}+fair-share: growth reverted, on {describe(spot)}")
        if kind == "shrink":  # a start too: on the nodes it was given
            plan = default_plan(v.spec)
            spot = typed_place.place(self.ledger, v, plan, prefer=tuple(p.node for p in v.placement or old.placement))
            return None if spot is None else JobDecision(
                spot, plan, f"{self.name}+fair-share: back to its request on {describe(spot)}, tenant above its share")
        return None

    def _apply(self, decision: Decision, m: Move, by_id, why: str | None = None) -> None:
        t = m.job.spec.tenant
        self.held[t] += _gpus(m.new) - _gpus(m.old)
        if m.new is None:
            decision.allocations.pop(m.job.job_id, None)
            decision.waiting[m.job.job_id] = why or (
                f"{'preempted' if m.job.running else 'waiting'} (fair-share): tenant {t} is above its share")
        else:
            m.why = decision.waiting.pop(m.job.job_id, None)
            decision.allocations[m.job.job_id] = m.new

    def _undo(self, decision: Decision, moves: list[Move], by_id) -> None:
        for m in reversed(moves):
            if m.new is not None:
                self.ledger.give(m.new.placement)
            if m.old is not None:
                self.ledger.take(m.old.placement)
            self._apply(decision, Move(m.job, m.new, m.old), by_id, m.why)

    def _over_limit(self, decision: Decision, claims: bool = True) -> list[str]:
        held = dict(self.held)
        for jid in self.claimed if claims else ():
            if jid not in decision.allocations:
                t = self.by_id[jid].spec.tenant
                held[t] = held.get(t, 0) + self.by_id[jid].spec.gpus
        return QuotaBook(self.cfg, held).over_limit()

    def _quota_ok(self, decision: Decision, by_id) -> bool:
        # neither with owners' waiting claims counted nor on what runs (a start within an
        # owner's quota must not leave running borrowers past what the cohort lends)
        return (set(self._over_limit(decision)) <= self.over_before[0]
                and set(self._over_limit(decision, claims=False)) <= self.over_before[1])
