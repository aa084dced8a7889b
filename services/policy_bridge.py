"""What the optimizer hands its policy: job views built from records, and a
performance oracle fed with the fitted models in KV ``gs_models``.

Kept apart from ``optimizer.py`` so the service stays a thin shell: the
policy sees the same ``JobView``/``PerfOracle`` shapes the simulator gives it.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.views import KvView
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import ACTIVE_STATES as ACTIVE
from gearshift.bus_schema.messages import JobRecord, JobState
from gearshift.bus_schema.plan_support import with_refused
from gearshift.bus_schema.topology import LinkFactors
from gearshift.policies import Decision, JobView, Placement, check_decision
from gearshift.policies.api import ShapeMemo, make_job_view
from gearshift.policies.decision import refuse_unsupported
from gearshift.policies.learning import CHANGE_TOL
from gearshift.policies.topology import arrange
from gearshift.policies.topology_price import TopologyPricedOracle
from gearshift.policies.views import KeptViews
from gearshift.services import capacity


def job_view(rec: JobRecord, now: float, progress: float | None = None) -> JobView:
    """The policy's view of one job, built as the simulator builds it
    (``policies.api.make_job_view``): attained service = GPU-seconds of ended
    allocations (``attained_gpu_s``) + the current one since ``last_switch_at``."""
    running = rec.state in ACTIVE
    placement = tuple(Placement(p.node, len(p.gpus), p.cpus) for p in rec.placement) if running else ()
    # records written before last_switch_at existed: the first scheduling time
    switch = rec.last_switch_at if rec.last_switch_at is not None else rec.scheduled_at
    steps = max(rec.steps_done, progress) if running and progress is not None else rec.steps_done
    # the plans its script refused leave the plan space the policy searches
    return make_job_view(rec.job_id, with_refused(rec.spec, rec.refused_plans), rec.submitted_at, now, steps_done=steps,
                         placement=placement, plan=rec.plan if running else None,
                         attained_before=rec.attained_gpu_s, restarts=rec.restarts,
                         last_switch_at=switch, started_at=rec.started_at)


class JobViews:
    """The policy's views of the live records, kept across rounds as the simulator
    keeps its own (``policies.views.KeptViews``): a job's view is built again
    (``job_view``) only when its record changed (the jobs view decodes a new record
    per KV revision); otherwise only what moves with time is set in place, a running
    job's steps (its agents' progress) and attained service. The same views, so the
    policy's caches keyed by their parts (``policies.rubick_problem``) hold while
    nothing changed."""

    def __init__(self) -> None:
        self._kept = KeptViews()

    def view(self, rec: JobRecord, now: float, progress: float | None = None) -> JobView:
        running = rec.state in ACTIVE
        steps = max(rec.steps_done, progress) if running and progress is not None else rec.steps_done
        return self._kept.view(rec.job_id, rec, now, steps, rec.attained_gpu_s, running,
                               lambda: job_view(rec, now, progress))

    def keep(self, job_ids: set[str]) -> None:
        """Forget the views of jobs that left the round (ended, archived)."""
        self._kept.keep(job_ids)

    def drop(self, job_ids: Any) -> None:
        """Forget the views of these jobs."""
        self._kept.drop(job_ids)


ROUND_STATES = frozenset((JobState.PENDING, *ACTIVE))  # the jobs a round hands its policy


class ViewOrder:
    """The live jobs in the records' order (the jobs view's: first seen first), each
    with its view (None: not a job a round hands its policy), kept across rounds as
    the simulator keeps its own (``sim.views.SimViews``): jobs seen for the first time
    join at the end, jobs gone leave, and only what changed is looked at."""

    def __init__(self) -> None:
        self._order: dict[str, JobView | None] = {}
        self.gone: list[str] = []  # jobs that left at the last ``follow``

    def forget(self) -> None:
        self._order = {}

    def follow(self, records: dict[str, JobRecord], changed: set[str]) -> list[str]:
        """Take ``records``' changes: drop the jobs gone, append those new; returns the
        jobs whose view is to be made again (``changed`` and the new ones)."""
        order = self._order
        self.gone = [j for j in changed if j in order and j not in records]
        for job_id in self.gone:
            del order[job_id]
        new = []
        for job_id in reversed(records):  # new jobs come last, in the order they came
            if job_id in order:
                break
            new.append(job_id)
        if len(order) + len(new) != len(records):  # not only appended: take the order afresh
            self.gone += [j for j in order if j not in records]
            self._order = order = dict.fromkeys(records)
            return list(records)
        for job_id in reversed(new):
            order[job_id] = None
        fresh = set(new)  # (a set: ``changed`` holds thousands of jobs in a busy round)
        return [j for j in changed if j in order and j not in fresh] + new[::-1]

    def put(self, job_id: str, view: JobView | None) -> None:
        self._order[job_id] = view

    def views(self, excluded: set[str]) -> list[JobView]:
        if excluded:
            return [v for j, v in self._order.items() if v is not None and j not in excluded]
        return [v for v in self._order.values() if v is not None]


class PolicyStep:
    """A round's call of its policy: the views it hands it (``JobViews``, with the
    steps agents publish between exits, ``gs.job.<id>.progress``: in memory, newest
    generation only, as the simulator knows them; the record learns them at exits and
    checkpoints), the oracle (``LiveModels``), tenant queues' settings for a sharing
    policy, and its decision, with operators' pins, checked."""

    def __init__(self, policy: Any, models: "LiveModels", *, wait_for_models: bool = False, clock: Clock = SYSTEM):
        self.policy = policy
        self.clock = clock  # the round's ``now``, the time the policy plans at
        self.models = models
        self.wait_for_models = wait_for_models
        self.queues: Any = None  # services.queues.QueueStore for a sharing policy
        self.share_base: Any = None
        self.progress: dict[str, tuple[int, int]] = {}  # job -> (generation, steps) from JobProgress
        self.checkpoints: dict[str, float] = {}  # job -> wall time of its latest checkpoint (JobProgress)
        self.cache = JobViews()
        self.order = ViewOrder()
        self._nodes_set = ShapeMemo()  # the nodes' shape the oracle's paths and free GPUs were last set for
        self.policy_cpu = 0.0  # the last call's own CPU seconds in its thread (``_schedule``)
        self.learned = 0  # configurations the oracle was taught as the last round began (``LiveModels.learn``)

    def on_progress(self, p: Any) -> None:
        got = self.progress.get(p.job_id)
        if got is None or (p.generation, p.steps_done) > got:
            self.progress[p.job_id] = (p.generation, p.steps_done)
            self.models.observe_progress(p.job_id, p.generation, p.ts, p.steps_done)  # speed, once it trains
        ck = getattr(p, "checkpoint_at", None)
        if ck is not None and ck > self.checkpoints.get(p.job_id, float("-inf")):
            self.checkpoints[p.job_id] = ck

    def view(self, rec: JobRecord, now: float) -> JobView:
        got = self.progress.get(rec.job_id)
        v = self.cache.view(rec, now, got[1] if got is not None and got[0] == rec.generation else None)
        v.checkpoint_at = self.checkpoints.get(rec.job_id)  # moves with progress, as steps do: set in place
        return v

    def views(self, records: dict[str, JobRecord], alive: set[str], now: float, skip: Any = ()) -> list[JobView]:
        """The views of pending and active jobs but those in ``skip`` and those on nodes not alive:
        a pass over every record (``kept_views`` follows the changes instead)."""
        views = [self.view(r, now) for r in records.values() if r.state in ROUND_STATES and r.job_id not in skip]
        views = [v for v in views if all(p.node in alive for p in v.placement)]
        live = {v.job_id for v in views}
        if len(self.progress) > len(views):  # forget jobs that ended
            self.progress = {k: v for k, v in self.progress.items() if k in live}
        if len(self.checkpoints) > len(views):
            self.checkpoints = {k: v for k, v in self.checkpoints.items() if k in live}
        self.cache.keep(live)
        self.order.forget()  # the kept order starts again from the records next time
        return views

    def kept_views(self, records: dict[str, JobRecord], now: float, changed: set[str], active: Any,
                   excluded: set[str]) -> list[JobView]:
        """``views``, with work in proportion to what changed (``ViewOrder``): the views
        of ``changed`` jobs made again, those of ``active`` ones (running: their steps and
        service move) refreshed, the others handed over as kept; ``excluded``: jobs left
        out this round (``skip`` and those placed on nodes not alive)."""
        order = self.order
        for job_id in order.follow(records, changed):
            rec = records.get(job_id)
            order.put(job_id, self.view(rec, now) if rec is not None and rec.state in ROUND_STATES else None)
        for job_id in order.gone:
            self.progress.pop(job_id, None)
            self.checkpoints.pop(job_id, None)
        self.cache.drop(order.gone)
        for job_id in active:
            if job_id not in changed:
                order.put(job_id, self.view(records[job_id], now))
        return order.views(excluded)

    async def decide(self, records: dict[str, JobRecord], node_states: list, alive: set[str], *,
                     skip: Any = (), changed: set[str] | None = None, active: Any = (), on_dead: Any = (),
                     pinned: Any = (), strict: bool = True) -> tuple[Decision, list[JobView], float]:
        """The policy's decision for the live records but ``skip`` on ``node_states``; its
        views; seconds it took. ``changed``: the jobs whose record changed since the last
        round (``kept_views``, with ``active`` the running jobs, ``on_dead`` the jobs on
        nodes not alive and ``pinned`` those with an operator's pin); None: every record
        looked at (``views``). ``strict``: the models' view synced with the server first."""
        models = await self.models.snapshot(strict)  # gs_models, made again only when it changed
        self.learned = self.models.learn(self.clock.now())  # step times held since the last lesson
        unmodelled = await self._unmodelled(records, models) if self.wait_for_models else {}
        # the round's nodes, once per shape (``NodeIndex``: a new one when any node's state is new,
        # its free GPUs included)
        self._nodes_set.get(node_states, self._set_nodes)
        t = self.clock.now()
        if changed is None:
            views = self.views(records, alive, t, {*skip, *unmodelled} if unmodelled else skip)
        else:
            views = self.kept_views(records, t, changed, active, {*skip, *unmodelled, *on_dead})
        # the models of the jobs whose record changed (a full round: of every job handed over)
        await self.models.refresh([records[v.job_id] for v in views] if changed is None
                                  else [records[j] for j in changed if j in records], models)
        if self.queues is not None:
            self.policy.set_config(await self.queues.config(self.share_base))
        # the policy is pure CPU work: off the loop, so the lease keeps being renewed
        t_policy = time.perf_counter()
        decision: Decision = await asyncio.to_thread(self._schedule, t, node_states, views)
        t_policy = time.perf_counter() - t_policy
        if self.queues is not None:
            await self.queues.save_usage(self.policy.memory())
        by_id = {v.job_id: v for v in views}
        refuse_unsupported(decision, by_id)
        capacity.apply_pins(decision, records, node_states, by_id, None if changed is None else pinned)
        arrange(decision, node_states, by_id)  # gangs within their topology (policies.topology)
        check_decision(decision, node_states, by_id)
        for job_id, key in unmodelled.items():
            decision.waiting[job_id] = f"waiting for its performance model: profiling {key}"
        return decision, views, t_policy

    def _schedule(self, t: float, node_states: list, views: list[JobView]) -> Decision:
        """The policy's call, in its thread; ``policy_cpu``: that thread's own CPU seconds
        (the round's wall time less this is time the thread waited for the GIL or a core)."""
        cpu = time.thread_time()
        try:
            return self.policy.schedule(t, node_states, views, self.models.oracle)
        finally:
            self.policy_cpu = time.thread_time() - cpu

    def _set_nodes(self, node_states: list) -> None:
        self.models.priced.set_paths({n.name: tuple(n.topology) for n in node_states})
        self.models.priced.set_free({n.name: n.gpus_free for n in node_states})

    async def _unmodelled(self, records: dict[str, JobRecord], models: dict) -> dict[str, str]:
        """Pending jobs whose model has no fit yet: job id -> model key (``models``: gs_models' snapshot)."""
        from gearshift.services.perfmodel_service import unmodelled_jobs

        got = await unmodelled_jobs(self.models.kv, records.values(), have=models.keys())
        return {job_id: key for job_id, (key, _) in got.items()}


def segment_gpu_s(rec: JobRecord, ts: float) -> float:
    """GPU-seconds of the allocation ``rec`` holds now, up to ``ts``."""
    if rec.state not in ACTIVE or not rec.placement:
        return 0.0
    since = rec.last_switch_at if rec.last_switch_at is not None else rec.scheduled_at
    if since is None:
        return 0.0
    return sum(len(p.gpus) for p in rec.placement) * max(0.0, ts - since)


PROGRESS_EVERY_S = 30.0  # a job's progress teaches the oracle at most this often
POOL_JOBS = 32  # a configuration's step time: the mean of the latest of at most this many jobs


class _Pool:
    """One configuration's step time as the jobs that ran it measured it (each job's
    latest, the last ``POOL_JOBS`` jobs), and the mean last taught to the oracle.

    Live step times are wall-clock measurements: two jobs on the same configuration
    differ by a few percent (start-up, a busy host), more than the oracle's
    ``CHANGE_TOL``. Taught one by one, each job's figure replaced the other's and every
    replacement made the policy rebuild that model's candidates, for every job of the
    model, round after round. Their mean moves only when the evidence does."""

    __slots__ = ("by_job", "taught")

    def __init__(self) -> None:
        self.by_job: dict[str, float] = {}
        self.taught: float | None = None

    def add(self, job_id: str, step_time: float) -> float:
        """Take a job's latest figure; the mean over the jobs kept."""
        by_job = self.by_job
        if by_job.pop(job_id, None) is None and len(by_job) >= POOL_JOBS:
            del by_job[next(iter(by_job))]  # the job heard from longest ago
        by_job[job_id] = step_time
        return sum(by_job.values()) / len(by_job)


class ModelsView(KvView[bytes]):
    """``gs_models``' values as stored, kept current from a watch; ``on_change`` is
    called on each write (the optimizer's leader kicks a round with it)."""

    def __init__(self, js: Any):
        super().__init__(js, subj.MODELS_BUCKET, bytes)
        self.on_change: Any = None

    def changed(self, key: str, old: bytes | None, new: bytes) -> None:
        if self.on_change is not None:
            self.on_change()


class LiveModels:
    """The fitted models as ``gs_models`` holds them, and the oracle policies get
    over them (``self.oracle``: a ``LearningOracle`` over a ``PerfModelOracle`` whose
    parameters follow ``gs_models``). Not an oracle itself.

    Falls back to perfmodel's own parameters (the shipped Rubick fits, or the
    nearest one scaled) for models that were never profiled.
    """

    def __init__(self, models_kv: Any, links: LinkFactors | None = None, learn_every: float = 0.0):
        from gearshift.policies.learning import LearningOracle
        from gearshift.policies.oracle import PerfModelOracle

        self.kv = models_kv
        self.view: ModelsView | None = None  # the optimizer's view of gs_models (``snapshot`` reads it)
        self.base = PerfModelOracle()
        # The fitted model priced by the topology a placement spans (``links``: the
        # optimizer's ``bandwidth``) with an nvlink-domain one NVLink island; the
        # simulator's policies get the same pricing (policies.topology_price).
        self.priced = TopologyPricedOracle(self.base, links or LinkFactors(), self.base.slowdown, islands=True)
        # What policies get: that, corrected by what ran (observe()).
        self.oracle = LearningOracle(self.priced)
        self._revisions: dict[str, int] = {}
        self._keys: dict[Any, str] = {}  # ModelSpec -> its key in gs_models
        self._snap: tuple[int, dict] = (-1, {})  # (stream's last sequence, snapshot of gs_models then)
        self._loaded_seq = -2  # the snapshot's sequence the models in use were last loaded from
        self._stepped: dict[str, tuple] = {}  # job -> (generation, ts, step, plan, placement, spec) of STEPPED
        self._progress_at: dict[str, tuple[int, float]] = {}  # job -> (generation, ts) of its last progress fed
        self._pools: dict[tuple, _Pool] = {}  # configuration (LearningOracle.config_key) -> its step times
        self.node_type: dict[str, str] = {}  # node -> GPU type (the optimizer's node view, every round)
        # Step times are taught to the oracle at most once every ``learn_every`` s (``learn``, at a
        # round's start): each lesson moves the oracle's revision, and a moved revision makes the
        # policy work out again the keys, candidates and curves of every job of the model taught
        # (half a round's CPU at 6,000 live jobs, ``loadtest.live_rounds``). Held meanwhile: the
        # latest figure per configuration; taught per model (``learn``). Out-of-memory marks are
        # taught at once. 0: at once.
        self.learn_every = learn_every
        self._held: dict[Any, tuple] = {}  # configuration -> (spec, plan, placement, step time)
        self._taught_at: dict[Any, float] = {}  # model -> when it was last taught (the round's clock)

    def _placement(self, rec: JobRecord) -> tuple[Placement, ...]:
        """Where ``rec`` runs, typed by its nodes' GPU type: the learning oracle keeps what
        ran per type (a V100's step time must not correct the A100 answers)."""
        return tuple(Placement(p.node, len(p.gpus), p.cpus, self.node_type.get(p.node, "")) for p in rec.placement)

    async def snapshot(self, strict: bool = True) -> dict[str, tuple[bytes, int]]:
        """``gs_models``: key -> (value, revision), from ``view``, made again only when
        the bucket changed (``strict``: the view synced with the server first, a
        stream-info request; else as it is, no request)."""
        assert self.view is not None, "the optimizer gives LiveModels its view of gs_models"
        if strict:
            await self.view.sync()
        if self.view.revision != self._snap[0]:
            self._snap = (self.view.revision, {k: (v, rev) for k, (v, rev, _) in self.view.entries.items()})
        return self._snap[1]

    async def refresh(self, records: list[JobRecord], snap: dict | None = None) -> int:
        """Load parameters that changed since the last round; returns how many.
        ``snap``: the round's ``snapshot()`` (else read here)."""
        import msgspec

        from gearshift import perfmodel
        from gearshift.bus_schema.perfmodel import model_kv_key
        from gearshift.perfmodel.model import PerfParams

        if snap is None:
            snap = await self.snapshot()
        if self._snap[0] != self._loaded_seq:  # the bucket changed: every model in use may have
            models = {*self._keys, *(rec.spec.model for rec in records)}
            self._loaded_seq = self._snap[0]
        else:  # else only models not seen before (a job whose record did not change brings none)
            models = {m for m in (rec.spec.model for rec in records) if m not in self._keys}
        loaded = 0
        for model in models:
            name = model.name
            key = self._keys.get(model)
            if key is None:
                key = self._keys[model] = model_kv_key(perfmodel.shape_from_spec(model).key)
            got = snap.get(key)
            if got is None or self._revisions.get(name) == got[1]:
                continue
            self.base.set_params(name, PerfParams.from_dict(msgspec.json.decode(got[0])))
            self._revisions[name] = got[1]
            loaded += 1
        return loaded

    def observe_report(self, rec: JobRecord, r: Any) -> bool:
        """Feed the oracle from one agent report: STEPPED of the job's current
        generation marks (time, step, plan, placement) once it trains; a later
        rank-0 EXITED of that generation gives the step time between the two; an
        exit whose message says the GPU ran out of memory marks the plan
        infeasible. True if the oracle changed."""
        if not r.rank0:
            return False
        kind = getattr(r.kind, "value", r.kind)
        if kind == "stepped":
            if rec.plan is not None and rec.placement and r.generation == rec.generation:
                placement = self._placement(rec)
                self._stepped[rec.job_id] = (r.generation, r.ts, int(r.start_step) + 1, rec.plan, placement, rec.spec)
            return False
        if kind != "exited":
            return False
        mark = self._stepped.get(rec.job_id)
        if mark is None or mark[0] != r.generation:
            if r.exit_code not in (0, None) and not r.stopped and is_oom(r.message) and rec.plan is not None \
                    and rec.placement and r.generation == rec.generation:
                placement = self._placement(rec)
                return self.oracle.observe(rec.spec, rec.plan, placement, oom=True)
            return False
        del self._stepped[rec.job_id]
        _, t0, s0, plan, placement, _spec = mark
        if r.exit_code not in (0, None) and not r.stopped and is_oom(r.message):
            return self.oracle.observe(rec.spec, plan, placement, oom=True)
        steps = max(int(r.progress_step or 0), int(r.steps_done or 0))
        if steps <= s0 or r.ts <= t0:
            return False
        return self._teach(rec.job_id, rec.spec, plan, placement, (r.ts - t0) / (steps - s0))

    def observe_progress(self, job_id: str, generation: int, ts: float, steps: int) -> bool:
        """A progress line of a generation that reported STEPPED: the step time since
        its first step (what the simulator tells its oracle once a job trains)."""
        mark = self._stepped.get(job_id)
        if mark is None or mark[0] != generation or steps <= mark[2] or ts <= mark[1]:
            return False
        last = self._progress_at.get(job_id)
        if last is not None and last[0] == generation and ts - last[1] < PROGRESS_EVERY_S:
            return False  # a running job reports every few seconds: its speed is news far less often
        self._progress_at[job_id] = (generation, ts)
        if len(self._progress_at) > 4 * max(1, len(self._stepped)):  # ended jobs
            self._progress_at = {j: v for j, v in self._progress_at.items() if j in self._stepped}
        _, t0, s0, plan, placement, spec = mark
        return self._teach(job_id, spec, plan, placement, (ts - t0) / (steps - s0))

    def _teach(self, job_id: str, spec: Any, plan: Any, placement: tuple[Placement, ...], step_time: float) -> bool:
        """Teach the oracle a configuration's step time: the mean of its jobs' latest
        figures (``_Pool``), once it moved by more than the oracle's tolerance from what
        it was last taught; with ``learn_every``, held for ``learn``. True if the oracle
        changed (or will, at ``learn``)."""
        key = self.oracle.config_key(spec, plan, placement)
        if key is None or not step_time > 0 or not math.isfinite(step_time):
            return self.oracle.observe(spec, plan, placement, step_time=step_time)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = _Pool()
        mean = pool.add(job_id, step_time)
        if pool.taught is not None and abs(pool.taught / mean - 1) <= CHANGE_TOL:
            self._held.pop(key, None)  # back within tolerance of what the oracle knows: nothing to teach
            return False
        if self.learn_every > 0:
            self._held[key] = (spec, plan, placement, mean)
            return True
        return self._tell(key, spec, plan, placement, mean)

    def _tell(self, key: Any, spec: Any, plan: Any, placement: tuple[Placement, ...], mean: float) -> bool:
        """The oracle taught a configuration's pooled step time, and its pool told so."""
        self._pools[key].taught = mean
        return self.oracle.observe(spec, plan, placement, step_time=mean)

    def learn(self, now: float) -> int:
        """Teach the oracle the lessons held (``_teach``) of a model last taught ``learn_every``
        s ago or more: one model a round, the one taught longest ago, and besides it any model
        overdue by twice ``learn_every``. Each model taught makes the policy work out again every
        job of that model, so models taught in one round add up in it; one a round spreads them
        over rounds. How many configurations were taught (0: none held, or none due)."""
        if not self._held:
            return 0
        keys: dict[Any, list] = {}
        for key in self._held:  # (model and batch, plan, GPUs per node, type): LearningOracle.config_key
            keys.setdefault(key[0], []).append(key)
        last = {m: self._taught_at.get(m, -math.inf) for m in keys}
        due = sorted((at, i, m) for i, (m, at) in enumerate(last.items()) if now - at >= self.learn_every)
        taught = 0
        for k, (at, _, model) in enumerate(due):
            if k > 0 and now - at < 2 * self.learn_every:
                continue
            for key in keys[model]:
                self._tell(key, *self._held.pop(key))
                taught += 1
            self._taught_at[model] = now
        return taught


def is_oom(message: str) -> bool:
    """Does a worker's exit message say the GPU ran out of memory (PyTorch/CUDA)?"""
    m = (message or "").lower()
    return "out of memory" in m or "outofmemoryerror" in m
