"""The agent's pure reconcile core and the emulated runner, without NATS."""

from __future__ import annotations

import ast
import signal
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gearshift.agent import core, launch
from gearshift.agent.emulated_runner import CheckpointStore, EmulatedRunner
from gearshift.bus_schema.messages import Allocation, NodePlacement, Plan
from tests.wait import eventually


def alloc(job: str, gen: int, nodes=("n0",), steps=10, step_time=0.01) -> Allocation:
    return Allocation(job_id=job, generation=gen, plan=Plan(dp=len(nodes)),
                      placement=[NodePlacement(node=n, gpus=[0]) for n in nodes], steps=steps, step_time=step_time)


@dataclass
class FakeRun:
    alloc: Allocation
    stopping: bool = False
    ckpt_dir: Path = Path("/ckpt/x")
    procs: list = field(default_factory=list)

    @property
    def generation(self) -> int:
        return self.alloc.generation


def test_reconcile_stops_removed_and_replaced_runs_and_fences_old_generations():
    runs = {"a": FakeRun(alloc("a", 1)), "b": FakeRun(alloc("b", 2)), "c": FakeRun(alloc("c", 1), stopping=True),
            "d": FakeRun(alloc("d", 3))}
    desired = {"b": alloc("b", 3), "d": alloc("d", 2), "e": alloc("e", 1), "f": alloc("f", 4), "c": alloc("c", 2)}
    todo = core.reconcile(desired, runs, launched={"f": 4, "e": 0})
    assert sorted(todo.stop) == [("a", "allocation removed"), ("b", "generation 3 replaces 2")]
    # d: an older generation than the running one is stale; c: still stopping; f: already launched
    assert [a.job_id for a in todo.launch] == ["e"]


def test_a_run_moves_only_along_the_declared_phases():
    run = core.Run(alloc=alloc("a", 1), node_rank=0, gpus=[0], run_dir=Path("/r"), ckpt_dir=Path("/c"))
    assert run.phase == core.RunPhase.LAUNCHING and not run.stopping
    run.advance(core.RunPhase.RUNNING)
    with pytest.raises(core.InvalidRunTransition):
        run.advance(core.RunPhase.LAUNCHING)
    run.advance(core.RunPhase.STOPPING)
    assert run.stopping and not run.done.is_set()
    with pytest.raises(core.InvalidRunTransition):
        run.advance(core.RunPhase.RUNNING)  # a stop is never undone
    run.advance(core.RunPhase.EXITED)
    assert run.done.is_set() and run.stopping
    for to in core.RunPhase:
        with pytest.raises(core.InvalidRunTransition):
            run.advance(to)  # exited is final
    # every phase but the last can reach it; the table is the only place they are declared
    assert all(core.RunPhase.EXITED in nxt for ph, nxt in core.RUN_TRANSITIONS.items() if ph != core.RunPhase.EXITED)


def test_a_predecessors_runs_are_over_unless_still_allocated_at_their_generation():
    left = [alloc("gone", 1), alloc("moved", 2), alloc("same", 3), alloc("cancelled", 1)]
    desired = {"moved": alloc("moved", 3), "same": alloc("same", 3)}
    over = core.ended_leftovers(left, desired)
    assert [a.job_id for a in over] == ["gone", "moved", "cancelled"]
    assert core.leftover_exit_code({"job_id": "x", "done": True, "step": 9}, "x", killed=True) == 0
    assert core.leftover_exit_code({"job_id": "other", "done": True}, "x", killed=False) == 143
    assert core.leftover_exit_code(None, "x", killed=True) == 137


def spec(rank: int) -> launch.RankSpec:
    return launch.RankSpec(rank=rank, local_rank=0, world_size=2, local_world_size=1, node_rank=rank, nnodes=2,
                           gpus=(0,))


async def test_emulated_ranks_keep_the_worker_contract():
    store = CheckpointStore()
    runner = EmulatedRunner(store)
    run = FakeRun(alloc("j", 1, steps=1000, step_time=0.01))
    r0 = await runner.start_rank(run, spec(0), {})
    r1 = await runner.start_rank(FakeRun(run.alloc), spec(1), {})
    await eventually(lambda: runner.progress(run)["step"] >= 1)  # it made steps
    runner.signal(r0, signal.SIGTERM)  # checkpoint at the step reached and leave
    assert await r0.wait() == 143
    step = store.latest(run.ckpt_dir)["step"]
    assert 1 <= step < 1000 and runner.progress(run)["step"] == step
    runner.signal(r1, signal.SIGTERM)
    assert await r1.wait() == 143
    # the next generation resumes from that checkpoint and runs to the end
    run2 = FakeRun(alloc("j", 2, steps=step + 5, step_time=0.01))
    r0 = await runner.start_rank(run2, spec(0), {})
    r1 = await runner.start_rank(FakeRun(run2.alloc), spec(1), {})
    assert await r0.wait() == 0 and await r1.wait() == 0  # the follower ends when rank 0 is done
    m = store.latest(run.ckpt_dir)
    assert m["done"] and m["step"] == step + 5 and runner.progress(run2)["start_step"] == step


async def test_a_killed_rank_keeps_only_its_periodic_checkpoints():
    store = CheckpointStore()
    runner = EmulatedRunner(store)
    run = FakeRun(alloc("k", 1, steps=10_000, step_time=0.01))
    r0 = await runner.start_rank(run, spec(0), {})
    await eventually(lambda: runner.progress(run)["step"] >= 1)  # steps made, but well within one interval
    runner.signal(r0, signal.SIGKILL)
    assert launch.exit_status(await r0.wait()) == 137
    assert store.latest(run.ckpt_dir) is None  # less than one checkpoint interval: nothing saved
