"""The ``profile`` command: run one plan for a few steps on GPUs no run,
allocation or other profiling run of this node uses, and reply with the
per-phase means (ms per step) from rank 0's progress file. Those GPUs show as
``reserved`` in the heartbeats while it runs, so the optimizer does not hand
them out.

The profiling contract (``agent/worker.py``): with ``GEARSHIFT_PROFILE_STEPS=N``
set, the script measures N steps, reports ``phases`` (ms per step) in its
progress file and exits 0. A script that ignores it is caught while it runs
(``profile_verdict``): once its progress passes N by ``IGNORED_SLACK`` steps
without phase times, or it exits without them, the run ends at once and says
so, instead of training until the timeout."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from gearshift.agent import launch
from gearshift.agent.core import Run
from gearshift.bus_schema.messages import Allocation, NodePlacement, ProfileCommand, ProfileResult

if TYPE_CHECKING:
    from gearshift.agent.agent import Agent


def free_gpus(node: str, count: int, reserved: Iterable[int], runs: Iterable[Run],
              desired: Mapping[str, Allocation]) -> list[int]:
    """GPU indices no run, allocation or profiling run of ``node`` uses."""
    busy = set(reserved)
    for run in runs:
        busy.update(run.gpus)
    for a in desired.values():
        for p in a.placement:
            if p.node == node:
                busy.update(p.gpus)
    return [i for i in range(count) if i not in busy]


IGNORED_SLACK = 10  # steps past GEARSHIFT_PROFILE_STEPS before a run counts as ignoring it
POLL_S = 0.2
IGNORED = "the script ignores GEARSHIFT_PROFILE_STEPS"


def profile_verdict(prog: Mapping | None, steps: int, elapsed: float, timeout: float,
                    codes: list[int] | None) -> str | None:
    """Is a profiling run over? None: not yet; "": it delivered its phase
    times; else why it failed. ``codes``: the ranks' exit statuses once all
    ended, else None. Pure (the caller's clock gives ``elapsed``)."""
    prog = prog or {}
    phases = prog.get("phases") or {}
    if codes is not None:
        if any(codes):
            return f"exit codes {codes}"
        if "iteration" not in phases:
            return f"{IGNORED}: it exited without reporting phase times (at step {int(prog.get('step') or 0)})"
        return ""
    step = int(prog.get("step") or 0)
    if "iteration" not in phases and step > steps + IGNORED_SLACK:
        return f"{IGNORED}: it ran {step} steps, {steps} asked, and reported no phase times"
    if elapsed > timeout:
        return f"timed out after {timeout:g} s at step {step} (GEARSHIFT_PROFILE_STEPS={steps})"
    return None


async def profile(agent: "Agent", cmd: ProfileCommand) -> ProfileResult:
    node = agent.node
    need = cmd.plan.dp * cmd.plan.tp * cmd.plan.pp
    gpus_now = await agent.probe.sample()
    free = [i for i in free_gpus(node, len(gpus_now), agent.reserved, agent.runs.values(), agent.desired)
            if gpus_now[i].healthy]
    if len(free) < need:
        return ProfileResult(ok=False, node=node, plan=cmd.plan, error=f"{need} GPUs wanted, {len(free)} free on {node}")
    gpus = free[:need]
    agent.reserved.update(gpus)
    alloc = Allocation(
        job_id=cmd.run_id, generation=1, plan=cmd.plan, placement=[NodePlacement(node=node, gpus=gpus)],
        command=cmd.command, env=cmd.env, step_time=cmd.step_time, steps=10**9, global_batch=cmd.global_batch,
    )
    run = Run(alloc=alloc, node_rank=0, gpus=gpus, run_dir=agent.workdir / "profile" / cmd.run_id,
              ckpt_dir=agent.workdir / "profile" / cmd.run_id / "ckpt")
    t0 = time.monotonic()
    log = agent.log.bind(profile=cmd.run_id, plan=cmd.plan.label())

    def failed(why: str) -> ProfileResult:
        return ProfileResult(ok=False, node=node, plan=cmd.plan, gpus=gpus, error=why, wall_s=time.monotonic() - t0)

    try:
        await agent.heartbeat.beat()  # the reservation is visible before the run starts
        try:
            await agent.spawner.spawn(run, node, {"GEARSHIFT_PROFILE_STEPS": str(cmd.steps)})
        except (OSError, ValueError) as exc:  # no such program, name too long, NUL byte (tests/test_fuzz.py)
            return failed(f"launch failed: {exc}")
        waits = [asyncio.create_task(p.wait()) for p in run.procs]
        while True:
            done, pending = await asyncio.wait(waits, timeout=POLL_S)
            codes = None if pending else [launch.exit_status(p.returncode) for p in run.procs]
            prog = agent.runner.progress(run) or {}
            why = profile_verdict(prog, cmd.steps, time.monotonic() - t0, cmd.timeout, codes)
            if why is not None:
                break
        for w in waits:
            w.cancel()
        if why:
            log.warning("profiling run failed", error=why)
            return failed(why)
        ph = prog.get("phases") or {}
        log.info("profiled", iter_ms=round(ph["iteration"], 2))
        return ProfileResult(
            ok=True, node=node, plan=cmd.plan, gpus=gpus, steps=int(prog.get("profiled") or cmd.steps),
            iter_ms=ph.get("iteration"), fwd_ms=ph.get("forward"), bwd_ms=ph.get("backward"),
            opt_ms=ph.get("optimizer"), wall_s=time.monotonic() - t0,
        )
    finally:
        for proc in run.procs:
            agent.runner.signal(proc, signal.SIGKILL)
        for proc in run.procs:
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except asyncio.TimeoutError:
                pass
        agent.probe.release(gpus)
        agent.reserved.difference_update(gpus)
        agent.wake()
