"""The optimizer service: scheduling rounds, allocations, job lifecycle.

Only the lease holder acts. As leader it
- consumes agents' RunReports (durable consumer, acked after the state
  change is written) and moves jobs to RUNNING / COMPLETED / FAILED /
  CANCELLED;
- runs a round on arrival, on completion, on request and on a timer: builds
  the policy's view from KV, calls the policy (the same objects the
  simulator runs), writes job records (CAS, with events) and then the
  allocations they imply;
- reconciles ``gs_alloc`` with ``gs_jobs`` every round, so a crash between
  the two writes heals by itself: the record is the truth, the allocation
  is derived from it.

Plan switches are a gang barrier. A running job whose plan or placement
changes gets generation g+1 in its record at once, but its old placement
goes into ``draining`` and only generation g's allocation is withdrawn:
every agent of g checkpoints and stops its ranks. Each EXITED report of g
removes its node from ``draining``; when none is left the allocation of g+1
is written, so no rank of g+1 starts before every rank of g has stopped.
Preempted, re-queued and crashed jobs drain the same way. While a placement
drains its GPUs count as held: no other job gets them. A drain that never
hears from a node (node lost, or ``drain_timeout`` over) is settled by the
round. The switch's timestamps ride in the record (``switch``) and become a
``job.switched`` event with the cost by phase once the new rank 0 reports
its first step (STEPPED).

Crashes: an EXITED report with a non-zero code the agent did not cause
re-queues the job (it resumes from its last checkpoint) up to
``max_retries`` times, then fails it with the reason.

Operators can pin a plan (``gs.optimizer.reconfigure``): while pinned the
optimizer uses that plan (and placement, if given) instead of the policy's.
With ``wait_for_models`` a job whose model has no fitted parameters (KV
``gs_models``) and no shipped fit waits for the profiler and says so.

The parts live in their own modules, each testable without NATS:
``lifecycle`` (report -> new state, ALLOWED_TRANSITIONS), ``capacity``
(held GPUs, GPU assignment, pins), ``alloc_writer`` (fenced, concurrent
allocation writes), ``report_consumer``, ``leadership`` (lease + fence) and
``views`` (materialised views of gs_jobs, gs_nodes, gs_alloc). A round reads
the views, so it costs O(live jobs + nodes), and its writes go out
concurrently with bounded parallelism.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from gearshift.bus import observe
from gearshift.bus.client import connect
from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.config import NonNegative, NonNegInt, Positive, ServiceConfig, defaults, load, option
from gearshift.bus.infra import ensure_infra
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus.server import Endpoint, RequestError, serve
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus.views import JobsView, NodesView
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    ACTIVE_STATES,
    ExplainEntry,
    ExplainReply,
    JobProgress,
    JobRecord,
    NodeReport,
    ReconfigureReply,
    ReconfigureRequest,
    RoundReply,
    RunReport,
)
from gearshift.bus_schema.ops import NodeModeReply, NodeModeRequest
from gearshift.bus_schema.topology import parse_factors
from gearshift.perfmodel.kernels import warm_up as warm_up_perfmodel

from gearshift.policies.kernels import warm_up
from gearshift.policies.registry import make_policy, policy_names
from gearshift.policies.sharing import Shared
from gearshift.services import node_modes
from gearshift.services.alloc_writer import AllocView, AllocWriter, allocation_for, bounded, emulated_step_time  # noqa: F401
from gearshift.services.dependencies import DependencyGate
from gearshift.services.fencing import Deposed
from gearshift.services.jobstore import JobStore
from gearshift.services.leadership import Leadership
from gearshift.services.liveness import NodeLiveness
from gearshift.services.outbox import OutboxFlusher
from gearshift.services.pacing import RoundPacer
from gearshift.services.policy_bridge import LiveModels, ModelsView, PolicyStep
from gearshift.services.progress_lines import ProgressFeed, decode_lines
from gearshift.services.queues import QueueStore
from gearshift.services.record_writer import REASON_WRITES_PER_ROUND, RecordWriter, with_drain_agents  # noqa: F401
from gearshift.services.report_consumer import ReportApplier, consume_reports
from gearshift.services.round_state import node_facts
from gearshift.services.rounds import Rounds

DEFAULT_MAX_RETRIES = 3
DEFAULT_DRAIN_TIMEOUT = 120.0


class OptimizerConfig(ServiceConfig):
    """gearshift optimizer: the scheduling rounds (one leader; standbys wait on the lease)."""

    service: ClassVar[str] = "optimizer"
    policy: Annotated[str, Meta(min_length=1), option("scheduling policy", env="GEARSHIFT_POLICY")] = "fifo"
    policy_options: Annotated[str | None, option(
        'JSON keyword arguments for the policy, e.g. {"restart_cost": 5}',
        env="GEARSHIFT_POLICY_OPTIONS")] = None
    interval: Annotated[Positive, option("seconds between timer rounds")] = 5.0
    node_timeout: Annotated[Positive, option("seconds without heartbeat before a node is lost")] = 10.0
    lease_ttl: Annotated[Positive, option("seconds a silent leader keeps the lease")] = 6.0
    archive_after: Annotated[NonNegative, option(
        "seconds a finished job stays in gs_jobs before it moves to the history store")] = 30.0
    max_retries: Annotated[NonNegInt, option(
        "crashes retried from the last checkpoint before a job fails")] = DEFAULT_MAX_RETRIES
    drain_timeout: Annotated[Positive, option(
        "seconds a switch waits for the old ranks' exit reports before it goes on")] = DEFAULT_DRAIN_TIMEOUT
    wait_for_models: Annotated[bool, option(
        "jobs without a fitted or shipped performance model wait for the profiler",
        env="GEARSHIFT_WAIT_FOR_MODELS")] = False
    round_gap: Annotated[NonNegative, option(
        "seconds at least between the end of a round and the start of the next (what arrives meanwhile "
        "goes into one round)")] = 0.1
    round_duty: Annotated[float, Meta(gt=0, le=1), option(
        "the most of the time rounds may take: after a round of W s the next waits W x (1 - duty) / duty "
        "(the leader's CPU for rounds: at most this share of a core)")] = 0.25
    learn_every: Annotated[NonNegative, option(
        "seconds at least between lessons of the policy's oracle from measured step times (each makes the "
        "policy work out again the candidates of every job of the models taught; out-of-memory exits are "
        "taught at once; 0: every measure at once)")] = 10.0
    bandwidth: Annotated[str, option(
        "inter-node bandwidth per topology level a placement spans, as a factor of the fitted one: "
        "LEVEL=FACTOR,..., e.g. cluster=0.25: across racks a quarter of in-rack (default: none, the fitted "
        "bandwidth everywhere)", metavar="FACTORS")] = ""

    def __post_init__(self) -> None:
        parse_factors(self.bandwidth)  # a one-line error naming bandwidth.LEVEL
        if self.policy_options:
            try:
                opts = msgspec.json.decode(self.policy_options)
            except msgspec.DecodeError:
                raise ValueError("policy_options: not valid JSON") from None
            if not isinstance(opts, dict):
                raise ValueError("policy_options: expected a JSON object")
        else:
            opts = {}

        if self.policy not in policy_names():
            raise ValueError(f"policy: unknown policy {self.policy!r}; known: {', '.join(policy_names())}")
        try:
            make_policy(self.policy, **opts)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"policy_options: {exc}") from None


log = get_logger(service="optimizer")

ACTIVE = ACTIVE_STATES
OPTIMIZER_RECONFIGURE = subj.OPTIMIZER_RECONFIGURE
PAUSE_ENV = "GEARSHIFT_FAULT_PAUSE_MID_ROUND"  # fault injection: path of a file that, present, stops the leader mid-round


_D = defaults(OptimizerConfig)  # the keyword defaults below are the config's, written once


class Optimizer:
    def __init__(
        self,
        nc: Any,
        *,
        policy: str = _D.policy,
        interval: float = _D.interval,
        node_timeout: float = _D.node_timeout,
        instance: str | None = None,
        lease_ttl: float = _D.lease_ttl,
        policy_options: dict[str, Any] | None = None,
        max_retries: int = _D.max_retries,
        drain_timeout: float = _D.drain_timeout,
        wait_for_models: bool = _D.wait_for_models,
        bandwidth: str = _D.bandwidth,
        round_gap: float = _D.round_gap,
        round_duty: float = _D.round_duty,
        learn_every: float = _D.learn_every,
        write_parallel: int = 32,
        archive_after: float = _D.archive_after,
        clock: Clock = SYSTEM,  # what stamps times: records, allocations, events, the policy's now
    ):
        self.nc, self.clock = nc, clock
        self.js = nc.jetstream()
        self.policy = make_policy(policy, **(policy_options or {}))
        self.interval = interval
        self.pacer = RoundPacer(round_gap, round_duty)  # kicked rounds close together become one
        self.node_timeout = node_timeout
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_ttl = lease_ttl
        self.max_retries = max_retries
        self.drain_timeout = drain_timeout
        self.wait_for_models = wait_for_models
        self.links = parse_factors(bandwidth)  # what the policy's oracle prices spans by (policies.topology_price)
        self.write_parallel = write_parallel
        self.learn_every = learn_every
        self.archive_after = archive_after
        self.store = JobStore(nc)
        self.store.lazy_clear = True  # an outbox is cleared by the record's next write, not a write of its own
        self.outbox = OutboxFlusher(self.store, clear=False)  # new records' events (services.outbox), as leader
        self.round_no = 0
        self.last_explain: Callable[[], list[ExplainEntry]] = list  # the last round's entries, made when asked
        self.kick = asyncio.Event()
        self.liveness = NodeLiveness(self.js, node_timeout, clock)
        self.lost_nodes = self.liveness.lost  # nodes this leader called lost
        self._round_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._svc: Any = None
        self._subs: list[Any] = []
        self.is_leader = False
        self.leader_since: float | None = None
        self.records_seen: dict[str, JobRecord] = {}  # the last round's records
        self._live_before: dict[str, JobRecord] = {}  # the jobs view's live records as the last round began
        self.reconcile_every = 10.0  # seconds between full gs_alloc reconciliations while nothing failed
        self._reconcile_at = 0.0  # monotonic time the next one is due (0: the first round as leader)
        self.operator = OperatorActions(self)
        self.rounds = Rounds(self)

    async def open(self) -> "Optimizer":
        await self.store.open()
        self.nodes_kv = await self.js.key_value(subj.NODES_BUCKET)
        self.models_kv = await self.js.key_value(subj.MODELS_BUCKET)
        self.modes_kv = await self.js.key_value(subj.NODE_MODES_BUCKET)
        self.modes = await node_modes.ModesView(self.js).start()
        self.models = LiveModels(self.models_kv, self.links, self.learn_every)
        self.models.view = await ModelsView(self.js).start()
        self.models.view.on_change = self._model_changed  # a model just fitted is used at once
        self.policy_step = PolicyStep(self.policy, self.models, wait_for_models=self.wait_for_models, clock=self.clock)
        self.queues = None
        if isinstance(self.policy, Shared):  # tenant queues: config seeds gs_queues, the bucket wins
            self.queues = self.policy_step.queues = await QueueStore(self.nc).open()
            self.share_base = self.policy_step.share_base = self.policy.cfg
            await self.queues.seed(self.share_base)
            await self._load_sharing_memory()
        # standbys keep their views warm too: a takeover need not read the buckets
        self.jobs = await JobsView(self.js, subj.JOBS_BUCKET).start()
        self.jobs.on_new = self._new_record  # a leader publishes a new job's event and runs a round
        self.nodes = await NodesView(self.js, subj.NODES_BUCKET, facts=node_facts).start()  # dirty: facts changed
        self.allocs = await AllocView(self.js).start()
        self.leadership = Leadership(
            self.nc, await self.js.key_value(subj.LEASE_BUCKET), "optimizer", self.instance, ttl=self.lease_ttl,
            buckets=[subj.JOBS_BUCKET, subj.ALLOC_BUCKET],
        )
        self.lease = self.leadership.lease
        self.liveness.fence = self.leadership.fence  # its node.lost events are the leader's, fenced
        self.writer = AllocWriter(self.leadership.fence, self.allocs, parallel=self.write_parallel, clock=self.clock)
        self.records = RecordWriter(self.store, self.writer, self.jobs, parallel=self.write_parallel,
                                    drain_timeout=self.drain_timeout, archive_after=self.archive_after, clock=self.clock)
        self.store.before_write = lambda rec: with_drain_agents(rec, self.nodes.get)  # each drain's agent incarnation
        self.deps = DependencyGate(self.store, self.jobs.entries, self.records.hint, self.clock, self.write_parallel)
        self.report_applier = ReportApplier(self.store, self.writer, self.records.hint, self.models,
                                            max_retries=lambda: self.max_retries, parallel=self.write_parallel,
                                            clock=self.clock)
        return self

    async def _load_sharing_memory(self) -> None:
        """Fair-share usage and starvation timers as the last leader saved them."""
        state = await self.queues.load_usage()
        if state:
            self.policy.restore(state)

    async def close(self) -> None:
        for view in (self.jobs, self.nodes, self.allocs, self.modes, self.models.view):
            await view.stop()

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the lease, lead until it is lost or ``stop`` is set."""
        try:
            await self.leadership.run(stop, lambda lost: self._lead(stop, lost))
        finally:
            await self.close()

    async def _lead(self, stop: asyncio.Event, lost: asyncio.Event) -> None:
        self.is_leader = True
        self.leader_since = time.monotonic()
        self._reconcile_at = 0.0  # a new leader heals what a dead one left half-written (a full round)
        self.store.fence = self.leadership.fence
        self.outbox.start()
        observe.LEADER.set(1)
        if self.queues is not None:  # a standby goes on from what the last leader saved, not from its start
            await self._load_sharing_memory()
        log.info("leading", instance=self.instance, policy=self.policy.name, epochs=self.leadership.fence.epochs)

        try:  # events a dead leader (or no leader: the admission only writes) left unpublished,
            # before the kernels below: on a cold numba cache they take tens of seconds, and
            # followers would wait that long for a job.submitted already written
            await self._flush_outboxes()
        except Deposed as exc:
            self.leadership.deposed(exc)
        # compile/load the numba kernels before the first round: the policy's and the
        # performance model's its oracle calls (compiled lazily inside a round, they held
        # the GIL for tens of seconds on a cold cache, and shutdown waited for the thread)
        await asyncio.to_thread(lambda: (warm_up(), warm_up_perfmodel()))
        self._svc = await serve(
            self.nc,
            "optimizer",
            [
                Endpoint("round", subj.OPTIMIZER_ROUND, None, self._round_endpoint),
                Endpoint("explain", subj.OPTIMIZER_EXPLAIN, None, self._explain_endpoint),
                Endpoint("reconfigure", OPTIMIZER_RECONFIGURE, ReconfigureRequest, self.operator.reconfigure),
                Endpoint("node", subj.OPTIMIZER_NODE, NodeModeRequest, self.operator.node),
            ],
            "gearshift scheduling rounds",
            {"policy": self.policy.name, "instance": self.instance},
        )

        async def on_kick(_msg: Any) -> None:
            self.kick.set()

        self._subs = [  # (new jobs kick a round from the jobs view: _new_record)
            await self.nc.subscribe(subj.OPTIMIZER_KICK, cb=on_kick),
        ]
        # progress lines in bulk from GS_PROGRESS, a fetch a second (services.progress_lines)
        feed = ProgressFeed(self.js, self.on_progress_lines)
        self._tasks = [
            asyncio.create_task(self._consume_reports()),
            asyncio.create_task(round_loop(self)),
            asyncio.create_task(feed.run(lambda: self.is_leader)),
        ]
        stop_w = asyncio.create_task(stop.wait())
        lost_w = asyncio.create_task(lost.wait())
        await asyncio.wait([stop_w, lost_w], return_when=asyncio.FIRST_COMPLETED)
        self.is_leader = False
        await cancel_and_wait([stop_w, lost_w, *self._tasks])
        await feed.stop()
        for s in self._subs:
            await s.unsubscribe()
        await self._svc.stop()
        await self.outbox.stop()
        self.store.fence = None
        observe.LEADER.set(0)

    def _model_changed(self) -> None:
        """A model written to ``gs_models`` (``ModelsView.on_change``): as leader, a round runs."""
        if self.is_leader:
            self.kick.set()

    def _new_record(self, rec: JobRecord, rev: int) -> None:
        """A job seen for the first time (``JobsView.on_new``): as leader, its
        ``job.submitted`` goes out (the admission only wrote it) and a round runs."""
        if self.is_leader:
            if rec.outbox:
                self.outbox.add(rec, rev)
            self.kick.set()

    async def _flush_outboxes(self) -> None:
        await self.jobs.sync()
        todo = [r.job_id for r in self.jobs.values() if r.outbox]
        await bounded([self.store.flush(j) for j in todo], self.write_parallel)

    # ------------------------------------------------------------ reports
    async def _consume_reports(self) -> None:
        try:
            await consume_reports(self.js, self.apply_report, self._round_lock, lambda: self.is_leader,
                                  apply_many=self.apply_reports, turn_gap=self.pacer.gap)
        except Deposed as exc:
            self.leadership.deposed(exc)

    async def apply_report(self, r: RunReport) -> None:
        """Move the job's state for one agent report; stale generations are ignored."""
        await self.apply_reports([r])

    async def apply_reports(self, reports: list[RunReport]) -> None:
        """A turn of reports (``report_consumer.ReportApplier``)."""
        try:
            if await self.report_applier.apply(reports):
                self.kick.set()
        except Deposed:
            raise
        except Exception:
            self._reconcile_at = 0.0  # records written, allocations maybe not: the next round heals them
            raise

    # ------------------------------------------------------------ rounds
    async def on_progress(self, msg: Any) -> None:
        """One progress line as a message (the parity harness delivers them so)."""
        self.on_progress_lines(decode_lines([msg]))

    def on_progress_lines(self, lines: list[JobProgress]) -> None:
        """Steps done between exits, for the policy's view (``PolicyInputs``)."""
        for p in lines:
            self.policy_step.on_progress(p)

    @property
    def progress(self) -> dict[str, tuple[int, int]]:
        return self.policy_step.progress

    async def _round_endpoint(self, _: None) -> RoundReply:
        return await self.round(flush=True)  # asked for: its waiting reasons are in the records when it answers

    async def _explain_endpoint(self, _: None) -> ExplainReply:
        return ExplainReply(policy=self.policy.name, round=self.round_no, jobs=self.last_explain())

    async def live_nodes(self) -> list[NodeReport]:
        """Nodes heard from within ``node_timeout`` by the server's clock (``liveness``)."""
        return await self.liveness.live(self.nodes, self.leader_since)

    def _grace_over(self) -> bool:
        return self.liveness.grace_over(self.leader_since)

    async def round(self, *, flush: bool = False, strict: bool = False) -> RoundReply:
        """One round now. ``flush``: its waiting reasons written before it returns;
        ``strict`` (implied by ``flush``): every view synced with the server first, as
        a full round does (``services.rounds``)."""
        async with self._round_lock:
            return await self._round(flush, strict)

    async def _round(self, flush: bool = False, strict: bool = False) -> RoundReply:
        return await self.rounds.run(flush, strict)  # services.rounds

    async def archive(self) -> int:
        """Finished jobs to the history store (``RecordWriter.archive``, at most one pass
        every few seconds), under the round lock, between rounds: 80-170 ms a pass at 200
        finishes a second on 2,000 nodes, which a round that did it waited for."""
        async with self._round_lock:
            return await self.records.archive()

    def pause_if_asked(self) -> None:
        """Fault injection (``PAUSE_ENV``): stop here, after deciding and before writing."""
        if _pause_requested():
            self.leadership.stop_renewing()
            _pause()


async def round_loop(opt: "Optimizer") -> None:
    """The leader's rounds: on a kick or every ``interval``, paced (``services.pacing``),
    each followed by an archive pass, until it is no longer leader."""
    async def failed_round() -> None:
        opt._reconcile_at = 0.0  # what it wrote may be half done: the next round heals it
        await asyncio.sleep(0.5)

    while opt.is_leader:
        try:
            await asyncio.wait_for(opt.kick.wait(), timeout=opt.interval)
        except asyncio.TimeoutError:
            pass
        wait = opt.pacer.delay(time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)  # what arrives meanwhile goes into this round
        opt.kick.clear()
        started = time.monotonic()
        if not await _leader_step(opt, opt.round, "round", failed_round):
            return
        opt.pacer.ended(started, time.monotonic())
        # between rounds, in the pacer's rest: not a round's time (the next pass retries a failed one)
        if not await _leader_step(opt, opt.archive, "archive"):
            return


async def _leader_step(opt: "Optimizer", step: Callable[[], Awaitable[Any]], what: str,
                       failed: Callable[[], Awaitable[None]] | None = None) -> bool:
    """Run one of the leader's steps; False once it was deposed (its loop ends)."""
    try:
        await step()
    except asyncio.CancelledError:
        raise
    except Deposed as exc:
        opt.leadership.deposed(exc)
        return False
    except Exception:
        log.exception(f"{what} failed")
        if failed is not None:
            await failed()
    return True


class OperatorActions:
    """What operators ask the leader: a node's mode (cordon / drain / uncordon) and a
    job's pinned plan. Both act through the optimizer's parts and kick a round."""

    def __init__(self, opt: "Optimizer"):
        self.opt = opt

    async def node(self, req: NodeModeRequest) -> NodeModeReply:
        """Cordon / drain / uncordon a node (applied by the next round, kicked now)."""
        if req.mode is not None:
            known = {n.node for n in await self.opt.live_nodes()}
            await node_modes.set_mode(self.opt.modes_kv, req, known, self.opt.clock)
            log.info("node mode", node=req.node, mode=req.mode.value, reason=req.reason)
            await self.opt.round(strict=True)  # applied before the reply: the jobs it moves are in it
        else:
            await self.opt.modes.sync()
        return node_modes.reply(self.opt.modes.modes(), self.opt.records_seen.values(), req.node)

    async def reconfigure(self, req: ReconfigureRequest) -> ReconfigureReply:
        try:
            reply = await self.opt.records.pin(req)
        except Deposed as exc:
            self.opt.leadership.deposed(exc)
            raise RequestError("503", "this optimizer is no longer the leader; retry", "job_id") from None
        self.opt.kick.set()
        return reply


def _pause_requested() -> bool:
    """Fault injection for the fencing test: the file named by
    GEARSHIFT_FAULT_PAUSE_MID_ROUND exists. The round then stops this process
    (SIGSTOP) after deciding and before writing, its lease renewal stopped."""
    path = os.environ.get(PAUSE_ENV)
    return bool(path) and os.path.exists(path)


def _pause() -> None:
    path = os.environ[PAUSE_ENV]
    os.unlink(path)
    with open(path + ".paused", "w") as f:
        f.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP)


async def amain(stop: asyncio.Event, args: OptimizerConfig) -> None:
    nc = await connect(args.server, name="gearshift-optimizer")
    await ensure_infra(nc)
    opt = await Optimizer(
        nc, policy=args.policy, interval=args.interval, node_timeout=args.node_timeout,
        policy_options=json.loads(args.policy_options) if args.policy_options else None,
        max_retries=args.max_retries, drain_timeout=args.drain_timeout, wait_for_models=args.wait_for_models,
        lease_ttl=args.lease_ttl, archive_after=args.archive_after, bandwidth=args.bandwidth,
        round_gap=args.round_gap, round_duty=args.round_duty, learn_every=args.learn_every,
    ).open()
    # a standby is ready too (it waits for the lease); readyz says which one leads
    obs = await observe.serve_http("optimizer", "optimizer", nc, lambda: {"leader": opt.is_leader, "round": opt.round_no})
    obs.set_ready()
    await opt.run(stop)
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    cfg = load(OptimizerConfig, argv)  # flags, GEARSHIFT_OPTIMIZER_<FIELD>, --config FILE
    run_service(lambda stop: amain(stop, cfg))


if __name__ == "__main__":
    main()
