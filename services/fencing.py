"""Server-side fencing of a leader's writes.

A new leader writes the key ``_epoch`` in every bucket it writes to; the
revision it gets is its epoch. Every later write it makes carries
``Nats-Expected-Last-Subject-Sequence-Subject: $KV.<bucket>._epoch`` with
that revision, so the server refuses it once another leader has taken over
(and bumped the epoch): a leader paused mid-round (SIGSTOP, a long GC, a
partition) cannot write anything when it wakes up.

A compare-and-set on a record needs two checks at once (the record's own
revision, and the epoch): it goes out as an atomic batch of two messages
(NATS 2.12+ ``Nats-Batch-*``), the record with its own expected revision and
a marker ``_fence`` with the epoch check; the server applies both or
neither. The streams get ``allow_atomic`` for that (``enable_atomic``).

A replicated stream (R3) reports a failed expected-sequence check as
10164 (``JSStreamWrongLastSequenceConstantErr``, no sequence in it) where a
single server says 10071; it also refuses a write while another write with
the same expected-sequence subject is still being proposed, and every fenced
write checks ``_epoch``. So a refusal is a deposition only if ``_epoch``
really moved; otherwise the write is retried (put, delete) or reported as a
conflict on the key (update: the caller re-reads and tries again).

Events are fenced the same way. A stream cannot check another stream's
sequence, so the leader's epoch for its events lives in ``GS_EVENTS`` itself,
under ``gs.fence.<writer>`` (a subject outside ``gs.evt.>``: no event reader
sees it): ``take`` publishes the mark, and every event the leader publishes
(``publish``) expects it to be that mark's sequence.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from nats.js.api import Header
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError

from gearshift.bus import observe
from gearshift.bus.publish import publisher
from gearshift.bus_schema import subjects as subj

EPOCH_KEY = "_epoch"
CHECK_KEY = "_fence"
WRONG_LAST_SEQUENCE = 10071  # JSStreamWrongLastSequenceErrF (single server)
WRONG_LAST_SEQUENCE_CONSTANT = 10164  # JSStreamWrongLastSequenceConstantErr (replicated streams)
WRONG_LAST = (WRONG_LAST_SEQUENCE, WRONG_LAST_SEQUENCE_CONSTANT)
RETRIES = 50  # a refused fenced put/delete while the epoch did not move: in-flight contention


class Deposed(RuntimeError):
    """A write refused because another leader holds a newer epoch."""


async def enable_atomic(nc: Any, stream: str) -> None:
    """Let ``stream`` accept atomic batches (idempotent)."""
    reply = json.loads((await nc.request(f"$JS.API.STREAM.INFO.{stream}", b"", timeout=5)).data)
    config = reply["config"]
    if config.get("allow_atomic"):
        return
    config["allow_atomic"] = True
    reply = json.loads((await nc.request(f"$JS.API.STREAM.UPDATE.{stream}", json.dumps(config).encode(),
                                         timeout=5)).data)
    if "error" in reply:
        raise RuntimeError(f"cannot enable atomic batches on {stream}: {reply['error']}")


class Fence:
    def __init__(self, nc: Any, buckets: list[str], holder: str, events: str | None = None):
        self.nc = nc
        self.js = nc.jetstream()
        self.buckets = buckets
        self.holder = holder
        self.epochs: dict[str, int] = {}
        # the subject of this writer's epoch mark in GS_EVENTS (``subjects.events_fence``);
        # None: its events are not fenced
        self.events = events
        self.event_epoch: int | None = None
        self.refused = 0  # writes the server refused because we were deposed
        # bucket -> the highest stream sequence the server acknowledged for a write of ours:
        # a view of the bucket that has applied it has every write we made (``KvView.catch_up``)
        self.written: dict[str, int] = {}

    def _stored(self, bucket: str, seq: int) -> int:
        if seq > self.written.get(bucket, 0):
            self.written[bucket] = seq
        return seq

    async def take(self) -> dict[str, int]:
        """Become the writer: bump the epoch of every bucket, and of the events."""
        for bucket in self.buckets:
            await enable_atomic(self.nc, f"KV_{bucket}")
            ack = await self.js.publish(f"$KV.{bucket}.{EPOCH_KEY}", self.holder.encode())
            self.epochs[bucket] = ack.seq
        if self.events is not None:
            self.event_epoch = (await self.js.publish(self.events, self.holder.encode())).seq
        return dict(self.epochs)

    async def _event_epoch_moved(self) -> bool:
        try:
            return (await self.js.get_last_msg(subj.EVENTS_STREAM, self.events)).seq != self.event_epoch
        except Exception:
            return True

    async def publish(self, subject: str, data: bytes, msg_id: str) -> None:
        """Publish an event (deduplicated by ``msg_id``) into GS_EVENTS, refused by
        the server once another writer published a newer epoch mark (``Deposed``)."""
        headers = {Header.MSG_ID: msg_id}
        pub = publisher(self.nc)
        if self.events is None or self.event_epoch is None:
            await pub.publish(subject, data, headers)
            return
        headers |= {"Nats-Expected-Last-Subject-Sequence": str(self.event_epoch),
                    "Nats-Expected-Last-Subject-Sequence-Subject": self.events}
        for attempt in range(RETRIES):
            try:
                await pub.publish(subject, data, headers)
                return
            except BadRequestError as exc:
                if exc.err_code not in WRONG_LAST:
                    raise
                if await self._event_epoch_moved():
                    self.refused += 1
                    raise Deposed(f"event {msg_id} on {subject} refused: a newer leader holds the events") from None
                await asyncio.sleep(0.005 * (attempt + 1))  # another fenced publish was in flight (R3)
        raise RuntimeError(f"event {msg_id} on {subject}: refused {RETRIES} times while the epoch did not move")

    def _headers(self, bucket: str) -> dict[str, str]:
        return {
            "Nats-Expected-Last-Subject-Sequence": str(self.epochs[bucket]),
            "Nats-Expected-Last-Subject-Sequence-Subject": f"$KV.{bucket}.{EPOCH_KEY}",
        }

    async def _epoch_moved(self, bucket: str) -> bool:
        kv = await self.js.key_value(bucket)
        try:
            return (await kv.get(EPOCH_KEY)).revision != self.epochs[bucket]
        except Exception:
            return True

    async def _fenced(self, bucket: str, key: str, data: bytes, headers: dict[str, str], what: str) -> int:
        pub = publisher(self.nc)
        for attempt in range(RETRIES):
            try:
                seq = await pub.publish(f"$KV.{bucket}.{key}", data, {**self._headers(bucket), **headers})
            except BadRequestError as exc:
                if exc.err_code not in WRONG_LAST:
                    raise
                if await self._epoch_moved(bucket):
                    self.refused += 1
                    raise Deposed(f"{what} of {bucket}/{key} refused: a newer leader holds {bucket}") from None
                await asyncio.sleep(0.005 * (attempt + 1))  # another fenced write was in flight
                continue
            return self._stored(bucket, seq)
        raise RuntimeError(f"{what} of {bucket}/{key}: refused {RETRIES} times while the epoch did not move")

    async def put(self, bucket: str, key: str, data: bytes) -> int:
        return await self._fenced(bucket, key, data, {}, "write")

    async def delete(self, bucket: str, key: str) -> None:
        await self._fenced(bucket, key, b"", {"KV-Operation": "DEL"}, "delete")

    async def batch(self, bucket: str, writes: list[tuple[str, bytes | None]]) -> None:
        """Several keys of one bucket written (``data``) or deleted (None) as one
        atomic batch, fenced once: the server stores all of them or none, and
        none once another leader holds the epoch. One acknowledgement for all."""
        if not writes:
            return
        for attempt in range(RETRIES):
            batch = uuid.uuid4().hex
            for i, (key, data) in enumerate(writes, 1):
                headers = {"Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i)}
                if data is None:
                    headers["KV-Operation"] = "DEL"
                await self.nc.publish(f"$KV.{bucket}.{key}", data or b"", headers=headers)
            reply = await self.nc.request(f"$KV.{bucket}.{CHECK_KEY}", b"", timeout=5, headers={
                "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(len(writes) + 1), "Nats-Batch-Commit": "1",
                **self._headers(bucket)})
            body = json.loads(reply.data)
            err = body.get("error")
            if err is None:
                self._stored(bucket, int(body.get("seq", 0)))
                observe.atomic_commit(f"KV_{bucket}", len(writes) + 1)
                return
            if err.get("err_code") not in WRONG_LAST:
                raise RuntimeError(f"batch of {len(writes)} writes to {bucket} failed: {err}")
            if await self._epoch_moved(bucket):
                self.refused += 1
                raise Deposed(f"batch of {len(writes)} writes to {bucket} refused: a newer leader holds {bucket}")
            await asyncio.sleep(0.005 * (attempt + 1))  # another fenced write was in flight
        raise RuntimeError(f"batch of {len(writes)} writes to {bucket}: refused {RETRIES} times while the epoch did not move")

    async def update_many(self, bucket: str, items: list[tuple[str, bytes, int]]) -> list[int]:
        """Compare-and-set of many keys (``(key, data, last revision)``) as one
        atomic batch, fenced once: all are stored or none. An atomic commit
        costs the server a disk sync (about 10 ms here, whatever the batch's
        size), so a round's records go out together. Returns the revisions;
        raises KeyWrongLastSequenceError when any record moved, Deposed when
        the epoch did."""
        if not items:
            return []
        batch = uuid.uuid4().hex
        for i, (key, data, last) in enumerate(items, 1):
            await self.nc.publish(f"$KV.{bucket}.{key}", data, headers={
                "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(i), "Nats-Expected-Last-Subject-Sequence": str(last)})
        reply = await self.nc.request(f"$KV.{bucket}.{CHECK_KEY}", b"", timeout=10, headers={
            "Nats-Batch-Id": batch, "Nats-Batch-Sequence": str(len(items) + 1), "Nats-Batch-Commit": "1",
            **self._headers(bucket)})
        body = json.loads(reply.data)
        err = body.get("error")
        if err is None:
            observe.atomic_commit(f"KV_{bucket}", len(items) + 1)
            first = self._stored(bucket, int(body["seq"])) - len(items)  # stored in order, the marker last
            return [first + i for i in range(len(items))]
        if err.get("err_code") in WRONG_LAST:
            if await self._epoch_moved(bucket):
                self.refused += 1
                raise Deposed(f"batch of {len(items)} updates of {bucket} refused: a newer leader holds {bucket}")
            raise KeyWrongLastSequenceError(description=err.get("description"))
        raise RuntimeError(f"batch of {len(items)} updates of {bucket} failed: {err}")

    async def update(self, bucket: str, key: str, data: bytes, last: int) -> int:
        """Compare-and-set of ``key`` on revision ``last``, fenced. Raises
        KeyWrongLastSequenceError on a conflict on the key, Deposed when the
        epoch moved."""
        batch = uuid.uuid4().hex
        await self.nc.publish(f"$KV.{bucket}.{key}", data, headers={
            "Nats-Batch-Id": batch, "Nats-Batch-Sequence": "1", "Nats-Expected-Last-Subject-Sequence": str(last)})
        reply = await self.nc.request(f"$KV.{bucket}.{CHECK_KEY}", b"", timeout=5, headers={
            "Nats-Batch-Id": batch, "Nats-Batch-Sequence": "2", "Nats-Batch-Commit": "1", **self._headers(bucket)})
        body = json.loads(reply.data)
        err = body.get("error")
        if err is None:
            observe.atomic_commit(f"KV_{bucket}", 2)
            return self._stored(bucket, int(body["seq"])) - 1  # the record is the batch's first message
        if err.get("err_code") in WRONG_LAST:
            if await self._epoch_moved(bucket):
                self.refused += 1
                raise Deposed(f"update of {bucket}/{key} refused: a newer leader holds {bucket}")
            raise KeyWrongLastSequenceError(description=err.get("description"))
        raise RuntimeError(f"update of {bucket}/{key} failed: {err}")
