"""Ending background tasks: cancel, and cancel again until they end.

Python 3.11's ``asyncio.wait_for`` swallows a cancellation that lands while the
future it waits on has just completed (it returns that future's result instead:
CPython gh-86296, fixed in 3.12 by rewriting ``wait_for`` over
``asyncio.timeout``). nats-py awaits every request through ``wait_for``, so a
loop such as an agent's heartbeat (a KV put every other beat) cancelled at that
moment goes on looping, and ``task.cancel(); await task`` then waits forever: a
CI run hung 120 s in ``Agent.stop`` that way. ``cancel_and_wait`` repeats the
cancellation while a task still runs, so a swallowed one costs ``every`` seconds,
not the process."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(tasks: Iterable[asyncio.Future | None], *, every: float = 0.5) -> None:
    """Cancel each task and wait until all have ended; a task still running
    ``every`` seconds after its cancellation is cancelled again. Their
    results and exceptions are dropped, as ``gather(..., return_exceptions=True)`` drops them."""
    tasks = [t for t in tasks if t is not None]
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    for t in tasks:  # retrieved, so none is logged as "never retrieved"
        if not t.cancelled():
            t.exception()
