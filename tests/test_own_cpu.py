"""A coroutine's own CPU (bus/process.py OwnCpu): the optimizer's round counts its
own steps, not what the loop's other tasks do while it waits (stop 52: the
process's CPU over a round grew with the nodes' heartbeats)."""

import asyncio
import time

import pytest

from gearshift.bus.process import OwnCpu


def _burn(n: int) -> int:
    x = 0
    for i in range(n):
        x += i * i
    return x


async def _worker(n: int, rounds: int) -> None:
    for _ in range(rounds):
        _burn(n)
        await asyncio.sleep(0)


def test_the_steps_of_its_own_count_and_the_other_tasks_do_not():
    async def main():
        async def own() -> str:
            for _ in range(10):
                _burn(20_000)
                await asyncio.sleep(0)  # the other task runs here: four times the work
            return "done"

        other = asyncio.create_task(_worker(80_000, 10))
        await asyncio.sleep(0)
        meter = OwnCpu(own())
        started = time.thread_time()
        got = await meter
        whole = time.thread_time() - started
        await other
        return got, meter.cpu, whole

    got, cpu, whole = asyncio.run(main())
    assert got == "done"
    assert 0 < cpu < whole / 3  # its own fifth of the work, not the loop's other four fifths


def test_so_far_from_inside_counts_the_steps_before_and_the_running_one():
    seen = []

    async def main():
        async def own() -> None:
            _burn(20_000)
            await asyncio.sleep(0)
            before = meter.cpu  # the first step, ended
            _burn(20_000)
            seen.append((before, meter.so_far()))

        meter = OwnCpu(own())
        await meter
        return meter.cpu

    total = asyncio.run(main())
    before, so_far = seen[0]
    assert 0 < before < so_far <= total


def test_an_error_and_a_cancellation_reach_the_coroutine_and_its_caller():
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad round")

    async def waits(cleaned: list) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    async def main():
        with pytest.raises(ValueError, match="bad round"):
            await OwnCpu(fails())
        cleaned: list = []
        task = asyncio.create_task(_await(OwnCpu(waits(cleaned))))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cleaned

    assert asyncio.run(main()) == [True]


async def _await(x):
    return await x
