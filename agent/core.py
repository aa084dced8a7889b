"""The agent's reconcile core, pure: what to stop and what to launch so the
runs on a node match the allocations that place jobs there. No I/O.

Fencing: ``launched`` holds the highest generation the agent started (or
was told to stop) per job; a generation at or below it is never launched, so
a stale allocation, a replay of an old value, or one that already ran to its
end cannot start anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from bus_schema.messages import Allocation


class RunState(Protocol):
    @property
    def generation(self) -> int: ...

    stopping: bool


@dataclass
class Actions:
    stop: list[tuple[str, str]] = field(default_factory=list)  # (job id, reason)
    launch: list[Allocation] = field(default_factory=list)


def reconcile(desired: Mapping[str, Allocation], runs: Mapping[str, RunState], launched: Mapping[str, int]) -> Actions:
    out = Actions()
    for job_id, run in runs.items():
        if run.stopping:
            continue
        want = desired.get(job_id)
        if want is None:
            out.stop.append((job_id, "allocation removed"))
        elif want.generation > run.generation:
            out.stop.append((job_id, f"generation {want.generation} replaces {run.generation}"))
        # an older generation than the running one is stale: keep running
    for job_id, want in desired.items():
        if job_id in runs:  # running, or stopping: its end wakes the reconciler again
            continue
        if want.generation <= launched.get(job_id, 0):
            continue
        out.launch.append(want)
    return out
