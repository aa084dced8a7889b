"""Polling for the integration tests: wait for a condition, never a fixed sleep."""

from __future__ import annotations

import asyncio
import time


async def eventually(fn, timeout: float = 5.0, interval: float = 0.02):
    """Poll ``fn`` (sync or async) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
