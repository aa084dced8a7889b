"""Job records in KV ``gs_jobs`` with compare-and-set, and their events.

Every change of a job goes through ``update``: a read -> change -> CAS loop.
The change appends the events it causes to the record's ``outbox`` in the
same write, so state and events can never disagree; ``flush`` then publishes
the outbox to ``GS_EVENTS`` (message id ``<job>:<seq>``, so a retried publish
is dropped by the stream, whose duplicate window is an hour). A service that
dies between the write and the publish leaves the outbox in KV, and the next
flush (leader start-up, admission start-up, the job's next write) publishes
it: no event is lost or duplicated.

Clearing the outbox costs a write of its own. With ``lazy_clear`` a store
skips it: it remembers the highest event sequence it has seen acknowledged
per job (``published``), and its next write of that record drops those events
from the outbox for free; ``archive`` drops the rest. Events a store does not
know to be published are published again (the stream drops the duplicate).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from gearshift.bus import observe
from gearshift.bus.kv import event_msg_id, kv_snapshot, publish_event
from gearshift.bus.publish import publisher
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobRecord, UsageBatch, UsageRow, event_kind
from gearshift.bus_schema.usage import usage_row
from gearshift.services.alloc_writer import bounded

Change = Callable[[JobRecord], JobRecord | None]
USAGE_BATCH = 500  # usage rows per GS_USAGE message (~150 bytes each: well under the payload limit)


def with_event(rec: JobRecord, event_type: type, *, ts: float, **fields: Any) -> JobRecord:
    """``rec`` with one more event in its outbox (sequence numbers are gapless)."""
    seq = rec.event_seq + 1
    ev = event_type(ts=ts, job_id=rec.job_id, seq=seq, generation=fields.pop("generation", rec.generation), **fields)
    return msgspec.structs.replace(rec, event_seq=seq, outbox=[*rec.outbox, ev])


class JobStore:
    def __init__(self, nc: NATS):
        self.nc = nc
        self.js = nc.jetstream()
        self.kv: Any = None
        self.fence: Any = None  # services.fencing.Fence while this store writes for a leader
        self.lazy_clear = False  # see the module's doc
        self.published: dict[str, int] = {}  # job -> highest event seq this store saw acknowledged
        self.events_sent = 0  # event publishes this store made (each acknowledged or failed)
        # job -> the publish of its events now in flight: a second publish of the same record
        # (the outbox flusher, a round, a report turn) waits for it instead of sending them again
        self._publishing: dict[str, asyncio.Future] = {}
        self.conflicts = 0  # compare-and-sets refused because the record had moved (then re-read)
        # applied to every record this store writes by compare-and-set (the optimizer's:
        # ``record_writer.with_drain_agents``); None: written as changed
        self.before_write: Callable[[JobRecord], JobRecord] | None = None

    async def open(self) -> "JobStore":
        self.kv = await self.js.key_value(subj.JOBS_BUCKET)
        self.history = await self.js.key_value(subj.HISTORY_BUCKET)
        return self

    async def get(self, job_id: str, *, history: bool = True) -> tuple[JobRecord, int] | None:
        """The live record (and its revision); a finished job moved to the
        history store comes from there (revision 0: it is never written again)."""
        got = await self._get(self.kv, job_id)
        if got is None and history:
            got = await self._get(self.history, job_id)
            return None if got is None else (got[0], 0)
        return got

    @staticmethod
    async def _get(kv: Any, job_id: str) -> tuple[JobRecord, int] | None:
        try:
            entry = await kv.get(job_id)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.operation in ("DEL", "PURGE"):
            return None
        return codec.decode(entry.value, JobRecord), entry.revision

    async def archive(self, rec: JobRecord) -> bool:
        """Move a finished record (events published, nothing draining) from
        ``gs_jobs`` to the history store: written there first, then deleted
        here, so a crash in between leaves it in both, never in neither."""
        if not rec.terminal or rec.draining:
            return False
        if rec.outbox:  # events still to publish (a lazily cleared outbox): out first, then gone
            await self.publish(rec)
            rec = msgspec.structs.replace(rec, outbox=[])
        await publisher(self.nc).put(subj.HISTORY_BUCKET, rec.job_id, codec.encode(rec))
        if self.fence is not None:
            await self.fence.delete(subj.JOBS_BUCKET, rec.job_id)
        else:
            await self.kv.delete(rec.job_id)
        self.published.pop(rec.job_id, None)
        return True

    async def archive_many(self, recs: list[JobRecord], *, parallel: int = 32, chunk: int = 500) -> int:
        """``archive`` of many finished records: their events left in outboxes
        published, their history copies written, then their ``gs_jobs`` keys
        deleted as atomic batches of ``chunk`` (fenced once each while leading: one
        commit per batch instead of one fenced delete per job). Returns how many."""
        recs = [r for r in recs if r.terminal and not r.draining]
        await bounded([self.publish(r) for r in recs if r.outbox], parallel)
        pub = publisher(self.nc)
        await bounded([pub.put(subj.HISTORY_BUCKET, r.job_id, codec.encode(msgspec.structs.replace(r, outbox=[])))
                       for r in recs], parallel)
        if self.fence is not None:
            for k in range(0, len(recs), chunk):
                await self.fence.batch(subj.JOBS_BUCKET, [(r.job_id, None) for r in recs[k:k + chunk]])
        else:
            await bounded([self.kv.delete(r.job_id) for r in recs], parallel)
        for r in recs:
            self.published.pop(r.job_id, None)
        return len(recs)

    async def publish_usage(self, recs: list[JobRecord]) -> None:
        """The accounts of finished jobs about to be archived, on ``GS_USAGE``: one
        message per tenant and up to ``USAGE_BATCH`` jobs (the usage verb reads a
        window of messages, not of jobs). Written before the records move, so a
        crash in between writes them again with the next archive pass (the reader
        counts a job once)."""
        by_tenant: dict[str, list[UsageRow]] = {}
        for rec in recs:
            by_tenant.setdefault(rec.spec.tenant, []).append(usage_row(rec))
        for tenant, rows in by_tenant.items():
            for k in range(0, len(rows), USAGE_BATCH):
                part = rows[k:k + USAGE_BATCH]
                await publisher(self.nc).publish(subj.usage_subject(tenant), codec.encode(UsageBatch(rows=part)),
                                                 {"Nats-Msg-Id": f"usage:{part[0].job_id}:{part[-1].job_id}:{len(part)}"})
                observe.usage_rows(part)

    async def create(self, rec: JobRecord, *, flush: bool = True) -> int | None:
        """Write a new record; its revision, or None if the id exists already.
        ``flush=False``: the caller publishes the outbox (``services.outbox``)."""
        data = codec.encode(rec)
        try:
            rev = await publisher(self.nc).update(subj.JOBS_BUCKET, rec.job_id, data, 0)
        except KeyWrongLastSequenceError:  # there, or deleted (archived): nats-py's create tells which
            try:
                rev = await self.kv.create(rec.job_id, data)
            except KeyWrongLastSequenceError:
                return None
        if flush:
            await self.flush(rec.job_id, have=(rec, rev))
        return rev

    async def update(self, job_id: str, change: Change, *, flush: bool = True,
                     hint: tuple[JobRecord, int] | None = None) -> JobRecord | None:
        """Apply ``change`` with CAS, retrying on conflicts. Returns the new
        record, or None when the job is unknown or ``change`` returned None.
        ``hint``: the record and revision a view holds, tried first (a stale
        one costs a failed CAS, then the record is read)."""
        got = await self._update(job_id, change, hint)
        if got is None:
            return None
        new, rev = got
        if flush and new.outbox:
            new = await self.flush(job_id, have=(new, rev)) or new
        return new

    async def update_many(self, items: list[tuple[str, Change, tuple[JobRecord, int] | None]], *,
                          chunk: int = 256, parallel: int = 32, publish: bool = True) -> list[JobRecord | None]:
        """``update`` of many records: each change applied to its hint (the
        view's record), all written as atomic batches of ``chunk`` (fenced
        while leading: ``Fence.update_many``), then their events published.
        A record without a hint, or whose change says "nothing to do", goes the
        one-by-one way (read, change, CAS); a batch refused because a record
        moved is halved until the ones that moved are found, and those go
        one by one. Results in the order of ``items``.
        ``publish=False``: the caller publishes the events (``publish``) once
        what must precede them is written."""

        out: list[tuple[JobRecord, int] | None] = [None] * len(items)
        fast: list[tuple[int, str, JobRecord, int]] = []
        slow: list[int] = []
        for i, (job_id, change, hint) in enumerate(items):
            new = change(hint[0]) if hint is not None and self.fence is not None else None
            if new is None:
                slow.append(i)
                continue
            if new.state != hint[0].state:
                hint[0].check_transition(new.state)
            if self.before_write is not None:
                new = self.before_write(new)
            fast.append((i, job_id, self._strip_published(job_id, new), hint[1]))
        parts = [fast[k:k + chunk] for k in range(0, len(fast), chunk)]
        while parts:
            part = parts.pop()
            try:
                revs = await self.fence.update_many(
                    subj.JOBS_BUCKET, [(job_id, codec.encode(new), last) for _, job_id, new, last in part])
            except KeyWrongLastSequenceError:
                self.conflicts += 1
                if len(part) <= 4:  # found the few that moved: one by one
                    slow.extend(i for i, *_ in part)
                else:  # halve the batch to find them: a few more commits, not one per record
                    parts += [part[:len(part) // 2], part[len(part) // 2:]]
                continue
            for (i, _, new, _), rev in zip(part, revs):
                out[i] = (new, rev)
        got = await bounded([self._update(items[i][0], items[i][1]) for i in slow], parallel)
        for i, g in zip(slow, got):
            out[i] = g
        if publish:
            await bounded([self.publish(g[0]) for g in out if g is not None and g[0].outbox], parallel)
        return [None if g is None else g[0] for g in out]

    def _strip_published(self, job_id: str, new: JobRecord) -> JobRecord:
        done = self.published.get(job_id, 0)
        if new.outbox and new.outbox[0].seq <= done:  # published already: cleared by this write
            new = msgspec.structs.replace(new, outbox=[e for e in new.outbox if e.seq > done])
        return new

    async def _update(self, job_id: str, change: Change,
                      hint: tuple[JobRecord, int] | None = None) -> tuple[JobRecord, int] | None:
        for attempt in range(100):
            hinted = hint is not None
            got = hint or await self.get(job_id, history=False)  # history is never written again
            hint = None
            if got is None:
                return None
            rec, rev = got
            new = change(rec)
            if new is None:
                if hinted:
                    continue  # "nothing to do" may come from a stale view: ask the bucket
                return None
            if new.state != rec.state:
                rec.check_transition(new.state)  # the state machine, enforced on every write
            if self.before_write is not None:
                new = self.before_write(new)
            new = self._strip_published(job_id, new)
            try:
                if self.fence is not None:  # a leader's write: refused once it is deposed
                    rev = await self.fence.update(subj.JOBS_BUCKET, job_id, codec.encode(new), rev)
                else:
                    rev = await publisher(self.nc).update(subj.JOBS_BUCKET, job_id, codec.encode(new), rev)
            except KeyWrongLastSequenceError:
                self.conflicts += 1
                # a replicated stream also refuses while another write on the same
                # expected-sequence subject is in flight: back off a little after a few
                await asyncio.sleep(0 if attempt < 3 else 0.002 * attempt)
                continue
            return new, rev
        raise RuntimeError(f"job {job_id}: too many concurrent updates")

    async def publish(self, rec: JobRecord) -> None:
        """Publish the outbox's events this store has not seen acknowledged, in
        order (one connection: the stream keeps the order they were sent in).
        One publish per job at a time: a call that finds one in flight waits for
        it and then sends only what it left. Without that, a record written
        while its events were in flight had them sent again: each a stored-
        message check and an acknowledgement for nothing (the stream drops the
        duplicate). Seen when the optimizer is slow: under cProfile, 48,006
        event publishes for 24,000 events (issue 24); at full speed, none."""
        job = rec.job_id
        while (busy := self._publishing.get(job)) is not None:
            await asyncio.wait([busy])  # its failure is its caller's: what it did not send is sent below
        done = self.published.get(job, 0)
        todo = [ev for ev in rec.outbox if ev.seq > done]
        if not todo:
            return
        mine = self._publishing[job] = asyncio.get_running_loop().create_future()
        try:
            self.events_sent += len(todo)
            await asyncio.gather(*(publish_event(self.js, ev, event_msg_id(ev), subj.job_event(ev.job_id, event_kind(ev)),
                                                 self.fence) for ev in todo))  # a leader's: fenced
            observe.job_events(rec, todo)
            if todo[-1].seq > self.published.get(job, 0):
                self.published[job] = todo[-1].seq
        finally:
            del self._publishing[job]
            mine.set_result(None)

    async def flush(self, job_id: str, *, have: tuple[JobRecord, int] | None = None,
                    clear: bool | None = None) -> JobRecord | None:
        """Publish a record's outbox, then remove what was published (CAS);
        with ``lazy_clear`` (or ``clear=False``) the removal waits for the
        record's next write. ``have``: the record just written and its revision
        (saves a read)."""
        got = have or await self.get(job_id, history=False)
        if got is None:
            return None
        rec, rev = got
        if not rec.outbox:
            return rec
        await self.publish(rec)
        if not (not self.lazy_clear if clear is None else clear):
            return rec
        done = rec.outbox[-1].seq

        def clear_(r: JobRecord) -> JobRecord | None:
            left = [e for e in r.outbox if e.seq > done]
            if len(left) == len(r.outbox):
                return None
            return msgspec.structs.replace(r, outbox=left)

        got = await self._update(job_id, clear_, (rec, rev))
        return got[0] if got else rec

    async def all(self) -> list[tuple[JobRecord, int]]:
        snap = await kv_snapshot(self.kv)
        return [(codec.decode(v, JobRecord), rev) for v, rev in snap.values()]

    async def flush_all(self) -> int:
        n = 0
        for rec, _ in await self.all():
            if rec.outbox:
                await self.flush(rec.job_id)
                n += 1
        return n
