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

from gearshift.bus_schema import subjects as subj


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
    ``kv.watch``), then changes. If the consumer disappears (a server restart
    loses ephemeral consumers) it is made again from the current values,
    which is a full resync: a deleted key's tombstone is its last value."""

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

    async def start(self) -> "NodeAllocWatch":
        await self._subscribe()
        self._task = asyncio.create_task(self._pump())
        return self

    async def _subscribe(self) -> None:
        self._psub = await self.js.pull_subscribe(
            self.prefix + ">",
            stream=self.stream,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, ack_policy=AckPolicy.NONE, inactive_threshold=120.0,
            ),
        )

    async def _pump(self) -> None:
        initial_done = False
        last_check = time.monotonic()
        while not self._stopped:
            try:
                msgs = await self._psub.fetch(64, timeout=1)
            except asyncio.CancelledError:
                raise
            except Exception:
                msgs = []
            for msg in msgs:
                op = (msg.headers or {}).get("KV-Operation")
                self._queue.put_nowait(AllocEntry(
                    key=msg.subject[len(self.prefix):], value=msg.data, operation=op,
                    revision=msg.metadata.sequence.stream,
                ))
                if not initial_done and msg.metadata.num_pending == 0:
                    initial_done = True
                    self._queue.put_nowait(None)
            if not msgs and not initial_done:
                initial_done = True
                self._queue.put_nowait(None)
            if not msgs and time.monotonic() - last_check > self.check_every:
                last_check = time.monotonic()
                try:
                    await self._psub.consumer_info()
                except asyncio.CancelledError:
                    raise
                except Exception:  # gone (server restarted) or unreachable: make it again
                    try:
                        await self._psub.unsubscribe()
                    except Exception:
                        pass
                    try:
                        await self._subscribe()
                    except asyncio.CancelledError:
                        raise
                    except Exception:
                        await asyncio.sleep(0.5)

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
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._psub.unsubscribe()
        except Exception:
            pass


async def node_alloc_watch(js: Any, node: str) -> NodeAllocWatch:
    return await NodeAllocWatch(js, node).start()
