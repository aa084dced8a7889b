"""Run a service's ``main()`` under cProfile (``loadtest.scale --profile``):

    python -m loadtest.profiled OUT.prof gearshift.services.admission --max-jobs-per-tenant 100

The module is imported as itself, not run as ``__main__`` (``python -m cProfile -m``
does that, and msgspec cannot resolve the configs' postponed annotations there); the
stats are written to ``OUT.prof`` when ``main()`` returns (SIGTERM stops a service).

The profiles count CPU time, not wall time (``time.thread_time``: the thread's own
CPU): on a busy 2-core machine a wall-clock profile charges the time a process
waits for a core to whatever it was doing (a socket write that woke nats-server
showed as 1.5 ms a call). Work handed to threads (``asyncio.to_thread``: the
optimizer's policy call) is profiled too, in its own thread, into
``OUT.threads.prof``.
"""

from __future__ import annotations

import asyncio
import cProfile
import importlib
import pstats
import sys
import threading
import time
from typing import Any


class _ThreadProfiles:
    """``asyncio.to_thread`` with each call profiled in its thread, all into one stats."""

    def __init__(self) -> None:
        self.profiles: list[cProfile.Profile] = []
        self._lock = threading.Lock()
        self._to_thread = asyncio.to_thread

    def install(self) -> None:
        async def to_thread(func: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await self._to_thread(self._run, func, *args, **kwargs)

        asyncio.to_thread = to_thread

    def _run(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        prof = cProfile.Profile(time.thread_time)
        try:
            return prof.runcall(func, *args, **kwargs)
        finally:
            with self._lock:
                self.profiles.append(prof)

    def dump(self, out: str) -> None:
        with self._lock:
            profiles = list(self.profiles)
        if not profiles:
            return
        stats = pstats.Stats(profiles[0])
        for p in profiles[1:]:
            stats.add(p)
        stats.dump_stats(out)


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m loadtest.profiled OUT.prof MODULE [ARGS...]")
    out, name, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    module = importlib.import_module(name)
    sys.argv = [name, *args]
    threads = _ThreadProfiles()
    threads.install()
    prof = cProfile.Profile(time.thread_time)
    try:
        prof.runcall(module.main)
    finally:
        prof.dump_stats(out)
        threads.dump(out.removesuffix(".prof") + ".threads.prof")


if __name__ == "__main__":
    main()
