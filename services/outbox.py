"""Publishing new records' outboxes off the request path.

A submit is acknowledged once its record (with the ``job.submitted`` event
in its outbox) is stored: one awaited write. ``OutboxFlusher`` then publishes
the events and clears the outboxes in the background, many records at once
with bounded parallelism, so a burst of submits costs the client one round
trip each and the server a few pipelined writes.

A process that dies before its flusher got to a record leaves the event in
the record's outbox: ``recover`` (admission start-up) publishes every outbox
its view holds, the optimizer does the same when it takes the lease, and any
later write of the record publishes it too. Message ids make a second publish
a no-op (``services.jobstore``): every event lands exactly once.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gearshift.bus.log import get_logger
from gearshift.bus_schema.messages import JobRecord
from gearshift.services.alloc_writer import bounded
from gearshift.services.jobstore import JobStore

log = get_logger(service="outbox")


class OutboxFlusher:
    def __init__(self, store: JobStore, *, parallel: int = 64, batch: int = 512):
        self.store = store
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
        await self.store.flush(rec.job_id, have=(rec, rev), clear=True)

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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
