"""The record writes a round makes: allocate, preempt, requeue, settle
drains, archive -- each a compare-and-set through ``JobStore`` (fenced while
leading) with the change computed by ``services.lifecycle``, then the
allocation that follows from it (``AllocWriter``). Many at once, at most
``parallel`` in flight; the view's record and revision are each write's first
try, so a write costs no read unless the record moved."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.alloc_watch import node_key
from gearshift.bus.log import get_logger
from gearshift.bus.server import RequestError, bad_request
from gearshift.bus.views import JobsView
from gearshift.bus_schema.messages import (
    ACTIVE_STATES,
    ExplainEntry,
    JobPreempted,
    JobRecord,
    JobRequeued,
    JobState,
    NodeReport,
    PinnedPlan,
    ReconfigureReply,
    ReconfigureRequest,
)
from gearshift.bus_schema.plan_support import model_refusal, plan_refusal, with_refused
from gearshift.policies import Decision
from gearshift.policies.decision import diff
from gearshift.services import capacity, lifecycle
from gearshift.services.alloc_writer import AllocWriter, bounded
from gearshift.services.jobstore import JobStore

log = get_logger(service="optimizer")
ACTIVE = ACTIVE_STATES
REASON_WRITES_PER_ROUND = 64  # waiting reasons rewritten into records per round (oldest jobs first)
# ... at most this often: each batch is a commit, which syncs KV_gs_jobs while the admission waits
# to write (a round per submit wrote one per submit: p99 110 ms against p50 4.7 ms)
REASON_EVERY_S = 1.0
# An archive pass at most this often: its jobs' accounts are one GS_USAGE message per
# tenant, so an hour of any number of finished jobs is at most 720 x tenants messages
# for ``gearshift usage`` to read (services.usage); jobs stay in gs_jobs a few s longer.
ARCHIVE_EVERY_S = 5.0


def _among(records: Mapping[str, JobRecord], job_ids: Iterable[str] | None) -> Iterable[JobRecord]:
    """The records of ``job_ids`` (sorted, those still there), or all of them (None)."""
    if job_ids is None:
        return records.values()
    return [records[j] for j in sorted(job_ids) if j in records]


def with_drain_agents(rec: JobRecord, report: Callable[[str], NodeReport | None]) -> JobRecord:
    """``rec`` with ``drain_agents`` following ``draining``: the incarnation (``started_at``)
    of each draining node's agent, taken from its last report when its drain begins,
    kept while it lasts. Written with the record (``JobStore.before_write``), so a leader
    that takes over mid-drain knows whether the agent restarted since; taken at the next
    round's look instead, an agent killed and restarted between the two was the first
    incarnation seen and its drain waited out ``--drain-timeout``."""
    have = rec.drain_agents
    if not rec.draining:
        return msgspec.structs.replace(rec, drain_agents={}) if have else rec
    agents = {p.node: have[p.node] for p in rec.draining if p.node in have}
    for p in rec.draining:
        if p.node not in agents:
            hb = report(p.node)
            if hb is not None:
                agents[p.node] = hb.started_at
    return rec if agents == have else msgspec.structs.replace(rec, drain_agents=agents)


def explain_entries(decision: Decision, records: Mapping[str, JobRecord]) -> list[ExplainEntry]:
    """Why each job waits or runs: the explain endpoint's entries."""
    out = [ExplainEntry(job_id=job_id, state=records[job_id].state.value, reason=why)
           for job_id, why in decision.waiting.items()]
    out += [ExplainEntry(job_id=job_id, state="allocated", reason=d.reason) for job_id, d in decision.allocations.items()]
    return out


class RecordWriter:
    def __init__(self, store: JobStore, allocs: AllocWriter, jobs: JobsView, *, parallel: int,
                 drain_timeout: float, archive_after: float, clock: Clock = SYSTEM):
        self.store = store
        self.clock = clock  # what stamps the records' times (allocated, queued, drained, archived)
        self.writer = allocs
        self.jobs = jobs
        self.parallel = parallel
        self.drain_timeout = drain_timeout
        self.archive_after = archive_after
        self._cancelling_since: dict[str, float] = {}  # this leader's first sight of each cancelling job
        self._reasons_due = float("-inf")  # clock time the next batch of waiting reasons may go out
        self._agent_at_drain: dict[tuple[str, str], float] = {}  # (job, node) -> agent started_at at first sight
        self._archived_at = float("-inf")  # when the last pass moved something

    async def archive(self, most: int = 2000) -> int:
        """Finished jobs leave ``gs_jobs`` for the history store ``archive_after``
        seconds after they ended (nothing draining; events left in the outbox
        are published on the way)."""
        now = self.clock.now()
        if now - self._archived_at < ARCHIVE_EVERY_S:
            return 0
        cutoff = now - self.archive_after
        done = [r for r in self.jobs.finished.values()
                if (r.finished_at or 0) <= cutoff and not r.draining][:most]
        if done:
            self._archived_at = now
            await self.store.publish_usage(done)  # their accounts first (bus_schema.usage)
        return await self.store.archive_many(done, parallel=self.parallel)

    def hint(self, job_id: str) -> tuple[JobRecord, int] | None:
        """The record and revision the view holds: the first CAS try (no read)."""
        e = self.jobs.entries.get(job_id)
        return None if e is None else (e[0], e[1])

    async def changed(self, records: dict[str, JobRecord], updates: list[tuple[str, Any]]) -> int:
        """Run record updates concurrently; keep ``records`` current; count changes."""
        results = await bounded([u for _, u in updates], self.parallel)
        n = 0
        for (job_id, _), new in zip(updates, results):
            if new is not None:
                records[job_id] = new
                n += 1
        return n

    async def requeue_lost(self, records: dict[str, JobRecord], alive: set[str],
                           candidates: Iterable[str] | None = None) -> int:
        """Jobs on lost nodes go back to the queue; ranks on nodes still alive drain first.
        ``candidates``: the jobs that may be on a lost node (None: every record is looked at)."""
        updates = []
        for rec in _among(records, candidates):
            gone = [p.node for p in rec.placement if p.node not in alive]
            if rec.state in ACTIVE and gone:
                updates.append((rec.job_id, self.back_to_queue(
                    rec, "node lost: " + ",".join(gone), JobRequeued, alive, with_checkpoint=True)))
        return await self.changed(records, updates)

    async def apply(
        self, decision: Decision, records: dict[str, JobRecord], gpu_count: Mapping[str, int],
        held: dict[str, set[int]], used: dict[str, set[int]] | None = None, holding: Mapping | None = None,
    ) -> int:
        """Write ``decision``; ``used`` and ``holding``: ``capacity.in_use`` and
        ``capacity.holding`` of ``records``, where the caller keeps them."""
        if used is None:
            used = capacity.in_use(records.values(), held)
        change = diff(capacity.holding(records.values()) if holding is None else holding, decision)
        # Preemptions first, so their GPUs are free for what follows.
        changes = await self.queue_many(records, [
            (records[job_id], decision.waiting.get(job_id, "preempted by policy"), JobPreempted)
            for job_id in change.preempt])
        todo = []
        for job_id in change.changed:  # starts and reconfigurations; entries may be deferred below
            d = decision.allocations[job_id]
            rec = records[job_id]
            placement = capacity.assign(rec, d, used, gpu_count)
            if placement is None:
                # the policy counted GPUs that are still draining: next round
                log.info("allocation deferred: GPUs still held", job_id=job_id)
                decision.allocations.pop(job_id)
                decision.waiting[job_id] = "waiting for GPUs that other jobs are still releasing"
                continue
            todo.append((rec, d, placement))
        return changes + await self.allocate_many(records, todo)

    async def allocate_many(self, records: dict[str, JobRecord], todo: list[tuple[JobRecord, Any, list]]) -> int:
        """New plans and placements: the records in atomic batches, then the
        allocations they imply (the old generation's withdrawn while it drains),
        then their events -- ``job.scheduled`` once its allocation exists."""
        ts = self.clock.now()
        got = await self.store.update_many(
            [(rec.job_id, lambda r, rec=rec, d=d, pl=pl: lifecycle.allocate(r, rec, d, pl, ts), self.hint(rec.job_id))
             for rec, d, pl in todo], parallel=self.parallel, publish=False)
        new = [r for r in got if r is not None]
        await self.writer.write_many([r for r in new if not r.draining], [r.job_id for r in new if r.draining])
        await bounded([self.store.publish(r) for r in new if r.outbox], self.parallel)
        for (rec, d, pl), r in zip(todo, got):
            if r is not None:
                records[r.job_id] = r
                log.debug("job scheduled", job_id=r.job_id, generation=r.generation, plan=d.plan.label(),
                         nodes=[p.node for p in pl], draining=[p.node for p in r.draining])
        return len(new)

    async def queue_many(self, records: dict[str, JobRecord], todo: list[tuple[JobRecord, str, type]]) -> int:
        """``back_to_queue`` for many jobs: records in atomic batches, then their
        allocations withdrawn, then their events."""
        ts = self.clock.now()
        got = await self.store.update_many(
            [(rec.job_id, lambda r, rec=rec, why=why, ev=ev: lifecycle.back_to_queue(r, rec.generation, why, ev, ts),
              self.hint(rec.job_id)) for rec, why, ev in todo], parallel=self.parallel, publish=False)
        new = [r for r in got if r is not None]
        await self.writer.write_many([], [r.job_id for r in new])
        await bounded([self.store.publish(r) for r in new if r.outbox], self.parallel)
        for r in new:
            records[r.job_id] = r
        return len(new)

    async def back_to_queue(
        self, rec: JobRecord, why: str, event: type, alive: set[str] | None = None, with_checkpoint: bool = False
    ) -> JobRecord | None:
        """PENDING again, its old ranks draining; the allocation is withdrawn."""
        ts = self.clock.now()
        new = await self.store.update(rec.job_id, lambda r: lifecycle.back_to_queue(
            r, rec.generation, why, event, ts, alive, with_checkpoint), hint=self.hint(rec.job_id))
        if new is not None:
            await self.writer.delete(rec.job_id)
            if event is JobRequeued:
                log.warning("job requeued", job_id=rec.job_id, reason=why)
        return new

    async def settle_drains(self, records: dict[str, JobRecord], alive: set[str],
                            nodes: Mapping[str, NodeReport] | None = None, draining: Iterable[str] | None = None,
                            cancelling: Iterable[str] | None = None) -> int:
        """End drains that cannot finish: nodes that are gone, nodes whose agent
        restarted and has nothing of the job (``restarted_without``), or a drain
        older than ``drain_timeout`` (the agent's SIGKILL should have come long before).
        ``draining``/``cancelling``: the jobs that may drain / be cancelling (None: every
        record is looked at)."""
        t = self.clock.now()
        updates = []
        agents, self._agent_at_drain = self._agent_at_drain, {}
        for rec in _among(records, draining):
            if not rec.draining:
                continue
            # a job's own checkpoint grace may be longer than the default wait
            wait = max(self.drain_timeout, (rec.spec.checkpoint_grace or 0.0) + 10.0)
            timed_out = rec.drain_started is not None and t - rec.drain_started > wait
            gone = [p.node for p in rec.draining if timed_out or p.node not in alive]
            if not gone and nodes is not None:
                gone = [p.node for p in rec.draining if self.restarted_without(rec, p.node, nodes.get(p.node), agents)]
            if gone:
                updates.append((rec.job_id, self.settle(rec.job_id, gone, timed_out)))
        return await self.changed(records, updates) + await self.settle_cancels(records, alive, cancelling)

    def restarted_without(self, rec: JobRecord, node: str, hb: NodeReport | None, seen: dict) -> bool:
        """Has ``node``'s agent restarted since this leader saw the drain begin,
        acted on the withdrawal of the job's allocation there (its heartbeat's
        ``alloc_rev`` is past the delete), and runs nothing of the old
        generations? Then no report will come -- an allocation written and
        withdrawn while the agent was down was never launched -- and the drain
        of that node is over. An agent that stayed up reports its run's exit."""
        if hb is None:
            return False
        # the incarnation the drain began under: written into the record then (with_drain_agents),
        # else (a record from before) the first one this leader saw
        first = rec.drain_agents.get(node) or seen.get((rec.job_id, node), hb.started_at)
        self._agent_at_drain[(rec.job_id, node)] = first  # the incarnation the drain began under
        if hb.started_at == first:
            return False
        withdrawn = self.writer.view.withdrawn.get(node_key(node, rec.job_id))
        if withdrawn is None or hb.alloc_rev < withdrawn or node_key(node, rec.job_id) in self.writer.view.entries:
            return False
        prefix = rec.job_id + "@"
        return not any(r.startswith(prefix) and int(r[len(prefix):]) < rec.generation for r in hb.running)

    async def settle_cancels(self, records: dict[str, JobRecord], alive: set[str],
                             candidates: Iterable[str] | None = None) -> int:
        """End cancels that no report will end (``lifecycle.cancel_unreported``)."""
        t = self.clock.now()
        since = {r.job_id: self._cancelling_since.get(r.job_id, t) for r in _among(records, candidates)
                 if r.state == JobState.CANCELLING}
        self._cancelling_since = since
        updates = []
        for job_id, first in since.items():
            rec = records[job_id]
            if lifecycle.cancel_unreported(rec, alive, t - first, self.drain_timeout, t) is not None:
                updates.append((job_id, self.store.update(job_id, lambda r, w=t - first: lifecycle.cancel_unreported(
                    r, alive, w, self.drain_timeout, self.clock.now()))))
        return await self.changed(records, updates)

    async def settle(self, job_id: str, gone: list[str], timed_out: bool) -> JobRecord | None:
        released = False

        def change(r: JobRecord) -> JobRecord | None:
            nonlocal released
            if not r.draining:
                return None
            new, released, _ = lifecycle.drained(r, gone, None, self.clock.now())
            return new

        new = await self.store.update(job_id, change)
        if new is not None:
            log.warning("drain settled without reports", job_id=job_id, nodes=gone, timed_out=timed_out)
            if released:
                await self.writer.put(new)
        return new

    async def explain(self, decision: Decision, records: dict[str, JobRecord], *,
                      flush: bool = False) -> Callable[[], list[ExplainEntry]]:
        """The waiting reasons written into records (``flush``: now, whatever the rate
        limit; a round a client asked for, ``gs.optimizer.round``, writes what it
        decided), and what makes the explain endpoint's entries (``explain_entries``)
        when it is asked: a round does not build one per job."""
        # A waiting job's reason can change every round for every pending job
        # (FIFO's "behind <head>"): a bounded number of record writes per round,
        # oldest first; the explain endpoint always has all of them fresh. One atomic
        # batch: a commit costs the server a disk sync, and while 64 single commits
        # synced one after the other every admission write to gs_jobs queued behind
        # them (the submit stall of issue 24: 1 submit in 20 waited ~250 ms). Which
        # reasons are stale is looked at only when a batch may go out.
        stale = []
        now = self.clock.now()
        if now >= self._reasons_due or flush:  # at most one batch every REASON_EVERY_S
            for job_id, why in decision.waiting.items():
                rec = records[job_id]
                if rec.reason != why and rec.state == JobState.PENDING:
                    stale.append((rec.submitted_at, job_id, why))
            if stale:
                self._reasons_due = now + REASON_EVERY_S
        await self.store.update_many([(
            job_id, lambda r, why=why: msgspec.structs.replace(r, reason=why) if r.state == JobState.PENDING else None,
            self.hint(job_id)) for _, job_id, why in sorted(stale)[:REASON_WRITES_PER_ROUND]], parallel=self.parallel)
        return lambda: explain_entries(decision, records)

    async def pin(self, req: ReconfigureRequest) -> ReconfigureReply:
        """An operator's plan pin (``gs.optimizer.reconfigure``) into the job's record."""

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
        if req.plan is not None:  # a plan the job's model or script cannot run changes nothing
            spec = got[0].spec
            refused = (model_refusal(spec, req.plan)
                       or plan_refusal(with_refused(spec, got[0].refused_plans).plan_support, req.plan))
            if refused is not None:
                raise bad_request(f"plan {req.plan.label()}: {refused[1]}", refused[0])
        new = await self.store.update(req.job_id, change)
        if new is None:
            raise RequestError("409", f"job {req.job_id} has ended", "job_id")
        log.info("plan pinned" if pin else "pin cleared", job_id=req.job_id, plan=req.plan.label() if req.plan else None)
        return ReconfigureReply(job_id=req.job_id, pinned=pin is not None, generation=new.generation)
