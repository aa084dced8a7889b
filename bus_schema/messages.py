"""Every message that travels on the gearshift bus, as msgspec Structs.

Conventions (see docs/architecture.md):
- ``kw_only=True`` and ``frozen=True`` on every class; msgspec does not inherit
  ``kw_only`` so it is repeated on each subclass.
- Input documents we own (``JobSpec`` and its parts) forbid unknown fields so a
  typo fails loudly; everything else ignores unknown fields so newer producers
  stay readable by older consumers.
- Numeric limits live in ``Annotated[..., Meta(...)]`` so that decoding alone
  rejects out-of-range values with the JSON path of the field.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta, Struct

from gearshift.bus_schema.topology import PATH_PATTERN as TOPOLOGY_PATH_PATTERN

# ---------------------------------------------------------------- limits
MAX_NAME = 128
MAX_STR = 256
MAX_ARGS = 64
MAX_ARG_LEN = 4096
MAX_ENV = 64
MAX_GPUS = 4096
MAX_MESSAGE_BYTES = 256 * 1024
MAX_AFTER = 256  # dependencies of one job (an array named by its id counts as one)
MAX_ARRAY = 10_000  # jobs one array submit creates

Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
Label = Annotated[str, Meta(max_length=MAX_STR)]
Tenant = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
JobId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
GpuTypeName = Annotated[str, Meta(min_length=1, max_length=16, pattern=r"^[a-z0-9]+$")]
NodeName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Arg = Annotated[str, Meta(max_length=MAX_ARG_LEN)]
EnvKey = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
PosInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]


# ``gc=False`` (both bases, so every message): instances are not tracked by Python's
# cycle collector. They are frozen data decoded from JSON and cannot form a cycle, and
# the services hold tens of thousands of them in their views: untracked, a view of
# 20,000 job records is 140,000 tracked objects instead of 200,000 (only the lists
# inside remain), and a full collection over it takes 7 ms instead of 19 (issue 24).
class _Input(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of documents written by users: unknown fields are errors."""


class _Msg(Struct, kw_only=True, frozen=True, gc=False):
    """Base of internal messages: unknown fields are ignored (forward compatible)."""


# ---------------------------------------------------------------- job spec
class ModelSpec(_Input, kw_only=True, frozen=True):
    name: Name
    params: Annotated[float, Meta(gt=0, le=10_000_000)]  # millions of parameters
    layers: Annotated[int, Meta(ge=1, le=4096)]
    hidden: Annotated[int, Meta(ge=1, le=1 << 20)]
    seq_len: Annotated[int, Meta(ge=1, le=1 << 22)]
    heads: Annotated[int, Meta(ge=1, le=4096)] | None = None
    # key/value heads (grouped-query attention); absent: as many as ``heads``.
    # With ``heads``, what admission and ``reconfigure`` check a plan's TP degree
    # against (``bus_schema.plan_support.model_refusal``).
    kv_heads: Annotated[int, Meta(ge=1, le=4096)] | None = None


class Plan(_Input, kw_only=True, frozen=True):
    """An execution plan. dp*tp*pp is the number of GPUs it runs on."""

    dp: Annotated[int, Meta(ge=1, le=MAX_GPUS)] = 1
    tp: Annotated[int, Meta(ge=1, le=64)] = 1
    pp: Annotated[int, Meta(ge=1, le=512)] = 1
    zero: Annotated[int, Meta(ge=0, le=3)] = 0
    offload: bool = False
    ga: Annotated[int, Meta(ge=1, le=4096)] = 1
    micro_batch: Annotated[int, Meta(ge=1, le=1 << 20)] | None = None
    grad_ckpt: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        """Short human form, e.g. ``PP2-TP4-DP2`` or ``DP4-Z2-GA2-GC``."""
        parts = []
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        parts.append(f"DP{self.dp}")
        if self.zero:
            parts.append(f"Z{self.zero}")
        if self.offload:
            parts.append("OFF")
        if self.ga > 1:
            parts.append(f"GA{self.ga}")
        if self.grad_ckpt:
            parts.append("GC")
        if self.micro_batch:
            parts.append(f"MB{self.micro_batch}")
        return "-".join(parts)


class PlanSupport(_Input, kw_only=True, frozen=True):
    """Which plans a job's script can run (``JobSpec.plan_support``); a field
    left out allows every value, so an absent declaration keeps every plan.
    Policies (through the plan space they search), the profiler and
    ``reconfigure`` honour it (``bus_schema.plan_support.plan_refusal``)."""

    dp_max: Annotated[int, Meta(ge=1, le=MAX_GPUS)] | None = None
    # tuples, not lists: a spec is hashed (policies' caches key on it)
    tp: Annotated[tuple[Annotated[int, Meta(ge=1, le=64)], ...], Meta(min_length=1, max_length=16)] | None = None
    pp: Annotated[tuple[Annotated[int, Meta(ge=1, le=512)], ...], Meta(min_length=1, max_length=16)] | None = None
    zero: Annotated[tuple[Annotated[int, Meta(ge=0, le=3)], ...], Meta(min_length=1, max_length=4)] | None = None
    offload: bool = True
    ga_max: Annotated[int, Meta(ge=1, le=4096)] | None = None
    grad_ckpt: bool = True
    # plans the script refused (it exited EXIT_PLAN_REFUSED under them), or declared unrunnable
    exclude: Annotated[tuple[Plan, ...], Meta(max_length=64)] | None = None
class DependOn(str, enum.Enum):
    """How a dependency must end for its dependent to start (Slurm's afterok /
    afternotok / afterany)."""

    COMPLETED = "completed"  # exit 0
    FAILED = "failed"  # failed (retries used up)
    FINISHED = "finished"  # any end: completed, failed or cancelled


class Dependency(_Input, kw_only=True, frozen=True):
    """``job`` must end as ``on`` says before the job that names it starts; a job
    that ends otherwise cancels it (with the reason). ``job`` may name an array
    (its id prefix): then every element of the array."""

    job: JobId
    on: DependOn = DependOn.COMPLETED


LevelName = Annotated[str, Meta(min_length=1, max_length=32, pattern=r"^[a-z][a-z0-9-]*$")]
TopologyPathText = Annotated[str, Meta(max_length=MAX_STR, pattern=TOPOLOGY_PATH_PATTERN)]


class TopologyRequest(_Input, kw_only=True, frozen=True):
    """Where a job's gang must / would rather lie (``bus_schema.topology``): ``required``:
    every generation of the job lies in one group of that level (it waits rather than
    span it); ``preferred``: that level when one has room, else the finest that has."""

    required: LevelName | None = None
    preferred: LevelName | None = None


class JobSpec(_Input, kw_only=True, frozen=True):
    name: Name
    model: ModelSpec
    global_batch: Annotated[int, Meta(ge=1, le=1 << 24)]
    steps: Annotated[int, Meta(ge=1, le=1 << 40)]
    gpus: Annotated[int, Meta(ge=1, le=MAX_GPUS)]
    cpus_per_gpu: Annotated[int, Meta(ge=1, le=256)] | None = None
    plan: Plan | None = None
    guaranteed: bool = False
    priority: Annotated[int, Meta(ge=-1000, le=1000)] = 0
    tenant: Tenant = "default"
    command: Annotated[list[Arg], Meta(min_length=1, max_length=MAX_ARGS)] | None = None
    env: Annotated[dict[EnvKey, Arg], Meta(max_length=MAX_ENV)] | None = None
    reconfigurable: bool = True
    # Emulated worker only (no command): seconds per step at the requested plan
    # and GPUs. Absent: the performance model's prediction, else 0.1 s.
    step_time: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    # GPU types the job may run on (bus_schema.gputypes.GPU_TYPES); absent or empty = any.
    # A job always runs on nodes of one type.
    gpu_types: Annotated[tuple[GpuTypeName, ...], Meta(max_length=16)] | None = None
    # The plan dimensions and values the job's script supports; absent: all of them.
    plan_support: PlanSupport | None = None
    # Seconds from SIGTERM (checkpoint and leave) to SIGKILL when the job is
    # preempted or switched; absent: the agent's --grace. At most the cluster's
    # maximum (admission's max_checkpoint_grace).
    checkpoint_grace: Annotated[float, Meta(gt=0, le=86_400)] | None = None
    # Jobs (of the same tenant, submitted before) this one waits for (services.dependencies).
    after: Annotated[list[Dependency], Meta(max_length=MAX_AFTER)] | None = None
    # N jobs ``<id>-0`` .. ``<id>-<N-1>`` that differ only by GEARSHIFT_ARRAY_INDEX in their env.
    array: Annotated[int, Meta(ge=1, le=MAX_ARRAY)] | None = None
    # Topology levels the gang must / would rather stay within (issue 23 item 1).
    topology: TopologyRequest | None = None


class SubmitRequest(_Input, kw_only=True, frozen=True):
    spec: JobSpec
    token: Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")] | None = None


class JobRef(_Input, kw_only=True, frozen=True):
    job_id: JobId
    # cancel only: the jobs that wait on this one (and theirs) are cancelled too;
    # False: they are judged by their condition (a cancelled job counts as finished)
    cascade: bool = True


class ListRequest(_Input, kw_only=True, frozen=True):
    """One page of jobs. A reply never exceeds MAX_MESSAGE_BYTES: it holds at
    most ``limit`` jobs and fewer if they would not fit; ``JobList.next_cursor``
    continues. ``all``: finished jobs moved to the history store too, paged after
    the live ones; a job archived while a client pages may come twice (the later
    record is the final one), never not at all."""

    tenant: Tenant | None = None
    states: list[str] | None = None
    node: NodeName | None = None  # jobs placed on this node
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 10_000
    cursor: Annotated[str, Meta(max_length=256)] | None = None  # JobList.next_cursor of the previous page
    all: bool = False
    array: JobId | None = None  # only the jobs of this array (its id prefix)


# ---------------------------------------------------------------- job record
class JobState(str, enum.Enum):
    PENDING = "pending"  # admitted, waiting for resources
    SCHEDULED = "scheduled"  # allocation written, agents launching
    RUNNING = "running"
    CANCELLING = "cancelling"  # cancel asked, processes being stopped
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TERMINAL_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
# States in which a job holds (or is being given) an allocation.
ACTIVE_STATES = (JobState.SCHEDULED, JobState.RUNNING)

# The job state machine: which state may follow which. Preemption and
# re-queueing go back to PENDING; a reconfiguration goes RUNNING -> SCHEDULED.
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.SCHEDULED, JobState.CANCELLED, JobState.FAILED}),
    JobState.SCHEDULED: frozenset(
        {JobState.RUNNING, JobState.PENDING, JobState.SCHEDULED, JobState.CANCELLING, JobState.FAILED,
         JobState.COMPLETED}
    ),
    JobState.RUNNING: frozenset(
        {JobState.SCHEDULED, JobState.PENDING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLING,
         JobState.RUNNING}
    ),
    JobState.CANCELLING: frozenset({JobState.CANCELLED, JobState.CANCELLING}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


class InvalidTransition(ValueError):
    pass


class NodeShare(_Msg, kw_only=True, frozen=True):
    node: NodeName
    gpus: PosInt


class PinnedPlan(_Msg, kw_only=True, frozen=True):
    """A plan (and optionally where) an operator fixed for a job; the
    optimizer applies it instead of the policy's choice while it is set."""

    plan: "Plan"
    placement: list[NodeShare] = []  # empty: first fit
    reason: str = ""
    # set by the scheduler itself (back to the last good plan after a refusal):
    # cleared once the job ran steps under it
    until_stepped: bool = False


class SwitchTiming(_Msg, kw_only=True, frozen=True):
    """Timestamps (wall clock) of one plan switch, filled in as it happens."""

    from_generation: NonNegInt
    to_generation: NonNegInt
    from_plan: "Plan | None" = None
    from_gpus: NonNegInt = 0
    started: float  # drain began (allocation of the old generation withdrawn)
    checkpointed: float | None = None  # last rank's checkpoint written
    checkpoint_step: NonNegInt = 0
    progress_step: NonNegInt = 0  # furthest step the old generation reached
    drained: float | None = None  # every rank of the old generation exited
    grace_expired: bool = False  # its ranks were SIGKILLed at the grace (the loss counts there)
    released: float | None = None  # allocation of the new generation written
    launched: float | None = None  # processes of the new generation started (rank 0's node)


class NodePlacement(_Msg, kw_only=True, frozen=True):
    node: NodeName
    gpus: list[NonNegInt]  # GPU indices on that node
    cpus: NonNegInt = 0


class Allocation(_Msg, kw_only=True, frozen=True):
    """What the optimizer decided for one job; agents carry it out.

    ``generation`` increases with every new allocation of the job: agents
    ignore commands and allocations older than what they already run.
    """

    job_id: JobId
    generation: PosInt
    plan: Plan
    placement: list[NodePlacement]
    reason: Label = ""
    predicted_throughput: NonNegFloat | None = None
    created_at: float = 0.0
    # A copy of what a launcher needs, so agents never read gs_jobs.
    command: list[str] | None = None
    env: dict[str, str] | None = None
    step_time: float | None = None
    steps: int = 0
    global_batch: int = 0
    grace: float | None = None  # the job's checkpoint grace (None: the agent's own)

    @property
    def gpus(self) -> int:
        return sum(len(p.gpus) for p in self.placement)

    def nodes(self) -> list[str]:
        return [p.node for p in self.placement]


class JobRecord(_Msg, kw_only=True, frozen=True):
    """The authoritative state of one job, stored in KV ``gs_jobs`` under its id."""

    job_id: JobId
    spec: JobSpec
    state: JobState = JobState.PENDING
    token: str | None = None
    submitted_at: float = 0.0
    scheduled_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    generation: NonNegInt = 0  # generation of the current allocation, 0 = none yet
    plan: Plan | None = None  # plan of the current allocation
    placement: list[NodePlacement] = []
    steps_done: NonNegInt = 0
    restarts: NonNegInt = 0
    exit_code: int | None = None
    reason: str = ""  # why it is in its state (waiting reason, failure reason)
    event_seq: NonNegInt = 0  # per-job sequence number of the last event
    outbox: list["AnyJobEvent"] = []  # events written with the state, not yet confirmed published
    # Gang barrier: the placement of generation ``drain_generation`` whose
    # processes have not all exited yet. Its GPUs stay held, and the next
    # generation's allocation is written only once it is empty.
    draining: list[NodePlacement] = []
    drain_generation: NonNegInt = 0
    drain_started: float | None = None
    # node -> the ``started_at`` its agent reported when the drain there began (its own
    # clock, compared only with its own later reports): a leader that did not see the
    # drain begin still knows whether that agent restarted since (issue 24)
    drain_agents: dict[str, float] = {}
    switch: "SwitchTiming | None" = None  # the plan switch in progress, for its JobSwitched event
    failures: NonNegInt = 0  # crashes retried from the last checkpoint
    checkpoint_step: NonNegInt = 0  # step of the last checkpoint an agent reported
    pinned: "PinnedPlan | None" = None  # operator override (gs.optimizer.reconfigure)
    # The latest progress report of a running job: filled in by admission's
    # get/list replies from gs.job.<job>.progress, never stored.
    live: "JobProgress | None" = None
    # What the simulator keeps too (policies.api.make_job_view): when the current
    # (or, while pending, the last) allocation started, and the GPU-seconds of the
    # allocations that ended. Defaults keep older records decodable.
    last_switch_at: float | None = None
    attained_gpu_s: NonNegFloat = 0.0
    # The plan it last ran steps under (rank 0 reported its first step), and the
    # plans its script refused (exit EXIT_PLAN_REFUSED): never chosen again.
    last_good_plan: "Plan | None" = None
    refused_plans: list["Plan"] = []
    # Dependencies (services.dependencies): ``spec.after`` with arrays expanded to
    # their elements at submit, and those whose condition is met (written by the
    # optimizer's rounds, so a new leader goes on from them). ``cascade``: this job
    # was cancelled with cascade, its dependents are cancelled too.
    after: list[Dependency] = []
    after_met: list[JobId] = []
    cascade: bool = False
    array_index: NonNegInt | None = None  # element of the array ``spec.array`` (GEARSHIFT_ARRAY_INDEX)
    # Accounting (bus_schema.usage): plan switches done and their cost, and the
    # steps done but not in the checkpoint resumed from, by cause (switch, requeue).
    switches: NonNegInt = 0
    switch_s: NonNegFloat = 0.0  # seconds, drain start -> first step of the new generation
    switch_gpu_s: NonNegFloat = 0.0  # those seconds times the new generation's GPUs
    steps_lost: dict[str, NonNegInt] = {}

    @property
    def waits_on_dependencies(self) -> bool:
        return self.state == JobState.PENDING and len(self.after_met) < len(self.after)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def check_transition(self, new: JobState) -> None:
        if new not in ALLOWED_TRANSITIONS[self.state]:
            raise InvalidTransition(f"job {self.job_id}: {self.state.value} -> {new.value} is not allowed")


# ---------------------------------------------------------------- nodes
class GpuProcess(_Msg, kw_only=True, frozen=True):
    pid: int
    used_memory: int | None = None  # bytes; None when NVML cannot tell


class GpuHealth(str, enum.Enum):
    """What the probe knows about a GPU. Anything but ``ok`` gets no work."""

    OK = "ok"
    LOST = "lost"  # NVML: GPU is lost (fell off the bus)
    RESET_REQUIRED = "reset_required"
    ERROR = "error"  # NVML: unknown error on this GPU
    XID = "xid"  # a critical XID error was reported for it
    STALE = "stale"  # the last NVML call for it did not return in time
    UNREADABLE = "unreadable"  # its UUID or memory could not be read
    NO_DRIVER = "no_driver"  # the driver went away (reload in progress)


class GpuReport(_Msg, kw_only=True, frozen=True):
    index: NonNegInt  # position in the agent's device table: allocations name GPUs by it
    uuid: str  # GPU-... or MIG-...; "" when NVML could not tell (never made up)
    name: str = ""
    memory_used: NonNegInt = 0  # bytes
    memory_total: NonNegInt = 0  # bytes
    utilization: Annotated[float, Meta(ge=0, le=100)] | None = None  # percent
    processes: list[GpuProcess] = []
    health: GpuHealth = GpuHealth.OK  # default: reports from agents older than the field
    health_reason: Label = ""

    @property
    def healthy(self) -> bool:
        return self.health == GpuHealth.OK


class NodeReport(_Msg, kw_only=True, frozen=True):
    node: NodeName
    ts: float
    gpus: list[GpuReport]
    cpus: NonNegInt
    memory_total: NonNegInt = 0  # host bytes
    memory_used: NonNegInt = 0
    probe: str = "nvml"  # nvml | fake
    reserved: list[NonNegInt] = []  # GPU indices busy outside any allocation (profiling runs)
    running: list[str] = []  # "<job_id>@<generation>" of the processes it runs
    agent_version: str = ""
    started_at: float = 0.0
    address: str = ""  # where other nodes reach this one (MASTER_ADDR when it holds rank 0)
    gpu_type: str = ""  # normalised NVML type of its GPUs (bus_schema.gputypes); "" unknown
    # where the node sits, coarse to fine, e.g. "rack=r1/nvlink-domain=r1a" (bus_schema.topology)
    topology: TopologyPathText = ""
    # the highest gs_alloc sequence of this node's keys the agent has applied and acted on (every
    # launch and stop it implied begun; a restarted agent's reports of what it reaped sent): with
    # ``running`` it tells the optimizer a withdrawn allocation has nothing left here (issue 24)
    alloc_rev: NonNegInt = 0


# ---------------------------------------------------------------- agent <-> services
class RunReportKind(str, enum.Enum):
    STARTED = "started"
    EXITED = "exited"
    STEPPED = "stepped"  # rank 0 finished the first step of this generation


class RunReport(_Msg, kw_only=True, frozen=True):
    """An agent's account of one job process, on the durable ``GS_REPORTS`` stream."""

    job_id: JobId
    generation: PosInt
    node: NodeName
    kind: RunReportKind
    ts: float
    rank0: bool = True
    steps_done: NonNegInt = 0
    exit_code: int | None = None
    # exited because the agent stopped it (cancel, newer generation) rather
    # than by itself
    stopped: bool = False
    message: str = ""
    # EXITED: the checkpoint the job resumes from and how far it had got
    checkpoint_step: int | None = None
    checkpoint_at: float | None = None  # wall time the checkpoint was complete
    progress_step: int = 0
    stop_sent_at: float | None = None  # when the agent sent SIGTERM
    grace_expired: bool = False  # a rank outlived the grace after SIGTERM and was SIGKILLed
    # STARTED / STEPPED: timings of the new generation
    launched_at: float | None = None  # processes spawned
    start_step: int = 0
    restore_s: float | None = None  # spawn -> state restored (interpreter, imports, rendezvous, load)
    first_step_s: float | None = None  # restored -> first step done


class JobProgress(_Msg, kw_only=True, frozen=True):
    """Live progress, published on core NATS ``gs.job.<job>.progress``."""

    job_id: JobId
    generation: PosInt
    node: NodeName
    ts: float
    steps_done: NonNegInt
    steps: NonNegInt = 0
    samples_per_s: NonNegFloat = 0.0
    loss: float | None = None
    # the job's latest complete checkpoint (its manifest): step and wall time
    checkpoint_step: int | None = None
    checkpoint_at: float | None = None


class StopCommand(_Input, kw_only=True, frozen=True):
    job_id: JobId
    generation: PosInt
    reason: Label = ""


class AgentReply(_Msg, kw_only=True, frozen=True):
    ok: bool
    error: str = ""
    node: str = ""


class CheckpointCommand(_Input, kw_only=True, frozen=True):
    """Ask a running job to checkpoint at the next agreed step and go on (SIGUSR1)."""

    job_id: JobId
    generation: PosInt


class ProfileCommand(_Input, kw_only=True, frozen=True):
    """Run a job's workload on this node for a few steps with one plan and
    report its per-phase times (``gs.agent.<node>.profile``)."""

    run_id: JobId
    plan: Plan
    global_batch: Annotated[int, Meta(ge=1, le=1 << 24)]
    command: Annotated[list[Arg], Meta(min_length=1, max_length=MAX_ARGS)] | None = None
    env: Annotated[dict[EnvKey, Arg], Meta(max_length=MAX_ENV)] | None = None
    steps: Annotated[int, Meta(ge=1, le=10_000)] = 5
    step_time: Annotated[float, Meta(gt=0, le=86_400)] | None = None  # emulated worker
    timeout: Annotated[float, Meta(gt=0, le=3600)] = 120.0


class ProfileResult(_Msg, kw_only=True, frozen=True):
    ok: bool
    node: str = ""
    error: str = ""
    plan: Plan | None = None
    gpus: list[int] = []
    steps: int = 0
    iter_ms: float | None = None
    fwd_ms: float | None = None
    bwd_ms: float | None = None  # backward + gradient sync
    opt_ms: float | None = None
    wall_s: float = 0.0


class ReconfigureRequest(_Input, kw_only=True, frozen=True):
    """Operator override (``gs.optimizer.reconfigure``): run ``job_id`` with
    ``plan`` (on ``placement`` if given) until cleared with ``plan: null``."""

    job_id: JobId
    plan: Plan | None = None
    placement: list[NodeShare] = []
    reason: Label = ""


class ReconfigureReply(_Msg, kw_only=True, frozen=True):
    job_id: str
    pinned: bool
    generation: int = 0


# ---------------------------------------------------------------- replies
class ErrorReply(_Msg, kw_only=True, frozen=True):
    code: str  # "400" bad request, "404" not found, "409" conflict, "503" unavailable
    error: str
    field: str | None = None


class SubmitReply(_Msg, kw_only=True, frozen=True):
    job_id: str  # an array's id prefix: its jobs are ``<job_id>-<i>``
    created: bool  # False when the token matched an earlier submission
    state: JobState
    array: NonNegInt = 0  # jobs of the array (0: not an array)


class JobList(_Msg, kw_only=True, frozen=True):
    jobs: list[JobRecord]
    next_cursor: str | None = None  # more jobs: ask again with this cursor


class NodeList(_Msg, kw_only=True, frozen=True):
    nodes: list[NodeReport]


# ---------------------------------------------------------------- tenant queues (issue 13)
class QueueSpec(_Input, kw_only=True, frozen=True):
    """A tenant's queue: nominal GPU quota, fair-share weight, cohort whose members
    borrow each other's unused quota up to ``borrow_limit`` and lend up to
    ``lend_limit`` (None: no limit). ``policies.queues.Queue`` is the same in the core."""

    tenant: Tenant
    quota: Annotated[int, Meta(ge=0, le=1 << 20)]
    weight: Annotated[float, Meta(gt=0, le=1e6)] = 1.0
    cohort: Annotated[str, Meta(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")] = ""
    borrow_limit: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None
    lend_limit: Annotated[int, Meta(ge=0, le=1 << 20)] | None = None


class QueueList(_Msg, kw_only=True, frozen=True):
    queues: list[QueueSpec]


class RoundReply(_Msg, kw_only=True, frozen=True):
    round: int
    allocations: int
    pending: int
    duration_ms: float


class ExplainEntry(_Msg, kw_only=True, frozen=True):
    job_id: str
    state: str
    reason: str


class ExplainReply(_Msg, kw_only=True, frozen=True):
    policy: str
    round: int
    jobs: list[ExplainEntry]


# ---------------------------------------------------------------- accounting (issue 23)
class UsageRow(_Msg, kw_only=True, frozen=True):
    """One finished job's account, on the ``GS_USAGE`` stream (``gs.usage.<tenant>``)
    when it moves to the history store; ``bus_schema.usage.usage_row`` makes it."""

    job_id: str
    tenant: str
    model: str
    gpus: int = 0
    state: str = ""
    submitted_at: float = 0.0
    finished_at: float | None = None  # None: still live (a live record's account so far)
    gpu_s: float = 0.0  # GPU-seconds held
    productive_gpu_s: float = 0.0  # held less switch downtime and the work redone
    wait_s: float = 0.0  # submit -> first start (or -> now / the end, if it never started)
    restarts: int = 0
    switches: int = 0
    switch_s: float = 0.0
    switch_gpu_s: float = 0.0
    steps_lost: dict[str, int] = {}


class UsageBatch(_Msg, kw_only=True, frozen=True):
    """Usage rows of one tenant archived together: one ``GS_USAGE`` message."""

    rows: list[UsageRow]


class UsageRequest(_Input, kw_only=True, frozen=True):
    """``gearshift usage``: jobs that finished in ``[since, until]`` (epoch seconds;
    ``until`` absent: now, and the live jobs' use so far), grouped ``by``."""

    since: NonNegFloat
    until: NonNegFloat | None = None
    by: Annotated[str, Meta(pattern=r"^(tenant|job|model)$")] = "tenant"
    tenant: Tenant | None = None
    limit: Annotated[int, Meta(ge=1, le=100_000)] = 10_000  # groups in the reply (by job: the most GPU-hours)


class UsageGroup(_Msg, kw_only=True, frozen=True):
    key: str
    jobs: int = 0
    gpu_hours: float = 0.0
    productive_gpu_hours: float = 0.0
    wait_hours: float = 0.0
    restarts: int = 0
    switches: int = 0
    switch_hours: float = 0.0
    switch_gpu_hours: float = 0.0
    steps_lost: dict[str, int] = {}


class UsageReply(_Msg, kw_only=True, frozen=True):
    since: float
    until: float
    by: str
    groups: list[UsageGroup]
    total: UsageGroup
    rows_read: int = 0  # usage rows read from the stream (the window's, no more)
    live: int = 0  # live records counted


# ---------------------------------------------------------------- events
class Event(_Msg, tag_field="kind", kw_only=True, frozen=True):
    """Base of every event on the ``GS_EVENTS`` stream."""

    v: int = 1
    ts: float


class JobEvent(Event, kw_only=True, frozen=True):
    job_id: str
    seq: PosInt  # per-job, gapless: 1, 2, 3, ...
    generation: NonNegInt = 0


class JobSubmitted(JobEvent, tag="job.submitted", kw_only=True, frozen=True):
    name: str
    tenant: str
    gpus: int
    guaranteed: bool = False


class JobScheduled(JobEvent, tag="job.scheduled", kw_only=True, frozen=True):
    plan: Plan
    placement: list[NodePlacement]
    reason: str = ""
    predicted_throughput: float | None = None


class JobReconfigured(JobEvent, tag="job.reconfigured", kw_only=True, frozen=True):
    plan: Plan
    placement: list[NodePlacement]
    previous_plan: Plan | None = None
    previous_gpus: int = 0
    reason: str = ""
    predicted_gain: float | None = None


class JobPreempted(JobEvent, tag="job.preempted", kw_only=True, frozen=True):
    reason: str = ""


class JobRunning(JobEvent, tag="job.running", kw_only=True, frozen=True):
    nodes: list[str] = []


class JobCompleted(JobEvent, tag="job.completed", kw_only=True, frozen=True):
    steps_done: int = 0


class JobFailed(JobEvent, tag="job.failed", kw_only=True, frozen=True):
    reason: str
    exit_code: int | None = None


class JobCancelRequested(JobEvent, tag="job.cancel_requested", kw_only=True, frozen=True):
    pass


class JobCancelled(JobEvent, tag="job.cancelled", kw_only=True, frozen=True):
    reason: str = ""  # "" : by user; else e.g. a dependency that ended otherwise


class JobRequeued(JobEvent, tag="job.requeued", kw_only=True, frozen=True):
    reason: str = ""
    retry: int = 0  # crash retries so far (0: not a crash)
    checkpoint_step: int = 0  # where it resumes


class JobSwitched(JobEvent, tag="job.switched", kw_only=True, frozen=True):
    """A plan switch is complete (the new generation made its first step),
    with its cost by phase in seconds:
    checkpoint (drain start -> checkpoint written), teardown (-> every rank
    of the old generation exited and the new allocation written), launch
    (-> new processes spawned), restore (-> state loaded), first_step
    (-> first step done); total is drain start -> first step done."""

    from_generation: int = 0
    from_plan: Plan | None = None
    plan: Plan | None = None
    from_gpus: int = 0
    gpus: int = 0
    nodes: list[str] = []
    checkpoint_s: float = 0.0
    teardown_s: float = 0.0
    launch_s: float = 0.0
    restore_s: float = 0.0
    first_step_s: float = 0.0
    total_s: float = 0.0
    checkpoint_step: int = 0
    resumed_step: int = 0
    steps_lost: int = 0  # reached by the old generation but not in its checkpoint
    grace_expired: bool = False  # it lost them because the grace ran out (counted under that cause)


class JobGraceExpired(JobEvent, tag="job.grace_expired", kw_only=True, frozen=True):
    """A stopped generation (preempted, switched, cancelled) outlived its
    checkpoint grace and was SIGKILLed: the steps it ran since its last
    checkpoint are lost (``gearshift_steps_lost_total{cause="grace_expired"}``)."""

    node: str = ""
    grace: float | None = None
    checkpoint_step: int = 0
    progress_step: int = 0
    steps_lost: int = 0


class JobPlanRefused(JobEvent, tag="job.plan_refused", kw_only=True, frozen=True):
    """The job's script exited EXIT_PLAN_REFUSED (78) under ``plan``: the plan is
    remembered as refused (``JobRecord.refused_plans``) and the job goes back to
    ``back_to``, the plan it last ran steps under (None: the policy picks among
    the plans left)."""

    plan: Plan
    back_to: Plan | None = None
    reason: str = ""


class JobProfiled(JobEvent, tag="job.profiled", kw_only=True, frozen=True):
    model_key: str = ""
    plans: int = 0
    train_error: float | None = None
    # every profiling run failed, yet the script runs: it is scheduled on the prior
    # model (the nearest Rubick model, scaled) and this says why
    error: str = ""


class NodeJoined(Event, tag="node.joined", kw_only=True, frozen=True):
    node: str
    gpus: int
    cpus: int


class NodeLost(Event, tag="node.lost", kw_only=True, frozen=True):
    node: str
    reason: str = ""


class RoundCompleted(Event, tag="round.completed", kw_only=True, frozen=True):
    round: int
    policy: str
    pending: int
    running: int
    changes: int
    duration_ms: float
    cpu_ms: float = 0.0  # the optimizer process's CPU time over the round (time.process_time, all threads)
    changed_jobs: int = 0  # live jobs whose record moved since the last round began, or that this round wrote
    # the round's own CPU: its steps on the optimizer's event-loop thread (``bus.process.OwnCpu``)
    # plus its policy's thread, without what the loop's other tasks did while the round waited
    own_cpu_ms: float = 0.0


AnyJobEvent = (
    JobSubmitted
    | JobScheduled
    | JobReconfigured
    | JobPreempted
    | JobRunning
    | JobCompleted
    | JobFailed
    | JobCancelRequested
    | JobCancelled
    | JobRequeued
    | JobSwitched
    | JobProfiled
    | JobPlanRefused
    | JobGraceExpired
)
AnyEvent = AnyJobEvent | NodeJoined | NodeLost | RoundCompleted

JOB_EVENT_TYPES: tuple[type[JobEvent], ...] = (
    JobSubmitted, JobScheduled, JobReconfigured, JobPreempted, JobRunning, JobCompleted, JobFailed,
    JobCancelRequested, JobCancelled, JobRequeued, JobSwitched, JobProfiled, JobPlanRefused,
    JobGraceExpired,
)
EVENT_TYPES: tuple[type[Event], ...] = (*JOB_EVENT_TYPES, NodeJoined, NodeLost, RoundCompleted)


def event_kind(ev: Event | type[Event]) -> str:
    cls = ev if isinstance(ev, type) else type(ev)
    return cls.__struct_config__.tag  # type: ignore[attr-defined]

