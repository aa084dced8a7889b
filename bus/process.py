"""A service process: uvloop, graceful shutdown on SIGTERM/SIGINT, GC tuning."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, TypeVar

import uvloop

from gearshift.bus import observe
from gearshift.bus.log import configure_logging, get_logger

T = TypeVar("T")


class GcClock:
    """Seconds this process spent in the garbage collector (``gc.callbacks``)."""

    total = 0.0
    _started = 0.0

    @classmethod
    def install(cls) -> None:
        if cls._hook not in gc.callbacks:
            gc.callbacks.append(cls._hook)

    @classmethod
    def _hook(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._started = time.perf_counter()
        elif cls._started:
            cls.total += time.perf_counter() - cls._started


class OwnCpu:
    """Awaits ``coro`` and sums the CPU of its own steps: ``time.thread_time`` of the
    loop's thread while the coroutine (and what it awaits in line) runs, not while it
    waits. What the loop's other tasks do meanwhile is not counted: the optimizer's
    node watcher decodes every node's heartbeat (1,000 a second at 2,000 nodes), and a
    round waits on acknowledgements and on its policy's thread, so the process's CPU
    over a round grows with the nodes whatever the round does (``loadtest.scale``'s
    node sweep, stop 52). Work handed to another thread is that thread's to count.

    ``cpu``: seconds of the steps that ended; ``so_far()``: with the step running now
    (called from inside ``coro``)."""

    def __init__(self, coro: Coroutine[Any, Any, T]):
        self.coro = coro
        self.cpu = 0.0
        self._step_started = 0.0

    def so_far(self) -> float:
        return self.cpu + (time.thread_time() - self._step_started)

    def __await__(self) -> Generator[Any, Any, T]:
        coro, value, error = self.coro, None, None
        while True:
            self._step_started = time.thread_time()
            try:
                step = coro.send(value) if error is None else coro.throw(error)
            except StopIteration as done:
                return done.value
            finally:
                self.cpu += time.thread_time() - self._step_started
            try:
                value, error = (yield step), None
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation goes to the coroutine, as a task would throw it
                value, error = None, exc


GC_THRESHOLD = 50_000  # young-generation allocations between collections (Python's default: 700)


def tune_gc() -> None:
    """Count the time spent collecting (``GcClock``; the optimizer logs it per
    round as ``gc_ms``), freeze what is alive after start-up and collect the
    young generation every ``GC_THRESHOLD`` allocations instead of 700
    (``GEARSHIFT_GC_THRESHOLD=N`` sets N; 0 keeps Python's defaults). Services
    hold tens of thousands of records in their views; with Python's defaults
    their collections were the tail of submit latency at 2,000 nodes
    (``loadtest.scale``, same command, idle 2-core box: submit p99 108 ms with
    the defaults, 37 ms with 50,000; round p99 with >= 5,000 live jobs 1.88 s
    and 1.20 s; peak RSS unchanged within 3%)."""
    GcClock.install()
    raw = os.environ.get("GEARSHIFT_GC_THRESHOLD")
    try:
        first = GC_THRESHOLD if raw is None or raw.strip() == "" else int(raw)
    except ValueError:  # one line, no traceback
        raise SystemExit(f"GEARSHIFT_GC_THRESHOLD: expected a whole number of allocations (0: Python's defaults), "
                         f"got {raw!r}") from None
    if first > 0:
        gc.freeze()
        gc.set_threshold(first, 20, 100)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop; SIGTERM/SIGINT set ``stop``."""
    configure_logging()
    tune_gc()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        except observe.MetricsPortBusy as exc:  # one clear line, no traceback
            get_logger().error(str(exc))
            raise SystemExit(4) from None

    use_uvloop = os.environ.get("GEARSHIFT_LOOP", "uvloop") == "uvloop"
    if use_uvloop:
        uvloop.run(runner())
    else:
        asyncio.run(runner())
