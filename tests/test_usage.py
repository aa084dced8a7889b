"""Accounting: a job's account from its record (pure), the usage endpoint's
window over the GS_USAGE stream, and its totals against the Prometheus counter
over the same run (real nats-server; agents stood in for by run reports)."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest

from gearshift.bus import observe
from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobRecord,
    JobSpec,
    JobState,
    NodePlacement,
    RunReportKind,
    SubmitReply,
    UsageBatch,
    UsageReply,
    UsageRow,
)
from gearshift.bus_schema.usage import aggregate, usage_row
from gearshift.services import usage as usage_mod
from gearshift.services.admission import start_admission
from gearshift.services.optimizer import Optimizer
from tests.test_optimizer import MODEL, register_nodes, report, wait_for

SPEC = {"name": "s", "model": MODEL, "global_batch": 8, "steps": 10, "gpus": 2}


def test_usage_row_counts_held_productive_and_lost():
    spec = msgspec.convert(SPEC, JobSpec)
    rec = JobRecord(job_id="j1", spec=spec, state=JobState.COMPLETED, submitted_at=100.0, started_at=130.0,
                    last_switch_at=200.0, finished_at=300.0, attained_gpu_s=50.0, steps_done=90,
                    placement=[NodePlacement(node="n0", gpus=[0, 1])], switches=1, switch_s=5.0, switch_gpu_s=10.0,
                    steps_lost={"switch": 10})
    row = usage_row(rec)
    assert row.gpu_s == 50.0 + 2 * 100.0 and row.wait_s == 30.0
    # held 250, less 10 of switch downtime, less 10/100 of it redone
    assert row.productive_gpu_s == pytest.approx(250.0 - 10.0 - 25.0)
    live = msgspec.structs.replace(rec, state=JobState.RUNNING, finished_at=None)
    assert usage_row(live, now=250.0).gpu_s == 50.0 + 2 * 50.0  # a live job: so far
    other = msgspec.structs.replace(row, job_id="j2", tenant="t2", gpu_s=3600.0)
    groups, total = aggregate([row, other, msgspec.structs.replace(row, job_id="j3")], "tenant")
    assert [(g.key, g.jobs) for g in groups] == [("t2", 1), ("default", 2)]
    assert total.jobs == 3 and total.gpu_hours == pytest.approx((2 * 250.0 + 3600.0) / 3600)
    assert total.steps_lost == {"switch": 30}


@pytest.fixture
async def admission(nc):
    adm, svc = await start_admission(nc, max_gpus=64)
    yield adm
    await svc.stop()
    await adm.close()


async def publish_rows(nc, rows, per=3):
    """As archive passes write them: a few rows of one tenant per message."""
    js = nc.jetstream()
    for k in range(0, len(rows), per):
        for tenant in sorted({r.tenant for r in rows[k:k + per]}):
            part = [r for r in rows[k:k + per] if r.tenant == tenant]
            await js.publish(subj.usage_subject(tenant), codec.encode(UsageBatch(rows=part)))


async def ask(nc, subject=subj.ADMISSION_USAGE, **req) -> UsageReply:
    return await call(nc, subject, json.dumps(req).encode(), UsageReply)


async def test_a_window_reads_only_its_part_of_the_stream_and_a_tenant_only_its_jobs(nc, admission):
    assert usage_mod.CLOCK_SKEW_S == 0.0  # the window starts where it says
    now = time.time()
    old = [UsageRow(job_id=f"o{i}", tenant="a", model="m", finished_at=now - 7200, gpu_s=3600.0) for i in range(40)]
    await publish_rows(nc, old)
    mid = time.time()
    await asyncio.sleep(0.01)  # the stream stamps nanoseconds: the two parts are apart
    new = [UsageRow(job_id=f"n{i}", tenant="a" if i % 2 else "b", model="m", finished_at=time.time(), gpu_s=1800.0,
                    steps_lost={"requeue": 1}) for i in range(10)]
    await publish_rows(nc, [*new, new[0]])  # a retried archive: deduplicated
    rep = await ask(nc, since=mid)
    assert rep.rows_read == 11  # the 40 older rows are never read
    assert {g.key: (g.jobs, g.gpu_hours) for g in rep.groups} == {"a": (5, 2.5), "b": (5, 2.5)}
    assert rep.total.steps_lost == {"requeue": 10}
    mine = await ask(nc, subj.ADMISSION_USAGE + ".b", since=mid, by="job")
    assert {g.key for g in mine.groups} == {f"n{i}" for i in range(0, 10, 2)}  # its own jobs only
    with pytest.raises(ServiceCallError) as err:
        await ask(nc, subj.ADMISSION_USAGE + ".b", since=mid, tenant="a")
    assert err.value.code == "403"
    with pytest.raises(ServiceCallError) as err:
        await ask(nc, since=mid, until=mid - 10)
    assert err.value.field == "until"
    before = await ask(nc, since=0, until=mid)  # finished_at decides: the older part only
    assert before.total.jobs == 40 and before.total.gpu_hours == pytest.approx(40.0)


def counted() -> dict[str, float]:
    out: dict[str, float] = {}
    for m in observe.GPU_SECONDS.collect():
        for s in m.samples:
            if s.name.endswith("_total") and s.labels["kind"] == "held":
                out[s.labels["tenant"]] = s.value
    return out


async def test_usage_totals_agree_with_the_prometheus_counter(nc, admission):
    await register_nodes(nc)
    opt = await Optimizer(nc, interval=0.3, lease_ttl=2, archive_after=0.0).open()
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    t0 = time.time()
    before = counted()
    try:
        await wait_for(lambda: asyncio.sleep(0, opt.is_leader), timeout=15)
        ids = []
        for i, (tenant, gpus) in enumerate([("ta", 2), ("tb", 4), ("ta", 1)]):
            body = {"spec": {**SPEC, "name": f"u{i}", "gpus": gpus, "tenant": tenant}}
            ids.append((await call(nc, subj.ADMISSION_SUBMIT, json.dumps(body).encode(), SubmitReply)).job_id)
        pending = {"spec": {**SPEC, "name": "never", "gpus": 8, "tenant": "tb"}}  # waits behind the others
        never = (await call(nc, subj.ADMISSION_SUBMIT, json.dumps(pending).encode(), SubmitReply)).job_id
        for job_id in ids:
            rec = await wait_for(lambda j=job_id: _rec(nc, j, JobState.SCHEDULED), timeout=30)
            node = rec.placement[0].node
            await report(nc, job_id, rec.generation, node, RunReportKind.STARTED)
            await wait_for(lambda j=job_id: _rec(nc, j, JobState.RUNNING))
        for job_id in ids:
            rec = await _rec(nc, job_id, JobState.RUNNING)
            await report(nc, job_id, rec.generation, rec.placement[0].node, RunReportKind.EXITED, exit_code=0,
                         steps_done=10)
        await call(nc, subj.ADMISSION_CANCEL, json.dumps({"job_id": never}).encode(), JobRecord)
        hist = await nc.jetstream().key_value(subj.HISTORY_BUCKET)

        async def archived():
            for j in [*ids, never]:
                try:
                    await hist.get(j)
                except Exception:
                    return False
            return True

        await wait_for(archived, timeout=30)
        rep = await ask(nc, since=t0 - 1, until=time.time() + 1)
    finally:
        stop.set()
        await task
    after = counted()
    got = {g.key: g.gpu_hours * 3600 for g in rep.groups}
    assert rep.total.jobs == 4 and rep.rows_read >= 4
    assert set(got) == {"ta", "tb"} and got["ta"] > 0 and got["tb"] > 0
    for tenant, gpu_s in got.items():
        assert after.get(tenant, 0.0) - before.get(tenant, 0.0) == pytest.approx(gpu_s, rel=1e-9)


async def _rec(nc, job_id, state):
    rec = await call(nc, subj.ADMISSION_GET, {"job_id": job_id}, JobRecord)
    return rec if rec.state == state else None


def test_the_scraper_reads_held_gpu_seconds_per_tenant_and_sums_lifetimes():
    from loadtest.usage_check import CounterScraper, parse

    text = ('# TYPE gearshift_gpu_seconds_total counter\n'
            'gearshift_gpu_seconds_total{kind="held",tenant="a"} 10.5\n'
            'gearshift_gpu_seconds_total{kind="productive",tenant="a"} 9.0\n'
            'gearshift_gpu_seconds_total{kind="held",tenant="b"} 2.0\n')
    assert parse(text) == {"a": 10.5, "b": 2.0}
    s = CounterScraper(".")
    s.last = {"http://p1": {"a": 10.5}, "http://p2": {"a": 1.5, "b": 2.0}}  # a restart starts again at 0
    assert s.totals() == {"a": 12.0, "b": 2.0}
