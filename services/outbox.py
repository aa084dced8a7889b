"""Publishing new records' outboxes off the request path.

A submit is acknowledged once its record (with the ``job.submitted`` event
in its outbox) is stored: one awaited write, the admission's only one. The
optimizer's leader sees the new record in its jobs view and its
``OutboxFlusher`` publishes the event in the background (fenced, many records
at once with bounded parallelism), without clearing the outbox: the leader's
next write of the record drops what it has published (``JobStore.lazy_clear``).
So a submit costs the admission one round trip and the server one stored
revision; publishing and clearing from the admission cost it two more round
trips and the bucket a second revision of every new record, which every view
of ``gs_jobs`` read (issue 24).

Events a leader has not published when it dies stay in the outbox: the next
leader publishes every outbox its view holds when it takes the lease, and any
later write of the record publishes them too. Message ids make a second publish
a no-op (``services.jobstore``): every event lands exactly once. ``recover``
publishes every outbox of a list of records (a flusher's start-up).
"""

from __future__ import annotations

import asyncio

from gearshift.bus.log import get_logger
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema.messages import JobRecord
from gearshift.services.alloc_writer import bounded
from gearshift.services.jobstore import JobStore

log = get_logger(service="outbox")


class OutboxFlusher:
    def __init__(self, store: JobStore, *, parallel: int = 64, batch: int = 512, clear: bool = True):
        self.store = store
        self.clear = clear  # False: published only; the record's next write drops them (``JobStore.lazy_clear``)
        self.parallel = parallel
        self.batch = batch
        self.queue: asyncio.Queue[tuple[JobRecord, int]] = asyncio.Queue()
        self.flushed = 0
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> "OutboxFlusher":
        self._task = asyncio.create_task(self._run(), name="outbox-flusher")
        return self

    def add(self, rec: JobRecord, rev: int) -> None:
        """A record just written at ``rev`` whose outbox is to be published."""
        self._idle.clear()
        self.queue.put_nowait((rec, rev))

    async def _run(self) -> None:
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty() and len(items) < self.batch:
                items.append(self.queue.get_nowait())
            try:
                await bounded([self._one(rec, rev) for rec, rev in items], self.parallel)
            except asyncio.CancelledError:
                raise
            except Exception:  # the events stay in the outboxes; recover() or the next write publishes them
                log.exception("outbox flush failed", records=len(items))
            self.flushed += len(items)
            if self.queue.empty():
                self._idle.set()

    async def _one(self, rec: JobRecord, rev: int) -> None:
        await self.store.flush(rec.job_id, have=(rec, rev), clear=self.clear)

    async def recover(self, records: list[JobRecord]) -> int:
        """Publish the outboxes a dead process left behind; returns how many."""
        todo = [r.job_id for r in records if r.outbox]
        await bounded([self.store.flush(j, clear=True) for j in todo], self.parallel)
        return len(todo)

    async def idle(self, timeout: float = 10.0) -> None:
        """Wait until everything added so far is flushed."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    async def stop(self, timeout: float = 5.0) -> None:
        """Flush what is queued (best effort), then stop."""
        try:
            await self.idle(timeout)
        except asyncio.TimeoutError:
            log.warning("outbox flusher stopped with records queued; their next writer publishes them",
                        queued=self.queue.qsize())
        await cancel_and_wait([self._task])
