"""An agent's watch of its own node's allocations (``gs_alloc`` keys
``<node>.<job>``).

``gs_alloc`` holds each allocation twice: under the job id (what the optimizer
reconciles and tools read) and under ``<node>.<job>`` for every node of its
placement (what the agent of that node watches). An agent's NATS user may
create consumers on ``KV_gs_alloc`` only with the filter ``$KV.gs_alloc.<node>.>``;
the server checks the filter because the watch uses the named create form
``$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`` (nats-py's ``kv.watch``
uses the unnamed form, whose filter the server cannot check, so agents do not
use it). The optimizer's side, which writes the copies, is
``gearshift.services.auth_alloc``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gearshift.bus.log import get_logger
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import subjects as subj

log = get_logger(component="alloc_watch")


def node_key(node: str, job_id: str) -> str:
    return f"{subj.token(node)}.{subj.token(job_id)}"


@dataclass
class AllocEntry:
    """What ``kv.watch`` yields, with the key reduced to the job id."""

    key: str
    value: bytes | None
    operation: str | None
    revision: int


class NodeAllocWatch:
    """Watch ``<node>.*`` in ``gs_alloc`` through a named, filtered, ephemeral
    pull consumer. Yields the current values first (``None`` after them, like
    ``kv.watch``), then changes. The consumer is made again, from the change
    after the last one that reached the watch (``_subscribe``), when it
    disappears (a server restart loses ephemeral consumers) and when it no
    longer hands over what it holds (``stalled``): it delivered past what
    reached this watch (sent to a connection that was going down: with no acks
    they are gone), or it has messages pending that no fetch gets (a consumer
    left stuck by a cluster server's restart). Either left the agent deaf to
    its node's allocations while it went on heartbeating, and the optimizer's
    drains of that node ended only at ``--drain-timeout``."""

    def __init__(self, js: Any, node: str, *, check_every: float = 5.0):
        self.js = js
        self.node = subj.token(node)
        self.stream = f"KV_{subj.ALLOC_BUCKET}"
        self.prefix = f"$KV.{subj.ALLOC_BUCKET}.{self.node}."
        self.check_every = check_every
        self._psub: Any = None
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._stopped = False
        self._seen = 0  # the highest stream sequence the current consumer handed over
        self.remade = 0  # consumers made again (tests, and the log says why)

    async def start(self) -> "NodeAllocWatch":
        await self._subscribe()
        self._task = asyncio.create_task(self._pump())
        return self

    async def _subscribe(self) -> None:
        """A consumer of the current values (the first), or of every change after the
        last one that reached the watch (a remade one): a write and its withdrawal
        missed meanwhile come as both, not as a tombstone alone, so the agent can say it
        never started that generation. Every key changed since keeps at least its last
        value, so nothing is skipped however much of its history the bucket dropped."""
        after = dict(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self._seen + 1) \
            if self._seen else dict(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT)
        self._psub = await self.js.pull_subscribe(
            self.prefix + ">",
            stream=self.stream,
            config=ConsumerConfig(**after, ack_policy=AckPolicy.NONE, inactive_threshold=120.0),
        )

    async def _fetch(self) -> list:
        if self._psub is None:  # the last one could not be made: the next check tries again
            await asyncio.sleep(1.0)
            return []
        try:
            return await self._psub.fetch(64, timeout=1)
        except asyncio.CancelledError:
            raise
        except Exception:
            return []

    def _hand_over(self, msgs: list) -> None:
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            self._seen = max(self._seen, seq)
            op = (msg.headers or {}).get("KV-Operation")
            self._queue.put_nowait(AllocEntry(key=msg.subject[len(self.prefix):], value=msg.data, operation=op,
                                              revision=seq))

    async def _pump(self) -> None:
        initial_done = False
        last_check = time.monotonic()
        while not self._stopped:
            msgs = await self._fetch()
            self._hand_over(msgs)
            if not initial_done and (not msgs or msgs[-1].metadata.num_pending == 0):
                initial_done = True
                self._queue.put_nowait(None)
            if not msgs and time.monotonic() - last_check > self.check_every:
                last_check = time.monotonic()
                why = await self._check()
                if why is not None:
                    await self._remake(why)

    async def _check(self) -> str | None:
        """Why the consumer must be made again, or None when it is sound."""
        if self._psub is None:
            return "no consumer: making one failed"
        info, why = await self._info()
        if why is not None or stalled(info, self._seen) is None:
            return why
        # what was on its way (a fetch that timed out just before it came) counts: fetch once more
        self._hand_over(await self._fetch())
        info, why = await self._info()
        return why if why is not None else stalled(info, self._seen)

    async def _info(self) -> tuple[Any, str | None]:
        """The consumer's info, or why there is none (gone, or unreachable)."""
        try:
            return await self._psub.consumer_info(), None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return None, f"consumer unreachable: {type(exc).__name__}"

    async def _remake(self, why: str) -> None:
        """A new consumer (``_subscribe``). Until one is made there is none
        (``_psub`` None), so the next check tries again: an unsubscribed one whose
        consumer the server still answers for looked sound and was never made again,
        and its fetches timed out for good."""
        log.warning("allocation watch made again", node=self.node, why=why)
        old, self._psub = self._psub, None
        if old is not None:
            try:  # the old consumer, asked for nothing more, expires (inactive_threshold)
                await old.unsubscribe()
            except Exception:
                pass
        try:
            await self._subscribe()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("allocation watch not made", node=self.node, error=str(exc) or type(exc).__name__)
            return
        self.remade += 1

    def __aiter__(self) -> "NodeAllocWatch":
        return self

    async def __anext__(self) -> AllocEntry | None:
        if self._stopped and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is StopAsyncIteration:
            raise StopAsyncIteration
        return item

    async def stop(self) -> None:
        self._stopped = True
        self._queue.put_nowait(StopAsyncIteration)
        await cancel_and_wait([self._task])
        if self._psub is not None:
            try:
                await self._psub.unsubscribe()
            except Exception:
                pass


def stalled(info: Any, seen: int) -> str | None:
    """Why a consumer (its ``consumer_info``) is not handing over what it holds, or
    None: it delivered past ``seen`` (the highest stream sequence that reached the
    watch), or it holds pending messages."""
    delivered = (info.delivered.stream_seq or 0) if info.delivered is not None else 0
    if delivered > seen:
        return f"delivered up to sequence {delivered}, received up to {seen}"
    if info.num_pending:
        return f"{info.num_pending} pending that no fetch got"
    return None


async def node_alloc_watch(js: Any, node: str) -> NodeAllocWatch:
    return await NodeAllocWatch(js, node).start()
