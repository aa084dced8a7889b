"""A job launched through ``torchrun`` (issue 20 item 8): the agent starts one
launcher per node and tells it the gang's layout (``PET_*``); a stop reaches
the ranks (torchrun starts each in a session of its own) so they checkpoint and
exit within the grace, and a SIGKILL at the grace leaves no worker behind.
Real torchrun, real agent, real optimizer; a tiny script keeping the worker
contract (the emulated worker's loop)."""

from __future__ import annotations

import asyncio
import sys

import psutil
import pytest

from gearshift.agent import core, launch
from gearshift.bus.client import call
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import Allocation, JobRecord, JobState, JobSwitched, NodePlacement, Plan, RunReportKind
from tests.test_switch import eventually, get, pin, progress_step, stack, state, submit  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not __import__("gearshift.agent.reference", fromlist=["x"]).have_torch(),
                                reason="torch not installed")

def torchrun(*script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *script]


def test_a_launcher_is_started_once_per_node_with_the_layout():
    alloc = Allocation(job_id="j", generation=2, plan=Plan(dp=4), command=torchrun("-m", "x"),
                       placement=[NodePlacement(node="a", gpus=[0, 1]), NodePlacement(node="b", gpus=[2, 3])])
    (spec,) = launch.rank_specs(alloc, "b")
    assert spec.local_world_size == 2 and spec.node_rank == 1 and spec.gpus == (2, 3) and spec.world_size == 4
    env = launch.environment(alloc, spec, node="b", master_addr="10.0.0.1", ckpt_dir=__import__("pathlib").Path("."),
                             progress_file=__import__("pathlib").Path("p"), base={})
    assert (env["PET_NPROC_PER_NODE"], env["PET_NNODES"], env["PET_NODE_RANK"]) == ("2", "2", "1")
    assert env["PET_MASTER_ADDR"] == "10.0.0.1" and env["PET_MASTER_PORT"] == env["MASTER_PORT"]
    assert launch.is_launcher(["/usr/bin/torchrun", "train.py"]) and not launch.is_launcher([sys.executable, "t.py"])
    plain = Allocation(job_id="j", generation=2, plan=Plan(dp=2), command=[sys.executable, "t.py"],
                       placement=[NodePlacement(node="a", gpus=[0, 1])])
    assert len(launch.rank_specs(plain, "a")) == 2 and "PET_NNODES" not in launch.environment(
        plain, launch.rank_specs(plain, "a")[0], node="a", master_addr="x", ckpt_dir=".", progress_file="p", base={})


def test_torchruns_signal_exit_after_a_checkpoint_reads_as_checkpointed():
    m = {"wall_time": 100.5}
    assert core.launcher_exit_code(1, launcher=True, stop_sent_at=100.0, manifest=m) == 143
    assert core.launcher_exit_code(1, launcher=True, stop_sent_at=110.0, manifest=m) == 1  # checkpoint is older
    assert core.launcher_exit_code(1, launcher=False, stop_sent_at=100.0, manifest=m) == 1
    assert core.launcher_exit_code(1, launcher=True, stop_sent_at=None, manifest=m) == 1  # it crashed by itself
    # a rank refused its plan (worker.refuse_plan): 78 whether or not a stop was sent
    assert core.launcher_exit_code(1, launcher=True, stop_sent_at=None, manifest=None, refused=True) == 78
    assert core.launcher_exit_code(1, launcher=True, stop_sent_at=100.0, manifest=m, refused=True) == 78
    assert core.launcher_exit_code(0, launcher=True, stop_sent_at=None, manifest=None, refused=True) == 0


def test_a_refusal_is_recorded_for_its_generation(tmp_path):
    from gearshift.agent import worker
    env = worker.WorkerEnv.from_env({"GEARSHIFT_GENERATION": "3", "GEARSHIFT_PROGRESS_FILE": str(tmp_path / "progress-0.json"),
                                     "GEARSHIFT_PLAN": '{"tp": 2}'})
    assert worker.plan_refused_generation(tmp_path) is None
    assert worker.refuse_plan(env, "tp", "no tensor parallelism") == worker.EXIT_PLAN_REFUSED == 78
    assert worker.plan_refused_generation(tmp_path) == 3


def _workers_in(run_dir) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cwd", "cmdline"]):
        try:
            if p.info["cwd"] == str(run_dir) and "torch.distributed.run" not in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except (psutil.Error, TypeError):
            continue
    return out


@pytest.mark.timeout(240)
async def test_a_torchrun_job_checkpoints_and_switches_within_the_grace(nc, stack, tmp_path):
    opt, agent, rec = stack
    a = await agent("a", gpus=2)
    job = await submit(nc, "tr", gpus=2, steps=100000, step_time=0.05, plan={"dp": 2},
                       command=torchrun("-m", "gearshift.agent.emulated_worker"))
    await eventually(lambda: asyncio.sleep(0, progress_step(tmp_path, "a", job, 1) >= 3), timeout=90)
    run_dir = tmp_path / "work" / "a" / "run" / job / "g1"
    assert len(_workers_in(run_dir)) == 2  # one launcher, two ranks (PET_NPROC_PER_NODE)
    await pin(nc, job, {"dp": 2, "ga": 2})
    sw = (await eventually(lambda: asyncio.sleep(0, [e for e in rec.of(JobSwitched) if e.job_id == job]),
                           timeout=90))[0]
    exited = [r for r in rec.report(RunReportKind.EXITED, 1, "a")]
    assert exited and exited[0].exit_code == 143 and exited[0].stopped
    assert exited[0].ts - exited[0].stop_sent_at < a.grace  # no SIGKILL at the grace
    assert sw.steps_lost == 0 and sw.resumed_step == sw.checkpoint_step >= 3
    assert not _workers_in(run_dir)



STUBBORN = ("import os, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # never checkpoints, never leaves\n"
            "open(f\"deaf-{os.environ['RANK']}\", 'w').close()  # only now is it deaf\n"
            "while True:\n"
            "    time.sleep(0.1)\n")


@pytest.mark.timeout(240)
async def test_a_torchrun_job_that_ignores_sigterm_is_killed_at_the_grace_with_its_workers(nc, stack, tmp_path):
    opt, agent, rec = stack
    a = await agent("a", gpus=2)
    a.grace = 2.0
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    job = await submit(nc, "stubborn", gpus=2, steps=100, plan={"dp": 2}, command=torchrun(str(script)))
    run_dir = tmp_path / "work" / "a" / "run" / job / "g1"
    await eventually(lambda: asyncio.sleep(0, len(_workers_in(run_dir)) == 2), timeout=90)
    # a SIGTERM before a rank ignores it would end that rank at once: wait until both are deaf
    await eventually(lambda: asyncio.sleep(0, len(list(run_dir.glob("deaf-*"))) == 2), timeout=90)
    await call(nc, subj.ADMISSION_CANCEL, {"job_id": job}, JobRecord)
    await eventually(lambda: state(nc, job, JobState.CANCELLED), timeout=60)
    exited = await eventually(lambda: asyncio.sleep(0, rec.report(RunReportKind.EXITED, 1, "a")), timeout=10)
    assert exited[0].exit_code == 137 and exited[0].stopped
    assert a.grace <= exited[0].ts - exited[0].stop_sent_at < a.grace + 8
    await eventually(lambda: asyncio.sleep(0, not _workers_in(run_dir)), timeout=10)  # none orphaned
