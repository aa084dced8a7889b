"""Live side of issue 10: the optimizer keeps what the simulator keeps (last switch,
attained GPU-seconds) and feeds its oracle from run reports, over a real nats-server."""

from __future__ import annotations

import time

from test_optimizer import _state, cluster, job, submit, wait_for  # noqa: F401  (cluster is a fixture)

from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobRecord,
    JobSpec,
    JobState,
    ModelSpec,
    NodePlacement,
    Plan,
    RunReport,
    RunReportKind,
)
from gearshift.services.policy_bridge import is_oom, job_view, segment_gpu_s

SPEC = JobSpec(name="x", model=ModelSpec(name="m", params=100, layers=4, hidden=64, seq_len=128), global_batch=8,
               steps=10, gpus=2)


def _rec(**kw) -> JobRecord:
    base = dict(job_id="x", spec=SPEC, state=JobState.RUNNING, submitted_at=0.0, scheduled_at=10.0,
                started_at=12.0, plan=Plan(dp=2), placement=[NodePlacement(node="n0", gpus=[0, 1], cpus=4)])
    base.update(kw)
    return JobRecord(**base)


def test_view_counts_service_from_the_last_switch_not_the_first_schedule():
    # Defect 6: after a preemption and a resume at 500, the view counted service (and
    # the minimum run time) from scheduled_at = 10.
    rec = _rec(last_switch_at=500.0, attained_gpu_s=300.0, restarts=1)
    v = job_view(rec, 560.0)
    assert v.last_switch_at == 500.0 and v.switched_at == 500.0
    assert v.attained_service == 300.0 + 2 * 60.0
    pending = _rec(state=JobState.PENDING, placement=[], last_switch_at=500.0, attained_gpu_s=420.0)
    assert job_view(pending, 9000.0).attained_service == 420.0  # queued time is not service
    assert segment_gpu_s(rec, 600.0) == 200.0 and segment_gpu_s(pending, 600.0) == 0.0


def test_old_records_decode_and_fall_back_to_scheduled_at():
    old = {"job_id": "x", "spec": codec.decode(codec.encode(SPEC), dict), "state": "running",
           "scheduled_at": 10.0, "placement": [{"node": "n0", "gpus": [0, 1], "cpus": 4}], "plan": {"dp": 2}}
    rec = codec.decode(codec.encode(old), JobRecord)
    assert rec.last_switch_at is None and rec.attained_gpu_s == 0.0
    assert job_view(rec, 40.0).attained_service == 2 * 30.0


def test_oom_message_detection():
    assert is_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert not is_oom("exited with code 3: boom")


async def _report(nc, job_id, gen, node, kind, ts, **kw):
    r = RunReport(job_id=job_id, generation=gen, node=node, kind=kind, ts=ts, **kw)
    await nc.jetstream().publish(subj.run_report(node, job_id), codec.encode(r),
                                 headers={"Nats-Msg-Id": f"{node}:{job_id}:{gen}:{kind.value}:{ts}"})


async def test_optimizer_learns_speed_and_oom_from_reports_and_keeps_service(nc, cluster):
    opt = cluster
    a = await submit(nc, "a", 2, steps=1000)
    rec = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED))
    node = rec.placement[0].node
    t0 = time.time()
    await _report(nc, a, 1, node, RunReportKind.STARTED, t0)
    await wait_for(lambda: _state(nc, a, JobState.RUNNING))
    await _report(nc, a, 1, node, RunReportKind.STEPPED, t0 + 1, start_step=0, first_step_s=0.5, restore_s=0.5)
    # 2 s per step between the first step and the crash at step 51: 100 s / 50 steps
    await _report(nc, a, 1, node, RunReportKind.EXITED, t0 + 101, exit_code=3, message="boom", progress_step=51,
                  steps_done=51)
    again = await wait_for(lambda: _state(nc, a, JobState.SCHEDULED, generation=2))
    plan = rec.plan
    from gearshift.policies.api import Placement

    pl = tuple(Placement(p.node, len(p.gpus), p.cpus) for p in rec.placement)
    assert abs(opt.models.oracle.observed(rec.spec, plan, pl) - rec.spec.global_batch / 2.0) < 1e-6
    # the requeue kept the GPU-seconds of the ended allocation and restarted the clock
    assert again.attained_gpu_s > 0 and again.last_switch_at is not None
    assert again.last_switch_at >= rec.last_switch_at
    # an out-of-memory exit marks the plan infeasible for the policies
    node = again.placement[0].node
    await _report(nc, a, 2, node, RunReportKind.EXITED, time.time(), exit_code=1,
                  message="torch.OutOfMemoryError: CUDA out of memory")
    await wait_for(lambda: _state(nc, a, JobState.FAILED))
    assert opt.models.oracle.infeasible(again.spec, again.plan)


def test_first_progress_after_stepped_teaches_the_oracle_and_exit_refines():
    from gearshift.policies.api import Placement
    from gearshift.services.policy_bridge import LiveModels

    m = LiveModels(None)
    rec = _rec(generation=3)
    stepped = RunReport(job_id="x", generation=3, node="n0", kind=RunReportKind.STEPPED, ts=100.0, start_step=9)
    assert not m.observe_report(rec, stepped)  # a mark, nothing learned yet
    assert not m.observe_progress("x", 2, 200.0, 60)  # another generation
    assert m.observe_progress("x", 3, 150.0, 35)  # (150-100) s / (35-10) steps = 2 s/step
    pl = (Placement("n0", 2, 4),)
    assert abs(m.oracle.observed(SPEC, rec.plan, pl) - SPEC.global_batch / 2.0) < 1e-9
    assert not m.observe_progress("x", 3, 160.0, 40)  # same speed again: no change
    # the exit gives the average over the whole generation: 4 s/step
    ex = RunReport(job_id="x", generation=3, node="n0", kind=RunReportKind.EXITED, ts=500.0, stopped=True,
                   progress_step=110)
    assert m.observe_report(rec, ex)
    assert abs(m.oracle.observed(SPEC, rec.plan, pl) - SPEC.global_batch / 4.0) < 1e-9


def test_what_ran_on_a_typed_node_teaches_that_type_only():
    """On a mixed cluster the optimizer's node view types each node; a step time measured
    on V100s is kept for V100 placements, not for untyped (or A100) ones."""
    from gearshift.policies.api import Placement
    from gearshift.services.policy_bridge import LiveModels

    m = LiveModels(None)
    m.node_type = {"n0": "v100"}
    rec = _rec(generation=3)
    m.observe_report(rec, RunReport(job_id="x", generation=3, node="n0", kind=RunReportKind.STEPPED, ts=100.0,
                                    start_step=9))
    assert m.observe_progress("x", 3, 150.0, 35)  # 2 s/step
    assert abs(m.oracle.observed(SPEC, rec.plan, (Placement("n0", 2, 4, "v100"),)) - SPEC.global_batch / 2.0) < 1e-9
    assert m.oracle.observed(SPEC, rec.plan, (Placement("n0", 2, 4),)) is None
    assert m.oracle.observed(SPEC, rec.plan, (Placement("n0", 2, 4, "a100"),)) is None


def test_jobs_on_one_configuration_teach_their_mean_not_each_figure_in_turn():
    """Two jobs on the same plan and GPUs measure 2.0 and 2.1 s/step (wall clocks on a busy
    host): taught one by one, each figure replaced the other and every replacement bumped
    the oracle (the policy rebuilt the model's candidates each round). Pooled, the oracle
    learns their mean, and again only when the mean moves past its tolerance."""
    from gearshift.policies.api import Placement
    from gearshift.services.policy_bridge import LiveModels

    m = LiveModels(None)
    a, b = _rec(job_id="a", generation=1), _rec(job_id="b", generation=1,
                                                placement=[NodePlacement(node="n1", gpus=[0, 1], cpus=4)])
    for rec in (a, b):
        m.observe_report(rec, RunReport(job_id=rec.job_id, generation=1, node=rec.placement[0].node,
                                        kind=RunReportKind.STEPPED, ts=0.0, start_step=0))
    rev0 = m.oracle.revision
    taught = 0
    for k in range(1, 11):  # every 40 s each job reports its speed since its first step
        ts = 40.0 * k
        taught += m.observe_progress("a", 1, ts, int(ts / 2.0) + 1)  # 2.0 s/step
        taught += m.observe_progress("b", 1, ts, int(ts / 2.1) + 1)  # about 2.1 s/step
    assert taught == m.oracle.revision - rev0 <= 3  # not 20: once at first, then as the mean settled
    speed = m.oracle.observed(SPEC, a.plan, (Placement("n0", 2, 4),))
    assert abs(SPEC.global_batch / speed - 2.05) < 2.05 * 0.02  # the mean of the two, within the tolerance


def test_step_times_are_taught_once_per_learn_every_and_out_of_memory_at_once():
    """Each lesson moves the oracle's revision, and a moved revision makes the policy work out
    again every job's key, candidates and curve of the model taught. With ``learn_every`` the
    lessons wait for the round that comes ``learn_every`` s after the last one; the latest
    figure per configuration is what is taught. An out-of-memory exit is not held."""
    from gearshift.policies.api import Placement
    from gearshift.services.policy_bridge import LiveModels

    m = LiveModels(None, learn_every=10.0)
    pl = (Placement("n0", 2, 4),)
    rec = _rec(generation=3)
    m.observe_report(rec, RunReport(job_id="x", generation=3, node="n0", kind=RunReportKind.STEPPED, ts=100.0,
                                    start_step=9))
    rev0 = m.oracle.revision
    assert m.observe_progress("x", 3, 150.0, 35)  # 2 s/step: held, the oracle will change
    assert m.oracle.revision == rev0 and m.oracle.observed(SPEC, rec.plan, pl) is None
    assert m.learn(0.0) == 1  # the first lesson: at once
    assert m.oracle.revision > rev0
    assert abs(m.oracle.observed(SPEC, rec.plan, pl) - SPEC.global_batch / 2.0) < 1e-9
    rev1 = m.oracle.revision
    assert m.observe_progress("x", 3, 300.0, 60)  # (300-100) / (60-10) = 4 s/step: held
    assert m.learn(9.9) == 0 and m.oracle.revision == rev1  # too soon after the last lesson
    assert m.observe_progress("x", 3, 400.0, 60)  # 6 s/step: replaces the held 4 s/step
    assert m.learn(10.0) == 1 and m.oracle.revision > rev1
    assert abs(m.oracle.observed(SPEC, rec.plan, pl) - SPEC.global_batch / 6.0) < 1e-9
    assert m.learn(100.0) == 0  # nothing held
    # a figure that came back within tolerance of what was taught is dropped, not taught
    assert m.observe_progress("x", 3, 500.0, 60)  # 8 s/step: held
    assert not m.observe_progress("x", 3, 550.0, 86)  # (550-100)/(86-10) = 5.92: within 2% of 6
    rev2 = m.oracle.revision
    assert m.learn(200.0) == 0 and m.oracle.revision == rev2
    # out of memory: at once, whatever learn_every says
    oom = RunReport(job_id="x", generation=3, node="n0", kind=RunReportKind.EXITED, ts=600.0, exit_code=1,
                    message="torch.OutOfMemoryError: CUDA out of memory")
    assert m.observe_report(rec, oom)
    assert m.oracle.infeasible(SPEC, rec.plan)


def test_models_are_taught_one_a_round_unless_one_is_overdue():
    """Models whose lessons fall due together are taught in turn, one a round (the one
    taught longest ago first), so one round does not work out again the jobs of every
    model at once; a model overdue by twice ``learn_every`` is taught beside the first."""
    import msgspec

    from gearshift.policies.api import Placement
    from gearshift.services.policy_bridge import LiveModels

    other = msgspec.structs.replace(SPEC, model=msgspec.structs.replace(SPEC.model, name="m2"))
    m = LiveModels(None, learn_every=10.0)
    pl = (Placement("n0", 2, 4),)
    plan = Plan(dp=2)
    speed = {"x": 1.0, "y": 1.0}

    def hold():  # a new figure for each model's configuration, past the oracle's tolerance
        for job, spec in (("x", SPEC), ("y", other)):
            speed[job] *= 1.5
            assert m._teach(job, spec, plan, pl, speed[job])

    def taught(now):
        before = {j: m.oracle.observed(s, plan, pl) for j, s in (("x", SPEC), ("y", other))}
        m.learn(now)
        return sorted(j for j, s in (("x", SPEC), ("y", other)) if m.oracle.observed(s, plan, pl) != before[j])

    hold()
    assert taught(0.0) == ["x", "y"]  # never taught: both overdue
    hold()
    assert taught(10.0) == ["x"]  # both due: one a round
    assert taught(10.5) == ["y"]
    hold()
    assert taught(20.0) == ["x"]  # y is not due before 20.5: they stay apart
    assert taught(20.5) == ["y"]
    hold()
    assert taught(45.0) == ["x", "y"]  # y due since 30.5 and overdue (24.5 s >= 20): beside x
