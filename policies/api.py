"""The scheduling interface shared by the optimizer service and the simulator.

Changes (newest first; all backward compatible, every new field has a default):
- ``NodeStates`` (issue 22): nodes handed as a list that names its shape (an object
  kept while no node's name, totals, domain, type or topology changes), so what
  depends on the shape alone is not read again every round.
- ``Decision.changes`` (issue 22): a policy may also tell its decision as what it
  changes against the views it was handed (``Changes``: the jobs placed, the jobs
  left out; every other running job kept as it holds), so ``policies.decision.diff``
  looks at those jobs only; whatever edits a decision's allocations afterwards sets
  it to None.
- Topology (issue 23): ``NodeState.topology`` (a ``bus_schema.topology`` path);
  ``policies.topology.arrange`` moves each gang within its job's required level
  (``JobSpec.topology``), the finest that has room, after the policy's round;
  ``check_decision`` refuses a placement that breaks a required level.
- ``PerfOracle`` may offer ``answers_token()``: a hashable that changes whenever
  any of its answers may change (None: it cannot tell). A policy may remember
  answers while it stays equal (``ordering.RequestSpeeds``, SRTF).
  ``LearningOracle``, ``PerfModelOracle`` and the simulator's ``BeliefOracle``
  offer it. Views may be kept across rounds (``policies.views.KeptViews``): a
  policy must not change the views it is handed.
- The decision core (issue 22): ``check_decision`` moved to ``policies.decision``
  (re-exported by ``policies``), with the GPU-type rules the simulator had alone
  (one type per placement, one the job accepts); ``policies.decision.diff`` splits a
  decision into keep / preempt / start / reconfigure for the simulator and the
  optimizer alike.
- GPU types (issue 13): ``NodeState.gpu_type``, ``Placement.gpu_type`` (not part of
  equality), ``placement_type``, ``accepts(spec, type)`` (``JobSpec.gpu_types``),
  ``with_type``. A job runs on nodes of one type; ``policies.hetero`` runs a policy
  that knows nothing of types once per type.
- ``JobView.target_throughput``: a guaranteed job's promised samples/s; when
  None, policies that need it compute "requested plan on requested GPUs" with
  the oracle. ``JobView.cpus`` property.
- ``JobView.switched_at``: last_switch_at, else started_at (used for pins).
- ``JobDecision.predicted_gain``: relative throughput change vs the job's
  current allocation (0.38 = +38%); None for starts.
- ``SchedOptions`` (restart_cost, min_run_time): policies take them as
  keyword options, e.g. ``make_policy("rubick", restart_cost=260,
  min_run_time=600)``.
- ``PerfOracle`` may also offer ``plans(job, placement)`` (candidate plans for
  that shape) and ``throughput_many(job, plans, placement)`` (vectorised);
  without them policies use ``policies.plans.candidate_plans`` and loop.
  ``policies.oracle.PerfModelOracle`` implements all three on ``perfmodel``.
  An oracle may also say what its answers depend on, ``spec_key(spec)``
  (hashable): jobs with equal keys share cached curves (default: the spec
  minus name/steps/tenant/priority/guarantee/command).
- ``check_decision`` also refuses plan/placement mismatches per job and
  duplicate nodes within one job.

A policy is a pure function of (cluster, jobs, clock, performance oracle) to a
*desired state*: the allocation every job should hold after this round. Jobs
that hold resources now and are absent from the decision are preempted; jobs
whose plan or placement differs are reconfigured (the caller charges the
restart). Keeping the output declarative lets the simulator and the optimizer
service apply it the same way, and makes invariants easy to check.

What callers should fill (simulator, optimizer service):
- ``NodeState``: capacity the policy may hand out (totals minus what is not
  the policy's: draining, profiling); ``domain`` = rack/switch if known.
- ``JobView``: ``placement``/``plan`` of running jobs (CPUs in the
  placement), ``steps_done``, ``attained_service`` (GPU-seconds, for
  las/tiresias/gavel), ``restarts``, ``started_at`` and ``last_switch_at``
  (when the current allocation started; for a job not running now, when its
  last allocation started), ``target_throughput`` for guaranteed jobs if the
  promise is not "its request as the model predicts it". Build it with
  ``make_job_view`` (the simulator and the optimizer both do).
- ``perf``: the fitted model, e.g. ``policies.oracle.PerfModelOracle()``;
  ``None`` makes model-driven policies fall back to ``AnalyticOracle``.
- Keep one policy object across rounds: it caches curves and remembers
  what it preempted.

Nothing here imports NATS; the simulator must stay fast, so these are slotted
dataclasses rather than bus messages. ``bus_schema.Plan`` is reused for plans
because a plan is the same thing on the bus and in the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gearshift.bus_schema.messages import JobSpec, Plan


@dataclass(slots=True)
class NodeState:
    name: str
    gpus_total: int
    gpus_free: int
    cpus_total: int
    cpus_free: int
    # Locality domain (rack / switch). Nodes in one domain talk faster.
    domain: str = ""
    # Normalised GPU type (bus_schema.gputypes); "" = unknown (the model's reference).
    gpu_type: str = ""
    # Topology path, coarse to fine (bus_schema.topology.parse_path); () = none known.
    # ``policies.topology.arrange`` keeps gangs within it after every policy's round.
    topology: tuple = ()


@dataclass(slots=True, frozen=True)
class Placement:
    """GPUs and CPUs a job holds on one node."""

    node: str
    gpus: int
    cpus: int = 0
    # The node's GPU type, so an oracle can answer for it (hypothetical shapes
    # carry the type they ask about). Not part of equality: it follows the node.
    gpu_type: str = field(default="", compare=False)


@dataclass(slots=True)
class JobView:
    """What a policy may know about one job (never the ground-truth speed)."""

    job_id: str
    spec: JobSpec
    submitted_at: float
    steps_done: float = 0.0
    # Current holding; empty when pending.
    placement: tuple[Placement, ...] = ()
    plan: Plan | None = None
    attained_service: float = 0.0  # GPU-seconds received so far
    restarts: int = 0
    last_switch_at: float | None = None  # when its current allocation started
    started_at: float | None = None  # first start, None if never ran
    # Guaranteed jobs: promised samples/s (None: the oracle's prediction of the
    # requested plan on the requested GPUs, compactly placed).
    target_throughput: float | None = None
    # Wall time of its latest checkpoint, as its agents report it (None: none
    # known); what a preemption would lose (``policies.victims``).
    checkpoint_at: float | None = None

    @property
    def running(self) -> bool:
        return bool(self.placement)

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.placement)

    @property
    def switched_at(self) -> float | None:
        """When the current allocation started: ``last_switch_at``, else the
        first start (callers that do not track switches still get pins)."""
        return self.last_switch_at if self.last_switch_at is not None else self.started_at

    @property
    def cpus(self) -> int:
        return sum(p.cpus for p in self.placement)

    @property
    def remaining_steps(self) -> float:
        return max(0.0, self.spec.steps - self.steps_done)


class NodeStates(list):
    """A round's ``NodeState`` s (a list) that name their shape: ``shape`` is an object
    the caller keeps for as long as every node's name, totals, domain, GPU type and
    topology stay as they are, in the same order (only what is free changes). What
    depends on the shape alone (``placement.Ledgers``, ``hetero.node_types``) is kept
    while it is the same object; a plain list is read afresh."""

    __slots__ = ("shape",)

    def __init__(self, nodes: Iterable[NodeState] = (), shape: object = None):
        super().__init__(nodes)
        self.shape = shape


class ShapeMemo:
    """One value worked out from a round's nodes (``make(nodes)``), kept while the
    nodes name the same shape (``NodeStates``): a plain list is read afresh. So a
    round's per-node work (index by name, capacity arrays, the candidate space) is
    done once per shape, not once per round. One tuple is swapped in, so a reader
    on another thread sees a value with the shape it was made for."""

    __slots__ = ("_hit",)

    def __init__(self) -> None:
        self._hit: tuple = (None, None)

    def get(self, nodes: list[NodeState], make: Any) -> Any:
        named = nodes.shape if type(nodes) is NodeStates else None
        hit = self._hit
        if named is None or hit[0] is not named:
            hit = (named, make(nodes))
            self._hit = hit
        return hit[1]


def placement_type(placement: tuple[Placement, ...]) -> str:
    """The GPU type of a placement (a job runs on one type): its first typed part."""
    for p in placement:
        if p.gpu_type:
            return p.gpu_type
    return ""


def accepts(spec: JobSpec, gpu_type: str) -> bool:
    """May a job run on GPUs of this type? (``JobSpec.gpu_types``, empty = any.)"""
    types = getattr(spec, "gpu_types", None)
    return not types or gpu_type in types


def with_type(placement: tuple[Placement, ...], gpu_type: str) -> tuple[Placement, ...]:
    """``placement`` with every part typed ``gpu_type``."""
    for p in placement:
        if p.gpu_type != gpu_type:
            break
    else:
        return placement
    return tuple(Placement(p.node, p.gpus, p.cpus, gpu_type) for p in placement)


def attained_service(before: float, placement: tuple[Placement, ...], last_switch_at: float | None, now: float) -> float:
    """GPU-seconds of ended allocations plus the current one's GPUs x time since it started."""
    if placement and last_switch_at is not None:
        return before + sum(p.gpus for p in placement) * max(0.0, now - last_switch_at)
    return before


def make_job_view(job_id: str, spec: JobSpec, submitted_at: float, now: float, *, steps_done: float = 0.0,
                  placement: tuple[Placement, ...] = (), plan: Plan | None = None, attained_before: float = 0.0,
                  restarts: int = 0, last_switch_at: float | None = None, started_at: float | None = None,
                  target_throughput: float | None = None, checkpoint_at: float | None = None) -> JobView:
    """The one way a ``JobView`` is made, live (``services.policy_bridge``) and in the
    simulator: attained service = GPU-seconds of finished allocations
    (``attained_before``) + the current one's GPUs x time since it started."""
    attained = attained_service(attained_before, placement, last_switch_at, now)
    return JobView(job_id=job_id, spec=spec, submitted_at=submitted_at, steps_done=steps_done,
                   placement=placement, plan=plan if placement else None, attained_service=attained,
                   restarts=restarts, last_switch_at=last_switch_at, started_at=started_at,
                   target_throughput=target_throughput, checkpoint_at=checkpoint_at)


@dataclass(slots=True)
class JobDecision:
    placement: tuple[Placement, ...]
    plan: Plan
    reason: str = ""
    predicted_throughput: float | None = None  # samples/s the policy expects
    predicted_gain: float | None = None  # vs the current allocation; None for a start


@dataclass(slots=True, frozen=True)
class Changes:
    """A decision told as what it changes against the job views its policy was handed
    (``jobs``: that list object): every job there holding an allocation keeps it as it
    holds (the same plan and placement) unless named here. ``placed``: the jobs allocated
    anew, elsewhere or again, in the decision's order; ``left``: jobs that held an
    allocation and are left out (preempted). ``policies.decision.diff`` then looks at
    these jobs only (issue 22's rounds that do only what changed)."""

    jobs: Any
    placed: tuple[str, ...]
    left: tuple[str, ...]


@dataclass(slots=True)
class Decision:
    """Desired state after a round: job_id -> allocation; absent = not running."""

    allocations: dict[str, JobDecision] = field(default_factory=dict)
    # Why each job that does not run is waiting, in words.
    waiting: dict[str, str] = field(default_factory=dict)
    # The same decision as changes, when its policy tells it so (``Changes``); whatever
    # edits ``allocations`` after the policy sets it to None.
    changes: Changes | None = None


class PerfOracle(Protocol):
    """What a policy may ask about job speed: the fitted model, never ground truth."""

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        """Predicted samples/s of ``plan`` on ``placement`` (0 if infeasible)."""
        ...


DEFAULT_RESTART_COST = 260.0  # s; Rubick's simulator figure until a measured model replaces it
DEFAULT_MIN_RUN_TIME = 600.0  # s


@dataclass(slots=True, frozen=True)
class SchedOptions:
    """Settings every reconfiguring policy honours.

    restart_cost: seconds of lost progress a (re)start costs; charged to every
      change of plan or placement when comparing options.
    min_run_time: a job that (re)started less than this ago is not switched by
      an optimisation move (guaranteed admissions may still evict best-effort
      jobs, see each policy).
    """

    restart_cost: float = DEFAULT_RESTART_COST
    min_run_time: float = DEFAULT_MIN_RUN_TIME


class Policy(Protocol):
    name: str

    def schedule(
        self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None
    ) -> Decision: ...


def default_plan(spec: JobSpec) -> Plan:
    """The plan a job asked for; plain data parallel over its GPUs if none."""
    if spec.plan is not None:
        return spec.plan
    return Plan(dp=spec.gpus)


class AllocationError(ValueError):
    """A decision that the cluster cannot hold (over-allocation, unknown node...)."""
