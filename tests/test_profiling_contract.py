"""The profiling contract (issue 20 item 8): ``GEARSHIFT_PROFILE_STEPS``. A
script that ignores it is caught while it runs and reported, and a model whose
profiling runs all fail leaves no job pending: the script crashed -> its jobs
fail with the reason; it ran but gave no timings -> its jobs run on the prior
model. The verdict is pure (the caller's clock, injected here: no sleeps); the
end-to-end test uses the real profiler, perfmodel, optimizer and agent."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from gearshift.agent.agent import Agent
from gearshift.agent.probe import FakeProbe
from gearshift.agent.profiling import IGNORED, IGNORED_SLACK, profile_verdict
from gearshift.bus.client import call
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobFailed, JobProfiled, JobState, ProfileResult, SubmitReply
from gearshift.services.profiler import crashed
from tests.test_switch import Recorder, eventually, get, state


def test_a_run_that_reports_its_phases_is_done_and_one_that_trains_on_is_caught():
    phases = {"step": 5, "phases": {"iteration": 12.0}}
    assert profile_verdict(phases, 5, elapsed=1.0, timeout=120, codes=[0]) == ""
    assert profile_verdict({"step": 3}, 5, elapsed=1.0, timeout=120, codes=None) is None  # still measuring
    # past the profile steps by the slack, no phase times: caught long before the timeout
    assert profile_verdict({"step": 5 + IGNORED_SLACK}, 5, elapsed=2.0, timeout=120, codes=None) is None
    why = profile_verdict({"step": 6 + IGNORED_SLACK}, 5, elapsed=2.0, timeout=120, codes=None)
    assert why.startswith(IGNORED) and f"{6 + IGNORED_SLACK} steps, 5 asked" in why
    why = profile_verdict({"step": 40}, 5, elapsed=0.5, timeout=120, codes=[0])  # left without its phases
    assert why.startswith(IGNORED)
    assert profile_verdict({"step": 2}, 5, elapsed=121.0, timeout=120, codes=None).startswith("timed out")
    assert profile_verdict(None, 5, elapsed=1.0, timeout=120, codes=[1, 0]) == "exit codes [1, 0]"


def test_only_a_script_that_crashed_every_run_counts_as_unable_to_run():
    bad = ProfileResult(ok=False, error="exit codes [3]")
    ignored = ProfileResult(ok=False, error=f"{IGNORED}: it ran 20 steps")
    assert crashed([bad, bad]) and not crashed([bad, ignored]) and not crashed([])


IGNORES = ("import os, runpy\n"
           "os.environ.pop('GEARSHIFT_PROFILE_STEPS', None)  # a script that never heard of the contract\n"
           "runpy.run_module('gearshift.agent.emulated_worker', run_name='__main__')\n")


@pytest.mark.timeout(180)
async def test_no_job_stays_pending_when_profiling_fails(nc, tmp_path):
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer
    from gearshift.services.perfmodel_service import start_perfmodel
    from gearshift.services.profiler import Profiler

    _, svc = await start_admission(nc)
    _, pm_svc = await start_perfmodel(nc)
    opt = await Optimizer(nc, interval=0.3, lease_ttl=2, wait_for_models=True).open()
    stop = asyncio.Event()
    tasks = [asyncio.create_task(opt.run(stop))]
    rec = await Recorder().open(nc)
    a = Agent(nc, "a", FakeProbe(4, 16 * 2**30, node="a"), tmp_path / "work" / "a", cpus=8, heartbeat=0.2,
              progress_interval=0.1, ckpt_root=tmp_path / "ckpt")
    await a.start()
    try:
        async def submit(name, model, command):
            spec = {"name": name, "model": {"params": 50, "layers": 6, "hidden": 512, "seq_len": 256, "name": model},
                    "global_batch": 16, "steps": 30, "gpus": 2, "step_time": 0.01, "command": command}
            return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id

        ignorer = await submit("ignorer", "ignorernet", [sys.executable, "-c", IGNORES])
        crasher = await submit("crasher", "crashernet", [sys.executable, "-c", "import sys; sys.exit(3)"])
        prof = await Profiler(nc, interval=0.3, steps=2).open()
        tasks.append(asyncio.create_task(prof.watch(stop)))
        failed = await eventually(lambda: state(nc, crasher, JobState.FAILED), timeout=120)
        assert failed.reason.startswith("profiling: every profiling run failed") and "exit codes" in failed.reason
        profiled = await eventually(lambda: asyncio.sleep(0, [e for e in rec.of(JobProfiled) if e.job_id == ignorer]),
                                    timeout=120)
        assert profiled[0].plans == 0 and profiled[0].error.count(IGNORED) >= 1
        # scheduled on the prior model, and it trains (a script ignoring the contract still trains)
        done = await eventually(lambda: state(nc, ignorer, JobState.RUNNING, JobState.COMPLETED), timeout=60)
        assert done.generation >= 1
        runs = profiled[0].error.removeprefix("every profiling run failed: ").split("; ")
        assert runs and all(r.startswith(IGNORED) for r in runs)  # caught by the contract, none by the 120 s timeout
        assert [e for e in rec.of(JobFailed) if e.job_id == crasher]
    finally:
        stop.set()
        await a.stop()
        await asyncio.gather(*tasks, return_exceptions=True)
        await pm_svc.stop()
        await svc.stop()


async def test_the_submits_of_one_gap_wake_the_profiler_once(nc):
    """A pass (a stream-info request, the waiting jobs read) ran for every submit: 1,600
    in 9 s of sequential submits (issue 24). Submits that come within ``gap`` of a pass
    now go into one pass. Deterministic: a gap longer than the test, then stop."""
    from gearshift.services.profiler import Profiler

    passes: list[int] = []

    async def count() -> None:
        passes.append(1)
        first_pass.set()

    async def run(gap: float, wakes: int) -> tuple[int, bool]:
        passes.clear()
        first_pass.clear()
        prof = await Profiler(nc, interval=3600.0, gap=gap).open()
        prof._profile_waiting = count  # the pass itself is not under test here
        stop = asyncio.Event()
        task = asyncio.create_task(prof.watch(stop))
        try:
            await asyncio.wait_for(first_pass.wait(), 30)  # the pass at the start
            first_pass.clear()
            for i in range(wakes):
                await nc.publish(f"gs.evt.job.j{i}.submitted", b"{}")
            await nc.flush()
            if gap == 0:
                await asyncio.wait_for(first_pass.wait(), 30)  # no gap: the wakes ran a pass at once
            else:
                for _ in range(3000):  # until the subscription has seen a wake (no fixed sleep)
                    if prof._wake.is_set():
                        break
                    await asyncio.sleep(0.01)
            woken = prof._wake.is_set()  # a wake waiting for the next pass
            stop.set()
            await asyncio.wait_for(task, 30)
        finally:
            stop.set()
            await prof.close()
        return len(passes), woken

    first_pass = asyncio.Event()
    # the start's pass only: the 50 wakes arrived (one waits) but the gap is not over
    assert await run(gap=3600.0, wakes=50) == (1, True)
    # the same wakes without a gap: they ran another pass at once
    assert (await run(gap=0.0, wakes=50))[0] >= 2
