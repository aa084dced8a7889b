"""bus.tasks.cancel_and_wait against the cancellation Python 3.11's wait_for swallows."""

from __future__ import annotations

import asyncio
import sys

from gearshift.bus.tasks import cancel_and_wait


async def _loop_of_waits(futs: list) -> None:
    """A background loop like an agent's heartbeat: one bounded wait after another."""
    while True:
        fut = asyncio.get_running_loop().create_future()
        futs.append(fut)
        await asyncio.wait_for(fut, 60)


async def _started(futs: list) -> None:
    while not futs:
        await asyncio.sleep(0)


async def test_a_cancellation_landing_as_the_wait_completes_is_repeated_until_the_loop_ends():
    futs: list = []
    task = asyncio.create_task(_loop_of_waits(futs))
    await _started(futs)
    futs[-1].set_result(None)  # the reply is in: wait_for's waiter is released on the next pass of the loop
    await cancel_and_wait([task], every=0.01)  # ... but the cancellation reaches it first
    assert task.cancelled()
    if sys.version_info < (3, 12):  # gh-86296: the first cancellation was swallowed and the loop went on
        assert len(futs) >= 2


async def test_the_swallowed_cancellation_is_real_on_this_python():
    """What a bare ``task.cancel(); await task`` met: the loop outlives its cancellation."""
    futs: list = []
    task = asyncio.create_task(_loop_of_waits(futs))
    await _started(futs)
    futs[-1].set_result(None)
    task.cancel()
    while len(futs) < 2 and not task.done():
        await asyncio.sleep(0)
    if sys.version_info < (3, 12):
        assert not task.done() and len(futs) == 2
    await cancel_and_wait([task], every=0.01)
    assert task.done()


async def test_ended_tasks_and_none_are_taken_and_their_exceptions_retrieved():
    async def fails():
        raise ValueError("boom")

    failed = asyncio.create_task(fails())
    await asyncio.wait([failed])
    sleeper = asyncio.create_task(asyncio.sleep(60))
    await cancel_and_wait([failed, None, sleeper])
    assert sleeper.cancelled() and isinstance(failed.exception(), ValueError)
