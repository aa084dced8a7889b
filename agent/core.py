"""The agent's reconcile core, pure: the life of one run on a node (declared
once, here), what to stop and what to launch so the runs on a node match the
allocations that place jobs there, and what to do with the runs a previous
agent left behind. No I/O.

Fencing: ``launched`` holds the highest generation the agent started (or
was told to stop) per job; a generation at or below it is never launched, so
a stale allocation, a replay of an old value, or one that already ran to its
end cannot start anything.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from gearshift.bus_schema.messages import Allocation
from gearshift.bus_schema.plan_support import EXIT_PLAN_REFUSED


class RunPhase(str, enum.Enum):
    LAUNCHING = "launching"  # ranks being started
    RUNNING = "running"
    STOPPING = "stopping"  # SIGTERM sent: by the agent, or because a rank failed
    EXITED = "exited"  # every rank ended


#: The only changes of phase a run may make (``Run.advance`` enforces them).
RUN_TRANSITIONS: dict[RunPhase, frozenset[RunPhase]] = {
    RunPhase.LAUNCHING: frozenset({RunPhase.RUNNING, RunPhase.STOPPING, RunPhase.EXITED}),
    RunPhase.RUNNING: frozenset({RunPhase.STOPPING, RunPhase.EXITED}),
    RunPhase.STOPPING: frozenset({RunPhase.EXITED}),
    RunPhase.EXITED: frozenset(),
}


class InvalidRunTransition(RuntimeError):
    pass


@dataclass
class Run:
    """One job@generation on this node: its ranks and how it is ending."""

    alloc: Allocation
    node_rank: int
    gpus: list[int]
    run_dir: Path
    ckpt_dir: Path
    procs: list[Any] = field(default_factory=list)  # runner.Rank handles
    progress_file: Path | None = None  # global rank 0's, when it runs here
    phase: RunPhase = RunPhase.LAUNCHING
    stopped_by_agent: bool = False
    reason: str = ""
    exit_codes: list[int] = field(default_factory=list)  # in the order the ranks ended
    done: asyncio.Event = field(default_factory=asyncio.Event)
    launched_at: float | None = None
    stop_sent_at: float | None = None
    grace_expired: bool = False  # SIGKILLed when the grace after SIGTERM ran out
    stepped: bool = False  # STEPPED reported

    @property
    def job_id(self) -> str:
        return self.alloc.job_id

    @property
    def generation(self) -> int:
        return self.alloc.generation

    @property
    def stopping(self) -> bool:
        """Ending: no new stop, no checkpoint command, no replacement yet."""
        return self.phase in (RunPhase.STOPPING, RunPhase.EXITED)

    def advance(self, to: RunPhase) -> None:
        if to not in RUN_TRANSITIONS[self.phase]:
            raise InvalidRunTransition(f"{self.job_id}@{self.generation}: {self.phase.value} -> {to.value}")
        self.phase = to
        if to == RunPhase.EXITED:
            self.done.set()


class RunState(Protocol):
    @property
    def generation(self) -> int: ...

    @property
    def stopping(self) -> bool: ...


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


def ended_leftovers(left: Iterable[Allocation], desired: Mapping[str, Allocation]) -> list[Allocation]:
    """Of the runs a previous agent on this node left (already stopped), those
    that are over: their generation is no longer this node's allocation (it
    was withdrawn, replaced, or the job was cancelled). The agent reports them
    EXITED and fences them -- nobody else will, and the optimizer waits for
    that report to end a drain or a cancel. A run still allocated at its
    generation is not over: the reconciler launches it again, and its end is
    reported then."""
    out = []
    for alloc in left:
        want = desired.get(alloc.job_id)
        if want is None or want.generation != alloc.generation:
            out.append(alloc)
    return out


def leftover_exit_code(manifest: Mapping[str, Any] | None, job_id: str, killed: bool) -> int:
    """How a predecessor's run ended, as far as anyone can know (its ranks
    were not this agent's children): 0 if the job's checkpoint says it is
    done, 137 if a rank ignored SIGTERM and was killed, else 143 (stopped,
    checkpointed -- by its parent-death signal or by this agent's SIGTERM)."""
    if manifest and manifest.get("done") and manifest.get("job_id") == job_id:
        return 0
    return 137 if killed else 143


def launcher_exit_code(code: int, *, launcher: bool, stop_sent_at: float | None,
                       manifest: Mapping[str, Any] | None, refused: bool = False) -> int:
    """How a run under a launcher ended. torchrun forwards our SIGTERM to its
    ranks, waits for them, then exits 1 (its ``SignalException``): with a
    checkpoint written since the SIGTERM, the ranks did what was asked, and
    that reads as 143 (checkpointed), as it does without a launcher. A rank's
    exit 78 (plan refused) also comes out of torchrun as 1 (its
    ``ChildFailedError``): ``refused`` (the rank recorded a refusal for this
    generation, ``worker.refuse_plan``) makes it 78 again."""
    if launcher and code == 1 and refused:
        return EXIT_PLAN_REFUSED
    if not launcher or code != 1 or stop_sent_at is None or not manifest:
        return code
    written = manifest.get("wall_time")
    return 143 if isinstance(written, (int, float)) and written >= stop_sent_at - 1.0 else code
