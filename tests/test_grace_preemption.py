"""Preemption with a grace period (issue 23 item 2): the job's checkpoint grace
(bounded at submit), carried to the agent in its allocation; a rank SIGKILLed
at the grace reported and its loss counted (``job.grace_expired``,
``gearshift_steps_lost_total{cause="grace_expired"}``); victims among equal
priority by least work since their last checkpoint (``policies.victims``).
The end-to-end check is ``loadtest.preemption`` (real services, emulated ranks
with scripted checkpoints), run here with a 2 s grace."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from gearshift.agent.emulated_runner import EmulatedRunner
from gearshift.agent.launch import RankSpec
from gearshift.bus import observe
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import (
    Allocation,
    JobGraceExpired,
    JobRecord,
    JobSpec,
    JobState,
    NodePlacement,
    Plan,
    RunReport,
    RunReportKind,
    SwitchTiming,
)
from gearshift.bus_schema.validate import SpecError, check_spec
from gearshift.policies.api import JobView, NodeState, Placement
from gearshift.policies.registry import make_policy
from gearshift.policies.victims import victim_order, work_since_checkpoint
from gearshift.services import lifecycle
from gearshift.services.alloc_writer import allocation_for
from tests.wait import eventually

MODEL = {"name": "gpt2", "params": 1560, "layers": 24, "hidden": 1920, "seq_len": 1024}


def spec(**over) -> JobSpec:
    doc = {"name": "j", "model": MODEL, "global_batch": 16, "steps": 10**6, "gpus": 2, "plan": {"dp": 2}, **over}
    return codec.decode(json.dumps(doc).encode(), JobSpec)


def test_a_jobs_grace_is_bounded_by_the_cluster_and_reaches_its_allocation():
    with pytest.raises(SpecError) as e:
        check_spec(spec(checkpoint_grace=900), max_grace=600)
    assert e.value.field == "checkpoint_grace" and "600" in e.value.message
    check_spec(spec(checkpoint_grace=30), max_grace=600)
    with pytest.raises(msgspec.ValidationError, match="checkpoint_grace"):
        spec(checkpoint_grace=0)
    rec = JobRecord(job_id="j", spec=spec(checkpoint_grace=30), state=JobState.SCHEDULED, generation=1, plan=Plan(dp=2),
                    placement=[NodePlacement(node="a", gpus=[0, 1])])
    assert allocation_for(rec).grace == 30 and allocation_for(msgspec.structs.replace(rec, spec=spec())).grace is None


def _draining(switch: bool) -> JobRecord:
    return JobRecord(job_id="j", spec=spec(checkpoint_grace=30), state=JobState.SCHEDULED if switch else JobState.PENDING,
                     generation=3 if switch else 2, plan=Plan(dp=2), drain_generation=2, drain_started=1.0,
                     draining=[NodePlacement(node="a", gpus=[0, 1])],
                     switch=SwitchTiming(from_generation=2, to_generation=3, started=1.0) if switch else None)


def _killed(expired: bool = True) -> RunReport:
    return RunReport(job_id="j", generation=2, node="a", kind=RunReportKind.EXITED, ts=40.0, exit_code=137,
                     stopped=True, checkpoint_step=200, checkpoint_at=30.0, progress_step=228, grace_expired=expired)


def test_a_rank_killed_at_the_grace_loses_what_ran_since_its_checkpoint_counted_once():
    out = lifecycle.apply_report(_draining(switch=False), _killed(), max_retries=3, now=40.0)
    ev = [e for e in out.new.outbox if isinstance(e, JobGraceExpired)]
    assert len(ev) == 1 and ev[0].steps_lost == 28 and ev[0].grace == 30 and ev[0].checkpoint_step == 200
    ok = lifecycle.apply_report(_draining(switch=False), _killed(expired=False), max_retries=3, now=40.0)
    assert not [e for e in ok.new.outbox if isinstance(e, JobGraceExpired)]
    # during a switch the loss is the switch's too: counted under grace_expired, not twice
    sw = lifecycle.apply_report(_draining(switch=True), _killed(), max_retries=3, now=40.0).new
    assert sw.switch.grace_expired
    stepped = RunReport(job_id="j", generation=3, node="a", kind=RunReportKind.STEPPED, ts=41.0, restore_s=0.1,
                        first_step_s=0.1, start_step=200)
    done = lifecycle.apply_report(msgspec.structs.replace(sw, outbox=[]), stepped, max_retries=3, now=41.0).new
    switched = done.outbox[-1]
    assert switched.steps_lost == 28 and switched.grace_expired
    grace, switch = observe.STEPS_LOST.labels("grace_expired"), observe.STEPS_LOST.labels("switch")
    g0, s0 = grace._value.get(), switch._value.get()
    observe.job_events(done, [*ev, switched])
    assert grace._value.get() - g0 == 28 and switch._value.get() == s0


def _view(name, prio, ck, switched=0.0, node="a"):
    s = spec(name=name, priority=prio)
    return JobView(job_id=name, spec=s, submitted_at=0.0, placement=(Placement(node, 2, 2),), plan=s.plan,
                   last_switch_at=switched, started_at=switched, checkpoint_at=ck)


def test_victims_among_equals_are_those_that_lose_least_and_classes_still_come_first():
    now = 100.0
    jobs = [_view("old-ckpt", 0, 10.0), _view("fresh", 0, 99.0), _view("never", 0, None, switched=50.0),
            _view("low", -1, 20.0)]
    assert work_since_checkpoint(jobs[1], now) == 2.0 and work_since_checkpoint(jobs[2], now) == 100.0
    assert [v.job_id for v in victim_order(jobs, now)] == ["low", "fresh", "never", "old-ckpt"]
    plain = [_view("a", 0, None), _view("b", 0, None)]
    assert victim_order(plain, now) is plain  # nothing reported: the policy's own order stands


def test_a_priority_policy_preempts_the_peer_that_loses_least_and_no_cascade_follows():
    now = 100.0
    nodes = [NodeState(name=n, gpus_total=4, gpus_free=4, cpus_total=64, cpus_free=64) for n in ("a", "b")]
    jobs = [_view("often", 0, 99.5, 80.0, "a"), _view("deaf", 0, 98.0, 80.1, "a"),
            _view("rare1", 0, None, 80.2, "b"), _view("rare2", 0, None, 80.3, "b"),
            JobView(job_id="high", spec=spec(name="high", priority=10), submitted_at=99.0)]
    d = make_policy("srtf", min_run_time=0.0).schedule(now, nodes, jobs, None)
    assert set(d.waiting) == {"often"} and "high" in d.allocations
    assert {j for j, a in d.allocations.items() if a.reason.endswith("kept")} == {"deaf", "rare1", "rare2"}


async def test_an_emulated_rank_scripted_to_ignore_sigterm_keeps_only_its_periodic_checkpoints(tmp_path):
    runner = EmulatedRunner()
    alloc = Allocation(job_id="j", generation=1, plan=Plan(dp=2), placement=[NodePlacement(node="a", gpus=[0, 1])],
                       steps=10**6, step_time=0.01, global_batch=16)
    run = SimpleNamespace(alloc=alloc, ckpt_dir=Path(tmp_path))
    rank = await runner.start_rank(run, RankSpec(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0,
                                                 nnodes=1, gpus=(0, 1)),
                                   {"GEARSHIFT_STEP_TIME": "0.01", "WORKER_CKPT_INTERVAL": "0.2",
                                    "WORKER_IGNORE_SIGTERM": "1"})
    # anchored on what the rank shows, never a fixed sleep: its first periodic checkpoint
    first = await eventually(lambda: (m := runner.manifest(run)) is not None and m["step"] > 0 and m, timeout=30)
    assert first["wall_time"] <= time.time()
    runner.signal(rank, signal.SIGTERM)
    # the rank has taken the signal off its queue, and a checkpoint interval later it still runs
    await eventually(lambda: rank._signal.empty(), timeout=30)
    taken = runner.progress(run)["step"]
    await eventually(lambda: runner.manifest(run)["step"] > taken or rank.returncode is not None, timeout=30)
    assert rank.returncode is None  # deaf to it
    runner.signal(rank, signal.SIGKILL)
    assert await rank.wait() == -signal.SIGKILL
    kept, reached = runner.manifest(run)["step"], runner.progress(run)["step"]
    assert kept >= first["step"] and 0 <= reached - kept <= 0.2 / 0.01 + 1  # at most one interval lost


@pytest.mark.timeout(180)
async def test_loadtest_preemption_passes_with_a_short_grace(tmp_path):
    from loadtest.preemption import scenario

    out = await scenario(argparse.Namespace(grace=2.0), tmp_path)
    assert out["passed"], out
    assert out["victims"] == out["least_work_since_checkpoint"] == ["often", "deaf"]
    assert out["jobs"]["deaf"]["steps_lost"] == out["steps_lost_grace_expired_total"]


def _sim(checkpoint_interval, checkpoint_time=20.0):
    from gearshift.bus_schema.messages import ModelSpec
    from gearshift.sim.engine import SimConfig, simulate
    from gearshift.sim.trace import Trace, TraceJob, parse_cluster

    def job(jid, submit, prio, grace=None):
        s = JobSpec(name=jid, model=ModelSpec(name="toy", params=10, layers=2, hidden=64, seq_len=16), global_batch=8,
                    steps=1000, gpus=2, plan=Plan(dp=2), step_time=1.0, priority=prio, checkpoint_grace=grace)
        return TraceJob(jid, submit, s)

    t = Trace("grace", [job("A", 0, 0, grace=5.0), job("B", 12, 0), job("H", 100, 10)], parse_cluster("1x4"))
    cfg = SimConfig(restart_cost=0, noise=0, interval=1000, checkpoint_interval=checkpoint_interval,
                    checkpoint_time=checkpoint_time, learn=False)
    res = simulate(t, make_policy("srtf", min_run_time=0.0), config=cfg)
    return {r.job.job_id: r for r in res.records}


def test_the_simulator_models_the_same_grace_loss_and_victim_choice():
    # at t=100: A (from 0) checkpointed at 90, B (from 12) at 72: A loses least (10 steps vs 28),
    # though SRTF's own order would stop B (more remaining); A's checkpoint (20 s) outlasts its 5 s grace
    recs = _sim(30.0)
    assert recs["A"].preemptions == 1 and recs["B"].preemptions == 0
    assert recs["A"].steps_lost == pytest.approx(10.0) and recs["A"].grace_expired == 1
    assert recs["A"].steps_done == 1000 and recs["A"].finish > recs["H"].finish  # the lost steps were run again
    within = _sim(30.0, checkpoint_time=1.0)  # checkpoints inside the grace: nothing lost
    assert within["A"].preemptions == 1 and within["A"].steps_lost == 0
    plain = _sim(None)  # no checkpoint model: the policy's own victim, nothing lost, as before
    assert plain["B"].preemptions == 1 and plain["A"].preemptions == 0 and plain["B"].steps_lost == 0
