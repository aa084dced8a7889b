"""The time source services take, so tests and the parity harness can inject one.

``SystemClock`` is wall-clock time (``time.time``); ``ManualClock`` moves only when
told to (``advance``/``set``), so a test makes a timeout happen deterministically
instead of sleeping past it.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (or the clock's own origin)."""
        ...


class SystemClock:
    __slots__ = ()

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to."""

    __slots__ = ("t",)

    def __init__(self, t: float = 0.0):
        self.t = float(t)

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"a clock does not go back (advance by {dt})")
        self.t += dt
        return self.t

    def set(self, t: float) -> None:
        self.t = float(t)


SYSTEM = SystemClock()


def now() -> float:
    """Wall-clock seconds: what a service without an injected clock reads."""
    return time.time()
