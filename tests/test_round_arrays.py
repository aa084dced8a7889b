"""Per-round shortcuts give what the full computation gives, on random inputs: the
simulator's progress on arrays (``sim.progress.RunningRows.advance``) against
``sim.engine.advance`` on each record, bit for bit; the priority policies' keep pass
from the last round (``policies.priority._keep_as_before``) against the full pass
of a policy with no last round, decision for decision; the rounds a steady policy
vouches for against asking it; a decision split on the changes its policy tells
(``policies.decision.diff`` with ``Decision.changes``) against the whole split."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from policy_helpers import MODEL, job

from gearshift.bus_schema.messages import JobSpec, JobState, Plan
from gearshift.policies import priority
from gearshift.policies.api import AllocationError, Changes, Decision, JobView, NodeState, Placement
from gearshift.policies.decision import NodeCapacity, _diff_changes, diff
from gearshift.policies.views import Carried, RoundJobs
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import InvariantError, SimConfig, SimJob, advance, simulate
from gearshift.sim.progress import RunningRows
from gearshift.sim.trace import Trace, TraceJob, parse_cluster


def _record(rng: random.Random, i: int) -> SimJob:
    spec = JobSpec(name=f"j{i}", model=MODEL, global_batch=8, steps=rng.randint(1, 5000), gpus=1,
                   plan=Plan(dp=1))
    r = SimJob(TraceJob(f"j{i}", 0.0, spec), JobView(f"j{i}", spec, 0.0))
    r.state = JobState.RUNNING
    r.rate = rng.choice([0.0, rng.uniform(0.01, 3.0), 1 / 3])
    r.updated_at = rng.choice([0.0, rng.uniform(0, 500)])
    r.productive_from = r.updated_at + rng.choice([0.0, -10.0, rng.uniform(0, 900)])
    r.steps_done = rng.uniform(0, spec.steps * 0.5)
    r.attained = rng.uniform(0, 1e5)
    r.gpu_seconds = r.attained
    r.run_time = rng.uniform(0, 1e4)
    r.gpus_held = rng.randint(1, 8)
    return r


@pytest.mark.parametrize("seed", range(5))
def test_rows_advance_as_each_record_would(seed):
    rng = random.Random(seed)
    recs = [_record(rng, i) for i in range(40)]
    twins = [_copy(r) for r in recs]  # advanced one at a time
    rows = RunningRows(check=False, size=4)  # grows as jobs attach
    for r in recs:
        rows.attach(r)
    t = 0.0
    for step in range(30):
        t += rng.choice([0.0, 300.0, rng.uniform(0, 700)])
        sd = rows.advance(t).tolist()
        for tw in twins:
            advance(tw, t, check=False)
        by_row = {r.job.job_id: s for r, s in zip(rows.recs, sd)}
        assert [by_row[tw.job.job_id] for tw in twins] == [tw.steps_done for tw in twins]
        if step % 7 == 3:  # one leaves (a release): its record gets everything back, exactly
            gone = recs.pop(rng.randrange(len(recs)))
            rows.detach(gone)
            tw = next(x for x in twins if x.job.job_id == gone.job.job_id)
            twins.remove(tw)
            assert _fields(gone) == _fields(tw)
    rows.detach_all()
    assert [_fields(r) for r in recs] == [_fields(tw) for tw in twins] and rows.n == 0


def test_rows_refuse_steps_beyond_a_jobs_total_as_advance_does():
    rng = random.Random(1)
    r = _record(rng, 0)
    r.rate, r.productive_from, r.updated_at = 10.0, 0.0, 0.0
    rows = RunningRows(check=True, error=InvariantError)
    rows.attach(r)
    with pytest.raises(InvariantError, match="j0: .* steps done of"):
        rows.advance(1e6)


def _copy(r: SimJob) -> SimJob:
    c = SimJob(r.job, r.view)
    for f in SimJob.__slots__:
        setattr(c, f, getattr(r, f))
    return c


def _fields(r: SimJob) -> tuple:
    return (r.steps_done, r.attained, r.gpu_seconds, r.run_time, r.updated_at)


# ---------------------------------------------------------------- the priority policies' keep shortcut
def _queue(seed: int, n: int = 70) -> Trace:
    """Random jobs of 1-8 GPUs, some spread over nodes, arriving faster than they finish."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        gpus = rng.choice([1, 1, 2, 3, 4, 6, 8])
        spec = JobSpec(name=f"j{i}", model=MODEL, global_batch=8, steps=rng.randint(50, 3000), gpus=gpus,
                       plan=Plan(dp=gpus), step_time=rng.choice([0.5, 1.0, 2.0]), priority=rng.choice([0, 0, 0, 1]))
        jobs.append(TraceJob(f"j{i}", rng.uniform(0, 4000), spec))
    jobs.sort(key=lambda j: j.submit)
    return Trace("random", jobs, parse_cluster(rng.choice(["2x4", "3x4", "4x2"])))


class _AgainstFresh:
    """Every round: the policy (its keep pass shortcut on, from the last round) and a
    new one (no last round: the full keep pass) decide the same, in the same order."""

    def __init__(self, name: str):
        self.name = name
        self.policy = make_policy(name, min_run_time=60.0)
        self.rounds = 0

    def schedule(self, now, nodes, jobs, perf):
        d = self.policy.schedule(now, nodes, jobs, perf)
        want = make_policy(self.name, min_run_time=60.0).schedule(now, nodes, jobs, perf)
        assert _words(d) == _words(want)
        self.rounds += 1
        return d


def _words(d) -> tuple:
    return ([(k, v.placement, v.plan, v.reason) for k, v in d.allocations.items()], list(d.waiting.items()))


@pytest.mark.parametrize("name", ["srtf", "tiresias", "las", "antman"])
@pytest.mark.parametrize("seed", range(3))
def test_keep_shortcut_decides_as_the_full_keep_pass(name, seed, monkeypatch):
    """The shortcut against the full keep pass, and, where the simulator's list says how
    it follows the last (``_keep_told``), that against the shortcut on the whole list."""
    told = []
    real, real_told = priority._keep_as_before, priority._keep_told

    def keep_told(jobs, at, fresh, carried, last, changed):
        got = real_told(jobs, at, fresh, carried, last, changed)
        want = real([jobs[i] for i in at], last)
        assert (got is None) == (want is None)
        if got is not None:
            assert list(got[0].items()) == list(want[0].items()) and got[1:3] == want[1:3]
            if got[3] is not None:  # the jobs that stopped, known
                assert sorted(got[3]) == sorted(last.keys() - got[0].keys())
            told.append(got)
        return got

    monkeypatch.setattr(priority, "_keep_told", keep_told)
    pol = _AgainstFresh(name)
    res = simulate(_queue(seed), pol, config=SimConfig(interval=60, restart_cost=20, noise=0))
    assert all(r.finish is not None for r in res.records)
    assert pol.rounds > 30 and len(told) > pol.rounds // 2  # the shortcut on what changed ran, mostly
    if name in ("srtf", "las"):
        assert sum(r.preemptions for r in res.records) > 0  # victims walked after a shortcut, too


def test_keep_shortcut_declines_a_job_not_holding_the_last_decision():
    rng = random.Random(3)
    pol = make_policy("srtf", min_run_time=0.0)
    inner = pol.inner("")
    took = []
    real = priority._keep_as_before
    priority._keep_as_before = lambda *a: took.append(r := real(*a)) or r
    try:
        def run(now, nodes, jobs):
            d = pol.schedule(now, nodes, jobs, None)
            assert _words(d) == _words(make_policy("srtf", min_run_time=0.0).schedule(now, nodes, jobs, None))
            return d
        nodes = [NodeState(f"n{i}", 4, 4, 8, 8) for i in range(2)]
        jobs = [job(f"a{i}", rng.choice([1, 2]), t=float(i), steps=100 + i, cpg=1) for i in range(6)]
        d = run(0.0, nodes, jobs)
        for j in jobs:  # they run what was decided ...
            if j.job_id in d.allocations:
                j.placement, j.plan = d.allocations[j.job_id].placement, d.allocations[j.job_id].plan
                j.last_switch_at = j.started_at = 0.0
        run(10.0, nodes, jobs)
        assert took[-1] is not None
        moved = next(j for j in jobs if j.placement)  # ... but one holds something else (its own copy)
        moved.placement = tuple(Placement(p.node, p.gpus, p.cpus) for p in moved.placement)
        run(20.0, nodes, jobs)
        assert took[-1] is None and inner._after is not None
    finally:
        priority._keep_as_before = real


@pytest.mark.parametrize("seed", range(3))
def test_rows_kernel_is_the_numpy_expressions_bit_for_bit(seed):
    """``RunningRows.advance`` and ``service`` (numba kernels) against ``advance_numpy``
    and ``service_numpy`` (the numpy expressions they replaced): every field of every row equal, round after round,
    with rows that do not move, do not grow, and hit their steps."""
    import numpy as np

    from gearshift.sim.progress import _FIELDS

    rng = random.Random(seed)
    a, b = RunningRows(check=False, size=4), RunningRows(check=False, size=4)
    for i in range(50):
        r = _record(rng, i)
        a.attach(r)
        b.attach(r)
    t = 0.0
    for _ in range(25):
        t += rng.choice([0.0, 300.0, rng.uniform(0, 2000)])
        assert np.array_equal(a.advance(t), b.advance_numpy(t))
        for i in range(a.n):
            if rng.random() < 0.3:  # views kept since some time, some in the future
                args = (i, None, rng.uniform(0, 1e4), rng.randint(1, 8), t + rng.uniform(-900, 300))
                a.set_view(*args)
                b.set_view(*args)
        assert a.service(t).tobytes() == b.service_numpy(t).tobytes()
        for f in _FIELDS:
            assert getattr(a, f)[:a.n].tobytes() == getattr(b, f)[:b.n].tobytes(), f


_FIELDS = ("state", "first_start", "finish", "starts", "reconfigs", "preemptions", "steps_done", "attained",
           "gpu_seconds", "run_time", "restart_lost", "placement", "plan", "attained_before")


def _outcome(res) -> list:
    return [(r.job.job_id,) + tuple(repr(getattr(r, f)) for f in _FIELDS) for r in res.records] + \
        [res.timeline, res.rounds, res.events, res.end_time]


@pytest.mark.parametrize("name", ["srtf", "fifo", "tiresias"])
@pytest.mark.parametrize("seed", range(4))
def test_steady_rounds_skipped_change_nothing(name, seed):
    """``SimConfig.skip_steady``: the rounds not asked of a steady policy
    (``protocols.SteadyPolicy``) leave every job's record, the timeline and the round
    count as asking it would; SRTF says it is steady, so some rounds are skipped there
    (its minimum run time protects victims: the skip ends when one may be taken)."""
    trace = _queue(seed)
    base = SimConfig(interval=60, restart_cost=20, noise=0, round_on_arrival=False, round_on_completion=False,
                     skip_steady=False)
    asked = simulate(trace, make_policy(name, min_run_time=150.0), config=base)
    skipped = simulate(trace, make_policy(name, min_run_time=150.0), config=replace(base, skip_steady=True))
    assert asked.rounds_skipped == 0
    assert _outcome(skipped) == _outcome(asked)
    assert all(r.finish is not None for r in skipped.records)
    if name == "srtf":
        assert skipped.rounds_skipped > 0 and sum(r.preemptions for r in skipped.records) > 0
    else:  # FIFO's and Tiresias's keys are not declared steady: every round is asked
        assert skipped.rounds_skipped == 0


def _apply(jobs: list[JobView], d, now: float) -> None:
    """The jobs hold what decision ``d`` gives them, as a caller applies it."""
    for j in jobs:
        a = d.allocations.get(j.job_id)
        if a is None:
            j.placement, j.plan = (), None
        elif a.placement != j.placement or a.plan != j.plan:
            j.placement, j.plan, j.last_switch_at = a.placement, a.plan, now
            if j.started_at is None:
                j.started_at = now


@pytest.mark.parametrize("checkpoints", [False, True])
@pytest.mark.parametrize("head_of_line", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_srtf_vouches_only_for_rounds_that_change_nothing(seed, head_of_line, checkpoints):
    """``PriorityPolicy.steady_until`` after rounds that placed and preempted jobs, too:
    once the decision is applied, every round before it (running jobs a little further
    on, nothing else moved) keeps every running job as it holds and starts none, and a
    policy with no last round decides the same. Random queues of 1-4 GPU jobs in two
    classes on 2-3 nodes, jobs arriving and finishing between rounds, with and without
    head-of-line blocking (without it, it vouches only after rounds that changed nothing),
    with and without checkpoints (victims then go by the work they lose, not from the
    bottom of the order)."""
    rng = random.Random(seed)
    min_run = rng.choice([0.0, 100.0, 250.0])
    nodes = [NodeState(f"n{i}", 4, 4, 8, 8) for i in range(rng.choice([2, 3]))]
    pol = make_policy("srtf", min_run_time=min_run, head_of_line=head_of_line)
    jobs: list[JobView] = []
    now, vouched, after_change = 0.0, 0, 0
    for step in range(80):
        for _ in range(rng.choice([0, 0, 1, 2, 3])):
            i = len(jobs) + step * 100
            gpus = rng.choice([1, 1, 2, 3, 4])
            spec = JobSpec(name=f"j{i}", model=MODEL, global_batch=8, steps=rng.randint(50, 3000), gpus=gpus,
                           plan=Plan(dp=gpus), priority=rng.choice([0, 0, 0, 1]))
            jobs.append(JobView(f"j{i}", spec, submitted_at=now))
        if jobs and rng.random() < 0.3:  # one ends
            jobs.remove(rng.choice(jobs))
        d = pol.schedule(now, nodes, jobs, None)
        held_before = {j.job_id: j.placement for j in jobs if j.placement}
        changed = {k: a.placement for k, a in d.allocations.items()} != held_before
        _apply(jobs, d, now)
        if checkpoints:  # what running jobs' agents report
            for j in jobs:
                j.checkpoint_at = rng.uniform(j.last_switch_at, now) if j.placement and rng.random() < 0.7 else None
        until = pol.steady_until()
        if until > now:
            vouched += 1
            after_change += changed
            later = rng.uniform(now, min(until, now + 600.0))
            for j in jobs:  # the running ones got on (their seconds left fall); the waiting ones did not
                if j.placement:
                    j.steps_done = min(float(j.spec.steps), j.steps_done + rng.uniform(0, 200))
            again = pol.schedule(later, nodes, jobs, None)
            held = {j.job_id: (j.placement, j.plan) for j in jobs if j.placement}
            assert {k: (a.placement, a.plan) for k, a in again.allocations.items()} == held
            fresh = make_policy("srtf", min_run_time=min_run, head_of_line=head_of_line)
            assert _words(fresh.schedule(later, nodes, jobs, None))[0] == _words(again)[0]
            now = later
        now += rng.choice([60.0, 300.0])
        for j in jobs:
            if j.placement:
                j.steps_done = min(float(j.spec.steps), j.steps_done + rng.uniform(0, 400))
    assert vouched > 5 and (after_change > 0 or not head_of_line)  # after rounds that changed something, too


# ---------------------------------------------------------------- decisions told as changes
class _ChangesAgainstFull:
    """Every round: the decision split on its changes (``diff(..., handed=jobs)``) is the
    split of the whole decision, and the capacity check on either refuses or passes alike."""

    def __init__(self, name: str):
        self.policy = make_policy(name, min_run_time=60.0)
        self.name = self.policy.name
        self.told = self.rounds = 0

    def schedule(self, now, nodes, jobs, perf):
        d = self.policy.schedule(now, nodes, jobs, perf)
        holding = {j.job_id: j for j in jobs if j.placement}
        full = diff(holding, replace_changes(d, None))
        assert diff(holding, d, jobs) == full
        lean = diff(holding, d, jobs, keep=False)  # the kept jobs not named: all else the same
        assert lean.keep is None and lean == replace(full, keep=None)
        if d.changes is not None and d.changes.jobs is jobs:
            assert _diff_changes(holding, d.allocations, d.changes) == full
            self.told += 1
        cap = NodeCapacity.of(nodes)
        live = {j.job_id: j for j in jobs}
        free_g = [n.gpus_free for n in nodes]
        free_c = [n.cpus_free for n in nodes]
        cap.check(d, live, free_g, free_c, holding, change=diff(holding, d, jobs))
        cap.check(d, live, free_g, free_c, holding, change=lean, held_live=True)
        cap.check(d, live, free_g, free_c, holding, change=lean)
        cap.check(d, live, free_g, free_c, holding, change=full)
        self.rounds += 1
        return d


def replace_changes(d, changes):
    """``d`` with other changes (the same allocations and words)."""
    return Decision(d.allocations, d.waiting, changes)


@pytest.mark.parametrize("name", ["srtf", "tiresias", "las", "antman"])
@pytest.mark.parametrize("seed", range(3))
def test_a_decision_split_on_its_changes_is_the_whole_split(name, seed):
    pol = _ChangesAgainstFull(name)
    res = simulate(_queue(seed), pol, config=SimConfig(interval=60, restart_cost=20, noise=0))
    assert all(r.finish is not None for r in res.records)
    assert pol.rounds > 30 and pol.told == pol.rounds  # every round told its changes
    if name in ("srtf", "las"):
        assert sum(r.preemptions for r in res.records) > 0


def test_changes_that_do_not_add_up_are_not_trusted():
    """A decision edited after its policy told its changes (an allocation added, one
    taken out) or a holding the policy was not handed: the whole decision is split."""
    rng = random.Random(5)
    nodes = [NodeState(f"n{i}", 4, 4, 8, 8) for i in range(2)]
    jobs = [job(f"a{i}", rng.choice([1, 2]), t=float(i), steps=100 + i, cpg=1) for i in range(6)]
    pol = make_policy("srtf", min_run_time=0.0)
    _apply(jobs, pol.schedule(0.0, nodes, jobs, None), 0.0)
    d = pol.schedule(10.0, nodes, jobs, None)
    holding = {j.job_id: j for j in jobs if j.placement}
    assert d.changes is not None and _diff_changes(holding, d.allocations, d.changes) is not None
    kept = next(iter(holding))
    edited = replace_changes(d, d.changes)
    edited.allocations = dict(d.allocations)
    del edited.allocations[kept]  # a kept job taken out, the changes not told
    assert _diff_changes(holding, edited.allocations, edited.changes) is None
    assert diff(holding, edited, jobs).preempt == (kept,)
    stranger = job("x", 1, running_on=(Placement("n0", 1, 1),))
    more = {**holding, "x": stranger}  # held, never handed to the policy
    assert _diff_changes(more, d.allocations, d.changes) is None
    assert diff(more, d, jobs).preempt == ("x",)
    assert diff(holding, d, list(jobs)) == diff(holding, d)  # another list than the one handed: the whole split
    # a start of a job not known: the same refusal with the kept jobs vouched for as live
    cap = NodeCapacity.of(nodes)
    ghost = replace_changes(d, Changes(jobs, (*d.changes.placed, "ghost"), d.changes.left))
    ghost.allocations = {"ghost": next(iter(d.allocations.values())), **d.allocations}
    free = [n.gpus_free for n in nodes], [n.cpus_free for n in nodes]
    for live in (False, True):
        for keep in (False, True):  # (the full walk then reads the kept jobs off the diff, named or not)
            with pytest.raises(AllocationError, match="unknown or finished job 'ghost'"):
                cap.check(ghost, {j.job_id: j for j in jobs}, *free, holding, change=diff(holding, ghost, jobs, keep=keep),
                          held_live=live)


@pytest.mark.parametrize("name", ["srtf", "las", "antman"])
@pytest.mark.parametrize("seed", range(6))
def test_changes_of_jobs_that_hold_what_does_not_fit_or_no_plan(name, seed):
    """Views no round decided: running jobs on more GPUs than a node has (some must
    move or stop), some holding no plan (given their request's): the changes told are
    still the whole split, on the first round and the next."""
    rng = random.Random(seed)
    nodes = [NodeState(f"n{i}", 4, 4, 8, 8) for i in range(3)]
    jobs = []
    for i in range(rng.randint(4, 12)):
        g = rng.choice([1, 2, 3])
        on = (Placement(rng.choice(nodes).name, g, g),) if rng.random() < 0.6 else ()
        jobs.append(job(f"j{i}", g, t=float(i), steps=rng.randint(50, 500), cpg=1, running_on=on,
                        since=-1000.0 if on else None))
        if on and rng.random() < 0.3:
            jobs[-1].plan = None
    pol = make_policy(name, min_run_time=0.0)
    for now in (0.0, 10.0):
        d = pol.schedule(now, nodes, jobs, None)
        holding = {j.job_id: j for j in jobs if j.placement}
        assert d.changes is not None and _diff_changes(holding, d.allocations, d.changes) is not None
        assert diff(holding, d, jobs) == diff(holding, replace_changes(d, None))


# ---------------------------------------------------------------- lists that say how they follow the last
class _Told:
    """Checks what the simulator's lists say (``RoundJobs``) against the list it handed
    before: the jobs that stay, in order, then those that joined; every view not named
    fresh is the very object, holding the very placement and plan; the columns carried
    (``Carried``) are those read from every view. Then asks ``name``."""

    def __init__(self, name: str):
        self.policy = make_policy(name, min_run_time=60.0)
        self.name = self.policy.name
        self.last = None  # (list, [(view, placement, plan)])
        self.carried = Carried()
        self.told = self.rounds = 0

    def schedule(self, now, nodes, jobs, perf):
        assert type(jobs) is RoundJobs
        self.carried.follow(jobs)
        if jobs.base is not None:
            base, seen = self.last
            assert jobs.base is base and base.base is None  # (no chain of rounds held)
            gone = set(jobs.gone)
            stay = [s for i, s in enumerate(seen) if i not in gone]
            assert [j.job_id for j in jobs[:len(stay)]] == [s[0].job_id for s in stay]
            assert set(range(len(stay), len(jobs))) <= set(jobs.fresh)
            for p, (v, placement, plan) in enumerate(stay):
                if p not in jobs.fresh:
                    assert jobs[p] is v and v.placement is placement and v.plan is plan
                elif jobs[p] is v:  # named fresh while the same: allowed, but not what it does
                    raise AssertionError(f"{v.job_id} named fresh, its view kept")
            self.told += 1
        want = Carried()
        want.follow(list(jobs))
        assert self.carried.ids == want.ids and self.carried.running == want.running
        self.last = (jobs, [(j, j.placement, j.plan) for j in jobs])
        self.rounds += 1
        return self.policy.schedule(now, nodes, jobs, perf)


@pytest.mark.parametrize("name", ["srtf", "tiresias"])
@pytest.mark.parametrize("seed", range(3))
def test_the_simulators_lists_say_truly_how_they_follow(name, seed):
    pol = _Told(name)
    res = simulate(_queue(seed), pol, config=SimConfig(interval=60, restart_cost=20, noise=0))
    assert all(r.finish is not None for r in res.records)
    assert pol.rounds > 30 and pol.told == pol.rounds - 1  # all but the first follow the one before (skipped rounds too)


def test_nodes_that_name_their_shape_give_the_ledger_of_their_states():
    """``api.NodeStates``: a ledger for nodes naming the shape of the last ones is the
    ledger of their states (free GPUs as they are now), and a new shape is read afresh."""
    from gearshift.policies.api import NodeStates
    from gearshift.policies.placement import Ledger, Ledgers

    rng = random.Random(2)
    shape = object()
    ledgers = Ledgers()
    names = [f"n{i}" for i in range(5)]
    for step in range(6):
        if step == 3:  # the cluster changed: a new shape, named anew
            names, shape = names + ["n9"], object()
        nodes = NodeStates([NodeState(n, 4, rng.randint(0, 4), 8, rng.randint(0, 8)) for n in names], shape)
        got, want = ledgers.fresh(nodes), Ledger(nodes)
        assert (got.free_g, got.free_c, got.order, got.types) == (want.free_g, want.free_c, want.order, want.types)
        assert ledgers.same == (step not in (0, 3))
