"""The simulator's job views, kept across rounds (``policies.views.KeptViews``, as the
optimizer keeps its own) with work per round proportional to what changed.

A record's view is built from it (``fresh_view``, the one view builder
``make_job_view``) when the record's ``version`` moved (every grant and release
bumps it), and otherwise only refreshed: a running job's steps and attained service.
Which records to look at each round, without a pass over the queue: the running
ones (their time-dependent fields move anyway), those that stopped running since the
last round (preempted, failed, finished), and those that arrived. A job that waits
keeps its version, so its view is handed over as kept.

The same pass over the running jobs accounts their progress up to the round
(``progress``, ``sim.engine.advance``'s body, which then need not walk them again):
every running job's steps and service move every round, and one pass that both
accounts and refreshes them costs less than two.

The list handed over says how it follows the one handed the round before
(``policies.views.RoundJobs``): the positions of the jobs gone, and of the views
built anew (the jobs that stopped, started or arrived); a policy's per-job columns
follow it in work proportional to those.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from gearshift.policies.api import JobView, NodeState, NodeStates, make_job_view
from gearshift.policies.views import KeptViews, RoundJobs
from gearshift.sim.progress import RunningRows


def fresh_view(r: Any, t: float) -> JobView:
    """The policy's copy of simulator record ``r`` at ``t``, made by the function the
    optimizer uses too."""
    v = r.view
    return make_job_view(v.job_id, v.spec, v.submitted_at, t, steps_done=r.steps_done, placement=r.placement,
                         plan=r.plan, attained_before=r.attained_before, restarts=v.restarts,
                         last_switch_at=v.last_switch_at, started_at=v.started_at,
                         target_throughput=v.target_throughput)


class SimViews:
    """The views of the simulator's live jobs (``live``: pending + running in arrival
    order; ``running``), handed to the policy in that order, as a ``RoundJobs`` that
    says how it follows the list handed the round before."""

    def __init__(self, live: dict, running: dict, check: bool = True, error: type[Exception] = AssertionError):
        self.live = live
        self.running = running
        self.check = check  # refuse steps done past a job's steps (beyond rounding), raising ``error``
        self.error = error
        self.kept = KeptViews()
        self.rows = RunningRows(check, error)  # the running jobs' progress (sim.progress)
        self._order: dict[str, JobView] = {}  # live job -> its view, in live's order
        self._last: RoundJobs | None = None  # the list handed last
        # each job's number in live's order (given as it joins), and the numbers along the last list
        self._number: dict[str, int] = {}
        self._numbers: list[int] = []
        self._next = 0

    def views(self, t: float) -> RoundJobs:
        """The views at ``t``, every running job's progress accounted up to ``t`` first."""
        live, running, kept, order = self.live, self.running, self.kept, self._order
        built: list[str] = []  # jobs whose view was built anew in its place
        gone: list[str] = []  # jobs no longer live
        left = self.rows.left  # stopped since the last round: preempted, failed or finished
        if left:
            stopped, self.rows.left = left - running.keys(), set()
        else:
            stopped = left
        for jid in stopped:  # (also those granted after the last views and stopped since: a failed launch)
            r = live.get(jid)
            if r is None:  # finished: left live (only a running job leaves it)
                if order.pop(jid, None) is not None:
                    gone.append(jid)
                kept.drop((jid,))
            else:
                order[jid] = self._build(r, t)
                built.append(jid)
        joined: list[str] | None = []
        if len(order) != len(live) or next(reversed(order), None) != next(reversed(live), None):
            joined = self._follow_live(t)  # arrivals (appended to live: its last job is new)
            order = self._order
        rows = self.rows
        sd = rows.advance(t)  # every running job's progress up to t, on arrays (sim.progress)
        if rows.unviewed:  # granted since the last round: the kept view if it stands, else one built
            get, slot, recs = kept.get, rows.slot, rows.recs
            for jid in list(rows.unviewed):
                i = slot[jid]
                r = recs[i]
                r.steps_done = float(sd[i])
                hit = get(jid)
                if hit is None or hit[0] != r.version or hit[5] is None:
                    order[jid] = self._build(r, t)
                    built.append(jid)
                    hit = get(jid)
                if hit[5] is not None:  # else (no start time) built afresh every round, as before
                    rows.set_view(i, hit[3], hit[2], hit[4], hit[5])
        service = rows.service(t).tolist()
        if rows.unviewed:
            for v, s, a in zip(rows.views, sd.tolist(), service):
                if v is not None:
                    v.steps_done = s
                    v.attained_service = a
            for jid in rows.unviewed:
                i = rows.slot[jid]
                rows.recs[i].steps_done = float(sd[i])
                order[jid] = self._build(rows.recs[i], t)
                built.append(jid)
        else:
            for v, s, a in zip(rows.views, sd.tolist(), service):  # each kept view refreshed (KeptViews.refresh)
                v.steps_done = s
                v.attained_service = a
        return self._tell(gone, built, joined)

    def _tell(self, gone: list[str], built: list[str], joined: list[str] | None) -> RoundJobs:
        """The list of this round's views, saying how it follows the last one (``RoundJobs``):
        ``gone`` left it, ``built`` were built anew in their places, ``joined`` were appended
        (None: the order was taken afresh, and it does not say). Positions come from each
        job's number, given in live's order as it joins (``_number``: ascending along the
        list, so a job's position is where its number falls among them)."""
        out = RoundJobs(self._order.values())
        number, numbers, last = self._number, self._numbers, self._last
        if joined is None or last is None:
            self._number = dict(zip(self._order, range(len(out))))
            self._numbers, self._next = list(range(len(out))), len(out)
        else:
            cut = sorted([bisect_left(numbers, number.pop(jid)) for jid in gone]) if gone else gone
            for p in reversed(cut):
                del numbers[p]
            stay = len(numbers)
            for jid in joined:
                number[jid] = self._next
                numbers.append(self._next)
                self._next += 1
            fresh = sorted({bisect_left(numbers, number[jid]) for jid in built}) if built else []
            if joined:  # (after every place built anew: those stayed)
                fresh.extend(range(stay, len(numbers)))
            if len(numbers) == len(out):
                last.base = None  # (no chain of rounds)
                out.base, out.gone, out.fresh = last, cut, fresh
            else:  # (not what live did: taken afresh)
                self._last = None
                return self._tell([], [], None)
        self._last = out
        return out

    def _build(self, r: Any, t: float) -> JobView:
        return self.kept.put(r.job.job_id, r.version, bool(r.placement), r.attained_before, fresh_view(r, t))

    def _follow_live(self, t: float) -> list[str] | None:
        """Jobs that arrived join at the end, as live appends them; anything else
        (a job left live without having run) and live's order is taken afresh. The
        jobs that joined (None: taken afresh)."""
        live, order = self.live, self._order
        joined = []
        for jid, r in reversed(live.items()):
            if jid in order:
                break
            joined.append(r)
        if len(order) + len(joined) != len(live):
            self.kept.drop(order.keys() - live.keys())
            self._order = {jid: self._kept_or_built(r, t) for jid, r in live.items()}
            return None
        joined.reverse()
        for r in joined:
            order[r.job.job_id] = self._build(r, t)
        return [r.job.job_id for r in joined]

    def _kept_or_built(self, r: Any, t: float) -> JobView:
        hit = self.kept.get(r.job.job_id)
        if hit is None or hit[0] != r.version:
            if r.job.job_id in self.rows.slot:  # running: its steps are on its row
                r.steps_done = float(self.rows.sd[self.rows.slot[r.job.job_id]])
            return self._build(r, t)
        return hit[3]


class NodeViews:
    """The nodes as the policy sees them (``NodeState``): a new list each round, of
    states made anew only for nodes whose free GPUs or CPUs changed since the last
    round (policies do not change what they are handed), naming the cluster's shape
    (``NodeStates``: it never changes in a run)."""

    def __init__(self, names: list[str], cap_g: list[int], cap_c: list[int], types: list[str]):
        self._states = [NodeState(n, g, g, c, c, "", ty) for n, g, c, ty in zip(names, cap_g, cap_c, types)]
        self._g = list(cap_g)
        self._c = list(cap_c)
        self._shape = object()  # the cluster's shape, named to the policy (api.NodeStates): it never changes

    def states(self, free_g: list[int], free_c: list[int]) -> list[NodeState]:
        states = self._states
        if free_g != self._g or free_c != self._c:
            for i, (st, g, c) in enumerate(zip(states, free_g, free_c)):
                if st.gpus_free != g or st.cpus_free != c:
                    states[i] = NodeState(st.name, st.gpus_total, g, st.cpus_total, c, "", st.gpu_type)
            self._g, self._c = free_g.copy(), free_c.copy()
        return NodeStates(states, self._shape)
