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
    Allocation,
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
from policies import Decision, JobView, NodeState, Placement, check_decision, make_policy
from policies.api import JobDecision

from .jobstore import JobStore, kv_snapshot, publish_event, with_event
from .lease import Lease
from .runtime import Endpoint, connect, ensure_infra, get_logger, now, run_service, serve

log = get_logger(service="optimizer")

ACTIVE = (JobState.SCHEDULED, JobState.RUNNING)
DEFAULT_STEP_TIME = 0.1


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
    ):
        self.nc = nc
        self.js = nc.jetstream()
        self.policy = make_policy(policy, **(policy_options or {}))
        self.interval = interval
        self.node_timeout = node_timeout
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.lease_ttl = lease_ttl
        self.store = JobStore(nc)
        self.round_no = 0
        self.last_explain: list[ExplainEntry] = []
        self.kick = asyncio.Event()
        self.lost_nodes: set[str] = set()
        self._round_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task] = []
        self._svc: Any = None
        self._subs: list[Any] = []
        self.is_leader = False
        self.leader_since: float | None = None

    async def open(self) -> "Optimizer":
        await self.store.open()
        self.alloc_kv = await self.js.key_value(subj.ALLOC_BUCKET)
        self.nodes_kv = await self.js.key_value(subj.NODES_BUCKET)
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
        log.info("leading", instance=self.instance, policy=self.policy.name)
        await self.store.flush_all()  # events a dead leader wrote but never published
        self._svc = await serve(
            self.nc,
            "optimizer",
            [
                Endpoint("round", subj.OPTIMIZER_ROUND, None, self._round_endpoint),
                Endpoint("explain", subj.OPTIMIZER_EXPLAIN, None, self._explain_endpoint),
            ],
            "gearshift scheduling rounds",
            {"policy": self.policy.name, "instance": self.instance},
        )

        async def on_kick(_msg: Any) -> None:
            self.kick.set()

        self._subs = [
            await self.nc.subscribe(subj.OPTIMIZER + ".kick", cb=on_kick),
            await self.nc.subscribe("gs.evt.job.*.submitted", cb=on_kick),
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
                    await self.apply_report(report)
                    await msg.ack()
        finally:
            # a pull subscription left open blocks drain() on shutdown
            await psub.unsubscribe()

    async def apply_report(self, r: RunReport) -> None:
        """Move the job's state for one agent report; stale generations are ignored."""
        ended = False

        def change(rec: JobRecord) -> JobRecord | None:
            nonlocal ended
            if rec.generation != r.generation or rec.terminal:
                return None
            ts = r.ts
            if r.kind == RunReportKind.STARTED:
                if rec.state == JobState.SCHEDULED and r.rank0:
                    new = msgspec.structs.replace(
                        rec, state=JobState.RUNNING, started_at=rec.started_at or ts, reason="running"
                    )
                    return with_event(new, JobRunning, ts=ts, nodes=[p.node for p in rec.placement])
                return None
            # EXITED
            steps = max(rec.steps_done, r.steps_done)
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
                new = msgspec.structs.replace(
                    rec, state=JobState.COMPLETED, finished_at=ts, steps_done=max(steps, rec.spec.steps),
                    exit_code=0, reason="completed",
                )
                return with_event(new, JobCompleted, ts=ts, steps_done=new.steps_done)
            if r.stopped:
                return None  # the agent stopped it on our request; nothing to learn
            ended = True
            why = f"process on {r.node} exited with code {r.exit_code}" + (f": {r.message}" if r.message else "")
            new = msgspec.structs.replace(
                rec, state=JobState.FAILED, finished_at=ts, steps_done=steps, exit_code=r.exit_code, reason=why
            )
            return with_event(new, JobFailed, ts=ts, reason=why, exit_code=r.exit_code)

        new = await self.store.update(r.job_id, change)
        if new is not None:
            log.info("job state", job_id=r.job_id, state=new.state.value, generation=r.generation)
        if ended:
            await self._delete_alloc(r.job_id)
            self.kick.set()

    # ------------------------------------------------------------ rounds
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
                new = await self._requeue(rec, "node lost: " + ",".join(p.node for p in rec.placement if p.node not in alive))
                if new:
                    records[rec.job_id] = new
                    changes += 1

        # Capacity: what cancelling jobs still hold is not free until they exit.
        held: dict[str, set[int]] = {}
        for rec in records.values():
            if rec.state == JobState.CANCELLING:
                for p in rec.placement:
                    held.setdefault(p.node, set()).update(p.gpus)
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
        views = [self._view(r) for r in records.values() if r.state in (JobState.PENDING, *ACTIVE)]
        views = [v for v in views if all(p.node in alive for p in v.placement)]
        decision: Decision = self.policy.schedule(now(), node_states, views, None)
        check_decision(decision, node_states, {v.job_id: v for v in views})

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
        if changes:
            ev = RoundCompleted(
                ts=now(), round=self.round_no, policy=self.policy.name, pending=pending,
                running=len(decision.allocations), changes=changes, duration_ms=ms,
            )
            await publish_event(self.js, ev, f"round:{self.instance}:{self.round_no}", subj.round_event(ev.__struct_config__.tag))
        return RoundReply(round=self.round_no, allocations=len(decision.allocations), pending=pending, duration_ms=ms)

    @staticmethod
    def _view(rec: JobRecord) -> JobView:
        placement = tuple(Placement(p.node, len(p.gpus), p.cpus) for p in rec.placement) if rec.state in ACTIVE else ()
        return JobView(
            job_id=rec.job_id,
            spec=rec.spec,
            submitted_at=rec.submitted_at,
            steps_done=rec.steps_done,
            placement=placement,
            plan=rec.plan if placement else None,
            restarts=rec.restarts,
            started_at=rec.started_at,
        )

    async def _apply(
        self, decision: Decision, records: dict[str, JobRecord], gpu_count: dict[str, int], held: dict[str, set[int]]
    ) -> int:
        changes = 0
        # GPU indices in use by jobs that keep their placement.
        used: dict[str, set[int]] = {k: set(v) for k, v in held.items()}
        keep: set[str] = set()
        for job_id, d in decision.allocations.items():
            rec = records[job_id]
            if rec.state in ACTIVE and self._same_shape(rec, d):
                keep.add(job_id)
                for p in rec.placement:
                    used.setdefault(p.node, set()).update(p.gpus)
        # Preemptions first, so their GPUs are free for what follows.
        for rec in list(records.values()):
            if rec.state in ACTIVE and rec.job_id not in decision.allocations:
                new = await self._preempt(rec, decision.waiting.get(rec.job_id, "preempted by policy"))
                if new:
                    records[rec.job_id] = new
                    changes += 1
        for job_id, d in decision.allocations.items():
            if job_id in keep:
                continue
            rec = records[job_id]
            placement = []
            for p in d.placement:
                taken = used.setdefault(p.node, set())
                free = [i for i in range(gpu_count[p.node]) if i not in taken][: p.gpus]
                if len(free) < p.gpus:
                    raise RuntimeError(f"node {p.node}: policy placed {p.gpus} GPUs, only {len(free)} free indices")
                taken.update(free)
                placement.append(NodePlacement(node=p.node, gpus=free, cpus=p.cpus))
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
            gen = r.generation + 1
            new = msgspec.structs.replace(
                r, state=JobState.SCHEDULED, generation=gen, plan=d.plan, placement=placement,
                scheduled_at=r.scheduled_at or ts, reason=d.reason, restarts=r.restarts + (1 if reconfig else 0),
            )
            if reconfig:
                return with_event(
                    new, JobReconfigured, ts=ts, generation=gen, plan=d.plan, placement=placement,
                    previous_plan=r.plan, previous_gpus=sum(len(p.gpus) for p in r.placement), reason=d.reason,
                )
            return with_event(
                new, JobScheduled, ts=ts, generation=gen, plan=d.plan, placement=placement, reason=d.reason,
                predicted_throughput=d.predicted_throughput,
            )

        new = await self.store.update(rec.job_id, change)
        if new is not None:
            await self._put_alloc(new)
            log.info("job scheduled", job_id=new.job_id, generation=new.generation, plan=d.plan.label(),
                     nodes=[p.node for p in placement])
        return new

    async def _preempt(self, rec: JobRecord, why: str) -> JobRecord | None:
        ts = now()

        def change(r: JobRecord) -> JobRecord | None:
            if r.state not in ACTIVE or r.generation != rec.generation:
                return None
            new = msgspec.structs.replace(r, state=JobState.PENDING, placement=[], reason=why, restarts=r.restarts + 1)
            return with_event(new, JobPreempted, ts=ts, reason=why)

        new = await self.store.update(rec.job_id, change)
        if new is not None:
            await self._delete_alloc(rec.job_id)
        return new

    async def _requeue(self, rec: JobRecord, why: str) -> JobRecord | None:
        ts = now()

        def change(r: JobRecord) -> JobRecord | None:
            if r.state not in ACTIVE or r.generation != rec.generation:
                return None
            new = msgspec.structs.replace(r, state=JobState.PENDING, placement=[], reason=why, restarts=r.restarts + 1)
            return with_event(new, JobRequeued, ts=ts, reason=why)

        new = await self.store.update(rec.job_id, change)
        if new is not None:
            await self._delete_alloc(rec.job_id)
            log.warning("job requeued", job_id=rec.job_id, reason=why)
        return new

    # ------------------------------------------------------------ allocations
    def allocation_for(self, rec: JobRecord) -> Allocation:
        assert rec.plan is not None
        return Allocation(
            job_id=rec.job_id, generation=rec.generation, plan=rec.plan, placement=rec.placement, reason=rec.reason,
            created_at=now(), command=rec.spec.command, env=rec.spec.env,
            step_time=emulated_step_time(rec, rec.plan), steps=rec.spec.steps, global_batch=rec.spec.global_batch,
        )

    async def _put_alloc(self, rec: JobRecord) -> None:
        await self.alloc_kv.put(rec.job_id, codec.encode(self.allocation_for(rec)))

    async def _delete_alloc(self, job_id: str) -> None:
        try:
            await self.alloc_kv.delete(job_id)
        except Exception:
            pass

    async def _reconcile_allocs(self, records: dict[str, JobRecord]) -> None:
        """Make gs_alloc agree with gs_jobs (heals a crash between the two writes)."""
        allocs = {k: codec.decode(v, Allocation) for k, (v, _) in (await kv_snapshot(self.alloc_kv)).items()}
        for job_id, rec in records.items():
            a = allocs.get(job_id)
            if rec.state in ACTIVE:
                if a is None or a.generation != rec.generation:
                    await self._put_alloc(rec)
            elif a is not None:
                await self._delete_alloc(job_id)
        for job_id in allocs.keys() - records.keys():
            await self._delete_alloc(job_id)


async def amain(stop: asyncio.Event, args: argparse.Namespace) -> None:
    nc = await connect(args.server, name="gearshift-optimizer")
    await ensure_infra(nc)
    opt = await Optimizer(
        nc, policy=args.policy, interval=args.interval, node_timeout=args.node_timeout,
        policy_options=json.loads(args.policy_options) if args.policy_options else None,
    ).open()
    await opt.run(stop)
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="gearshift-optimizer")
    ap.add_argument("--server", default=os.environ.get("GEARSHIFT_NATS_URL"))
    ap.add_argument("--policy", default=os.environ.get("GEARSHIFT_POLICY", "fifo"))
    ap.add_argument("--policy-options", default=os.environ.get("GEARSHIFT_POLICY_OPTIONS"),
                    help='JSON keyword arguments for the policy, e.g. {"restart_cost": 5}')
    ap.add_argument("--interval", type=float, default=5.0, help="seconds between timer rounds")
    ap.add_argument("--node-timeout", type=float, default=10.0, help="seconds without heartbeat before a node is lost")
    args = ap.parse_args(argv)
    run_service(lambda stop: amain(stop, args))


if __name__ == "__main__":
    main()
