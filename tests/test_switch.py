"""Plan switches, the gang barrier, crash retries and lost agents with the
real optimizer, real agents and real worker processes (the emulated worker;
the PyTorch reference workload where torch is installed)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from gearshift.agent.agent import Agent
from gearshift.agent.probe import FakeProbe
from gearshift.bus.client import call
from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    Event,
    GpuReport,
    JobRecord,
    JobRequeued,
    JobState,
    JobSwitched,
    NodeReport,
    ReconfigureReply,
    RunReport,
    RunReportKind,
    SubmitReply,
)
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import OPTIMIZER_RECONFIGURE, Optimizer
from tests.wait import eventually as _eventually

MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}


def eventually(fn, timeout=20.0, interval=0.05):
    return _eventually(fn, timeout, interval)


class Recorder:
    """Everything on the events stream and the reports stream, as it happens."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.reports: list[RunReport] = []

    async def open(self, nc) -> "Recorder":
        async def on_event(msg):
            self.events.append(codec.decode_event(msg.data))

        async def on_report(msg):
            self.reports.append(codec.decode(msg.data, RunReport))

        self.subs = [await nc.subscribe("gs.evt.>", cb=on_event), await nc.subscribe("gs.report.>", cb=on_report)]
        return self

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]

    def report(self, kind: RunReportKind, gen: int, node: str | None = None) -> list[RunReport]:
        return [r for r in self.reports if r.kind == kind and r.generation == gen and node in (None, r.node)]


@pytest.fixture
async def stack(nc, tmp_path):
    """Admission + optimizer in process, and a factory of in-process agents."""
    _, svc = await start_admission(nc)
    opt = await Optimizer(nc, interval=0.3, node_timeout=2.0, lease_ttl=2, max_retries=1).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    await eventually(lambda: asyncio.sleep(0, opt.is_leader and opt._svc is not None))
    rec = await Recorder().open(nc)
    agents: list[Agent] = []

    async def agent(node: str, gpus: int = 4) -> Agent:
        a = Agent(nc, node, FakeProbe(gpus, 16 * 2**30, node=node), tmp_path / "work" / node, cpus=8,
                  heartbeat=0.2, grace=10.0, progress_interval=0.1, ckpt_root=tmp_path / "ckpt")
        await a.start()
        agents.append(a)
        return a

    yield opt, agent, rec
    # teardown is bounded: on a loaded box the in-process services' NATS calls can stall
    # past pytest's limit while stopping; the test's verdict is already in
    for a in agents:
        await _bounded(a.stop())
    stop.set()
    try:
        await asyncio.wait_for(task, 20)
    except BaseException:
        task.cancel()
    await _bounded(svc.stop())


async def _bounded(aw, seconds: float = 20.0) -> None:
    try:
        await asyncio.wait_for(aw, seconds)
    except (asyncio.TimeoutError, Exception):
        pass


async def submit(nc, name, gpus=1, steps=200, **kw) -> str:
    spec = {"name": name, "model": MODEL, "global_batch": 16, "steps": steps, "gpus": gpus, **kw}
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def get(nc, job_id) -> JobRecord:
    return await call(nc, subj.ADMISSION_GET, {"job_id": job_id}, JobRecord)


async def state(nc, job_id, *states, gen=None):
    r = await get(nc, job_id)
    return r if r.state in states and gen in (None, r.generation) else None


async def pin(nc, job_id, plan, placement=()):
    req = {"job_id": job_id, "plan": plan, "placement": [{"node": n, "gpus": g} for n, g in placement]}
    return await call(nc, OPTIMIZER_RECONFIGURE, json.dumps(req).encode(), ReconfigureReply)


def progress_step(tmp_path, node, job_id, gen) -> int:
    try:
        with open(tmp_path / "work" / node / "run" / job_id / f"g{gen}" / "progress-0.json") as f:
            return json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return 0


async def test_switch_checkpoints_at_an_agreed_step_and_resumes_with_the_new_plan(nc, stack, tmp_path):
    opt, agent, rec = stack
    await agent("a")
    job = await submit(nc, "sw", gpus=1, steps=150, step_time=0.02)
    await eventually(lambda: state(nc, job, JobState.RUNNING))
    await eventually(lambda: asyncio.sleep(0, progress_step(tmp_path, "a", job, 1) >= 20))
    assert (await pin(nc, job, {"dp": 2, "zero": 1}, [("a", 2)])).pinned

    sw = (await eventually(lambda: asyncio.sleep(0, rec.of(JobSwitched))))[0]
    exited = rec.report(RunReportKind.EXITED, 1, "a")[0]
    started = rec.report(RunReportKind.STARTED, 2, "a")[0]
    assert exited.exit_code == 143 and exited.stopped
    # the new generation started after the old one exited, from its checkpoint, losing nothing
    assert started.launched_at >= exited.ts
    assert sw.checkpoint_step == exited.checkpoint_step == sw.resumed_step >= 20
    assert sw.steps_lost == 0 and sw.plan.dp == 2 and sw.plan.zero == 1 and sw.gpus == 2 and sw.from_gpus == 1
    assert sw.total_s >= sw.checkpoint_s + sw.teardown_s and sw.total_s < 15
    done = await eventually(lambda: state(nc, job, JobState.COMPLETED), timeout=30)
    assert done.generation == 2 and done.steps_done == 150 and done.restarts == 1
    log = (tmp_path / "work" / "a" / "run" / job / "g2" / "rank-0.log").read_text()
    assert f"resuming from step {sw.checkpoint_step} of 150" in log


async def test_gang_switch_stops_every_rank_before_any_restarts(nc, stack, tmp_path):
    opt, agent, rec = stack
    await agent("a")
    await agent("b")
    # rank 0 checkpoints slowly: the other node's rank is gone long before it
    job = await submit(nc, "gang", gpus=2, steps=4000, step_time=0.02, env={"WORKER_STOP_DELAY": "1.5"},
                       plan={"dp": 2})
    await pin(nc, job, {"dp": 2}, [("a", 1), ("b", 1)])
    first = await eventually(lambda: state(nc, job, JobState.RUNNING))
    if first.generation == 1:  # the pin came after the first round: wait for its switch
        await eventually(lambda: asyncio.sleep(0, rec.of(JobSwitched)))
    gen = (await get(nc, job)).generation
    assert sorted(p.node for p in (await get(nc, job)).placement) == ["a", "b"]
    n_switched = len(rec.of(JobSwitched))
    # the ranks must be past start-up (signal handlers in place, rank 0 stepping)
    # or SIGTERM ends them both at once, before rank 0 can be slow on purpose
    rank0 = (await get(nc, job)).placement[0].node
    await eventually(lambda: asyncio.sleep(0, progress_step(tmp_path, rank0, job, gen) >= 1), timeout=30)
    await pin(nc, job, {"dp": 2}, [("b", 2)])
    mid = await eventually(lambda: state(nc, job, JobState.SCHEDULED, gen=gen + 1), timeout=5)
    assert {p.node for p in mid.draining} <= {"a", "b"}
    await eventually(lambda: asyncio.sleep(0, len(rec.of(JobSwitched)) > n_switched))
    # the recorder reads reports and events through separate consumers: let it catch up
    await eventually(lambda: asyncio.sleep(0, {r.node for r in rec.report(RunReportKind.EXITED, gen)} == {"a", "b"}
                                          and rec.report(RunReportKind.STARTED, gen + 1)), timeout=10)
    exits = rec.report(RunReportKind.EXITED, gen)
    starts = rec.report(RunReportKind.STARTED, gen + 1)
    assert {r.node for r in exits} == {"a", "b"} and starts
    assert max(r.ts for r in exits) - min(r.ts for r in exits) > 1.0  # rank 0's node really was slower
    assert min(r.launched_at for r in starts) >= max(r.ts for r in exits)  # barrier: none restarted early
    await pin(nc, job, None)


async def test_draining_gpus_are_not_given_to_another_job(nc, stack, tmp_path):
    opt, agent, rec = stack
    await agent("a", gpus=2)
    await agent("b", gpus=2)
    slow = await submit(nc, "slow", gpus=2, steps=1000, step_time=0.02, env={"WORKER_STOP_DELAY": "2"},
                        plan={"dp": 2})
    r = await eventually(lambda: state(nc, slow, JobState.RUNNING))
    src = r.placement[0].node
    dst = "b" if src == "a" else "a"
    await eventually(lambda: asyncio.sleep(0, progress_step(tmp_path, src, slow, r.generation) >= 5))
    await pin(nc, slow, {"dp": 2}, [(dst, 2)])  # moves: its old node drains for 2 s
    await eventually(lambda: state(nc, slow, JobState.SCHEDULED, gen=r.generation + 1), timeout=5)
    other = await submit(nc, "other", gpus=2, steps=20, step_time=0.02)
    seen = opt.round_no  # round seen+2 begun: round seen+1, begun after the submit, has completed
    await eventually(lambda: asyncio.sleep(0, opt.round_no >= seen + 2))  # while the old ranks still checkpoint
    assert (await get(nc, other)).state == JobState.PENDING
    o = await eventually(lambda: state(nc, other, JobState.SCHEDULED, JobState.RUNNING, JobState.COMPLETED))
    exited = rec.report(RunReportKind.EXITED, r.generation, src)[0]
    assert o.placement[0].node == src and o.scheduled_at >= exited.ts


async def test_crash_is_retried_from_the_last_checkpoint_then_fails_after_the_limit(nc, stack, tmp_path):
    opt, agent, rec = stack
    await agent("a")
    job = await submit(nc, "crashy", gpus=1, steps=60, step_time=0.02,
                       env={"WORKER_CRASH_AT": "40", "WORKER_CKPT_INTERVAL": "0.1"})
    done = await eventually(lambda: state(nc, job, JobState.COMPLETED, JobState.FAILED), timeout=30)
    assert done.state == JobState.COMPLETED and done.failures == 1 and done.steps_done == 60
    rq = [e for e in rec.of(JobRequeued) if e.job_id == job]
    assert len(rq) == 1 and rq[0].retry == 1 and 0 < rq[0].checkpoint_step <= 40
    log = (tmp_path / "work" / "a" / "run" / job / "g2" / "rank-0.log").read_text()
    assert f"resuming from step {rq[0].checkpoint_step} of 60" in log

    bad = await submit(nc, "always-crashes", gpus=1, steps=10, command=[sys.executable, "-c", "import sys; sys.exit(3)"])
    failed = await eventually(lambda: state(nc, bad, JobState.FAILED), timeout=30)
    assert failed.failures == 1 and "code 3" in failed.reason and "after 1 retries" in failed.reason


@pytest.mark.skipif(not __import__("gearshift.agent.reference", fromlist=["x"]).have_torch(), reason="torch not installed")
@pytest.mark.timeout(300)  # three torch process starts: ~20 s idle, far more on a loaded machine
async def test_torch_reference_job_switches_dp_degree_and_keeps_its_trajectory(nc, stack, tmp_path):
    from gearshift.agent import reference

    opt, agent, rec = stack
    await agent("a", gpus=2)
    spec = reference.job_spec("torchref", steps=64, global_batch=32, gpus=1, extra_args=("--ckpt-every", "1000"))
    job = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id
    await eventually(lambda: asyncio.sleep(0, progress_step(tmp_path, "a", job, 1) >= 5), timeout=60)
    await pin(nc, job, {"dp": 2, "zero": 1}, [("a", 2)])
    done = await eventually(lambda: state(nc, job, JobState.COMPLETED, JobState.FAILED), timeout=90)
    assert done.state == JobState.COMPLETED and done.generation == 2
    # KV can be ahead of the event recorder's consumer by a moment
    sw = (await eventually(lambda: asyncio.sleep(0, rec.of(JobSwitched)), timeout=10))[0]
    assert sw.steps_lost == 0 and sw.resumed_step == sw.checkpoint_step >= 5
    final = json.loads((tmp_path / "ckpt" / job / "manifest.json").read_text())
    base = await asyncio.to_thread(reference.run_local, {"dp": 1}, 64, 32, tmp_path / "base")
    assert final["step"] == 64 and final["world_size"] == 2
    assert abs(final["loss"] - base["loss"]) <= 1e-9 * abs(base["loss"])


async def test_lost_agent_requeues_its_job_which_resumes_elsewhere_from_the_checkpoint(nc, nats_url, tmp_path):
    """Agents as real processes; one is SIGKILLed with its job's processes (the node dies)."""
    _, svc = await start_admission(nc)
    opt = await Optimizer(nc, interval=0.3, node_timeout=2.0, lease_ttl=2).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    rec = await Recorder().open(nc)
    procs = {}
    env = {**os.environ, "GEARSHIFT_NATS_URL": nats_url}
    try:
        for node in ("a", "b"):
            procs[node] = subprocess.Popen(
                [sys.executable, "-m", "gearshift.agent", "--node", node, "--fake-gpus", "2", "--workdir",
                 str(tmp_path / node), "--ckpt-root", str(tmp_path / "ckpt"), "--heartbeat", "0.2"],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        nodes_kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
        await eventually(lambda: _two(nodes_kv), timeout=20)
        job = await submit(nc, "victim", gpus=2, steps=400, step_time=0.02, plan={"dp": 2},
                           env={"WORKER_CKPT_INTERVAL": "0.2"})
        r = await eventually(lambda: state(nc, job, JobState.RUNNING))
        node = r.placement[0].node
        await eventually(lambda: asyncio.sleep(0, _manifest_step(tmp_path, job) >= 20))
        # the node dies: its agent and the job's processes
        pids = [int(x) for x in (tmp_path / node / "run" / job / "g1" / "pids").read_text().split()]
        os.killpg(procs[node].pid, signal.SIGKILL)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        killed_at = _manifest_step(tmp_path, job)
        rq = await eventually(lambda: asyncio.sleep(0, [e for e in rec.of(JobRequeued) if e.job_id == job]), timeout=20)
        assert "node lost" in rq[0].reason
        again = await eventually(lambda: state(nc, job, JobState.RUNNING, gen=2), timeout=20)
        other = "b" if node == "a" else "a"
        assert [p.node for p in again.placement] == [other]
        done = await eventually(lambda: state(nc, job, JobState.COMPLETED), timeout=40)
        assert done.steps_done == 400
        log = (tmp_path / other / "run" / job / "g2" / "rank-0.log").read_text()
        resumed = int(log.split("resuming from step ")[1].split()[0])
        assert resumed >= killed_at >= 20
    finally:
        for p in procs.values():
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        stop.set()
        await task
        await svc.stop()


async def _two(kv):
    return len(await kv_snapshot(kv)) >= 2


def _manifest_step(tmp_path, job) -> int:
    try:
        return json.loads((tmp_path / "ckpt" / job / "manifest.json").read_text())["step"]
    except (OSError, ValueError, KeyError):
        return 0


async def test_job_of_an_unprofiled_model_waits_for_the_profiler_then_runs(nc, tmp_path):
    """Optimizer with --wait-for-models, the profiler and perfmodel services, one agent."""
    from gearshift.bus_schema.perfmodel import model_kv_key as kv_key
    from gearshift.services.perfmodel_service import start_perfmodel
    from gearshift.services.profiler import Profiler

    _, svc = await start_admission(nc)
    _, pm_svc = await start_perfmodel(nc)
    opt = await Optimizer(nc, interval=0.3, lease_ttl=2, wait_for_models=True).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    rec = await Recorder().open(nc)
    a = Agent(nc, "a", FakeProbe(4, 16 * 2**30, node="a"), tmp_path / "work" / "a", cpus=8, heartbeat=0.2,
              progress_interval=0.1, ckpt_root=tmp_path / "ckpt")
    await a.start()
    try:
        model = {"name": "tinynet", "params": 50, "layers": 6, "hidden": 512, "seq_len": 256}
        spec = {"name": "new-model", "model": model, "global_batch": 16, "steps": 20, "gpus": 2, "step_time": 0.02}
        job = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id
        waiting = await eventually(lambda: state(nc, job, JobState.PENDING))
        async def says_why():
            r = await get(nc, job)
            return "waiting for its performance model" in r.reason

        await eventually(says_why, timeout=10)
        prof = await Profiler(nc, interval=0.3, steps=2).open()
        ptask = asyncio.create_task(prof.watch(stop))
        profiled = await eventually(lambda: asyncio.sleep(0, [e for e in rec.events if getattr(e, "job_id", None) == job and
                                                             type(e).__name__ == "JobProfiled"]), timeout=120)
        assert 3 <= profiled[0].plans <= 7
        models = await nc.jetstream().key_value(subj.MODELS_BUCKET)
        assert (await models.get(kv_key(profiled[0].model_key))).value
        done = await eventually(lambda: state(nc, job, JobState.COMPLETED), timeout=30)
        assert done.steps_done == 20 and waiting.generation == 0
    finally:
        stop.set()
        await a.stop()
        await task
        if "ptask" in locals():
            await ptask
        await pm_svc.stop()
        await svc.stop()
