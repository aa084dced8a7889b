"""Leader lease on a KV key: one active instance, standbys take over.

The holder rewrites the key every ``renew`` seconds. A standby remembers the
revision it last saw and when it saw it *on its own monotonic clock*; if the
revision has not moved for ``ttl`` seconds it takes the lease with a
compare-and-set on that revision. No wall clocks are compared across hosts,
and two standbys cannot both win (the CAS fails for the second).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError


class Lease:
    def __init__(self, kv: Any, key: str, holder: str, *, ttl: float = 6.0, renew: float = 1.5):
        self.kv = kv
        self.key = key
        self.holder = holder
        self.ttl = ttl
        self.renew = renew
        self.revision: int | None = None
        self.is_leader = False
        self._seen: tuple[int, float] | None = None  # (revision, monotonic time first seen)

    async def try_acquire(self) -> bool:
        """One attempt; True if we hold the lease afterwards."""
        value = f"{self.holder} {time.time():.3f}".encode()
        try:
            entry = await self.kv.get(self.key)
        except KeyNotFoundError:
            entry = None
        if entry is None or entry.value is None or entry.operation in ("DEL", "PURGE"):
            try:
                self.revision = await self.kv.create(self.key, value)
            except KeyWrongLastSequenceError:
                return False
            self.is_leader = True
            return True
        if entry.value.split(b" ", 1)[0].decode() == self.holder:
            return await self._renew(entry.revision)
        now = time.monotonic()
        if self._seen is None or self._seen[0] != entry.revision:
            self._seen = (entry.revision, now)
            return False
        if now - self._seen[1] < self.ttl:
            return False
        try:
            self.revision = await self.kv.update(self.key, value, last=entry.revision)
        except KeyWrongLastSequenceError:
            return False
        self.is_leader = True
        return True

    async def _renew(self, last: int) -> bool:
        value = f"{self.holder} {time.time():.3f}".encode()
        try:
            self.revision = await self.kv.update(self.key, value, last=last)
            self.is_leader = True
        except KeyWrongLastSequenceError:
            self.is_leader = False
        return self.is_leader

    async def hold(self, lost: asyncio.Event) -> None:
        """Renew until the lease is lost (then set ``lost``) or cancelled."""
        while True:
            await asyncio.sleep(self.renew)
            ok = False
            try:
                ok = self.revision is not None and await self._renew(self.revision)
            except Exception:
                ok = False
            if not ok:
                self.is_leader = False
                lost.set()
                return

    async def release(self) -> None:
        if self.is_leader and self.revision is not None:
            try:
                await self.kv.delete(self.key, last=self.revision)
            except Exception:
                pass
        self.is_leader = False
