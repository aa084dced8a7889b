"""The job lifecycle, pure: what a run report, a drain or a requeue does to a
job record. No I/O and no NATS; the optimizer's report consumer and rounds
call these inside ``JobStore.update`` (a CAS loop), which also enforces
``ALLOWED_TRANSITIONS`` on every change (``check``).

Each function takes the record as read and returns the record to write (or
None: nothing to change) plus what the caller must do next (``Outcome``):
write the released generation's allocation, delete the allocation of a job
that ended, wake a round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gearshift.bus_schema.messages import (
    ACTIVE_STATES,
    ALLOWED_TRANSITIONS,
    InvalidTransition,
    JobCancelled,
    JobCompleted,
    JobFailed,
    JobGraceExpired,
    JobPlanRefused,
    JobReconfigured,
    JobRecord,
    JobRequeued,
    JobRunning,
    JobScheduled,
    JobState,
    JobSwitched,
    PinnedPlan,
    Plan,
    RunReport,
    RunReportKind,
    SwitchTiming,
)
from gearshift.bus_schema.plan_support import EXIT_PLAN_REFUSED, MAX_REFUSED_PLANS, plan_shape, supported, with_refused
from gearshift.services.jobstore import with_event
from gearshift.services.policy_bridge import segment_gpu_s

ACTIVE = ACTIVE_STATES


def check(old: JobRecord, new: JobRecord) -> JobRecord:
    """``new`` if ``old.state -> new.state`` is allowed, else InvalidTransition."""
    if new.state != old.state and new.state not in ALLOWED_TRANSITIONS[old.state]:
        raise InvalidTransition(f"job {old.job_id}: {old.state.value} -> {new.state.value} is not allowed")
    return new


@dataclass
class Outcome:
    """What a change means beyond the record: ``released`` -- the next
    generation's allocation may now be written; ``ended`` -- the job (or this
    attempt) is over, its allocation goes and a round should run."""

    new: JobRecord | None = None
    released: bool = False
    ended: bool = False


def drains(rec: JobRecord, r: RunReport) -> bool:
    """Is ``r`` the exit of a rank of ``rec``'s draining generation?"""
    return (r.kind == RunReportKind.EXITED and bool(rec.draining) and r.generation == rec.drain_generation
            and r.node in {p.node for p in rec.draining})


def apply_report(rec: JobRecord, r: RunReport, *, max_retries: int, now: float) -> Outcome:
    """One agent report applied to ``rec``; stale generations change nothing."""
    if drains(rec, r):
        new, released, ended = drained(rec, [r.node], r, now)
        return Outcome(new, released, ended)
    if rec.generation != r.generation or rec.terminal:
        return Outcome()
    ts = r.ts
    if r.kind == RunReportKind.STARTED:
        new = rec
        if rec.switch is not None and rec.switch.to_generation == r.generation and r.rank0:
            new = msgspec.structs.replace(new, switch=msgspec.structs.replace(rec.switch, launched=r.launched_at or ts))
        if rec.state == JobState.SCHEDULED and r.rank0:
            new = msgspec.structs.replace(new, state=JobState.RUNNING, started_at=rec.started_at or ts, reason="running")
            return Outcome(with_event(new, JobRunning, ts=ts, nodes=[p.node for p in rec.placement]))
        return Outcome(new if new is not rec else None)
    if r.kind == RunReportKind.STEPPED:
        if not r.rank0:
            return Outcome()
        new = stepped_under(rec)
        if rec.switch is not None and rec.switch.to_generation == r.generation:
            new = switched(new, r)
        return Outcome(new if new is not rec else None)
    if r.kind != RunReportKind.EXITED:
        return Outcome()
    steps = max(rec.steps_done, r.steps_done)
    if r.checkpoint_step is not None:
        rec = msgspec.structs.replace(rec, checkpoint_step=max(rec.checkpoint_step, r.checkpoint_step))
    if rec.state == JobState.CANCELLING:
        new = msgspec.structs.replace(
            rec, state=JobState.CANCELLED, finished_at=ts, steps_done=steps, reason="cancelled by user")
        return Outcome(with_event(new, JobCancelled, ts=ts), ended=True)
    if rec.state not in ACTIVE:
        return Outcome()
    if r.exit_code == 0 and r.rank0:
        if rec.switch is not None and rec.switch.to_generation == r.generation and r.first_step_s is not None:
            # it finished before its STEPPED report was applied: close the switch now
            rec = switched(rec, r)
        new = msgspec.structs.replace(
            rec, state=JobState.COMPLETED, finished_at=ts, steps_done=max(steps, rec.spec.steps),
            exit_code=0, reason="completed",
        )
        return Outcome(with_event(new, JobCompleted, ts=ts, steps_done=new.steps_done), ended=True)
    if r.stopped or r.exit_code == 0:
        return Outcome()  # stopped on our request, or a follower that finished: nothing to learn
    why = f"process on {r.node} exited with code {r.exit_code}" + (f": {r.message}" if r.message else "")
    others = [p for p in rec.placement if p.node != r.node]
    drain = dict(draining=others, drain_generation=rec.generation, drain_started=now if others else None)
    if r.exit_code == EXIT_PLAN_REFUSED and rec.plan is not None:
        return plan_refused(rec, r, steps, drain)
    if rec.failures < max_retries:
        # retry from the last checkpoint; the other nodes' ranks drain first
        retry = rec.failures + 1
        new = msgspec.structs.replace(
            rec, state=JobState.PENDING, placement=[], steps_done=steps, failures=retry,
            attained_gpu_s=rec.attained_gpu_s + segment_gpu_s(rec, ts),
            restarts=rec.restarts + 1, switch=None, reason=f"retry {retry}/{max_retries}: {why}", **drain,
            steps_lost=lost_steps(rec, "requeue", steps - rec.checkpoint_step),
        )
        return Outcome(with_event(new, JobRequeued, ts=ts, reason=new.reason, retry=retry,
                                  checkpoint_step=rec.checkpoint_step), ended=True)
    why = f"{why} (after {rec.failures} retries)" if rec.failures else why
    new = msgspec.structs.replace(
        rec, state=JobState.FAILED, finished_at=ts, steps_done=steps, exit_code=r.exit_code, reason=why,
        switch=None, **drain,
    )
    return Outcome(with_event(new, JobFailed, ts=ts, reason=why, exit_code=r.exit_code), ended=True)


def stepped_under(rec: JobRecord) -> JobRecord:
    """Rank 0 ran a step under the current plan: it is the job's last good plan,
    and a pin the scheduler set to get back to it has done its work."""
    new = rec
    if rec.plan is not None and rec.last_good_plan != rec.plan:
        new = msgspec.structs.replace(new, last_good_plan=rec.plan)
    pin = rec.pinned
    if pin is not None and pin.until_stepped and rec.plan is not None and plan_shape(pin.plan) == plan_shape(rec.plan):
        new = msgspec.structs.replace(new, pinned=None)
    return new


def plan_refused(rec: JobRecord, r: RunReport, steps: int, drain: dict[str, Any]) -> Outcome:
    """The script exited EXIT_PLAN_REFUSED under ``rec.plan``: not a crash. The
    plan joins ``refused_plans`` (the policies never see it again) and the job
    goes back to its last good plan (pinned until it runs steps there; an
    operator's pin of the refused plan becomes a pin of the last good one);
    without one the policy picks among the plans left. It fails only when no
    plan can be left: its own plan refused and nothing else to run."""
    assert rec.plan is not None
    ts = r.ts
    refused = [*rec.refused_plans, rec.plan] if all(
        plan_shape(p) != plan_shape(rec.plan) for p in rec.refused_plans) else list(rec.refused_plans)
    spec = with_refused(rec.spec, refused)
    back = rec.last_good_plan if rec.last_good_plan is not None and supported(spec, rec.last_good_plan) else None
    label = rec.plan.label()
    operator_pin = rec.pinned is not None and not rec.pinned.until_stepped
    pin = rec.pinned if rec.pinned is not None and supported(spec, rec.pinned.plan) else None
    if back is not None and (pin is None or pin.until_stepped):
        pin = PinnedPlan(plan=back, reason=f"back to the last good plan: {label} refused",
                         until_stepped=not operator_pin)
    own = plan_shape(rec.spec.plan or Plan(dp=rec.spec.gpus)) == plan_shape(rec.plan)
    stuck = back is None and pin is None and (own and not rec.spec.reconfigurable or len(refused) > MAX_REFUSED_PLANS)
    why = f"plan {label} refused by the job's script on {r.node} (exit {EXIT_PLAN_REFUSED})"
    if stuck:
        why += ": no other plan to run"
        new = msgspec.structs.replace(rec, state=JobState.FAILED, finished_at=ts, steps_done=steps,
                                      exit_code=r.exit_code, reason=why, switch=None, refused_plans=refused, **drain)
        return Outcome(with_event(new, JobFailed, ts=ts, reason=why, exit_code=r.exit_code), ended=True)
    why += f": back to {back.label()}" if back is not None else ": another plan"
    new = msgspec.structs.replace(
        rec, state=JobState.PENDING, placement=[], steps_done=steps, pinned=pin, refused_plans=refused,
        attained_gpu_s=rec.attained_gpu_s + segment_gpu_s(rec, ts), restarts=rec.restarts + 1, switch=None,
        reason=why, **drain,
    )
    return Outcome(with_event(new, JobPlanRefused, ts=ts, plan=rec.plan, back_to=back, reason=why), ended=True)


def cancel_unreported(rec: JobRecord, alive: set[str], waiting_s: float, timeout: float,
                      ts: float) -> JobRecord | None:
    """CANCELLED for a cancel no agent will report on: every node of the job
    is lost, or none reported within ``timeout`` (an agent killed after the
    allocation was written but before it started the run knows nothing of it
    once restarted). None while a report may still come."""
    if rec.state != JobState.CANCELLING:
        return None
    lost = all(p.node not in alive for p in rec.placement)
    if not lost and waiting_s <= timeout:
        return None
    why = "its nodes were lost" if lost else f"no agent reported its end within {timeout:g} s"
    new = msgspec.structs.replace(rec, state=JobState.CANCELLED, finished_at=ts, switch=None,
                                  reason=f"cancelled by user ({why})")
    return with_event(new, JobCancelled, ts=ts)


def drained(rec: JobRecord, nodes: list[str], r: RunReport | None, ts: float) -> tuple[JobRecord, bool, bool]:
    """``rec`` with ``nodes`` no longer draining -> (record, release the next
    generation's allocation, job ended)."""
    left = [p for p in rec.draining if p.node not in nodes]
    new = msgspec.structs.replace(rec, draining=left, drain_started=rec.drain_started if left else None)
    if r is not None and r.checkpoint_step is not None:
        new = msgspec.structs.replace(new, checkpoint_step=max(rec.checkpoint_step, r.checkpoint_step))
    expired = r is not None and r.grace_expired and r.rank0
    if expired:  # rank 0 was SIGKILLed at the grace: what it ran since its last checkpoint is lost
        assert r is not None
        new = with_event(new, JobGraceExpired, ts=r.ts, node=r.node, grace=rec.spec.checkpoint_grace,
                         checkpoint_step=r.checkpoint_step or 0, progress_step=r.progress_step,
                         steps_lost=max(0, r.progress_step - (r.checkpoint_step or 0)))
    sw = rec.switch
    if sw is not None and expired:
        sw = msgspec.structs.replace(sw, grace_expired=True)
    if sw is not None and r is not None:
        ck = sw.checkpointed
        if r.checkpoint_at is not None and r.checkpoint_at >= sw.started - 1:
            ck = max(ck or 0.0, r.checkpoint_at)
        sw = msgspec.structs.replace(
            sw, checkpointed=ck, checkpoint_step=max(sw.checkpoint_step, r.checkpoint_step or 0),
            progress_step=max(sw.progress_step, r.progress_step))
    if left:
        return msgspec.structs.replace(new, switch=sw), False, False
    if sw is not None:
        sw = msgspec.structs.replace(sw, drained=ts)
    if rec.state == JobState.CANCELLING and rec.switch is not None:
        # cancelled while switching: the new generation never started
        new = msgspec.structs.replace(new, state=JobState.CANCELLED, finished_at=ts, switch=None,
                                      reason="cancelled by user")
        return with_event(new, JobCancelled, ts=ts), False, True
    if rec.state in ACTIVE:
        if sw is not None:
            sw = msgspec.structs.replace(sw, released=ts)
        return msgspec.structs.replace(new, switch=sw), True, False
    return msgspec.structs.replace(new, switch=sw), False, False


def switched(rec: JobRecord, r: RunReport) -> JobRecord:
    """The new generation made its first step: the switch's cost by phase."""
    sw = rec.switch
    assert sw is not None
    started = sw.started
    ckpt = sw.checkpointed or started
    released = sw.released or ckpt
    launched = sw.launched or r.launched_at or released
    restore = max(0.0, r.restore_s or 0.0)
    first = max(0.0, r.first_step_s or 0.0)
    done_at = launched + restore + first
    gpus = sum(len(p.gpus) for p in rec.placement)
    total = max(0.0, done_at - started)
    new = msgspec.structs.replace(rec, switch=None, switches=rec.switches + 1, switch_s=rec.switch_s + total,
                                  switch_gpu_s=rec.switch_gpu_s + total * gpus,
                                  steps_lost=lost_steps(rec, "switch", sw.progress_step - sw.checkpoint_step))
    return with_event(
        new, JobSwitched, ts=r.ts, from_generation=sw.from_generation, from_plan=sw.from_plan, plan=rec.plan,
        from_gpus=sw.from_gpus, gpus=sum(len(p.gpus) for p in rec.placement), nodes=[p.node for p in rec.placement],
        checkpoint_s=max(0.0, ckpt - started), teardown_s=max(0.0, released - ckpt),
        launch_s=max(0.0, launched - released), restore_s=restore, first_step_s=first,
        total_s=max(0.0, done_at - started), checkpoint_step=sw.checkpoint_step, resumed_step=r.start_step,
        steps_lost=max(0, sw.progress_step - sw.checkpoint_step), grace_expired=sw.grace_expired,
    )


def lost_steps(rec: JobRecord, cause: str, n: int) -> dict[str, int]:
    """``rec.steps_lost`` with ``n`` more steps (at least 0) lost to ``cause`` (what
    ``gearshift_steps_lost_total`` counts from the events, kept in the record for accounting)."""
    if n <= 0:
        return rec.steps_lost
    return {**rec.steps_lost, cause: rec.steps_lost.get(cause, 0) + n}


def drain_fields(r: JobRecord, ts: float, alive: set[str] | None = None) -> dict[str, Any]:
    """What must stop before ``r`` may start again: the drain already under way
    (its new generation never started), else its current placement; only
    nodes in ``alive`` when given (a lost node reports nothing)."""
    if r.draining:
        drain, gen = list(r.draining), r.drain_generation
    else:
        drain, gen = list(r.placement), r.generation
    if alive is not None:
        drain = [p for p in drain if p.node in alive]
    if not drain:
        return {"draining": [], "drain_generation": 0, "drain_started": None}
    return {"draining": drain, "drain_generation": gen, "drain_started": r.drain_started or ts}


def back_to_queue(r: JobRecord, rec_generation: int, why: str, event: type, ts: float,
                  alive: set[str] | None = None, with_checkpoint: bool = False) -> JobRecord | None:
    """PENDING again (preempted, node lost), its old ranks draining."""
    if r.state not in ACTIVE or r.generation != rec_generation:
        return None
    new = msgspec.structs.replace(
        r, state=JobState.PENDING, placement=[], reason=why, restarts=r.restarts + 1, switch=None,
        attained_gpu_s=r.attained_gpu_s + segment_gpu_s(r, ts), **drain_fields(r, ts, alive),
    )
    if event is JobRequeued:  # resumes from its checkpoint: what it did past it is redone
        new = msgspec.structs.replace(new, steps_lost=lost_steps(r, "requeue", r.steps_done - r.checkpoint_step))
    extra = {"checkpoint_step": r.checkpoint_step} if with_checkpoint else {}
    return with_event(new, event, ts=ts, reason=why, **extra)


def allocate(r: JobRecord, rec: JobRecord, d: Any, placement: list, ts: float) -> JobRecord | None:
    """A new generation for ``r`` (the policy's decision ``d`` on ``placement``):
    SCHEDULED, and if it was running, a gang-barrier switch from its old
    placement. None if the job changed under the round or is mid-switch."""

    reconfig = rec.state in ACTIVE  # as the round saw it
    if r.state not in (JobState.PENDING, *ACTIVE) or r.generation != rec.generation:
        return None  # changed under us (cancelled, completed): skip this round
    if reconfig and r.draining:
        return None  # one switch at a time
    gen = r.generation + 1
    new = msgspec.structs.replace(
        r, state=JobState.SCHEDULED, generation=gen, plan=d.plan, placement=placement,
        scheduled_at=r.scheduled_at or ts, reason=d.reason, restarts=r.restarts + (1 if reconfig else 0),
        last_switch_at=ts, attained_gpu_s=r.attained_gpu_s + segment_gpu_s(r, ts),
    )
    if reconfig:  # gang barrier: generation gen starts once every rank of r.generation exited
        new = msgspec.structs.replace(
            new, draining=list(r.placement), drain_generation=r.generation, drain_started=ts,
            switch=SwitchTiming(from_generation=r.generation, to_generation=gen, from_plan=r.plan,
                                from_gpus=sum(len(p.gpus) for p in r.placement), started=ts),
        )
        return with_event(
            new, JobReconfigured, ts=ts, generation=gen, plan=d.plan, placement=placement,
            previous_plan=r.plan, previous_gpus=sum(len(p.gpus) for p in r.placement), reason=d.reason,
            predicted_gain=d.predicted_gain,
        )
    return with_event(
        new, JobScheduled, ts=ts, generation=gen, plan=d.plan, placement=placement, reason=d.reason,
        predicted_throughput=d.predicted_throughput,
    )
