"""Helpers of the tests that drive the ``gearshift`` command against live processes."""

from __future__ import annotations

import time


def wait_for(pred, timeout=30.0, step=0.2):
    """Poll ``pred`` until it returns something truthy (returned), or fail."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(step)
    raise AssertionError(f"condition not met in {timeout}s (last: {last!r})")
