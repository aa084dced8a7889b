"""bus.tasks.cancel_and_wait against the cancellation Python 3.11's wait_for swallows."""

from __future__ import annotations

import ast
import asyncio
import sys
from pathlib import Path

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


def _cancel_then_gather(tree) -> list[int]:
    """Lines where a function awaits ``asyncio.gather`` on what it cancelled (a task, or
    the tasks of a collection it looped over calling ``cancel()``): what hangs for good
    when the cancellation is swallowed."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        cancelled: set[str] = set()
        for node in ast.walk(fn):
            if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
                for sub in ast.walk(node):
                    if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "cancel"
                            and isinstance(sub.func.value, ast.Name) and sub.func.value.id == node.target.id):
                        cancelled.add(ast.unparse(node.iter))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "cancel"
                    and not node.args):
                cancelled.add(ast.unparse(node.func.value))
        for node in ast.walk(fn):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "asyncio.gather":
                args = {ast.unparse(a.value if isinstance(a, ast.Starred) else a) for a in node.args}
                if args & cancelled:
                    found.append(node.lineno)
    return found


def test_no_background_task_is_cancelled_once_and_then_awaited():
    """Services, the agent, the bus and the harness end their loops with ``cancel_and_wait``."""
    root = Path(__file__).resolve().parent.parent
    bad = [f"{p.relative_to(root)}:{line}"
           for folder in ("services", "agent", "bus", "loadtest", "gearshift")
           for p in sorted((root / folder).rglob("*.py"))
           for line in _cancel_then_gather(ast.parse(p.read_text()))]
    assert not bad, f"cancel() then gather() on the same tasks: use bus.tasks.cancel_and_wait: {bad}"
    # the check sees the pattern it forbids
    sample = ("async def stop(self):\n    for t in self._tasks:\n        t.cancel()\n"
              "    await asyncio.gather(*self._tasks, return_exceptions=True)\n"
              "async def stop2(self):\n    self._task.cancel()\n    await asyncio.gather(self._task)\n")
    assert _cancel_then_gather(ast.parse(sample)) == [4, 7]
