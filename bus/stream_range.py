"""Read part of a stream with bounded delivery: an ephemeral pull consumer.

A push consumer (ordered or not) sends the rest of the stream as fast as flow
control lets it, whatever the reader wants: a reader that stops after one page
of a list still has every later record delivered to it, each a message that
nats-server sends and the reader's client parses, before its unsubscribe
lands. Paging through N archived jobs that way delivered about N^2 / (2 x page)
messages (measured at stop 39: 5.0 history deliveries per job to the admission
for one `gearshift get jobs --all` over 3,000 jobs; ``loadtest.scale``'s
``messages_per_job``). A pull consumer delivers what each fetch asks for, so a
reader that stops reads at most one fetch past that point. Fetches start small
and double (``first``, then up to ``chunk``), so a reader that stops early (a
page full by bytes, not by count) is not sent a full chunk it never reads.

Usage::

    async with stream_range(js, stream, subject, start_seq=42) as msgs:
        async for msg in msgs:
            ...  # break whenever; the consumer is deleted on the way out
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

DEFAULT_CHUNK = 256
INACTIVE_S = 60.0  # the server removes a consumer its reader left behind (a crash) after this


@contextlib.asynccontextmanager
async def stream_range(js: Any, stream: str, subject: str, *, start_seq: int | None = None,
                       start_time: datetime.datetime | None = None, chunk: int = DEFAULT_CHUNK,
                       first: int = 16, want: Callable[[], int] | None = None,
                       timeout: float = 2.0) -> AsyncIterator[AsyncIterator[Any]]:
    """The messages of ``stream`` on ``subject`` from ``start_seq`` (or the first
    stored at or after ``start_time``, or the first), in order, fetched ``first``
    at a time, doubling up to ``chunk``, up to the last one stored when it was read
    (``num_pending`` 0). ``want``: how many more the reader can use at most (a
    page's room), so no fetch asks for more. ``timeout``: how long a fetch waits
    when nothing is stored in the range."""
    if start_seq is not None:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=max(1, start_seq))
    elif start_time is not None:
        policy = dict(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start_time)
    else:
        policy = dict(deliver_policy=DeliverPolicy.ALL)
    name = "range-" + js._nc._nuid.next().decode()
    await js.add_consumer(stream, ConsumerConfig(
        name=name, filter_subject=subject, ack_policy=AckPolicy.NONE, mem_storage=True, num_replicas=1,
        inactive_threshold=INACTIVE_S, **policy))
    psub = await js.pull_subscribe_bind(consumer=name, stream=stream)

    async def messages() -> AsyncIterator[Any]:
        n = min(first, chunk)
        while True:
            try:
                got = await psub.fetch(max(1, min(n, want()) if want else n), timeout=timeout)
            except nats.errors.TimeoutError:  # nothing (more) stored in the range
                return
            for msg in got:
                yield msg
            if not got or got[-1].metadata.num_pending == 0:
                return
            n = min(2 * n, chunk)

    try:
        yield messages()
    finally:
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, name)
