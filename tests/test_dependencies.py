"""Job dependencies and arrays: the verdicts (pure), admission's checks and the
optimizer's gate against a real nats-server; agents stood in for by their run
reports, as in ``test_optimizer``."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    Dependency,
    DependOn,
    ExplainReply,
    JobList,
    JobRecord,
    JobSpec,
    JobState,
    RunReportKind,
    SubmitReply,
)
from gearshift.services.admission import job_id_for, start_admission
from gearshift.services.dependencies import BROKEN, MET, WAIT, resolve, verdict
from gearshift.services.optimizer import Optimizer
from tests.test_optimizer import MODEL, register_nodes, report, wait_for

SPEC = {"name": "s", "model": MODEL, "global_batch": 8, "steps": 10, "gpus": 2}


def rec(job_id, state=JobState.PENDING, after=(), met=(), cascade=False, tenant="default"):
    spec = msgspec.convert({**SPEC, "tenant": tenant}, JobSpec)
    return JobRecord(job_id=job_id, spec=spec, state=state, after=[Dependency(job=j, on=DependOn(on)) for j, on in after],
                     after_met=list(met), cascade=cascade)


# ------------------------------------------------------------------ pure
@pytest.mark.parametrize("state,cascade,on,want", [
    (JobState.RUNNING, False, "completed", WAIT),
    (JobState.COMPLETED, False, "completed", MET),
    (JobState.FAILED, False, "completed", BROKEN),
    (JobState.FAILED, False, "failed", MET),
    (JobState.COMPLETED, False, "failed", BROKEN),
    (JobState.CANCELLED, False, "finished", MET),
    (JobState.CANCELLED, False, "completed", BROKEN),
    (JobState.CANCELLED, True, "finished", BROKEN),  # cascade: the subtree goes whatever it asked
    (JobState.FAILED, False, "finished", MET),
])
def test_verdict(state, cascade, on, want):
    assert verdict(Dependency(job="p", on=DependOn(on)), rec("p", state, cascade=cascade)) == want


def test_resolve_records_met_then_cancels_with_reason_and_is_idempotent():
    child = rec("c", after=[("a", "completed"), ("b", "completed")])
    parents = {"a": rec("a", JobState.COMPLETED), "b": rec("b", JobState.RUNNING)}
    once = resolve(child, parents, 5.0)
    assert once is not None and once.after_met == ["a"] and once.state == JobState.PENDING
    assert resolve(once, parents, 6.0) is None  # the same verdicts again: nothing to write
    parents["b"] = rec("b", JobState.FAILED)
    gone = resolve(once, parents, 7.0)
    assert gone.state == JobState.CANCELLED and gone.cascade and gone.finished_at == 7.0
    assert gone.reason == "cancelled: dependency b ended failed, needed completed"
    assert gone.outbox[-1].reason == gone.reason  # the event says why
    assert resolve(rec("x", after=[("gone", "finished")]), {"gone": None}, 1.0).state == JobState.CANCELLED


# ------------------------------------------------------------------ admission
@pytest.fixture
async def admission(nc):
    adm, svc = await start_admission(nc, max_gpus=64)
    yield adm
    await svc.stop()
    await adm.close()


async def submit(nc, subject=subj.ADMISSION_SUBMIT, token=None, **over) -> SubmitReply:
    body = {"spec": {**SPEC, **over}, **({"token": token} if token else {})}
    return await call(nc, subject, json.dumps(body).encode(), SubmitReply)


async def settled(kv) -> dict:
    """The jobs bucket. (A submit is one write, the record: nothing lands later from
    the admission between two snapshots; the submitted event is the optimizer's.)"""
    return await kv_snapshot(kv)


async def refused(nc, **kw) -> ServiceCallError:
    kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
    before = await settled(kv)
    with pytest.raises(ServiceCallError) as err:
        await submit(nc, **kw)
    assert await kv_snapshot(kv) == before  # nothing changed
    return err.value


async def test_submit_refuses_unknown_foreign_and_cyclic_dependencies(nc, admission):
    a = (await submit(nc)).job_id
    other = (await submit(nc, tenant="other")).job_id
    e = await refused(nc, after=[{"job": a}, {"job": "jnosuchjob"}])
    assert e.code == "400" and e.field == "spec.after[1].job" and "no job jnosuchjob" in e.message
    e = await refused(nc, after=[{"job": other}])
    assert e.field == "spec.after[0].job" and f"no job {other} of tenant default" in e.message
    own = job_id_for("default", "tok-self")  # the id a token gives is known before the submit
    e = await refused(nc, token="tok-self", after=[{"job": own}])
    assert e.field == "spec.after[0].job" and "cycle" in e.message
    e = await refused(nc, after=[{"job": a, "on": "sometimes"}])
    assert e.field == "spec.after[0].on"
    ok = await submit(nc, after=[{"job": a, "on": "finished"}])
    got = await call(nc, subj.ADMISSION_GET, {"job_id": ok.job_id}, JobRecord)
    assert [(d.job, d.on.value) for d in got.after] == [(a, "finished")] and got.after_met == []


async def test_array_submit_is_idempotent_listed_by_prefix_and_expands_as_a_dependency(nc, admission):
    arr = await submit(nc, token="arr-1", array=5)
    assert arr.array == 5 and arr.created
    page = await call(nc, subj.ADMISSION_LIST, {"array": arr.job_id, "limit": 2}, JobList)
    assert len(page.jobs) == 2 and page.next_cursor is not None  # paged
    jobs = await call(nc, subj.ADMISSION_LIST, {"array": arr.job_id}, JobList)
    assert sorted(j.job_id for j in jobs.jobs) == [f"{arr.job_id}-{i}" for i in range(5)]
    assert sorted(j.array_index for j in jobs.jobs) == list(range(5))
    again = await submit(nc, token="arr-1", array=5)
    assert not again.created and again.job_id == arr.job_id
    assert len((await call(nc, subj.ADMISSION_LIST, {}, JobList)).jobs) == 5  # no new record
    with pytest.raises(ServiceCallError) as err:  # the token, another spec
        await submit(nc, token="arr-1", array=6)
    assert err.value.code == "409"
    fan_in = await submit(nc, after=[{"job": arr.job_id}])  # the array's id: every element
    got = await call(nc, subj.ADMISSION_GET, {"job_id": fan_in.job_id}, JobRecord)
    assert [d.job for d in got.after] == [f"{arr.job_id}-{i}" for i in range(5)]


# ------------------------------------------------------------------ the optimizer's gate
async def start_optimizer(nc):
    opt = await Optimizer(nc, interval=0.3, lease_ttl=2, max_retries=0).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    await wait_for(lambda: asyncio.sleep(0, opt.is_leader), timeout=15)
    return opt, stop, task


@pytest.fixture
async def cluster(nc, admission):
    await register_nodes(nc)
    opt, stop, task = await start_optimizer(nc)
    yield opt
    stop.set()
    await task


async def job(nc, job_id) -> JobRecord:
    return await call(nc, subj.ADMISSION_GET, {"job_id": job_id}, JobRecord)


def in_state(nc, job_id, *states):
    async def check():
        r = await job(nc, job_id)
        return r if r.state in states else None
    return check


async def run_to(nc, job_id, exit_code=0):
    """Stand in for the job's agent: started, then exited with ``exit_code``."""
    r = await wait_for(in_state(nc, job_id, JobState.SCHEDULED))
    node = r.placement[0].node
    await report(nc, job_id, r.generation, node, RunReportKind.STARTED)
    await wait_for(in_state(nc, job_id, JobState.RUNNING))
    await report(nc, job_id, r.generation, node, RunReportKind.EXITED, exit_code=exit_code, steps_done=10)


async def test_a_pipeline_waits_releases_and_cancels_with_the_reason(nc, cluster):
    a = (await submit(nc, name="pretrain")).job_id
    b = (await submit(nc, name="eval", after=[{"job": a}])).job_id
    c = (await submit(nc, name="finetune", after=[{"job": b, "on": "finished"}])).job_id
    if_failed = (await submit(nc, name="report-failure", after=[{"job": a, "on": "failed"}])).job_id
    await wait_for(in_state(nc, a, JobState.SCHEDULED), timeout=30)  # the first round warms numba up
    explain = await wait_for(lambda: _explained(nc, b, "(scheduled;"))
    assert explain.reason == f"waiting for dependencies: {a} (scheduled; needs completed)"
    assert (await job(nc, b)).state == JobState.PENDING  # 8 GPUs free, still it waits
    await run_to(nc, a)
    await wait_for(in_state(nc, a, JobState.COMPLETED))
    gone = await wait_for(in_state(nc, if_failed, JobState.CANCELLED))
    assert gone.reason == f"cancelled: dependency {a} ended completed, needed failed"
    await run_to(nc, b, exit_code=3)  # max_retries=0: eval fails at once
    await wait_for(in_state(nc, b, JobState.FAILED))
    r = await wait_for(in_state(nc, c, JobState.SCHEDULED))  # on: finished -- a failure is an end
    assert r.after_met == [b]
    seen = {(j, ev.__struct_config__.tag): ev.ts for j in (a, b, c) async for ev in _events(nc, j)}
    assert seen[(b, "job.scheduled")] >= seen[(a, "job.completed")]
    assert seen[(c, "job.scheduled")] >= seen[(b, "job.failed")]


async def _explained(nc, job_id, saying=""):
    reply = await call(nc, subj.OPTIMIZER_EXPLAIN, None, ExplainReply)
    return next((e for e in reply.jobs if e.job_id == job_id and saying in e.reason), None)


async def _events(nc, job_id):
    sub = await nc.jetstream().subscribe(f"gs.evt.job.{job_id}.>", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:
                return
            yield codec.decode_event(msg.data)
    finally:
        await sub.unsubscribe()


async def test_cancel_cascades_unless_told_not_to(nc, cluster):
    head = (await submit(nc, name="head")).job_id
    mid = (await submit(nc, name="mid", after=[{"job": head}])).job_id
    leaf = (await submit(nc, name="leaf", after=[{"job": mid, "on": "finished"}])).job_id
    await wait_for(in_state(nc, head, JobState.SCHEDULED), timeout=30)
    await call(nc, subj.ADMISSION_CANCEL, {"job_id": mid}, JobRecord)  # pending: cancelled at once, cascade
    gone = await wait_for(in_state(nc, leaf, JobState.CANCELLED))
    assert gone.reason == f"cancelled: dependency {mid} was cancelled" and gone.cascade
    # without cascade an on: finished dependent is released by the cancel
    mid2 = (await submit(nc, name="mid2", after=[{"job": head}])).job_id
    leaf2 = (await submit(nc, name="leaf2", after=[{"job": mid2, "on": "finished"}])).job_id
    await call(nc, subj.ADMISSION_CANCEL, {"job_id": mid2, "cascade": False}, JobRecord)
    assert (await wait_for(in_state(nc, leaf2, JobState.SCHEDULED))).after_met == [mid2]


async def test_array_elements_get_their_index_in_the_launched_env(nc, cluster):
    arr = await submit(nc, array=3, gpus=1, env={"X": "1"})
    alloc_kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)

    async def allocs():
        snap = await kv_snapshot(alloc_kv)
        got = {k: codec.decode(v, Allocation) for k, (v, _) in snap.items() if "." not in k}
        return got if len(got) == 3 else None

    got = await wait_for(allocs, timeout=30)
    assert {k: a.env for k, a in got.items()} == {
        f"{arr.job_id}-{i}": {"X": "1", "GEARSHIFT_ARRAY_INDEX": str(i)} for i in range(3)}
    with pytest.raises(ServiceCallError) as err:  # the agent sets it
        await submit(nc, env={"GEARSHIFT_ARRAY_INDEX": "7"})
    assert err.value.field == "spec.env.GEARSHIFT_ARRAY_INDEX"


async def test_a_new_leader_releases_what_the_old_one_saw_waiting(nc, admission):
    """Nothing of the gate lives in the leader's memory: a successor that never
    saw the dependent wait releases it from the records."""
    await register_nodes(nc)
    opt, stop, task = await start_optimizer(nc)
    a = (await submit(nc, name="a")).job_id
    b = (await submit(nc, name="b", after=[{"job": a}])).job_id
    r = await wait_for(in_state(nc, a, JobState.SCHEDULED), timeout=30)
    await wait_for(lambda: _explained(nc, b))
    stop.set()
    await task
    opt2, stop2, task2 = await start_optimizer(nc)
    try:
        await report(nc, a, r.generation, r.placement[0].node, RunReportKind.EXITED, exit_code=0, steps_done=10)
        await wait_for(in_state(nc, a, JobState.COMPLETED), timeout=15)
        assert (await wait_for(in_state(nc, b, JobState.SCHEDULED), timeout=15)).after_met == [a]
    finally:
        stop2.set()
        await task2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_loadtest_dependencies_holds_across_a_leader_kill():
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([sys.executable, "-m", "loadtest.dependencies", "--json"], capture_output=True, text=True,
                       timeout=380, cwd=Path(__file__).resolve().parent.parent)
    report = json.loads(p.stdout)  # stdout is the JSON alone; the verdict line is on stderr
    assert report["ok"] is True and p.returncode == 0, report
    assert "ok" in p.stderr.splitlines()
    assert all(report["checks"].values()) and report["new_leader"]["pid"] != report["killed"]["pid"]
