"""Materialised views of KV buckets, fed by a watch, with revisions.

A service keeps what it reads on every request or round in memory, up to
date from an ordered consumer on the bucket's stream (last value per key,
then every change), instead of re-reading the whole bucket each time. A
reader that must see another service's latest writes first calls ``sync()``:
one stream-info request for the stream's last sequence, then it waits until
the view has applied that revision. One that must see only its own writes
calls ``catch_up(seq)`` with the sequence the server acknowledged for the last
of them: no request.

``JobsView`` keeps the live (non-terminal) jobs apart from the finished ones
and counts live jobs per tenant, so a submit never scans, and a round costs
O(live jobs). ``NodesView`` decides liveness by the server's clock: each
value carries the time the server stored it, and a node's age is measured
against the newest server timestamp seen plus the time elapsed here since,
never against the agent's own clock.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
from nats.js.api import DeliverPolicy

from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import JobRecord, NodeReport
from gearshift.bus_schema.topology import islands, parse_path

T = TypeVar("T")
# A view gives the event loop back after this many messages in a row. nats-py hands a
# subscription's queued messages to its callback without a pause while any wait, so a
# burst (a round's batch of 500 records, every node's report after a restart) held the
# loop until the last was applied, and the requests that came meanwhile (a submit) waited.
YIELD_EVERY = 64


def _seq_and_ts(msg: Any) -> tuple[int, float]:
    """(stream sequence, server timestamp in s) from a JetStream message's
    reply subject. nats-py's ``msg.metadata`` builds dataclasses and a
    datetime per message: a view of 2,000 heartbeating nodes reads a thousand
    a second. Reply forms: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.
    <cseq>.<ts_ns>.<pending>`` and the longer one with domain and account hash
    (``<sseq>`` 7th, ``<ts_ns>`` 9th after ``$JS.ACK``)."""
    t = msg.reply.split(".") if msg.reply else ()
    if len(t) == 9 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[5]), int(t[7]) / 1e9
    if len(t) >= 11 and t[0] == "$JS" and t[1] == "ACK":
        return int(t[7]), int(t[9]) / 1e9
    md = msg.metadata  # anything else: nats-py's parser (raises if not JetStream)
    return md.sequence.stream, md.timestamp.timestamp()


class Marks:
    """Keys changed since a reader last took them (``take``), bounded: past ``limit``
    keys the set is dropped and the next ``take`` says so (None: look at everything),
    so a view nobody takes from (a standby's) does not grow without end."""

    __slots__ = ("keys", "lost", "limit")

    def __init__(self, limit: int = 50_000):
        self.keys: set[str] = set()
        self.lost = False
        self.limit = limit

    def add(self, key: str) -> None:
        keys = self.keys
        keys.add(key)
        if len(keys) > self.limit:
            keys.clear()
            self.lost = True

    def take(self) -> set[str] | None:
        """The keys marked since the last take; None when more than ``limit`` were."""
        keys, lost = self.keys, self.lost
        self.keys, self.lost = set(), False
        return None if lost else keys


class KvView(Generic[T]):
    """key -> (decoded value, revision, server timestamp), kept current."""

    def __init__(self, js: Any, bucket: str, decode: Callable[[bytes], T], *,
                 skip: Callable[[str], bool] = lambda k: k.startswith("_")):
        self.js = js
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.prefix = f"$KV.{bucket}."
        self.decode = decode
        self.skip = skip
        self.entries: dict[str, tuple[T, int, float]] = {}
        self.revision = 0  # highest stream sequence applied
        self.server_ts = 0.0  # newest server timestamp seen, and when (monotonic) it arrived
        self._server_seen_at = time.monotonic()
        self._sub: Any = None
        self._advanced = asyncio.Event()
        self._in_a_row = 0  # messages applied since the loop was last given back

    async def start(self) -> "KvView[T]":
        self._sub = await self.js.subscribe(
            self.prefix + ">", stream=self.stream, ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, cb=self._on_msg,
            pending_msgs_limit=1_000_000, pending_bytes_limit=1 << 30,
        )
        await self.sync()
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass
            self._sub = None

    async def _on_msg(self, msg: Any) -> None:
        key = msg.subject[len(self.prefix):]
        seq, ts = _seq_and_ts(msg)
        if ts > self.server_ts:
            self.server_ts, self._server_seen_at = ts, time.monotonic()
        if seq > self.revision:
            self.revision = seq
        if not self.skip(key):
            op = (msg.headers or {}).get("KV-Operation")
            old = self.entries.get(key)
            if op in ("DEL", "PURGE") or not msg.data:
                if old is not None:
                    del self.entries[key]
                    self.removed(key, old[0])
                self.tombstone(key, seq)
            else:
                try:
                    value = self.decode(msg.data)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    value = None
                if value is not None:
                    self.entries[key] = (value, seq, ts)
                    self.changed(key, old[0] if old else None, value)
        self._advanced.set()
        self._in_a_row += 1
        if self._in_a_row >= YIELD_EVERY:
            self._in_a_row = 0
            await asyncio.sleep(0)

    # hooks for subclasses
    def changed(self, key: str, old: T | None, new: T) -> None: ...

    def removed(self, key: str, old: T) -> None: ...

    def tombstone(self, key: str, seq: int) -> None:
        """A delete of ``key`` at stream sequence ``seq``, seen live or (the last
        value of a deleted key) when the view starts."""

    async def sync(self, timeout: float = 10.0) -> int:
        """Wait until every write made before this call is applied (a stream-info request)."""
        info = await self.js.stream_info(self.stream)
        return await self.catch_up(info.state.last_seq, timeout)

    async def catch_up(self, want: int, timeout: float = 10.0) -> int:
        """Wait until the view has applied stream sequence ``want``, with no request:
        a writer that knows the sequence its own last write was stored at
        (``services.fencing.Fence.written``) sees that write, and all before it."""
        deadline = time.monotonic() + timeout
        while self.revision < want:
            self._advanced.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"view of {self.bucket} stuck at {self.revision} < {want}")
            try:
                await asyncio.wait_for(self._advanced.wait(), left)
            except asyncio.TimeoutError:
                pass
        return self.revision

    def server_now(self) -> float:
        """The server's clock now, estimated from the newest timestamp it stamped."""
        return self.server_ts + (time.monotonic() - self._server_seen_at)

    def get(self, key: str) -> T | None:
        e = self.entries.get(key)
        return None if e is None else e[0]

    def values(self) -> list[T]:
        return [e[0] for e in self.entries.values()]


class JobsView(KvView[JobRecord]):
    """``gs_jobs``: live jobs, finished ones, live count per tenant, and the
    order of submission for paged lists."""

    def __init__(self, js: Any, bucket: str):
        super().__init__(js, bucket, lambda b: codec.decode(b, JobRecord))
        self.live: dict[str, JobRecord] = {}
        self.finished: dict[str, JobRecord] = {}  # terminal, still in the hot bucket
        self.tenant_live: Counter[str] = Counter()
        self.order: list[tuple[float, str]] = []  # (submitted_at, job_id), sorted
        self.dirty = Marks()  # keys applied since a reader last took them (the optimizer's rounds)
        # called with (record, revision) for each key seen for the first time (the optimizer's
        # leader publishes a new record's events and kicks a round)
        self.on_new: Callable[[JobRecord, int], None] | None = None

    def changed(self, key: str, old: JobRecord | None, new: JobRecord) -> None:
        self.dirty.add(key)
        if old is None:
            bisect.insort(self.order, (new.submitted_at, key))
            if self.on_new is not None:
                self.on_new(new, self.entries[key][1])
        if old is not None and not old.terminal:
            self.tenant_live[old.spec.tenant] -= 1
        if not new.terminal:
            self.tenant_live[new.spec.tenant] += 1
        # a finished job whose other ranks still drain stays in the round's view
        if new.terminal and not new.draining:
            self.live.pop(key, None)
        else:
            self.live[key] = new
        if new.terminal:
            self.finished[key] = new

    def removed(self, key: str, old: JobRecord) -> None:
        self.dirty.add(key)
        if not old.terminal:
            self.tenant_live[old.spec.tenant] -= 1
        self.live.pop(key, None)
        self.finished.pop(key, None)
        i = bisect.bisect_left(self.order, (old.submitted_at, key))
        if i < len(self.order) and self.order[i] == (old.submitted_at, key):
            del self.order[i]

    def page(self, after: tuple[float, str] | None, limit: int,
             keep: Callable[[JobRecord], bool]) -> tuple[list[JobRecord], tuple[float, str] | None]:
        """Up to ``limit`` records after ``after`` in submission order that
        ``keep``; and the position to continue from (None: no more)."""
        i = 0 if after is None else bisect.bisect_right(self.order, after)
        out: list[JobRecord] = []
        while i < len(self.order) and len(out) < limit:
            pos = self.order[i]
            i += 1
            rec = self.get(pos[1])
            if rec is not None and keep(rec):
                out.append(rec)
        more = i < len(self.order)
        return out, (self.order[i - 1] if more and i > 0 else None)


class _GpuCounts:
    """Each node's GPU count and topology path, and the cluster's capacity recomputed
    only when a node comes, goes or changes either."""

    def _init_counts(self) -> None:
        self._gpus: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._capacity: tuple[int, int | None] | None = (0, None)

    def _count(self, key: str, gpus: int, topology: str = "") -> None:
        if self._gpus.get(key) != gpus or self._paths.get(key, "") != topology:
            self._gpus[key] = gpus
            self._paths[key] = topology
            self._capacity = None

    def removed(self, key: str, old: Any) -> None:
        self._gpus.pop(key, None)
        self._paths.pop(key, None)
        self._capacity = None

    def capacity(self) -> tuple[int, int | None]:
        """(GPUs of all registered nodes, most GPUs on one NVLink island: one node, or
        the nodes of one ``nvlink-domain``, ``bus_schema.topology.islands``)."""
        if self._capacity is None:
            island = max(self._gpus.values(), default=None)
            if any(self._paths.values()):
                got = islands([(_path(self._paths.get(k, "")), g) for k, g in self._gpus.items()])
                island = max(got, default=island)
            self._capacity = (sum(self._gpus.values()), island)
        return self._capacity


def _path(text: str) -> tuple:
    try:
        return parse_path(text)
    except ValueError:  # a bad path is refused where the agent reports it; here: no island
        return ()


class NodesView(_GpuCounts, KvView[NodeReport]):
    """``gs_nodes`` with liveness by the server's clock. ``dirty``: the nodes whose
    report changed since a reader last took them; ``live_names``: who is alive,
    found from the nodes heard from longest ago (the server stamps reports in the
    order it stores them, so the silent ones are at the front of ``_heard``)."""

    def __init__(self, js: Any, bucket: str, facts: Callable[[NodeReport], Any] | None = None):
        super().__init__(js, bucket, lambda b: codec.decode(b, NodeReport))
        self._init_counts()
        self.dirty = Marks()
        # ``facts``: what a reader needs of a report (the optimizer's ``round_state.node_facts``);
        # given, a node is marked dirty only when its facts changed, not on every heartbeat, so a
        # reader's work follows the nodes that changed and the heartbeats are paid for here, once
        self._facts_of = facts
        self.facts: dict[str, Any] = {}
        self._heard: dict[str, float] = {}  # node -> server time of its last report, oldest first
        self._live: tuple[frozenset, list[str]] | None = None  # (silent names, live names sorted), last given

    def changed(self, key: str, old: NodeReport | None, new: NodeReport) -> None:
        self._count(key, len(new.gpus), new.topology)
        if self._facts_of is None:
            self.dirty.add(key)
        else:
            f = self._facts_of(new)
            if old is None or self.facts.get(key) != f:
                self.facts[key] = f
                self.dirty.add(key)
        if old is None:
            self._live = None
        self._heard.pop(key, None)
        self._heard[key] = self.entries[key][2]

    def removed(self, key: str, old: Any) -> None:
        super().removed(key, old)
        self.facts.pop(key, None)
        self.dirty.add(key)
        self._heard.pop(key, None)
        self._live = None

    def live_names(self, timeout: float) -> tuple[list[str], list[tuple[NodeReport, float]]]:
        """(names of the nodes heard from within ``timeout``, sorted: the same list
        object while nobody came or went; [(silent node, its age)]). Costs the silent
        nodes, not all."""
        now = self.server_now()
        silent = []
        for key, ts in self._heard.items():
            if now - ts <= timeout:
                break
            silent.append((self.entries[key][0], now - ts))
        gone = frozenset(n.node for n, _ in silent)
        if self._live is None or self._live[0] != gone:
            self._live = (gone, sorted(k for k in self._heard if k not in gone))
        return self._live[1], silent

    def age(self, key: str) -> float | None:
        """Seconds since the server stored this node's last report."""
        e = self.entries.get(key)
        return None if e is None else max(0.0, self.server_now() - e[2])

    def alive(self, timeout: float) -> tuple[list[NodeReport], list[tuple[NodeReport, float]]]:
        """(nodes heard from within ``timeout``, [(silent node, its age)])."""
        now = self.server_now()
        live, silent = [], []
        for rep, _, ts in self.entries.values():
            age = now - ts
            (live.append(rep) if age <= timeout else silent.append((rep, age)))
        live.sort(key=lambda n: n.node)
        return live, silent


class _Gpus(msgspec.Struct):
    gpus: list[msgspec.Raw] = []
    topology: str = ""


_GPUS = msgspec.json.Decoder(_Gpus)


class NodeCapacity(_GpuCounts):
    """``gs_nodes`` as the admission needs it: each node's GPU count and topology
    path (a partial decode of its report: the GPUs' entries are not parsed), read
    from a snapshot of the bucket, not from a watch. Every agent writes its report
    every heartbeat, a thousand a second at 2,000 nodes, and a watch cost the
    admission a message each (more CPU than its submits, issue 24), while what it
    needs of them, the cluster's capacity, hardly ever changes. So it is read again
    when a caller finds it older than ``every`` seconds (``stale``; the caller
    refreshes it off the request path) and before anything is refused for want of
    capacity (``refresh``): a node that registered since is counted then. Node
    lists read the bucket when asked (``reports``)."""

    def __init__(self, js: Any, bucket: str, every: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.js = js
        self.bucket = bucket
        self.every = every
        self.clock = clock
        self.read_at = float("-inf")  # when (``clock``) the snapshot was taken
        self.reads = 0
        self._kv: Any = None
        self._init_counts()

    async def start(self) -> "NodeCapacity":
        self._kv = await self.js.key_value(self.bucket)
        await self.refresh()
        return self

    async def stop(self) -> None: ...

    def stale(self) -> bool:
        return self.clock() - self.read_at > self.every

    async def refresh(self) -> None:
        """Read every node's report again (one consumer pass over the bucket)."""
        at = self.clock()
        snap = await kv_snapshot(self._kv)
        for key in [k for k in self._gpus if k not in snap]:
            self.removed(key, None)
        for key, (raw, _) in snap.items():
            try:
                got = _GPUS.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            self._count(key, len(got.gpus), got.topology)
        self.read_at = at
        self.reads += 1

    async def reports(self) -> list[NodeReport]:
        """Every node's last report, read now."""
        out = []
        for raw, _ in (await kv_snapshot(self._kv)).values():
            try:
                out.append(codec.decode(raw, NodeReport))
            except (msgspec.DecodeError, msgspec.ValidationError):
                pass
        return out
