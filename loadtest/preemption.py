"""Preemption with a grace period (issue 23 item 2), against real services.

    python -m loadtest.preemption [--grace 30] [--json]

A real nats-server, the admission service and the optimizer (policy ``srtf``:
priority classes, then shortest remaining time, preempting from the bottom of
that order, minimum run time 0) in this process, and a fleet of
real agents whose ranks are emulated (``loadtest.fleet``: ``EmulatedRunner``)
with scripted checkpoint behaviour (``WORKER_CKPT_INTERVAL``,
``WORKER_IGNORE_SIGTERM``). Every job asks for ``checkpoint_grace = --grace``;
the agents' own default grace is shorter (5 s), so a kill at the job's grace
shows the job's grace was used.

Two nodes x 4 GPUs hold 2-GPU jobs of priority 0 (the equals):
- ``often``: checkpoints every 0.25 s, leaves on SIGTERM;
- ``rare1``, ``rare2``: checkpoint every 1000 s (never, here), leave on SIGTERM;
- later ``deaf``: checkpoints every 3 s and ignores SIGTERM;
and a ``filler`` of priority 5 that makes room for ``deaf`` when cancelled. A
2-GPU job of priority 10 arrives; the shared victim order
(``policies.victims``) takes, among the equals, the least work since the last
checkpoint: ``often`` (SRTF's own order would take whichever has the most
steps left). ``often`` is then cancelled, ``deaf`` takes the filler's GPUs, and
a second priority-10 job arrives: ``deaf`` again loses least (its checkpoint
is at most 3 s old, the rare jobs' start 20 s or more), and is SIGKILLed at the
grace. ``deaf`` is
SIGKILLed at the grace and loses what it ran since its last periodic
checkpoint, counted as ``gearshift_steps_lost_total{cause="grace_expired"}``.

Checks (``passed``): each victim is the candidate with the least work since
its last checkpoint (GPUs x seconds, from the checkpoints its agents reported
when the high-priority job arrived), that is ``often`` then ``deaf``; every preempted
job's lost steps (its exit report: steps reached - checkpoint kept) are at
most what it ran since its last checkpoint before the SIGTERM (the manifest it
reported last; ``often`` loses 0: it checkpoints on SIGTERM); ``deaf`` exits
137 with ``grace_expired`` no sooner than the grace after its SIGTERM and
within a few seconds of it, and loses at most one checkpoint interval of
steps (3 s / 0.05 s + 1); the counter equals its ``job.grace_expired``
event's steps lost, which equals the loss its exit report shows. What it
compares is measured in one run, never an absolute time; the only wall-clock
bound is the grace itself, which the agent enforces.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.bus import observe
from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobGraceExpired,
    JobPreempted,
    JobProgress,
    JobRecord,
    RunReport,
    RunReportKind,
    SubmitReply,
    SubmitRequest,
)
from loadtest.fleet import Fleet

MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}
STEP_TIME = 0.05
# checkpoint ages far apart (0.25 s or 3 s against never), so a loaded machine's report lag cannot swap them
LOW = {"often": {"WORKER_CKPT_INTERVAL": "0.25"},
       "deaf": {"WORKER_CKPT_INTERVAL": "3", "WORKER_IGNORE_SIGTERM": "1"},
       "rare1": {"WORKER_CKPT_INTERVAL": "1000"},
       "rare2": {"WORKER_CKPT_INTERVAL": "1000"}}


class Watch:
    """Events, reports and progress lines as they come."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.reports: list[RunReport] = []
        self.last_ckpt: dict[str, tuple[int, float]] = {}  # job -> (step, time) of the latest checkpoint seen

    async def open(self, nc: Any) -> "Watch":
        async def on_event(msg: Any) -> None:
            self.events.append(codec.decode_event(msg.data))

        async def on_report(msg: Any) -> None:
            self.reports.append(codec.decode(msg.data, RunReport))

        async def on_progress(msg: Any) -> None:
            p = codec.decode(msg.data, JobProgress)
            if p.checkpoint_step is not None and p.checkpoint_at is not None:
                self.last_ckpt[p.job_id] = (p.checkpoint_step, p.checkpoint_at)

        self.subs = [await nc.subscribe("gs.evt.job.>", cb=on_event), await nc.subscribe("gs.report.>", cb=on_report),
                     await nc.subscribe("gs.job.*.progress", cb=on_progress)]
        return self

    def of(self, kind: type, job: str | None = None) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind) and job in (None, e.job_id)]

    def exited(self, job: str, generation: int) -> list[RunReport]:
        return [r for r in self.reports if r.job_id == job and r.generation == generation and r.rank0
                and r.kind == RunReportKind.EXITED]


async def until(pred: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(step)
    raise TimeoutError(f"{what}: not within {timeout:g} s")


async def scenario(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer

    server = NatsServer(workdir / "js")
    server.start()
    nc = fleet = opt = None
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        nc = await connect(server.url, name="preemption", retry_for=10)
        await ensure_infra(nc)
        _, svc = await start_admission(nc)
        opt = await Optimizer(nc, policy="srtf", interval=0.5, node_timeout=10, lease_ttl=2,
                              policy_options={"min_run_time": 0.0}, drain_timeout=a.grace + 30).open()
        tasks.append(asyncio.create_task(opt.run(stop)))
        watch = await Watch().open(nc)
        fleet = await Fleet(nc, 2, 4, heartbeat=0.5, progress_interval=0.2, grace=5.0,
                            workdir=str(workdir / "fleet")).start()
        lost_before = observe.STEPS_LOST.labels("grace_expired")._value.get()

        async def submit(name: str, priority: int, env: dict[str, str] | None = None) -> str:
            spec = {"name": name, "model": MODEL, "global_batch": 16, "steps": 10**6, "gpus": 2, "plan": {"dp": 2},
                    "priority": priority, "step_time": STEP_TIME, "checkpoint_grace": a.grace, "env": env or None}
            req = codec.decode(json.dumps({"spec": spec}).encode(), SubmitRequest)
            return (await call(nc, subj.ADMISSION_SUBMIT, req, SubmitReply)).job_id

        async def get(job: str) -> JobRecord:
            return await call(nc, subj.ADMISSION_GET, {"job_id": job}, JobRecord)

        async def cancel(job: str) -> None:
            await call(nc, subj.ADMISSION_CANCEL, {"job_id": job}, JobRecord)

        async def running(*jobs: str) -> bool:
            recs = [await get(j) for j in jobs]
            return all(r.state.value == "running" for r in recs)

        ids: dict[str, str] = {}
        for name in ("often", "rare1", "rare2"):
            ids[name] = await submit(name, 0, LOW[name])
        filler = await submit("filler", 5)  # a higher class: never among the equals; it makes room for deaf
        await until(lambda: running(*ids.values(), filler), 60, "three low-priority jobs and the filler running")
        by_id = {v: k for k, v in ids.items()}
        victims: list[str] = []
        least: list[str] = []
        work_seen: list[dict[str, float]] = []
        before: dict[str, tuple[tuple[int, float] | None, int]] = {}

        async def preempt_once(i: int) -> None:
            """A priority-10 job arrives; the victim's preempted generation ends."""
            seen = {e.job_id for e in watch.of(JobPreempted)}
            snapshot = dict(watch.last_ckpt)
            now = time.time()
            work = {}
            for name, job in ids.items():  # GPU-seconds since the last checkpoint, of the equals still running
                rec = await get(job)
                if rec.state.value == "running":
                    since = max(snapshot[job][1] if job in snapshot else 0.0, rec.last_switch_at or 0.0)
                    work[name] = round(2 * (now - since), 2)
            work_seen.append(work)
            least.append(min(work, key=work.__getitem__))
            await submit(f"high{i}", 10)
            ev = await until(lambda: asyncio.sleep(0, [e for e in watch.of(JobPreempted) if e.job_id not in seen]),
                             30, f"a victim for high{i}")
            victims.extend(by_id.get(e.job_id, e.job_id) for e in ev)
            for e in ev:
                before[e.job_id] = (snapshot.get(e.job_id), e.generation)
            for e in ev:  # the victim's rank 0 reports how the preempted generation ended
                await until(lambda: asyncio.sleep(0, watch.exited(e.job_id, e.generation)), a.grace + 30,
                            f"{by_id.get(e.job_id)} exited")

        await until(lambda: asyncio.sleep(0, ids["often"] in watch.last_ckpt), 30, "often's first checkpoint")
        await asyncio.sleep(3.0)  # the rare jobs accumulate work since their start; often checkpoints
        await preempt_once(0)  # often (~0.5 GPU-s) against rare1/rare2 (>= 6)
        # deaf takes the filler's GPUs (often, done with, is cancelled so it does not take them back)
        await cancel(ids["often"])
        ids["deaf"] = await submit("deaf", 0, LOW["deaf"])
        by_id[ids["deaf"]] = "deaf"
        await cancel(filler)
        await until(lambda: running(ids["deaf"]), 60, "deaf running")
        await until(lambda: asyncio.sleep(0, ids["deaf"] in watch.last_ckpt), 30, "deaf's first checkpoint")
        await asyncio.sleep(1.0)  # past its checkpoint: steps it will lose
        await preempt_once(1)  # deaf (<= ~7 GPU-s) against rare1/rare2 (>= 30)
        await asyncio.sleep(1.0)  # the last exit's events reach the stream
        out_jobs = {}
        ok = victims == least == ["often", "deaf"]
        for job, (ck, gen) in before.items():
            r = watch.exited(job, gen)[0]
            lost = max(0, r.progress_step - (r.checkpoint_step or 0))
            ran_since = r.progress_step - (ck[0] if ck else 0)  # since the last checkpoint it reported
            waited = (r.ts - r.stop_sent_at) if r.stop_sent_at else None
            out_jobs[by_id[job]] = {"exit_code": r.exit_code, "grace_expired": r.grace_expired, "steps_lost": lost,
                                    "ran_since_last_checkpoint": ran_since, "stop_to_exit_s": waited,
                                    "checkpoint_step": r.checkpoint_step, "progress_step": r.progress_step}
            ok &= lost <= max(0, ran_since)
        deaf = out_jobs.get("deaf", {})
        ok &= deaf.get("exit_code") == 137 and deaf.get("grace_expired") is True
        ok &= deaf.get("stop_to_exit_s") is not None and a.grace <= deaf["stop_to_exit_s"] < a.grace + 10
        ok &= out_jobs.get("often", {}).get("steps_lost") == 0 and out_jobs.get("often", {}).get("exit_code") == 143
        grace_events = watch.of(JobGraceExpired)
        events = {by_id.get(j, j): [e.__struct_config__.tag for e in watch.events if getattr(e, "job_id", None) == j]
                  for j in ids.values()}
        # and no more than one checkpoint interval of steps: what its scripted checkpoints bound
        bound = int(float(LOW["deaf"]["WORKER_CKPT_INTERVAL"]) / STEP_TIME) + 1
        ok &= deaf.get("steps_lost", bound + 1) <= bound
        counted = observe.STEPS_LOST.labels("grace_expired")._value.get() - lost_before
        ok &= [by_id.get(e.job_id) for e in grace_events] == ["deaf"]
        ok &= counted == sum(e.steps_lost for e in grace_events) == deaf.get("steps_lost")
        return {"passed": bool(ok), "grace_s": a.grace, "victims": victims, "least_work_since_checkpoint": least,
                "work_since_checkpoint_gpu_s": work_seen, "jobs": out_jobs, "deaf_loss_bound_steps": bound,
                "events": events, "steps_lost_grace_expired_total": counted,
                "grace_expired_events": [{"job": by_id.get(e.job_id), "steps_lost": e.steps_lost,
                                          "checkpoint_step": e.checkpoint_step, "progress_step": e.progress_step}
                                         for e in grace_events]}
    finally:
        stop.set()
        if fleet is not None:
            for agent in list(fleet.agents.values()):
                agent.grace = 0.5
                try:
                    await asyncio.wait_for(agent.stop(), 20)
                except Exception:
                    pass
        for t in tasks:
            try:
                await asyncio.wait_for(t, 20)
            except BaseException:
                t.cancel()
        if nc is not None:
            await nc.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.preemption", description=__doc__.split("\n\n")[0])
    ap.add_argument("--grace", type=float, default=30.0, help="every job's checkpoint_grace (s)")
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.grace <= 0:
        ap.error("--grace must be positive")
    from gearshift.bus.log import configure_logging

    configure_logging("json", a.log_level)
    with tempfile.TemporaryDirectory(prefix="gearshift-preemption-") as d:
        try:
            out = asyncio.run(scenario(a, Path(d)))
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
    print(json.dumps(out, indent=None if a.json else 1))
    return 0 if out.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
