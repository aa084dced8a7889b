"""Replay of the Pollux OSDI'21 workloads with the Pollux authors' job model.

Why a replay of its own: a Pollux job has no fixed length. It trains until it has run
its application's epochs, and its progress per second is its *goodput*: throughput x
statistical efficiency. The efficiency moves with the gradient noise scale as training
goes on, and the job re-tunes its batch size between epochs without a restart.
gearshift's event simulator (``sim.engine``) gives an allocation one constant speed in
steps per second, so it cannot hold this model. The replay is round-based, as the
authors' ``simulator/simulator.py`` is (``petuum/adaptdl``, ``osdi21-artifact``,
rewritten here, not copied). It runs any registered policy through the same API and
decision check as the simulator:

- Cluster: 16 nodes x 4 GPUs (the artifact's default ``--min-nodes 16 --num-gpus 4``),
  rounds every 60 s (``--interval``). Every round, each job advances ``interval``
  seconds (``Cluster.step``, then ``Job.step``). Then the policy gets the jobs that have
  arrived and not finished, and returns a ``Decision``. ``check_decision`` refuses a bad
  one. A job whose GPUs per node changed is re-allocated (``Job.reallocate``): 30 s with
  no progress, one more restart, and a new batch split.
- Job progress (``Job.step``): the truth is ``sim.pollux_apps``. Step and sync seconds
  come from the measured placement rows, and gradient statistics from the validation
  rows at the job's epoch. Progress grows at ``gain / (step + accum x (step - sync))``
  per second. The job finishes at the epoch boundary after its last epoch, at the exact
  second. It re-chooses its batch at every epoch boundary and round
  (``Job.update_local_bsz``), with its own fitted goodput model (the PolluxAgent).
- What a job tells a Pollux policy (``stats_for``, the authors'
  ``get_pollux_job_info``): the throughput parameters fitted (``pollux_goodput.fit_perf_params``)
  to every (nodes, replicas, atomic batch) it has run, its current gradient statistics,
  its batch limits, and a limit of ``min(max(2 x most replicas run, 1), 64, max batch /
  min atomic batch)`` replicas. ncf has 1 replica and a fixed batch of 32768.
- Optimus and other fixed-batch policies (the authors' "+Oracle" baselines) run each
  job at the workload's ``batch_size``. They see ``spec.steps`` and ``steps_done`` as
  the iterations that batch needs (``Application.iteration``), and an oracle that answers
  the measured throughput (``OracleThroughput``).

JCT = completion - submission, averaged over all jobs.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, NodeState, Placement
from gearshift.policies.decision import check_decision
from gearshift.policies.pollux import PolluxJobStats, fixed_batch_split
from gearshift.policies.pollux_goodput import GoodputModel, efficiency, fit_perf_params
from gearshift.sim.pollux_apps import Application, application

RESCALE_S = 30.0
WORKLOADS = Path(__file__).parent / "data" / "philly-pollux"
NCF_BATCH = 32768


@dataclass(slots=True)
class ReplayJob:
    name: str
    app: Application
    submitted: float
    target_batch: int | None  # None: adapts (Pollux); else the fixed batch
    spec: JobSpec
    placement: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    atomic: int = 0
    accum: int = 0
    rescale_left: float = 0.0
    progress: float = 0.0
    epoch: int = 0
    attained: float = 0.0
    restarts: int | None = None
    completed: float | None = None
    started: float | None = None
    switched: float | None = None
    profile: dict = field(default_factory=dict)
    fitted: object = None  # PerfParams fitted to ``profile`` (refitted when it grows)
    dirty: bool = False
    grad: tuple[float, float] | None = None

    @property
    def params(self):
        """The throughput parameters fitted to every configuration run so far (None before one)."""
        if self.dirty:
            ks = list(self.profile)
            vs = list(self.profile.values())
            self.fitted = fit_perf_params([k[0] for k in ks], [k[1] for k in ks], [k[2] for k in ks],
                                          [v[0] for v in vs], [v[1] for v in vs])
            self.dirty = False
        return self.fitted

    # ---------------------------------------------------------------- batch
    def update_batch(self) -> None:
        lim = self.app.limits
        nodes, reps = len(self.placement), sum(self.placement)
        batch = self.target_batch
        if batch is None and self.params is None:
            batch = max(lim.init_batch, lim.min_atomic * reps)
        if batch is None:
            _, self.atomic, self.accum = GoodputModel(self.params, *self.grad, lim).best(nodes, reps)
        else:
            self.atomic, self.accum = fixed_batch_split(batch, reps, lim)
        self.atomic = min(self.atomic, int(lim.max_batch / (reps * (self.accum + 1))))

    def observe(self, nodes: int, reps: int, step: float, sync: float, sqr: float, var: float) -> None:
        self.grad = (sqr, var)
        key = (nodes, reps, self.atomic)
        if key in self.profile:
            return
        self.profile[key] = (step, sync)
        self.dirty = True

    # ---------------------------------------------------------------- time
    def step(self, now: float, seconds: float) -> None:
        """Advance from ``now`` by ``seconds`` (``Job.step``)."""
        if not self.placement or self.completed is not None:
            return
        gpus = sum(self.placement)
        delay = min(self.rescale_left, seconds)
        self.rescale_left -= delay
        self.attained += delay * gpus
        t = now + delay
        seconds -= delay
        app = self.app
        while seconds > 0 and self.completed is None:
            reps = sum(self.placement)
            batch = reps * self.atomic * (self.accum + 1)
            step, sync = app.throughput(self.placement, self.atomic)
            sqr, var = app.grad_stats(batch, self.epoch)
            self.observe(len(self.placement), reps, step, sync, sqr, var)
            gain = efficiency(batch, app.limits.init_batch, sqr, var) * batch / app.limits.init_batch
            rate = float(gain) / (step + (step - sync) * self.accum)
            nxt = app.progress(self.epoch + 1)
            if self.progress + rate * seconds < nxt:
                self.progress += rate * seconds
                self.attained += seconds * gpus
                seconds = 0
            else:
                self.epoch += 1
                delta = min(float(round((nxt - self.progress) / rate)), seconds)
                if self.epoch >= app.max_epochs:
                    self.completed = t + delta
                self.progress = nxt
                t += delta
                self.attained += delta * gpus
                seconds -= delta
            self.update_batch()

    def reallocate(self, now: float, nodes: tuple[str, ...], counts: tuple[int, ...]) -> None:
        self.nodes, self.placement = nodes, counts
        if counts:
            self.update_batch()
            self.rescale_left = RESCALE_S
            self.restarts = 0 if self.restarts is None else self.restarts + 1
            self.started = now if self.started is None else self.started
            self.switched = now
        else:
            self.atomic = 0

    # ---------------------------------------------------------------- what policies see
    def plan(self) -> Plan | None:
        if not self.placement:
            return None
        return Plan(dp=sum(self.placement), micro_batch=max(1, self.atomic), ga=self.accum + 1)

    def iterations_done(self) -> float:
        b = self.target_batch or self.app.limits.init_batch
        return self.app.iteration(b, self.epoch - 1) if self.epoch > 0 else 0.0

    def view(self, now: float) -> JobView:
        pl = tuple(Placement(n, c, c * 12) for n, c in zip(self.nodes, self.placement))
        return JobView(job_id=self.name, spec=self.spec, submitted_at=self.submitted,
                       steps_done=min(self.iterations_done(), self.spec.steps - 1), placement=pl, plan=self.plan(),
                       attained_service=self.attained, restarts=self.restarts or 0, last_switch_at=self.switched,
                       started_at=self.started)


def stats_for(job: ReplayJob) -> PolluxJobStats:
    app = job.app
    most = max((k[1] for k in job.profile), default=0)
    cap = 1 if app.name == "ncf" else min(max(2 * most, 1), 64, app.limits.max_batch // app.limits.min_atomic)
    sqr, var = job.grad if job.grad is not None else (0.0, 0.0)
    return PolluxJobStats(limits=app.limits, params=job.params if job.grad is not None else None,
                          grad_sqr=sqr, grad_var=var, max_replicas=cap, fixed_batch=job.target_batch)


class OracleThroughput:
    """The measured samples/s of a fixed-batch job (Optimus+Oracle's speed function)."""

    def __init__(self, jobs: dict[str, ReplayJob], gpus_per_node: int):
        self.jobs = jobs
        self.gpn = gpus_per_node

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        rj = self.jobs[job.job_id]
        reps = plan.gpus
        shape = tuple(min(self.gpn, reps - self.gpn * i) for i in range(-(-reps // self.gpn)))
        atomic, accum = fixed_batch_split(rj.spec.global_batch, reps, rj.app.limits)
        step, sync = rj.app.throughput(shape, atomic)
        return reps * atomic * (accum + 1) / (step + (step - sync) * accum)


def load_workload(path: str | Path, adaptive: bool) -> list[ReplayJob]:
    jobs = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            app = application(r["application"].strip())
            target = None if adaptive else int(r["batch_size"])
            if app.name == "ncf" and adaptive:
                target = NCF_BATCH
            batch = target or app.limits.init_batch
            steps = max(2, int(math.ceil(app.iteration(batch, app.max_epochs - 1))))
            spec = JobSpec(name=r["name"], model=ModelSpec(name=app.name, params=1.0, layers=1, hidden=1, seq_len=1),
                           global_batch=batch, steps=steps, gpus=max(1, int(r["num_replicas"])), step_time=1.0)
            jobs.append(ReplayJob(r["name"], app, float(r["time"]), target, spec))
    return jobs


@dataclass(slots=True)
class ReplayResult:
    policy: str
    jcts: dict[str, float]
    restarts: int
    rounds: int
    makespan: float
    unfinished: int

    @property
    def avg_jct(self) -> float:
        return sum(self.jcts.values()) / max(len(self.jcts), 1)


def replay(policy, jobs: list[ReplayJob], nodes: int = 16, gpus_per_node: int = 4, interval: float = 60.0,
           horizon: float = 14 * 86400.0) -> ReplayResult:
    """Run ``policy`` (a gearshift ``Policy``) on ``jobs`` until all finish (or ``horizon``)."""
    cluster = [NodeState(f"n{i:02d}", gpus_per_node, gpus_per_node, 12 * gpus_per_node, 12 * gpus_per_node)
               for i in range(nodes)]
    order = {n.name: i for i, n in enumerate(cluster)}
    by_id = {j.name: j for j in jobs}
    oracle = OracleThroughput(by_id, gpus_per_node)
    now, rounds = 0.0, 0
    while any(j.completed is None for j in jobs) and now < horizon:
        for j in jobs:
            j.step(now, interval)
        now += interval
        live = [j for j in jobs if j.submitted <= now and j.completed is None]
        views = [j.view(now) for j in live]
        decision = policy.schedule(now, cluster, views, oracle)
        check_decision(decision, cluster, {v.job_id: v for v in views})
        rounds += 1
        for j in jobs:
            d = decision.allocations.get(j.name)
            parts = sorted(((order[p.node], p.node, p.gpus) for p in d.placement if p.gpus), key=lambda x: x[0]) if d else []
            nodes_, counts = tuple(p[1] for p in parts), tuple(p[2] for p in parts)
            if counts != j.placement or nodes_ != j.nodes:
                j.reallocate(now, nodes_, counts)
    done = {j.name: j.completed - j.submitted for j in jobs if j.completed is not None}
    return ReplayResult(getattr(policy, "name", "?"), done, sum(j.restarts or 0 for j in jobs), rounds,
                        max((j.completed for j in jobs if j.completed is not None), default=0.0),
                        sum(1 for j in jobs if j.completed is None))


def run_named(policy_name: str, workload: str | Path = WORKLOADS / "workload-6.csv", seed: int = 0,
              generations: int | None = None, **options) -> ReplayResult:
    """Replay a registered policy on a Pollux workload (``pollux`` adapts batch sizes; others
    run the workload's fixed ones)."""
    from gearshift.policies.registry import make_policy

    adaptive = policy_name == "pollux"
    jobs = load_workload(workload, adaptive)
    if adaptive:
        options.setdefault("restart_cost", RESCALE_S)
        options["stats"] = lambda v: stats_for(by_id[v.job_id])
        options["seed"] = seed
        if generations is not None:
            options["generations"] = generations
    elif policy_name == "optimus":  # the artifact's cap: target batch / smallest atomic batch (ncf: 1)
        options.setdefault("max_gpus", lambda v: 1 if v.spec.model.name == "ncf"
                           else max(1, v.spec.global_batch // by_id[v.job_id].app.limits.min_atomic))
    by_id = {j.name: j for j in jobs}
    return replay(make_policy(policy_name, **options), jobs)
