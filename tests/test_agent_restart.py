"""An agent killed outright (SIGKILL) and started again on the same workdir:
the runs its predecessor never reported ended are reported by the successor,
so a drain or a cancel the dead agent was in the middle of ends at once, not
at the optimizer's ``--drain-timeout``. Real agent processes, real worker
processes, a real nats-server, the real optimizer and admission."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gearshift.bus.client import call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobRecord,
    JobState,
    ReconfigureReply,
    RoundReply,
    RunReport,
    RunReportKind,
    SubmitReply,
)
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer
from tests.wait import eventually as _eventually

MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}
DRAIN_TIMEOUT = 600.0  # far beyond any wait here: only a report can end a drain in time


def eventually(fn, timeout=30.0, interval=0.1):
    return _eventually(fn, timeout, interval)


class AgentProcess:
    """``python -m agent`` on a fixed workdir, killed with SIGKILL and started again."""

    def __init__(self, nats_url: str, node: str, tmp_path) -> None:
        self.argv = [sys.executable, "-m", "gearshift.agent", "--node", node, "--fake-gpus", "2", "--workdir",
                     str(tmp_path / node), "--ckpt-root", str(tmp_path / "ckpt"), "--heartbeat", "0.2",
                     "--grace", "3"]
        self.env = {**os.environ, "GEARSHIFT_NATS_URL": nats_url, "GEARSHIFT_METRICS_PORT": "0"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        """The agent only: its job processes are left to their parent-death signal."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def node_timeout() -> float:
    return 30.0  # longer than an agent's restart: the node stays alive through it


@pytest.fixture
async def cluster(nc, nats_url, tmp_path, node_timeout):
    _, svc = await start_admission(nc)
    opt = await Optimizer(nc, interval=0.3, node_timeout=node_timeout, lease_ttl=2, drain_timeout=DRAIN_TIMEOUT).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    reports: list[RunReport] = []

    async def on_report(msg):
        reports.append(codec.decode(msg.data, RunReport))

    sub = await nc.subscribe("gs.report.>", cb=on_report)
    agent = AgentProcess(nats_url, "a", tmp_path)
    agent.start()
    try:
        yield agent, reports
    finally:
        agent.stop()
        await sub.unsubscribe()
        stop.set()
        try:
            await asyncio.wait_for(task, 20)
        except BaseException:
            task.cancel()
        try:
            await asyncio.wait_for(svc.stop(), 20)
        except BaseException:
            pass


async def submit(nc) -> str:
    spec = {"name": "long", "model": MODEL, "global_batch": 16, "steps": 5000, "gpus": 1, "step_time": 0.02,
            "env": {"WORKER_CKPT_INTERVAL": "0.2"}}
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def get(nc, job_id) -> JobRecord:
    return await call(nc, subj.ADMISSION_GET, {"job_id": job_id}, JobRecord)


async def running_with_progress(nc, job_id, tmp_path) -> JobRecord:
    async def ready():
        r = await get(nc, job_id)
        if r.state != JobState.RUNNING:
            return None
        try:
            prog = json.loads((tmp_path / "a" / "run" / job_id / f"g{r.generation}" / "progress-0.json").read_text())
        except (OSError, ValueError):
            return None
        return r if prog.get("step", 0) >= 5 else None

    return await eventually(ready, timeout=60)


async def test_a_switch_whose_agent_was_killed_mid_drain_goes_on_when_the_agent_is_back(nc, cluster, tmp_path):
    agent, reports = cluster
    job = await submit(nc)
    rec = await running_with_progress(nc, job, tmp_path)
    g = rec.generation
    # the agent dies exactly between the withdrawal of g and any reaction to it
    agent.freeze()
    req = {"job_id": job, "plan": {"dp": 1, "grad_ckpt": True}, "placement": [{"node": "a", "gpus": 1}]}
    assert (await call(nc, subj.OPTIMIZER_RECONFIGURE, json.dumps(req).encode(), ReconfigureReply)).pinned

    async def draining():
        r = await get(nc, job)
        return r if r.generation == g + 1 and [p.node for p in r.draining] == ["a"] else None

    await eventually(draining, timeout=20)
    agent.kill()
    assert not [r for r in reports if r.kind == RunReportKind.EXITED and r.generation == g]
    t0 = time.monotonic()
    agent.start()
    switched = await eventually(lambda: _state(nc, job, JobState.RUNNING, g + 1), timeout=60)
    assert time.monotonic() - t0 < DRAIN_TIMEOUT / 10  # the report ended the drain, not the timeout
    exited = [r for r in reports if r.kind == RunReportKind.EXITED and r.generation == g]
    assert len(exited) == 1 and exited[0].stopped and exited[0].exit_code in (143, 137)
    assert exited[0].message == "ended with the previous agent"
    assert exited[0].checkpoint_step is not None and exited[0].checkpoint_step >= 5
    assert switched.plan.grad_ckpt and not switched.draining
    # g is fenced: the successor never ran it again
    assert not [r for r in reports if r.kind == RunReportKind.STARTED and r.generation == g and r.ts > exited[0].ts]
    log = tmp_path / "a" / "run" / job / f"g{g + 1}" / "rank-0.log"
    await eventually(lambda: asyncio.sleep(0, log.exists() and "resuming" in log.read_text()), timeout=30)
    assert f"resuming from step {exited[0].checkpoint_step} of 5000" in log.read_text()


async def test_a_cancel_whose_process_died_with_its_agent_ends_when_the_agent_is_back(nc, cluster, tmp_path):
    agent, reports = cluster
    job = await submit(nc)
    rec = await running_with_progress(nc, job, tmp_path)
    agent.freeze()
    cancelled = await call(nc, subj.ADMISSION_CANCEL, {"job_id": job}, JobRecord)
    assert cancelled.state == JobState.CANCELLING
    alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)

    async def withdrawn():
        try:
            entry = await alloc_kv.get(f"a.{job}")
            return entry.value in (None, b"")
        except Exception:
            return True

    await eventually(withdrawn, timeout=20)
    agent.kill()
    for _ in range(2):  # rounds after the kill (run and waited for here) do not end it
        await call(nc, subj.OPTIMIZER_ROUND, None, RoundReply)
    assert (await get(nc, job)).state == JobState.CANCELLING  # nobody else can end it
    agent.start()
    done = await eventually(lambda: _state(nc, job, JobState.CANCELLED, rec.generation), timeout=60)
    assert done.reason == "cancelled by user"
    exited = [r for r in reports if r.kind == RunReportKind.EXITED and r.generation == rec.generation]
    assert len(exited) == 1 and exited[0].stopped


@pytest.mark.parametrize("node_timeout", [2.0])
async def test_a_cancel_on_a_node_that_never_comes_back_ends_when_the_node_is_lost(nc, cluster, tmp_path):
    agent, reports = cluster
    job = await submit(nc)
    await running_with_progress(nc, job, tmp_path)
    agent.freeze()
    assert (await call(nc, subj.ADMISSION_CANCEL, {"job_id": job}, JobRecord)).state == JobState.CANCELLING
    agent.kill()  # for good: no successor will report
    done = await eventually(lambda: _state(nc, job, JobState.CANCELLED, 1), timeout=30)
    assert "nodes were lost" in done.reason
    assert not [r for r in reports if r.kind == RunReportKind.EXITED and r.job_id == job]


async def test_a_run_still_allocated_is_launched_again_and_reports_only_its_real_end(nc, cluster, tmp_path):
    agent, reports = cluster
    job = await submit(nc)
    rec = await running_with_progress(nc, job, tmp_path)
    agent.kill()
    await asyncio.sleep(0.5)
    agent.start()

    async def resumed():
        try:
            log = (tmp_path / "a" / "run" / job / f"g{rec.generation}" / "rank-0.log").read_text()
        except OSError:
            return False
        return log.count("resuming from step") >= 2

    await eventually(resumed, timeout=60)
    r = await get(nc, job)
    assert r.state == JobState.RUNNING and r.generation == rec.generation and r.restarts == 0
    # the generation goes on where it was: no EXITED for it (the optimizer would take it for the job's end)
    assert not [x for x in reports if x.kind == RunReportKind.EXITED and x.job_id == job]


async def _state(nc, job_id, state, gen):
    r = await get(nc, job_id)
    return r if r.state == state and r.generation == gen else None
