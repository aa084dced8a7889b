"""Leadership: one active optimizer, standbys waiting on a KV lease, and
the fence that makes a deposed leader's writes fail at the server.

``run`` waits for the lease; on winning it takes the fence (bumps the epoch
of every bucket it will write, ``services.fencing``) and calls ``lead``
with an event that is set when the lease is lost -- by renewal failing, or
by any write coming back ``Deposed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from gearshift.bus.log import get_logger
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import subjects as subj
from gearshift.services.fencing import Deposed, Fence
from gearshift.services.lease import Lease

log = get_logger(service="leadership")


class Leadership:
    def __init__(self, nc: Any, lease_kv: Any, name: str, instance: str, *, ttl: float, buckets: list[str]):
        self.instance = instance
        self.ttl = ttl
        self.lease = Lease(lease_kv, name, instance, ttl=ttl, renew=ttl / 4)
        self.fence = Fence(nc, buckets, instance, events=subj.events_fence(name))  # its events are fenced too
        self.lost: asyncio.Event | None = None
        self._hold: asyncio.Task | None = None

    def stop_renewing(self) -> None:
        """Fault injection: stop the renewal loop, so that only the fence can
        notice a takeover (the worst case: a leader whose lease check is late)."""
        if self._hold is not None:
            self._hold.cancel()

    async def run(self, stop: asyncio.Event, lead: Callable[[asyncio.Event], Awaitable[None]]) -> None:
        while not stop.is_set():
            if await self.lease.try_acquire():
                self.lost = asyncio.Event()
                await self.fence.take()
                hold = self._hold = asyncio.create_task(self.lease.hold(self.lost))
                try:
                    await lead(self.lost)
                finally:
                    await cancel_and_wait([hold])
                if stop.is_set():
                    break
                log.warning("lease lost; back to standby", instance=self.instance)
            else:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(1.0, self.ttl / 4))
                except asyncio.TimeoutError:
                    pass
        await self.lease.release()

    def deposed(self, exc: Deposed) -> None:
        """A write was refused: another leader holds the epoch. Step down."""
        log.warning("deposed: write refused by the server", instance=self.instance, error=str(exc))
        if self.lost is not None:
            self.lost.set()
