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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import time
import uuid
from typing import Any

import msgspec
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus_schema import codec, subjects as subj
from bus_schema.messages import (
    JobProgress,
    ACTIVE_STATES,
    Allocation,
    JobSwitched,
    NodeShare,
    PinnedPlan,
    ReconfigureReply,
    ReconfigureRequest,
    SwitchTiming,
    ExplainEntry,
    ExplainReply,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobPreempted,
    JobReconfigured,
    JobRecord,
    JobRequeued,
    JobRunning,
    JobScheduled,
    JobState,
    NodeLost,
    NodePlacement,
    NodeReport,
    Plan,
    RoundCompleted,
    RoundReply,
    RunReport,
    RunReportKind,
)
from bus_schema.ops import NodeModeReply, NodeModeRequest
from policies import Decision, JobView, NodeState, Placement, check_decision, make_policy
from policies.api import JobDecision

from . import auth_alloc, node_modes, observe
from .policy_bridge import ModelOracle, job_view, segment_gpu_s
from .queues import QueueStore
from policies.sharing import Shared
from .jobstore import JobStore, kv_snapshot, publish_event, with_event
from .lease import Lease
from .runtime import Endpoint, connect, ensure_infra, get_logger, now, run_service, serve

log = get_logger(service="optimizer")

ACTIVE = ACTIVE_STATES
DEFAULT_STEP_TIME = 0.1
DEFAULT_MAX_RETRIES = 3
DEFAULT_DRAIN_TIMEOUT = 120.0
OPTIMIZER_RECONFIGURE = subj.OPTIMIZER_RECONFIGURE


def emulated_step_time(rec: JobRecord, plan: Plan) -> float:
    """Seconds per step for the emulated worker: the spec's step time at its
    requested GPUs, scaled linearly to the plan's GPUs."""
    base = rec.spec.step_time or DEFAULT_STEP_TIME
    return base * rec.spec.gpus / max(1, plan.gpus)


class Optimizer:
    def __init__(
        self,
        nc: Any,
        *,
        policy: str = "fifo",
        interval: float = 5.0,
        node_timeout: float = 10.0,
        instance: str | None = None,
        lease_ttl: float = 6.0,
        policy_options: dict[str, Any] | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
        wait_for_models: bool = False,
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.policy = make_policy(policy, **(policy_options or {}))
        self.interval = interval
        self.node_timeout = node_timeout
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_ttl = lease_ttl
        self.max_retries = max_retries
        self.drain_timeout = drain_timeout
        self.wait_for_models = wait_for_models
        self.store = JobStore(nc)
        self.round_no = 0
        self.last_explain: list[ExplainEntry] = []
        self.kick = asyncio.Event()
        self.lost_nodes: set[str] = set()
        self._round_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._svc: Any = None
        self._subs: list[Any] = []
        self.progress: dict[str, tuple[int, int]] = {}  # job -> (generation, steps) from JobProgress
        self.is_leader = False
        self.leader_since: float | None = None
        self.records_seen: dict[str, JobRecord] = {}  # the last round's records

    async def open(self) -> "Optimizer":
        await self.store.open()
        self.alloc_kv = await self.js.key_value(subj.ALLOC_BUCKET)
        self.nodes_kv = await self.js.key_value(subj.NODES_BUCKET)
        self.models_kv = await self.js.key_value(subj.MODELS_BUCKET)
        self.modes_kv = await self.js.key_value(subj.NODE_MODES_BUCKET)
        self.models = ModelOracle(self.models_kv)
        self.queues = None
        if isinstance(self.policy, Shared):  # tenant queues: config seeds gs_queues, the bucket wins
            self.queues = await QueueStore(self.nc).open()
            self.share_base = self.policy.cfg
            await self.queues.seed(self.share_base)
            usage = await self.queues.load_usage()
            if usage:
                self.policy.fair.load(usage)
        self.lease = Lease(
            await self.js.key_value(subj.LEASE_BUCKET), "optimizer", self.instance, ttl=self.lease_ttl,
            renew=self.lease_ttl / 4,
        )
        return self

    # ------------------------------------------------------------ lifecycle
    async def run(self, stop: asyncio.Event) -> None:
        """Wait for the lease, lead until it is lost or ``stop`` is set."""
        while not stop.is_set():
            if await self.lease.try_acquire():
                lost = asyncio.Event()
                await self._lead(stop, lost)
                if stop.is_set():
                    break
                log.warning("lease lost; back to standby", instance=self.instance)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(1.0, self.lease_ttl / 4))
                except asyncio.TimeoutError:
                    pass
        await self.lease.release()

    async def _lead(self, stop: asyncio.Event, lost: asyncio.Event) -> None:
        self.is_leader = True
        self.leader_since = time.monotonic()
        observe.LEADER.set(1)
        log.info("leading", instance=self.instance, policy=self.policy.name)
        from policies.kernels import warm_up

        await asyncio.to_thread(warm_up)  # compile/load the numba kernels before the first round
        await self.store.flush_all()  # events a dead leader wrote but never published
        self._svc = await serve(
            self.nc,
            "optimizer",
            [
                Endpoint("round", subj.OPTIMIZER_ROUND, None, self._round_endpoint),
                Endpoint("explain", subj.OPTIMIZER_EXPLAIN, None, self._explain_endpoint),
                Endpoint("reconfigure", OPTIMIZER_RECONFIGURE, ReconfigureRequest, self._reconfigure_endpoint),
                Endpoint("node", subj.OPTIMIZER_NODE, NodeModeRequest, self._node_endpoint),
            ],
            "gearshift scheduling rounds",
            {"policy": self.policy.name, "instance": self.instance},
        )

        async def on_kick(_msg: Any) -> None:
            self.kick.set()

        self._subs = [
            await self.nc.subscribe(subj.OPTIMIZER_KICK, cb=on_kick),
            await self.nc.subscribe("gs.evt.job.*.submitted", cb=on_kick),
            await self.nc.subscribe("gs.job.*.progress", cb=self.on_progress),
        ]
        self._tasks = [
            asyncio.create_task(self.lease.hold(lost)),
            asyncio.create_task(self._consume_reports()),
            asyncio.create_task(self._round_loop()),
        ]
        stop_w = asyncio.create_task(stop.wait())
        lost_w = asyncio.create_task(lost.wait())
        await asyncio.wait([stop_w, lost_w], return_when=asyncio.FIRST_COMPLETED)
        self.is_leader = False
        for t in (stop_w, lost_w, *self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for s in self._subs:
            await s.unsubscribe()
        await self._svc.stop()
        self.is_leader = False
        observe.LEADER.set(0)

    # ------------------------------------------------------------ reports
    async def _consume_reports(self) -> None:
        psub = await self.js.pull_subscribe(
            subj.REPORTS_SUBJECTS,
            durable="optimizer",
            stream=subj.REPORTS_STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30),
        )
        try:
            while self.is_leader:  # nats-py's fetch can swallow a cancel: check a flag too
                try:
                    msgs = await psub.fetch(64, timeout=1)
                except asyncio.CancelledError:
                    raise
                except Exception:  # timeout: nothing to do
                    continue
                for msg in msgs:
                    try:
                        report = codec.decode(msg.data, RunReport)
                    except msgspec.MsgspecError:
                        log.warning("dropping malformed run report", subject=msg.subject)
                        await msg.term()
                        continue
                    # Not during a round: a round decides from the records it read
                    # at its start, and a report settling a drain meanwhile would
                    # have its fresh allocation deleted by that round's reconcile.
                    async with self._round_lock:
                        await self.apply_report(report)
                    await msg.ack()
        finally:
            # a pull subscription left open blocks drain() on shutdown
            await psub.unsubscribe()

    async def apply_report(self, r: RunReport) -> None:
        """Move the job's state for one agent report; stale generations are ignored."""
        ended = False
        released = False

        def change(rec: JobRecord) -> JobRecord | None:
            nonlocal ended, released
            ended = released = False
            if (r.kind == RunReportKind.EXITED and rec.draining and r.generation == rec.drain_generation
                    and r.node in {p.node for p in rec.draining}):
                new, released, ended = self._drained(rec, [r.node], r)
                return new
            self.models.observe_report(rec, r)  # what ran teaches the oracle (policies.learning)
            if rec.generation != r.generation or rec.terminal:
                return None
            ts = r.ts
            if r.kind == RunReportKind.STARTED:
                new = rec
                if rec.switch is not None and rec.switch.to_generation == r.generation and r.rank0:
                    new = msgspec.structs.replace(
                        new, switch=msgspec.structs.replace(rec.switch, launched=r.launched_at or ts))
                if rec.state == JobState.SCHEDULED and r.rank0:
                    new = msgspec.structs.replace(
                        new, state=JobState.RUNNING, started_at=rec.started_at or ts, reason="running"
                    )
                    return with_event(new, JobRunning, ts=ts, nodes=[p.node for p in rec.placement])
                return new if new is not rec else None
            if r.kind == RunReportKind.STEPPED:
                if rec.switch is None or rec.switch.to_generation != r.generation or not r.rank0:
                    return None
                return self._switched(rec, r)
            if r.kind != RunReportKind.EXITED:
                return None
            steps = max(rec.steps_done, r.steps_done)
            if r.checkpoint_step is not None:
                rec = msgspec.structs.replace(rec, checkpoint_step=max(rec.checkpoint_step, r.checkpoint_step))
            if rec.state == JobState.CANCELLING:
                ended = True
                new = msgspec.structs.replace(
                    rec, state=JobState.CANCELLED, finished_at=ts, steps_done=steps, reason="cancelled by user"
                )
                return with_event(new, JobCancelled, ts=ts)
            if rec.state not in ACTIVE:
                return None
            if r.exit_code == 0 and r.rank0:
                ended = True
                if rec.switch is not None and rec.switch.to_generation == r.generation and r.first_step_s is not None:
                    # it finished before its STEPPED report was applied: close the switch now
                    rec = self._switched(rec, r)
                new = msgspec.structs.replace(
                    rec, state=JobState.COMPLETED, finished_at=ts, steps_done=max(steps, rec.spec.steps),
                    exit_code=0, reason="completed",
                )
                return with_event(new, JobCompleted, ts=ts, steps_done=new.steps_done)
            if r.stopped or r.exit_code == 0:
                return None  # stopped on our request, or a follower that finished: nothing to learn
            ended = True
            why = f"process on {r.node} exited with code {r.exit_code}" + (f": {r.message}" if r.message else "")
            others = [p for p in rec.placement if p.node != r.node]
            if rec.failures < self.max_retries:
                # retry from the last checkpoint; the other nodes' ranks drain first
                retry = rec.failures + 1
                new = msgspec.structs.replace(
                    rec, state=JobState.PENDING, placement=[], steps_done=steps, failures=retry,
                    attained_gpu_s=rec.attained_gpu_s + segment_gpu_s(rec, ts),
                    restarts=rec.restarts + 1, switch=None, reason=f"retry {retry}/{self.max_retries}: {why}",
                    draining=others, drain_generation=rec.generation, drain_started=now() if others else None,
                )
                return with_event(new, JobRequeued, ts=ts, reason=new.reason, retry=retry,
                                  checkpoint_step=rec.checkpoint_step)
            why = f"{why} (after {rec.failures} retries)" if rec.failures else why
            new = msgspec.structs.replace(
                rec, state=JobState.FAILED, finished_at=ts, steps_done=steps, exit_code=r.exit_code, reason=why,
                draining=others, drain_generation=rec.generation, drain_started=now() if others else None,
                switch=None,
            )
            return with_event(new, JobFailed, ts=ts, reason=why, exit_code=r.exit_code)

        new = await self.store.update(r.job_id, change)
        if new is not None:
            log.info("job state", job_id=r.job_id, state=new.state.value, generation=r.generation,
                     kind=r.kind.value, draining=[p.node for p in new.draining])
        if released and new is not None:
            await self._put_alloc(new)
        if ended or released:
            if ended and new is not None and new.state not in ACTIVE:
                await self._delete_alloc(r.job_id)
            self.kick.set()

    def _drained(self, rec: JobRecord, nodes: list[str], r: RunReport | None) -> tuple[JobRecord, bool, bool]:
        """``rec`` with ``nodes`` no longer draining -> (record, release the next
        generation's allocation, job ended)."""
        ts = now()
        left = [p for p in rec.draining if p.node not in nodes]
        new = msgspec.structs.replace(rec, draining=left, drain_started=rec.drain_started if left else None)
        if r is not None and r.checkpoint_step is not None:
            new = msgspec.structs.replace(new, checkpoint_step=max(rec.checkpoint_step, r.checkpoint_step))
        sw = rec.switch
        if sw is not None and r is not None:
            ck = sw.checkpointed
            if r.checkpoint_at is not None and r.checkpoint_at >= sw.started - 1:
                ck = max(ck or 0.0, r.checkpoint_at)
            sw = msgspec.structs.replace(
                sw, checkpointed=ck, checkpoint_step=max(sw.checkpoint_step, r.checkpoint_step or 0),
                progress_step=max(sw.progress_step, r.progress_step))
        if left:
            return msgspec.structs.replace(new, switch=sw), False, False
        if sw is not None:
            sw = msgspec.structs.replace(sw, drained=ts)
        if rec.state == JobState.CANCELLING and rec.switch is not None:
            # cancelled while switching: the new generation never started
            new = msgspec.structs.replace(new, state=JobState.CANCELLED, finished_at=ts, switch=None,
                                          reason="cancelled by user")
            return with_event(new, JobCancelled, ts=ts), False, True
        if rec.state in ACTIVE:
            if sw is not None:
                sw = msgspec.structs.replace(sw, released=ts)
            return msgspec.structs.replace(new, switch=sw), True, False
        return msgspec.structs.replace(new, switch=sw), False, False

    def _switched(self, rec: JobRecord, r: RunReport) -> JobRecord:
        """The new generation made its first step: the switch's cost by phase."""
        sw = rec.switch
        assert sw is not None
        started = sw.started
        ckpt = sw.checkpointed or started
        released = sw.released or ckpt
        launched = sw.launched or r.launched_at or released
        restore = max(0.0, r.restore_s or 0.0)
        first = max(0.0, r.first_step_s or 0.0)
        done_at = launched + restore + first
        new = msgspec.structs.replace(rec, switch=None)
        return with_event(
            new, JobSwitched, ts=r.ts, from_generation=sw.from_generation, from_plan=sw.from_plan, plan=rec.plan,
            from_gpus=sw.from_gpus, gpus=sum(len(p.gpus) for p in rec.placement), nodes=[p.node for p in rec.placement],
            checkpoint_s=max(0.0, ckpt - started), teardown_s=max(0.0, released - ckpt),
            launch_s=max(0.0, launched - released), restore_s=restore, first_step_s=first,
            total_s=max(0.0, done_at - started), checkpoint_step=sw.checkpoint_step, resumed_step=r.start_step,
            steps_lost=max(0, sw.progress_step - sw.checkpoint_step),
        )

    # ------------------------------------------------------------ rounds
    async def on_progress(self, msg: Any) -> None:
        """Steps done between exits, for the policy's view (in memory, newest generation
        only; the record itself still learns them at exits and checkpoints)."""
        try:
            p = codec.decode(msg.data, JobProgress)
        except msgspec.MsgspecError:
            return
        got = self.progress.get(p.job_id)
        if got is None or (p.generation, p.steps_done) > got:
            self.progress[p.job_id] = (p.generation, p.steps_done)
            self.models.observe_progress(p.job_id, p.generation, p.ts, p.steps_done)  # speed, once it trains

    async def _round_loop(self) -> None:
        while self.is_leader:
            try:
                await asyncio.wait_for(self.kick.wait(), timeout=self.interval)
            except asyncio.TimeoutError:
                pass
            self.kick.clear()
            try:
                await self.round()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("round failed")
                await asyncio.sleep(0.5)

    async def _round_endpoint(self, _: None) -> RoundReply:
        return await self.round()

    async def _explain_endpoint(self, _: None) -> ExplainReply:
        return ExplainReply(policy=self.policy.name, round=self.round_no, jobs=self.last_explain)

    async def live_nodes(self) -> list[NodeReport]:
        snap = await kv_snapshot(self.nodes_kv)
        reports = [codec.decode(v, NodeReport) for v, _ in snap.values()]
        t = now()
        alive = []
        for n in reports:
            if t - n.ts <= self.node_timeout:
                alive.append(n)
                self.lost_nodes.discard(n.node)
            elif n.node not in self.lost_nodes and self._grace_over():
                self.lost_nodes.add(n.node)
                await publish_event(
                    self.js, NodeLost(ts=t, node=n.node, reason=f"no heartbeat for {t - n.ts:.0f}s"),
                    f"node:{n.node}:lost:{n.ts:.3f}", subj.node_event(n.node, "node.lost"),
                )
                log.warning("node lost", node=n.node, silent_s=round(t - n.ts, 1))
        return sorted(alive, key=lambda n: n.node)

    def _grace_over(self) -> bool:
        # A new leader gives agents one timeout to be heard before calling nodes lost.
        return self.leader_since is not None and time.monotonic() - self.leader_since > self.node_timeout

    async def round(self) -> RoundReply:
        async with self._round_lock:
            return await self._round()

    async def _round(self) -> RoundReply:
        started = time.perf_counter()
        self.round_no += 1
        records = {r.job_id: r for r, _ in await self.store.all()}
        nodes = await self.live_nodes()
        alive = {n.node for n in nodes}
        changes = 0

        # Jobs on lost nodes go back to the queue.
        for rec in list(records.values()):
            if rec.state in ACTIVE and any(p.node not in alive for p in rec.placement) and self._grace_over():
                new = await self._requeue(rec, "node lost: " + ",".join(p.node for p in rec.placement if p.node not in alive), alive)
                if new:
                    records[rec.job_id] = new
                    changes += 1
        changes += await self._settle_drains(records, alive)
        # Operators' cordons and drains (services.node_modes).
        modes = await node_modes.read_modes(self.modes_kv)
        for rec, why in node_modes.to_move(records.values(), modes):
            new = await self._preempt(rec, why)
            if new:
                records[rec.job_id] = new
                changes += 1
        self.records_seen = records

        # Capacity: what cancelling and draining jobs still hold is not free
        # until their processes exited; neither are GPUs agents profile on.
        held: dict[str, set[int]] = {}
        for rec in records.values():
            if rec.state == JobState.CANCELLING:
                for p in rec.placement:
                    held.setdefault(p.node, set()).update(p.gpus)
            # A switching job's old GPUs stay held until its old ranks exit, except
            # those its new placement reuses: the policy counts those as the job's
            # holding already, and counting them twice over-allocates the node.
            own = {(p.node, g) for p in rec.placement for g in p.gpus} if rec.state in ACTIVE else set()
            for p in rec.draining:
                held.setdefault(p.node, set()).update(g for g in p.gpus if (p.node, g) not in own)
        for n in nodes:
            if n.reserved:
                held.setdefault(n.node, set()).update(n.reserved)
            sick = [g.index for g in n.gpus if not g.healthy]  # lost, XID, stale...: no work
            if sick:
                held.setdefault(n.node, set()).update(sick)
        for node, gpus in node_modes.cordon_held(nodes, records.values(), modes).items():
            held.setdefault(node, set()).update(gpus)
        node_states = [
            NodeState(
                name=n.node,
                gpus_total=len(n.gpus) - len(held.get(n.node, ())),
                gpus_free=len(n.gpus) - len(held.get(n.node, ())),
                cpus_total=n.cpus,
                cpus_free=n.cpus,
            )
            for n in nodes
        ]
        unmodelled = await self._unmodelled(records) if self.wait_for_models else {}
        views = [self._view(r) for r in records.values()
                 if r.state in (JobState.PENDING, *ACTIVE) and r.job_id not in unmodelled]
        views = [v for v in views if all(p.node in alive for p in v.placement)]
        if len(self.progress) > len(views):  # forget jobs that ended
            live_ids = {v.job_id for v in views}
            self.progress = {k: v for k, v in self.progress.items() if k in live_ids}
        await self.models.refresh([records[v.job_id] for v in views])
        if self.queues is not None:
            self.policy.set_config(await self.queues.config(self.share_base))
        # the policy is pure CPU work: off the loop, so the lease keeps being renewed
        decision: Decision = await asyncio.to_thread(self.policy.schedule, now(), node_states, views, self.models.oracle)
        if self.queues is not None:
            await self.queues.save_usage(self.policy.fair.state())
        self._apply_pins(decision, records, node_states, {v.job_id for v in views})
        check_decision(decision, node_states, {v.job_id: v for v in views})
        for job_id, key in unmodelled.items():
            decision.waiting[job_id] = f"waiting for its performance model: profiling {key}"

        gpu_count = {n.node: len(n.gpus) for n in nodes}
        changes += await self._apply(decision, records, gpu_count, held)
        await self._reconcile_allocs(records)

        explain = []
        for job_id, why in decision.waiting.items():
            explain.append(ExplainEntry(job_id=job_id, state=records[job_id].state.value, reason=why))
            if records[job_id].reason != why and records[job_id].state == JobState.PENDING:
                await self.store.update(
                    job_id, lambda r, why=why: msgspec.structs.replace(r, reason=why) if r.state == JobState.PENDING else None
                )
        for job_id, d in decision.allocations.items():
            explain.append(ExplainEntry(job_id=job_id, state="allocated", reason=d.reason))
        self.last_explain = explain

        pending = sum(1 for v in views if v.job_id not in decision.allocations)
        ms = (time.perf_counter() - started) * 1e3
        observe.ROUND_SECONDS.labels(self.policy.name).observe(ms / 1e3)
        observe.job_states(records.values())
        if changes:
            ev = RoundCompleted(
                ts=now(), round=self.round_no, policy=self.policy.name, pending=pending,
                running=len(decision.allocations), changes=changes, duration_ms=ms,
            )
            await publish_event(self.js, ev, f"round:{self.instance}:{self.round_no}", subj.round_event(ev.__struct_config__.tag))
        return RoundReply(round=self.round_no, allocations=len(decision.allocations), pending=pending, duration_ms=ms)

    def _view(self, rec: JobRecord) -> JobView:
        # with the progress agents publish between exits (gs.job.<id>.progress), as the simulator knows it
        got = self.progress.get(rec.job_id)
        return job_view(rec, now(), got[1] if got is not None and got[0] == rec.generation else None)

    async def _apply(
        self, decision: Decision, records: dict[str, JobRecord], gpu_count: dict[str, int], held: dict[str, set[int]]
    ) -> int:
        changes = 0
        # GPU indices in use: held (cancelling, draining, profiling) and every
        # active job's current placement: a job that is switched or preempted
        # now drains first, so nobody else may take its GPUs this round.
        used: dict[str, set[int]] = {k: set(v) for k, v in held.items()}
        keep: set[str] = set()
        for rec in records.values():
            if rec.state in ACTIVE:
                for p in rec.placement:
                    used.setdefault(p.node, set()).update(p.gpus)
        for job_id, d in decision.allocations.items():
            rec = records[job_id]
            if rec.state in ACTIVE and self._same_shape(rec, d):
                keep.add(job_id)
        # Preemptions first, so their GPUs are free for what follows.
        for rec in list(records.values()):
            if rec.state in ACTIVE and rec.job_id not in decision.allocations:
                new = await self._preempt(rec, decision.waiting.get(rec.job_id, "preempted by policy"))
                if new:
                    records[rec.job_id] = new
                    changes += 1
        for job_id, d in list(decision.allocations.items()):  # entries may be deferred below
            if job_id in keep:
                continue
            rec = records[job_id]
            own = {p.node: set(p.gpus) for p in rec.placement} if rec.state in ACTIVE else {}
            placement = []
            for p in d.placement:
                # a switching job may reuse its own GPUs: its ranks stop before the new ones start
                taken = used.get(p.node, set()) - own.get(p.node, set())
                taken |= {g for q in placement if q.node == p.node for g in q.gpus}
                free = [i for i in range(gpu_count[p.node]) if i not in taken][: p.gpus]
                if len(free) < p.gpus:
                    placement = None
                    break
                placement.append(NodePlacement(node=p.node, gpus=free, cpus=p.cpus))
            if placement is None:
                # the policy counted GPUs that are still draining: next round
                log.info("allocation deferred: GPUs still held", job_id=job_id)
                decision.allocations.pop(job_id)
                decision.waiting[job_id] = "waiting for GPUs that other jobs are still releasing"
                continue
            for p in placement:
                used.setdefault(p.node, set()).update(p.gpus)
            new = await self._allocate(rec, d, placement)
            if new:
                records[job_id] = new
                changes += 1
        return changes

    @staticmethod
    def _same_shape(rec: JobRecord, d: JobDecision) -> bool:
        have = sorted((p.node, len(p.gpus), p.cpus) for p in rec.placement)
        want = sorted((p.node, p.gpus, p.cpus) for p in d.placement)
        return have == want and rec.plan == d.plan

    async def _allocate(self, rec: JobRecord, d: JobDecision, placement: list[NodePlacement]) -> JobRecord | None:
        ts = now()
        reconfig = rec.state in ACTIVE

        def change(r: JobRecord) -> JobRecord | None:
            if r.state not in (JobState.PENDING, *ACTIVE) or r.generation != rec.generation:
                return None  # changed under us (cancelled, completed): skip this round
            if reconfig and r.draining:
                return None  # one switch at a time
            gen = r.generation + 1
            new = msgspec.structs.replace(
                r, state=JobState.SCHEDULED, generation=gen, plan=d.plan, placement=placement,
                scheduled_at=r.scheduled_at or ts, reason=d.reason, restarts=r.restarts + (1 if reconfig else 0),
                last_switch_at=ts, attained_gpu_s=r.attained_gpu_s + segment_gpu_s(r, ts),
            )
            if reconfig:  # gang barrier: generation gen starts once every rank of r.generation exited
                new = msgspec.structs.replace(
                    new, draining=list(r.placement), drain_generation=r.generation, drain_started=ts,
                    switch=SwitchTiming(from_generation=r.generation, to_generation=gen, from_plan=r.plan,
                                        from_gpus=sum(len(p.gpus) for p in r.placement), started=ts),
                )
            if reconfig:
                return with_event(
                    new, JobReconfigured, ts=ts, generation=gen, plan=d.plan, placement=placement,
                    previous_plan=r.plan, previous_gpus=sum(len(p.gpus) for p in r.placement), reason=d.reason,
                    predicted_gain=d.predicted_gain,
                )
            return with_event(
                new, JobScheduled, ts=ts, generation=gen, plan=d.plan, placement=placement, reason=d.reason,
                predicted_throughput=d.predicted_throughput,
            )

        new = await self.store.update(rec.job_id, change)
        if new is not None:
            if new.draining:
                await self._delete_alloc(new.job_id)  # the old generation checkpoints and stops
            else:
                await self._put_alloc(new)
            log.info("job scheduled", job_id=new.job_id, generation=new.generation, plan=d.plan.label(),
                     nodes=[p.node for p in placement], draining=[p.node for p in new.draining])
        return new

    async def _preempt(self, rec: JobRecord, why: str) -> JobRecord | None:
        return await self._back_to_queue(rec, why, JobPreempted)

    async def _requeue(self, rec: JobRecord, why: str, alive: set[str]) -> JobRecord | None:
        # ranks on the nodes still alive must stop before the job restarts
        new = await self._back_to_queue(rec, why, JobRequeued, alive, with_checkpoint=True)
        if new is not None:
            log.warning("job requeued", job_id=rec.job_id, reason=why)
        return new

    async def _back_to_queue(
        self, rec: JobRecord, why: str, event: type, alive: set[str] | None = None, with_checkpoint: bool = False
    ) -> JobRecord | None:
        """PENDING again, its old ranks draining; the allocation is withdrawn."""
        ts = now()

        def change(r: JobRecord) -> JobRecord | None:
            if r.state not in ACTIVE or r.generation != rec.generation:
                return None
            new = msgspec.structs.replace(
                r, state=JobState.PENDING, placement=[], reason=why, restarts=r.restarts + 1, switch=None,
                attained_gpu_s=r.attained_gpu_s + segment_gpu_s(r, ts), **_drain_fields(r, ts, alive),
            )
            extra = {"checkpoint_step": r.checkpoint_step} if with_checkpoint else {}
            return with_event(new, event, ts=ts, reason=why, **extra)

        new = await self.store.update(rec.job_id, change)
        if new is not None:
            await self._delete_alloc(rec.job_id)
        return new

    # ------------------------------------------------------------ drains, pins, models
    async def _settle_drains(self, records: dict[str, JobRecord], alive: set[str]) -> int:
        """End drains that cannot finish: nodes that are gone, or a drain older
        than ``drain_timeout`` (the agent's SIGKILL should have come long before)."""
        changes = 0
        t = now()
        for rec in list(records.values()):
            if not rec.draining:
                continue
            timed_out = rec.drain_started is not None and t - rec.drain_started > self.drain_timeout
            gone = [p.node for p in rec.draining if timed_out or p.node not in alive]
            if not gone:
                continue
            released = False

            def change(r: JobRecord, gone=gone) -> JobRecord | None:
                nonlocal released
                if not r.draining:
                    return None
                new, released, _ = self._drained(r, gone, None)
                return new

            new = await self.store.update(rec.job_id, change)
            if new is not None:
                log.warning("drain settled without reports", job_id=rec.job_id, nodes=gone, timed_out=timed_out)
                records[rec.job_id] = new
                changes += 1
                if released:
                    await self._put_alloc(new)
        return changes

    def _apply_pins(
        self, decision: Decision, records: dict[str, JobRecord], nodes: list[NodeState], eligible: set[str]
    ) -> None:
        """Operator-pinned plans replace the policy's choice for their jobs,
        where the GPUs the other jobs leave allow it."""
        pinned = [r for r in records.values() if r.pinned is not None and r.job_id in eligible]
        if not pinned:
            return
        policy_choice = {rec.job_id: decision.allocations.pop(rec.job_id, None) for rec in pinned}
        for rec in sorted(pinned, key=lambda r: r.submitted_at):
            pin = rec.pinned
            assert pin is not None
            free = {n.name: n.gpus_total for n in nodes}
            for d in decision.allocations.values():
                for p in d.placement:
                    free[p.node] = free.get(p.node, 0) - p.gpus
            shares = [(s.node, s.gpus) for s in pin.placement]
            current = [(p.node, len(p.gpus)) for p in rec.placement]
            if (not shares and rec.state in ACTIVE and rec.plan == pin.plan
                    and sum(g for _, g in current) == pin.plan.gpus):
                shares = current  # already runs the pinned plan: stay where it is
            if not shares:  # first fit: one node if possible, else fill nodes in order
                need = pin.plan.gpus
                one = next((n for n in sorted(free) if free[n] >= need), None)
                if one is not None:
                    shares = [(one, need)]
                else:
                    for n in sorted(free):
                        take = min(need, max(0, free[n]))
                        if take:
                            shares.append((n, take))
                            need -= take
                    if need:
                        shares = []
            if not shares or any(free.get(n, -1) < g for n, g in shares):
                if policy_choice[rec.job_id] is not None:  # keep what the policy chose meanwhile
                    decision.allocations[rec.job_id] = policy_choice[rec.job_id]
                else:
                    decision.waiting[rec.job_id] = f"pinned plan {pin.plan.label()} waits for {pin.plan.gpus} GPUs"
                continue
            decision.waiting.pop(rec.job_id, None)
            cur = {p.node: p.cpus for p in rec.placement}
            decision.allocations[rec.job_id] = JobDecision(
                placement=tuple(Placement(n, g, cur.get(n, 0)) for n, g in shares), plan=pin.plan,
                reason=f"pinned by operator{': ' + pin.reason if pin.reason else ''}",
            )

    async def _unmodelled(self, records: dict[str, JobRecord]) -> dict[str, str]:
        """Pending jobs whose model has no fit yet: job id -> model key."""
        from .perfmodel_service import unmodelled_jobs

        return {job_id: key for job_id, (key, _) in (await unmodelled_jobs(self.models_kv, records.values())).items()}

    async def _node_endpoint(self, req: NodeModeRequest) -> NodeModeReply:
        """Cordon / drain / uncordon a node (applied by the next round, kicked now)."""
        if req.mode is not None:
            known = {n.node for n in await self.live_nodes()}
            await node_modes.set_mode(self.modes_kv, req, known)
            log.info("node mode", node=req.node, mode=req.mode.value, reason=req.reason)
            await self.round()  # applied before the reply: the jobs it moves are in it
        return node_modes.reply(await node_modes.read_modes(self.modes_kv), self.records_seen.values(), req.node)

    async def _reconfigure_endpoint(self, req: ReconfigureRequest) -> ReconfigureReply:
        from .runtime import RequestError, bad_request

        if req.plan is not None:
            if req.placement and sum(s.gpus for s in req.placement) != req.plan.gpus:
                raise bad_request(f"placement has {sum(s.gpus for s in req.placement)} GPUs, plan "
                                  f"{req.plan.label()} needs {req.plan.gpus}", "placement")
        pin = None if req.plan is None else PinnedPlan(plan=req.plan, placement=req.placement, reason=req.reason)

        def change(r: JobRecord) -> JobRecord | None:
            if r.terminal:
                return None
            return msgspec.structs.replace(r, pinned=pin)

        got = await self.store.get(req.job_id)
        if got is None:
            raise RequestError("404", f"no job {req.job_id}", "job_id")
        new = await self.store.update(req.job_id, change)
        if new is None:
            raise RequestError("409", f"job {req.job_id} has ended", "job_id")
        self.kick.set()
        log.info("plan pinned" if pin else "pin cleared", job_id=req.job_id, plan=req.plan.label() if req.plan else None)
        return ReconfigureReply(job_id=req.job_id, pinned=pin is not None, generation=new.generation)

    # ------------------------------------------------------------ allocations
    def allocation_for(self, rec: JobRecord) -> Allocation:
        assert rec.plan is not None
        return Allocation(
            job_id=rec.job_id, generation=rec.generation, plan=rec.plan, placement=rec.placement, reason=rec.reason,
            created_at=now(), command=rec.spec.command, env=rec.spec.env,
            step_time=emulated_step_time(rec, rec.plan), steps=rec.spec.steps, global_batch=rec.spec.global_batch,
        )

    async def _put_alloc(self, rec: JobRecord) -> None:
        data = codec.encode(self.allocation_for(rec))
        await self.alloc_kv.put(rec.job_id, data)
        await auth_alloc.put(self.alloc_kv, rec.job_id, data, [p.node for p in rec.placement])

    async def _delete_alloc(self, job_id: str) -> None:
        try:
            await self.alloc_kv.delete(job_id)
        except Exception:
            pass
        await auth_alloc.delete(self.alloc_kv, job_id)  # the per-node copies agents read

    async def _reconcile_allocs(self, records: dict[str, JobRecord]) -> None:
        """Make gs_alloc agree with gs_jobs (heals a crash between the two writes)."""
        allocs = {k: codec.decode(v, Allocation) for k, (v, _) in (await kv_snapshot(self.alloc_kv)).items()
                  if "." not in k}  # <node>.<job> keys are per-node copies (services.auth_alloc)
        for job_id, rec in records.items():
            a = allocs.get(job_id)
            if rec.state in ACTIVE and not rec.draining:
                if a is None or a.generation != rec.generation:
                    await self._put_alloc(rec)
            elif a is not None:
                await self._delete_alloc(job_id)
        for job_id in allocs.keys() - records.keys():
            await self._delete_alloc(job_id)
        await auth_alloc.reconcile(self.alloc_kv)


def _drain_fields(r: JobRecord, ts: float, alive: set[str] | None = None) -> dict[str, Any]:
    """What must stop before ``r`` may start again: the drain already under way
    (its new generation never started), else its current placement; only
    nodes in ``alive`` when given (a lost node reports nothing)."""
    if r.draining:
        drain, gen = list(r.draining), r.drain_generation
    else:
        drain, gen = list(r.placement), r.generation
    if alive is not None:
        drain = [p for p in drain if p.node in alive]
    if not drain:
        return {"draining": [], "drain_generation": 0, "drain_started": None}
    return {"draining": drain, "drain_generation": gen, "drain_started": r.drain_started or ts}


async def amain(stop: asyncio.Event, args: argparse.Namespace) -> None:
    nc = await connect(args.server, name="gearshift-optimizer")
    await ensure_infra(nc)
    opt = await Optimizer(
        nc, policy=args.policy, interval=args.interval, node_timeout=args.node_timeout,
        policy_options=json.loads(args.policy_options) if args.policy_options else None,
        max_retries=args.max_retries, drain_timeout=args.drain_timeout, wait_for_models=args.wait_for_models,
    ).open()
    # a standby is ready too (it waits for the lease); readyz says which one leads
    obs = await observe.serve_http("optimizer", "optimizer", nc, lambda: {"leader": opt.is_leader, "round": opt.round_no})
    obs.set_ready()
    await opt.run(stop)
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="gearshift-optimizer")
    ap.add_argument("--server", default=os.environ.get("GEARSHIFT_NATS_URL"))
    ap.add_argument("--policy", default=os.environ.get("GEARSHIFT_POLICY", "fifo"))
    ap.add_argument("--policy-options", default=os.environ.get("GEARSHIFT_POLICY_OPTIONS"),
                    help='JSON keyword arguments for the policy, e.g. {"restart_cost": 5}')
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between timer rounds")
    ap.add_argument("--node-timeout", type=float, default=10.0, help="seconds without heartbeat before a node is lost")
    ap.add_argument("--max-retries", type=int, default=DEFAULT_MAX_RETRIES,
                    help="crashes retried from the last checkpoint before a job fails")
    ap.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT,
                    help="seconds a switch waits for the old ranks' exit reports before it goes on")
    ap.add_argument("--wait-for-models", action="store_true",
                    default=os.environ.get("GEARSHIFT_WAIT_FOR_MODELS", "") not in ("", "0"),
                    help="jobs without a fitted or shipped performance model wait for the profiler")
    from services.config import OptimizerConfig, parse_args

    args = parse_args(ap, OptimizerConfig, argv)  # --config FILE, GEARSHIFT_OPTIMIZER_<FIELD>
    run_service(lambda stop: amain(stop, args))


if __name__ == "__main__":
    main()
