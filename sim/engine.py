"""The discrete-event simulator.

Time jumps from event to event: the next arrival, the next completion, the next
scheduling round (a fixed grid every ``interval`` seconds, plus, by default, a round
right after any arrival or completion). At a round the policy gets the cluster, the
live jobs and the belief oracle, and returns the full desired state; the simulator
refuses (raises ``AllocationError``) a decision that over-allocates or names unknown
jobs, then applies the difference: preempt jobs left out, start new ones, restart
jobs whose plan or placement changed.

Model of a job (and why):
- It progresses at its ground-truth speed (``sim.truth``), only while it holds its
  allocation, and only after the restart cost of that allocation has elapsed: every
  (re)start, resume after preemption and reconfiguration pays ``restart_cost`` seconds
  holding its GPUs without progress (Rubick's artifact charges 260 s).
- Preemption and reconfiguration keep the steps done (checkpoint on SIGTERM, as
  gearshift's agent does); the lost time is the restart. With a checkpoint model
  (``SimConfig.checkpoint_interval``) the grace is modelled as live: a job whose
  checkpoint on SIGTERM takes longer than its grace (``JobSpec.checkpoint_grace``,
  else ``SimConfig.grace``) is killed and keeps only its last periodic checkpoint,
  losing the steps since (``SimJob.steps_lost``); policies see each running job's
  last checkpoint (``JobView.checkpoint_at``) and choose victims by it
  (``policies.victims``). One difference: live, the victim holds its GPUs during
  the grace; here they are free at once.
- It finishes exactly when its steps are done (not at the next round boundary, which is
  where Blox observes completions).

Invariants, checked at every event when ``check_invariants`` is on (the default):
no node holds more GPUs or CPUs than it has; only jobs holding an allocation make
progress; steps done never exceed steps.
"""

from __future__ import annotations

import heapq
import math
import time as _time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from gearshift.bus_schema.messages import ALLOWED_TRANSITIONS, InvalidTransition, JobState, Plan
from gearshift.policies.api import JobView, NodeState, Placement, Policy, accepts, with_type
from gearshift.policies.decision import NodeCapacity, check_decision, diff
from gearshift.policies.learning import LearningOracle
from gearshift.policies.protocols import SteadyPolicy, TokenedOracle, supports
from gearshift.sim.collect import fewer_collections
from gearshift.sim.declared import declared_spec
from gearshift.sim.dependencies import DependencyHold
from gearshift.sim.topology import TopologyStep
from gearshift.sim.trace import ClusterSpec, Trace, TraceJob
from gearshift.sim.truth import BeliefOracle, GroundTruth, Predictor
from gearshift.sim.views import NodeViews, SimViews

# Job states are the bus's (``JobState``) and change only along its ALLOWED_TRANSITIONS
# (``move``). A trace job that has not arrived has no state, None: on the bus a job has
# no record before it is submitted. A grant passes SCHEDULED on its way to RUNNING (the
# simulator writes and launches an allocation in one instant; the restart cost is time
# holding GPUs without progress), so a reconfiguration is RUNNING -> SCHEDULED ->
# RUNNING, as live. Finishing is COMPLETED; a failed launch (out of memory) re-queues.
PENDING, SCHEDULED, RUNNING, COMPLETED = JobState.PENDING, JobState.SCHEDULED, JobState.RUNNING, JobState.COMPLETED
TRANSITIONS: dict[JobState | None, frozenset[JobState]] = {None: frozenset({PENDING}), **ALLOWED_TRANSITIONS}
_EPS = 1e-9


class InvariantError(AssertionError):
    """The simulator caught itself (or a policy) breaking a rule of the model."""


@dataclass(slots=True)
class SimConfig:
    interval: float = 60.0
    restart_cost: float = 260.0
    # Per-job restart cost (JobSpec -> seconds); when set it replaces the flat
    # ``restart_cost`` (e.g. perfmodel.restart.restart_seconds, the measured model).
    restart_model: Callable[[Any], float] | None = None
    seed: int = 0
    noise: float = 0.05  # ground-truth noise where nothing was measured (log-normal sigma)
    # Ground truth where nothing was measured = prediction x noise x this factor (>1 =
    # slower than the fitted model believes; a robustness check for plan-choosing policies).
    unmeasured_slowdown: float = 1.0
    round_on_arrival: bool = True
    round_on_completion: bool = True
    horizon: float | None = None  # stop at this simulated time, report the rest unfinished
    # Stop when no job could make progress for this long (a policy that never starts a
    # job, or keeps launching plans that do not fit, would loop forever); the rest is
    # reported unfinished.
    stall_limit: float = 2 * 86400.0
    stop_when_tracked_done: bool = True
    check_invariants: bool = True
    # Also run policies.decision.check_decision on every decision (slower; the incremental
    # check the simulator runs, NodeCapacity.check, refuses the same decisions).
    full_check: bool = False
    # Tell policies each guaranteed job's measured request speed as its target
    # (JobView.target_throughput); off: policies use the model's prediction of the request.
    measured_targets: bool = False
    record_timeline: bool = True
    # Rounds in which nothing moved (no job arrived, ended, started or stopped since the
    # last decision was applied, and the oracle's answers stand) are not asked of a policy
    # that says it would change nothing then (policies.protocols.SteadyPolicy, SRTF): the
    # running jobs' progress is accounted as every round does, and nothing else changes.
    skip_steady: bool = True
    # "measured": policies may choose only configurations with a measured row or the
    # job's own request; "extended": any configuration, truth from sim.extended where
    # nothing was measured (needs the fitted model). See sim/README.md.
    regime: str = "measured"
    systematic: float = 0.15  # extended truth: log-normal sigma per (model, plan family)
    distance_slowdown: float = 0.10  # extended truth: x(1 + this x distance from measured)
    headroom: float = 0.10  # extended truth: OOM when the memory estimate leaves less free
    # Policies' oracle learns from what runs (policies.learning.LearningOracle).
    learn: bool = True
    # Preemption with a grace period (issue 23): seconds between a running job's periodic
    # checkpoints (None: no checkpoint model; a stopped job keeps every step, as before),
    # the seconds a checkpoint on SIGTERM takes, and the grace of a job without its own.
    checkpoint_interval: float | None = None
    checkpoint_time: float = 0.0
    grace: float = 10.0
    # Declared steps = true x a seeded log-uniform factor in [1, this) (sim.declared); policies
    # see the declaration, the job finishes at its true steps. 1: declared = true.
    declared_noise: float = 1.0
    # A topology (sim.topology.SimTopology, issue 23): paths, link factors, aware or flat.
    topology: Any = None


@dataclass(slots=True)
class SimJob:
    """The simulator's bookkeeping of one job (the per-job CSV is made from these); the
    bus's record of a live job is ``bus_schema.messages.JobRecord``."""

    job: TraceJob
    view: JobView
    state: JobState | None = None  # None: not arrived yet
    rate: float = 0.0  # steps/s of the current allocation
    alloc_at: float = 0.0  # when the current allocation began
    productive_from: float = 0.0  # alloc_at + restart cost
    updated_at: float = 0.0  # progress is accounted up to here
    version: int = 0  # moves at every grant and release: stale completion events, kept views (sim.views)
    gpus_held: int = 0
    # Authoritative state. ``view`` keeps the view-only fields (restarts, started_at, last_switch_at,
    # target_throughput); policies get views built from the record (sim.views), never ``view`` itself.
    steps_done: float = 0.0
    attained: float = 0.0
    placement: tuple = ()
    plan: Plan | None = None
    last_plan_label: str = ""
    first_start: float | None = None
    finish: float | None = None
    starts: int = 0
    reconfigs: int = 0
    preemptions: int = 0
    restart_lost: float = 0.0
    restart_gpu_seconds: float = 0.0
    run_time: float = 0.0  # seconds holding an allocation
    gpu_seconds: float = 0.0
    truth_sources: dict = field(default_factory=dict)  # source -> allocations
    stalled: int = 0  # allocations on which the job could not run at all (out of memory)
    min_rate_ratio: float = math.inf  # guaranteed jobs: worst rate / requested rate
    preempted_after_start: bool = False
    request_step_time: float = 0.0
    observed: bool = True  # the current allocation's speed was told to the oracle
    attained_before: float = 0.0  # GPU-seconds of finished allocations
    steps_lost: float = 0.0  # steps since the last checkpoint, lost when a stop outlasted the grace
    grace_expired: int = 0  # stops that outlasted the grace

    @property
    def spec(self):
        """The job's spec (what ``policies.decision`` reads of a live job)."""
        return self.job.spec


def move(r: SimJob, new: JobState) -> None:
    """``r`` to state ``new``, or InvalidTransition if the bus's state machine forbids it."""
    if new not in TRANSITIONS[r.state]:
        was = r.state.value if r.state is not None else "not submitted"
        raise InvalidTransition(f"job {r.job.job_id}: {was} -> {new.value} is not allowed")
    r.state = new


@dataclass(slots=True)
class SimResult:
    policy: str
    trace: str
    cluster: ClusterSpec
    config: SimConfig
    records: list[SimJob]
    tracked: frozenset[str] | None
    end_time: float
    rounds: int
    events: int
    wall_s: float
    # Step-function samples after each event: (time, GPUs allocated, jobs queued, jobs running)
    timeline: list[tuple[float, int, int, int]]
    topology: Any = None  # sim.topology.TopologyStep (SimConfig.topology): spans, slow_gpu_s
    rounds_skipped: int = 0  # rounds not asked of a steady policy (SimConfig.skip_steady)

    @property
    def topology_spans(self) -> dict[str, int] | None:
        """Grants per topology level their nodes spanned."""
        return self.topology.spans if self.topology is not None else None


# ------------------------------------------------------------ a job's progress (pure functions of its record)
def last_checkpoint_at(r: SimJob, t: float, interval: float) -> float | None:
    """When running job ``r`` made its latest periodic checkpoint by ``t`` (None:
    none since its allocation began training)."""
    start = r.productive_from
    if t < start + interval:
        return None
    return start + math.floor((t - start) / interval) * interval


def lose_past_grace(r: SimJob, t: float, cfg: SimConfig) -> float:
    """Stop ``r`` at ``t`` (progress accounted to ``t``): if its checkpoint on
    SIGTERM outlasts its grace it is killed and keeps only its last periodic
    checkpoint; the steps since are lost. Returns them."""
    assert cfg.checkpoint_interval is not None
    grace = r.job.spec.checkpoint_grace or cfg.grace
    if cfg.checkpoint_time <= grace or r.rate <= 0:
        return 0.0
    ck = last_checkpoint_at(r, t, cfg.checkpoint_interval)
    since = ck if ck is not None else r.productive_from
    lost = min(r.steps_done, max(0.0, t - since) * r.rate)
    r.steps_done -= lost
    r.steps_lost += lost
    r.grace_expired += 1
    return lost


def advance(r: SimJob, t: float, check: bool = True) -> None:
    """Account progress of running job ``r`` up to time ``t``."""
    if check and r.state != RUNNING:
        raise InvariantError(f"job {r.job.job_id} would progress without holding an allocation")
    dt = t - r.updated_at
    if dt <= 0:
        return
    start = max(r.updated_at, r.productive_from)
    steps = r.job.spec.steps
    if t > start and r.rate > 0:
        r.steps_done += (t - start) * r.rate
        if r.steps_done > steps:
            if check and r.steps_done > steps * (1 + 1e-6) + 1e-6:
                raise InvariantError(f"job {r.job.job_id}: {r.steps_done} steps done of {steps}")
            r.steps_done = float(steps)
    g = dt * r.gpus_held
    r.attained += g
    r.gpu_seconds += g
    r.run_time += dt
    r.updated_at = t


def finish_time(r: SimJob) -> float:
    """When ``r`` finishes at its current rate (or fails, if its plan does not fit)."""
    if r.rate <= 0:
        return r.productive_from  # it fails (out of memory) when it would start training
    left = r.job.spec.steps - r.steps_done
    return max(r.updated_at, r.productive_from) + left / r.rate


def check_capacity(sim: "Simulator", nodes: Iterable[int] | None = None) -> None:
    """The invariant: no node holds more than it has, and free + held = capacity.
    ``nodes``: the indices of the nodes to check (those whose holdings changed; what
    they hold is summed from the placements of the jobs on them, ``Simulator.on_node``);
    None: every node, from every running job's placement."""
    n = len(sim.node_names)
    used_g = [0] * n
    used_c = [0] * n
    if nodes is None:
        nodes = range(n)
        for r in sim.running.values():
            for p in r.placement:
                i = sim.node_index[p.node]
                used_g[i] += p.gpus
                used_c[i] += p.cpus
    else:
        for i in nodes:
            name = sim.node_names[i]
            for r in sim.on_node[i].values():
                if r.state != RUNNING:
                    raise InvariantError(f"node {name}: job {r.job.job_id} holds GPUs there without running")
                for p in r.placement:
                    if p.node == name:
                        used_g[i] += p.gpus
                        used_c[i] += p.cpus
    for i in nodes:
        if used_g[i] > sim.cap_g[i] or used_c[i] > sim.cap_c[i]:
            raise InvariantError(f"node {sim.node_names[i]} holds {used_g[i]} GPUs / {used_c[i]} CPUs")
        if used_g[i] + sim.free_g[i] != sim.cap_g[i] or used_c[i] + sim.free_c[i] != sim.cap_c[i]:
            raise InvariantError(f"node {sim.node_names[i]}: free-capacity bookkeeping is off")


class Simulator:
    def __init__(self, trace: Trace, policy: Policy, cluster: ClusterSpec | None = None,
                 config: SimConfig | None = None, predictor: Predictor | None = None,
                 progress: Callable[[float, int, int], None] | None = None,
                 truth_predictor: Predictor | None = None):
        self.trace = trace
        self.policy = policy
        self.cluster = cluster or trace.cluster
        self.cfg = config or SimConfig()
        cfg = self.cfg
        if cfg.regime not in ("measured", "extended"):
            raise ValueError(f"regime must be 'measured' or 'extended', not {cfg.regime!r}")
        self.truth = GroundTruth(self.cluster.gpus_per_node, cfg.noise, cfg.seed, predictor,
                                 unmeasured_slowdown=cfg.unmeasured_slowdown, truth_predictor=truth_predictor,
                                 systematic=cfg.systematic if truth_predictor else 0.0,
                                 distance_slowdown=cfg.distance_slowdown if truth_predictor else 0.0,
                                 headroom=cfg.headroom if truth_predictor else None)
        allowed = self.truth.measured_config if cfg.regime == "measured" else None
        self.progress = progress
        c = self.cluster
        nodes = c.node_list()
        self.node_names = [n[0] for n in nodes]
        self.node_types = [n[1] for n in nodes]
        self.cap_g = [n[2] for n in nodes]
        self.cap_c = [n[3] for n in nodes]
        self.node_index = {n: i for i, n in enumerate(self.node_names)}
        self.free_g = self.cap_g.copy()
        self.free_c = self.cap_c.copy()
        self.on_node: list[dict[str, SimJob]] = [{} for _ in self.node_names]  # the running jobs on each node
        self._touched: set[int] = set()  # nodes whose holdings changed since the last capacity check
        topo = cfg.topology
        self.topo = TopologyStep(topo, self.node_names, truth_predictor or predictor) if topo is not None else None
        self.belief = BeliefOracle(self.cluster.gpus_per_node, predictor, allowed=allowed)
        self.belief = self.topo.belief(self.belief, predictor) if self.topo is not None else self.belief
        self.oracle = LearningOracle(self.belief) if cfg.learn else self.belief
        self.node_views = NodeViews(self.node_names, self.cap_g, self.cap_c, self.node_types)
        self.capacity = NodeCapacity(self.node_names, self.node_types, self.cap_g, self.cap_c,
                                     topo.paths if topo is not None and topo.aware else None)
        self.records = [SimJob(j, JobView(job_id=j.job_id, spec=declared_spec(j.spec, cfg.declared_noise, cfg.seed, j.job_id),
                                          submitted_at=j.submit)) for j in trace.jobs]
        self.by_id = {r.job.job_id: r for r in self.records}
        self.holds = DependencyHold(self.records)  # a trace's ``after`` column (sim.dependencies)
        self.live: dict[str, SimJob] = {}  # pending + running, in arrival order
        self.running: dict[str, SimJob] = {}
        self._unobserved: list[tuple[SimJob, int]] = []  # grants not yet told to the oracle (observe_started)
        # the policy's views, kept across rounds; they account the running jobs' progress at each round
        self.views = SimViews(self.live, self.running, cfg.check_invariants, InvariantError)
        self.heap: list[tuple[float, int, int]] = []  # (finish time, version, record index)
        self.index = {id(r): i for i, r in enumerate(self.records)}
        self.timeline: list[tuple[float, int, int, int]] = []
        self.alloc_gpus = 0
        self.n_progressing = 0  # running jobs whose allocation lets them train
        self.now = 0.0
        self.rounds = 0
        self.events = 0
        self.steady = SteadyRounds(self.policy, self.oracle, cfg)  # rounds in which nothing moved
        refuse_too_big(trace.jobs, self.node_types, self.cap_g)

    def _release(self, r: SimJob, t: float) -> None:
        self.steady.moved = True
        self.views.rows.detach(r)  # its accounting back on the record (sim.progress)
        advance(r, t, self.cfg.check_invariants)
        r.attained_before = r.attained
        lost = max(0.0, min(t, r.productive_from) - r.alloc_at)
        r.restart_lost += lost
        r.restart_gpu_seconds += lost * r.gpus_held
        self.alloc_gpus -= r.gpus_held
        jid = r.job.job_id
        if self.topo is not None:
            self.topo.released(jid, t)
        for p in r.placement:
            i = self.node_index[p.node]
            self.free_g[i] += p.gpus
            self.free_c[i] += p.cpus
            self.on_node[i].pop(jid, None)
            self._touched.add(i)
        r.version += 1
        r.gpus_held = 0
        if r.rate > 0:
            self.n_progressing -= 1
        r.rate = 0.0
        del self.running[r.job.job_id]

    def _grant(self, r: SimJob, placement: tuple[Placement, ...], plan: Plan, t: float) -> None:
        # the nodes' own type, whatever the decision said (truth and learning read it)
        placement = with_type(placement, self.node_types[self.node_index[placement[0].node]])
        self.steady.moved = True
        jid = r.job.job_id
        for p in placement:
            i = self.node_index[p.node]
            self.free_g[i] -= p.gpus
            self.free_c[i] -= p.cpus
            self.on_node[i][jid] = r
            self._touched.add(i)
            if self.cfg.check_invariants and (self.free_g[i] < 0 or self.free_c[i] < 0):
                raise InvariantError(f"node {p.node} over capacity after granting {r.job.job_id}")
        step_time, source = self.truth.step_time(r.job, plan, placement)
        if self.topo is not None:  # its links priced by the level it spans; timed for slow_gpu_s
            step_time = self.topo.price(r.job.spec, plan, placement, step_time, (jid, t))
        r.truth_sources[source] = r.truth_sources.get(source, 0) + 1
        r.rate = 1.0 / step_time if step_time > 0 else 0.0
        if r.rate == 0:
            r.stalled += 1
        else:
            self.n_progressing += 1
        r.observed = False
        if r.job.spec.guaranteed:
            r.min_rate_ratio = min(r.min_rate_ratio, r.rate * r.request_step_time)
        move(r, SCHEDULED)
        move(r, RUNNING)
        r.alloc_at = r.updated_at = t
        r.productive_from = t + (self.cfg.restart_model(r.job.spec) if self.cfg.restart_model
                                 else self.cfg.restart_cost)
        r.gpus_held = placement[0].gpus if len(placement) == 1 else sum(p.gpus for p in placement)
        self.alloc_gpus += r.gpus_held
        r.starts += 1
        if r.first_start is None:
            r.first_start = t
            r.view.started_at = t
        r.placement = placement
        r.plan = plan
        r.last_plan_label = plan.label()
        v = r.view
        v.placement = placement
        v.plan = plan
        v.last_switch_at = t
        v.restarts = r.starts - 1
        self.running[r.job.job_id] = r
        r.version += 1
        self._unobserved.append((r, r.version))
        ft = finish_time(r)
        if ft < math.inf:
            heapq.heappush(self.heap, (ft, r.version, self.index[id(r)]))
        self.views.rows.attach(r)  # its accounting, while it runs (sim.progress)

    # ------------------------------------------------------------ a round
    def _nodes(self) -> list[NodeState]:
        out = self.node_views.states(self.free_g, self.free_c)
        return self.topo.nodes(out) if self.topo is not None else out

    def _round(self, t: float) -> bool:
        """Run the policy and apply its decision. True if any allocation changed."""
        self.rounds += 1
        if self.cfg.learn:
            observe_started(self, t)
        token = self.steady.token()
        if self.steady.quiet(t, token, self.topo is None):
            self.views.rows.advance(t)  # the running jobs' accounting, as every round's views do
            return False
        views = self.views.views(t)  # every running job's progress accounted to t, too (SimViews.views)
        if self.cfg.checkpoint_interval is not None:  # what agents report live (JobProgress)
            for v in views:
                r = self.running.get(v.job_id)
                v.checkpoint_at = last_checkpoint_at(r, t, self.cfg.checkpoint_interval) if r is not None else None
        nodes = self._nodes()
        decision = self.policy.schedule(t, nodes, views, self.oracle)
        if self.topo is not None:
            self.topo.arrange(decision, nodes, views)
        if self.cfg.full_check:
            check_decision(decision, nodes, {v.job_id: v for v in views})
        # Refuse a decision the cluster cannot hold before applying any of it;
        # unchanged allocations were checked when granted.
        change = diff(self.running, decision, views, keep=False)  # what it changed, if it tells (Decision.changes)
        self.capacity.check(decision, self.live, self.free_g, self.free_c, self.running, change=change, held_live=True)
        running = self.running
        if self.cfg.checkpoint_interval is not None:
            for jid in (*change.preempt, *change.reconfigure):
                self.views.rows.detach(running[jid])
                lose_past_grace(running[jid], t, self.cfg)
        for jid in change.preempt:
            r = running[jid]
            self._release(r, t)
            move(r, PENDING)
            r.preemptions += 1
            if r.job.spec.guaranteed:
                r.preempted_after_start = True
            r.placement = ()
            r.plan = None
            r.view.placement = ()
            r.view.plan = None
        for jid in change.reconfigure:
            r = running[jid]
            self._release(r, t)
            r.reconfigs += 1
        # Free everything first, then grant, so swaps between jobs are legal.
        allocs = decision.allocations
        live = self.live
        for jid in change.changed:
            d = allocs[jid]
            self._grant(live[jid], tuple(d.placement), d.plan, t)
        changed = bool(change.preempt or change.changed)
        if changed and self.cfg.check_invariants:
            check_capacity(self, self._touched)  # the nodes whose holdings changed since the last check
            self._touched.clear()
        elif not self.cfg.check_invariants:
            self._touched.clear()
        self.steady.decided(token)
        return changed

    # ------------------------------------------------------------ the loop
    def run(self) -> SimResult:
        wall0 = _time.perf_counter()
        cfg = self.cfg
        jobs = self.records
        n = len(jobs)
        tracked_left = set(self.trace.tracked) if (self.trace.tracked and cfg.stop_when_tracked_done) else None
        for r in jobs:
            if r.job.spec.guaranteed:
                # Guarantee metrics compare with the measured speed of the job's own request.
                # With measured_targets the policy is told that speed as the promise
                # (JobView.target_throughput); by default it predicts the request itself.
                r.request_step_time = self.truth.request_step_time(r.job)
                if cfg.measured_targets and r.request_step_time > 0:
                    r.view.target_throughput = r.job.spec.global_batch / r.request_step_time
        nxt = 0  # next arrival
        interval = cfg.interval
        next_round = jobs[0].job.submit if n else math.inf
        next_round = math.floor(next_round / interval) * interval
        heap = self.heap
        done = 0
        last_report = 0.0
        horizon = cfg.horizon if cfg.horizon is not None else math.inf
        last_change = 0.0
        while done < n:
            while heap and (jobs[heap[0][2]].version != heap[0][1] or jobs[heap[0][2]].state != RUNNING):
                heapq.heappop(heap)
            t_comp = heap[0][0] if heap else math.inf
            t_arr = jobs[nxt].job.submit if nxt < n else math.inf
            if not self.live and nxt < n and next_round < t_arr:
                # Idle cluster: skip empty rounds up to the grid point at or after the arrival.
                next_round = math.ceil(t_arr / interval) * interval
            t = min(t_comp, t_arr, next_round)
            if t == math.inf or t > horizon:
                break
            if self.n_progressing or nxt < n and t_arr <= t:
                last_change = t
            elif t - last_change > cfg.stall_limit:
                break
            self.now = t
            self.events += 1
            completed = arrived = False
            while heap and heap[0][0] <= t + _EPS:
                ft, ver, idx = heapq.heappop(heap)
                r = jobs[idx]
                if r.version != ver or r.state != RUNNING:
                    continue
                if r.rate <= 0:  # its plan does not fit: the launch fails, the job is re-queued
                    if cfg.learn:  # ... and the oracle learns that the plan does not fit
                        self.oracle.observe(r.job.spec, r.plan, r.placement, oom=True)
                    self._release(r, ft)
                    move(r, PENDING)
                    r.placement, r.plan = (), None
                    r.view.placement, r.view.plan = (), None
                    completed = True
                    continue
                self.views.rows.detach(r)
                advance(r, ft, self.cfg.check_invariants)
                if cfg.check_invariants and r.steps_done < r.job.spec.steps * (1 - 1e-6) - 1e-6:
                    raise InvariantError(f"job {r.job.job_id} completed with {r.steps_done} of {r.job.spec.steps} steps")
                r.steps_done = r.view.steps_done = float(r.job.spec.steps)
                self._release(r, ft)
                move(r, COMPLETED)
                r.finish = ft
                del self.live[r.job.job_id]
                done += 1
                completed = True
                for d in self.holds.completed(r.job.job_id):  # its dependents that arrived join the queue
                    self.live[d.job.job_id] = d
                    arrived = self.steady.moved = True
                if tracked_left is not None:
                    tracked_left.discard(r.job.job_id)
            while nxt < n and jobs[nxt].job.submit <= t:
                r = jobs[nxt]
                move(r, PENDING)
                nxt += 1
                if self.holds.arrive(r):
                    self.live[r.job.job_id] = r
                    arrived = self.steady.moved = True
            if tracked_left is not None and not tracked_left:
                break
            run_round = t >= next_round or (arrived and cfg.round_on_arrival) or (completed and cfg.round_on_completion)
            if run_round and self.live:
                # A round that starts nothing while nothing runs is not the end: a policy
                # may wait on time (minimum run time after a failed launch); the stall
                # limit ends a real deadlock.
                self._round(t)
            if t >= next_round:
                next_round = (math.floor(t / interval) + 1) * interval
            if cfg.record_timeline:
                sample_timeline(self, t)
            if self.progress is not None and t - last_report > 3600:
                last_report = t
                self.progress(t, done, n)
        end = self.now
        self.views.rows.detach_all()
        for r in list(self.running.values()):  # account partial progress of the unfinished
            advance(r, end, self.cfg.check_invariants)
        return SimResult(self.policy.name, self.trace.name, self.cluster, cfg, self.records, self.trace.tracked, end,
                         self.rounds, self.events, _time.perf_counter() - wall0, self.timeline,
                         self.topo, self.steady.skipped)



class SteadyRounds:
    """Which rounds need not ask a steady policy again (``SimConfig.skip_steady``,
    ``policies.protocols.SteadyPolicy``): those in which nothing moved since its last
    decision (``moved``: every grant, release and arrival sets it; a decision clears it),
    with the oracle's answers (``answers_token``) those it decided under, and no
    checkpoints or topology feeding it inputs that move with time."""

    def __init__(self, policy: Any, oracle: Any, cfg: SimConfig):
        on = cfg.skip_steady and cfg.checkpoint_interval is None and supports(policy, SteadyPolicy)
        self._until = policy.steady_until if on else None
        self._answers = oracle.answers_token if supports(oracle, TokenedOracle) else None
        self.moved = True
        self._decided_under: object = None
        self.skipped = 0

    def token(self) -> object:
        return self._answers() if self._answers is not None else None

    def quiet(self, t: float, token: object, flat: bool) -> bool:
        """Skip the round at ``t`` (counted in ``skipped``)? ``flat``: no topology."""
        if (self._until is None or self.moved or token is None or token != self._decided_under or not flat
                or not t < self._until()):
            return False
        self.skipped += 1
        return True

    def decided(self, token: object) -> None:
        """A decision was made under ``token`` and applied."""
        self.moved, self._decided_under = False, token


def refuse_too_big(jobs: Iterable[TraceJob], node_types: list[str], cap_g: list[int]) -> None:
    """A job asking for more GPUs than the types it accepts have in all: a clear error
    (checked once per set of accepted types)."""
    by_type = {t: sum(g for u, g in zip(node_types, cap_g) if u == t) for t in dict.fromkeys(node_types)}
    biggest_for: dict = {}
    for j in jobs:
        types = j.spec.gpu_types
        key = tuple(types) if types else None
        biggest = biggest_for.get(key)
        if biggest is None:
            biggest = biggest_for[key] = max((g for t, g in by_type.items() if accepts(j.spec, t)), default=0)
        if j.spec.gpus > biggest:
            what = f" of the types it accepts ({', '.join(j.spec.gpu_types)})" if j.spec.gpu_types else ""
            raise ValueError(f"job {j.job_id} asks for {j.spec.gpus} GPUs; the cluster has {biggest}{what}")


def observe_started(sim: "Simulator", t: float) -> None:
    """Tell the oracle the speed of allocations that have started training (what
    a running job's step reports reveal), once per allocation, in the order the
    allocations were granted (the running jobs' order). Only the allocations not
    yet told are looked at (``_unobserved``, appended by every grant; one whose
    job was released since, its version moved, is dropped)."""
    left = []
    for r, version in sim._unobserved:
        if r.version != version or r.observed or r.rate <= 0:
            continue
        if t >= r.productive_from:
            r.observed = True
            sim.oracle.observe(r.job.spec, r.plan, r.placement, step_time=1.0 / r.rate)
        else:
            left.append((r, version))
    sim._unobserved = left


def sample_timeline(sim: "Simulator", t: float) -> None:
    """One timeline row at ``t`` (allocated GPUs, waiting, running), when it changed."""
    row = (t, sim.alloc_gpus, len(sim.live) - len(sim.running), len(sim.running))
    tl = sim.timeline
    if tl and tl[-1][0] == t:
        tl[-1] = row
    elif not tl or tl[-1][1:] != row[1:]:
        tl.append(row)


def simulate(trace: Trace, policy: Policy, cluster: ClusterSpec | None = None, config: SimConfig | None = None,
             predictor: Predictor | None = None, progress=None, truth_predictor: Predictor | None = None) -> SimResult:
    with fewer_collections():
        return Simulator(trace, policy, cluster, config, predictor, progress, truth_predictor).run()
