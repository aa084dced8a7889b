"""Paged job lists against a real nats-server: no reply over the payload
limit, filters, and finished jobs paged from the history store."""

from __future__ import annotations

import asyncio
import json
import os

import msgspec

from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import MAX_MESSAGE_BYTES, JobList, JobRecord, JobSpec, JobState, ListRequest, SubmitReply
from gearshift.services.admission import start_admission
from gearshift.services.jobstore import JobStore
from gearshift.services.paging import Pager, history_page
from loadtest.scale import bus_counts, cli_list_all

MODEL = {"name": "m", "params": 100, "layers": 4, "hidden": 64, "seq_len": 128}


async def submit(nc, name, tenant="default", env=None):
    spec = {"name": name, "model": MODEL, "global_batch": 8, "steps": 10, "gpus": 1, "tenant": tenant}
    if env:
        spec["env"] = env
    return (await call(nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)).job_id


async def pages(nc, **req):
    out, cursor, sizes = [], None, []
    while True:
        msg = await nc.request(subj.ADMISSION_LIST, codec.encode(ListRequest(cursor=cursor, **req)), timeout=10)
        sizes.append(len(msg.data))
        got = codec.decode(msg.data, JobList)
        out.append(got.jobs)
        cursor = got.next_cursor
        if cursor is None:
            return out, sizes


async def test_pages_stay_under_the_payload_limit_and_filters_apply(nc):
    adm, svc = await start_admission(nc)
    try:
        big = {f"K{i}": "x" * 1000 for i in range(60)}  # ~60 KB per record: 4 fit in a reply
        ids = [await submit(nc, f"big{i}", env=big) for i in range(10)]
        ids += [await submit(nc, f"t{i}", tenant="other") for i in range(5)]
        got, sizes = await pages(nc)  # default limit 10,000 would not fit in one reply
        assert max(sizes) <= MAX_MESSAGE_BYTES and len(got) >= 3
        assert [j.job_id for p in got for j in p] == ids  # submission order, each once
        small, _ = await pages(nc, tenant="other", limit=2)
        assert [len(p) for p in small] == [2, 2, 1] and all(j.spec.tenant == "other" for p in small for j in p)
        none, _ = await pages(nc, states=["running"])
        assert none == [[]]
        bad = await nc.request(subj.ADMISSION_LIST, json.dumps({"cursor": "zzz"}).encode(), timeout=5)
        assert b"cursor" in bad.data and b"error" in bad.data
    finally:
        await svc.stop()
        await adm.close()


async def test_all_pages_through_history_then_live_jobs(nc):
    adm, svc = await start_admission(nc)
    try:
        ids = [await submit(nc, f"j{i}") for i in range(12)]
        store = await JobStore(nc).open()
        for job_id in ids[:8]:  # finish and archive the first eight
            await store.update(job_id, lambda r: msgspec.structs.replace(
                r, state=JobState.CANCELLED, finished_at=1.0, reason="cancelled by user"))
            rec, _ = await store.get(job_id)
            assert await store.archive(rec)
        assert (await store.get(ids[0]))[0].state == JobState.CANCELLED  # still readable, from history
        live, _ = await pages(nc, limit=5)
        assert [j.job_id for p in live for j in p] == ids[8:]
        every, _ = await pages(nc, limit=5, all=True)
        assert [len(p) for p in every] == [5, 5, 2]
        assert sorted(j.job_id for p in every for j in p) == sorted(ids)
        cancelled, _ = await pages(nc, all=True, states=["cancelled"])
        assert sorted(j.job_id for p in cancelled for j in p) == sorted(ids[:8])
    finally:
        await svc.stop()
        await adm.close()


async def test_a_job_archived_while_a_client_pages_is_still_listed(nc):
    """Live jobs are paged first and history last: a job that moves to the history
    store between two pages is never skipped (the scale run's get jobs --all missed
    6 of 20,589 when history came first)."""
    from gearshift.client import Client

    adm, svc = await start_admission(nc)
    try:
        ids = [await submit(nc, f"j{i}") for i in range(6)]
        store = await JobStore(nc).open()

        async def archive(job_id):
            await store.update(job_id, lambda r: msgspec.structs.replace(
                r, state=JobState.CANCELLED, finished_at=1.0, reason="cancelled by user"))
            rec, _ = await store.get(job_id)
            assert await store.archive(rec)

        first = codec.decode((await nc.request(subj.ADMISSION_LIST, codec.encode(
            ListRequest(limit=2, all=True)), timeout=10)).data, JobList)
        assert [j.job_id for j in first.jobs] == ids[:2]
        await archive(ids[4])  # not listed yet: it leaves the live pages
        await archive(ids[0])  # listed already: it will come again, from history
        seen, cursor = [j.job_id for j in first.jobs], first.next_cursor
        while cursor is not None:
            got = codec.decode((await nc.request(subj.ADMISSION_LIST, codec.encode(
                ListRequest(limit=2, all=True, cursor=cursor)), timeout=10)).data, JobList)
            seen += [j.job_id for j in got.jobs]
            cursor = got.next_cursor
        assert set(seen) == set(ids) and seen.count(ids[0]) == 2 and seen.count(ids[4]) == 1
        jobs = await Client(nc).jobs(all=True)  # one record per job, the final one
        assert sorted(j.job_id for j in jobs) == sorted(ids)
        assert {j.job_id: j.state for j in jobs}[ids[0]] == JobState.CANCELLED
    finally:
        await svc.stop()
        await adm.close()


async def archived(js, n: int, prefix: str) -> list[bytes]:
    """``n`` finished jobs written straight to the history store, ``<prefix>00000`` on,
    200 writes at a time; their encoded records."""
    spec = msgspec.convert({"name": "h", "model": MODEL, "global_batch": 8, "steps": 10, "gpus": 1}, JobSpec)
    recs = [codec.encode(JobRecord(job_id=f"{prefix}{i:05d}", spec=spec, state=JobState.COMPLETED,
                                   submitted_at=float(i))) for i in range(n)]
    for i in range(0, n, 200):
        await asyncio.gather(*(js.publish(f"$KV.{subj.HISTORY_BUCKET}.{prefix}{k:05d}", recs[k])
                               for k in range(i, min(n, i + 200))))
    return recs


async def test_a_history_page_has_only_its_own_records_delivered(monitored_server):
    """One page of 50 out of 2,000 archived jobs: nats-server's monitor counts what
    it delivered to the reader. A push consumer sent the rest of the store too
    (about N^2 / (2 x page) deliveries to page through N jobs); a pull consumer
    sends what the page reads (``bus.stream_range``)."""
    server = monitored_server
    writer = reader = None
    try:
        writer = await connect(server.url, name="writer", retry_for=2)
        await ensure_infra(writer)
        recs = await archived(writer.jetstream(), 2000, "j")
        reader = await connect(server.url, name="reader", retry_for=2)
        rjs = reader.jetstream()
        before = bus_counts(server.monitor_url)["connections"]["reader"][1]
        got, last, more = await history_page(rjs, 0, 50, lambda r: True, Pager())
        first = bus_counts(server.monitor_url)["connections"]["reader"][1] - before
        assert [r.job_id for r in got] == [f"j{i:05d}" for i in range(50)] and more
        # the next page goes on from where the first stopped
        got2, _, more2 = await history_page(rjs, last, 50, lambda r: True, Pager())
        assert [r.job_id for r in got2] == [f"j{i:05d}" for i in range(50, 100)] and more2
        # the page's 50 and a few API replies (nothing past the page is fetched: what is
        # pending says there is more); the push consumer's count here was 1,885
        assert first <= 50 + 10, first
        # a page full by bytes, not by count: fetches start small and ask for about what
        # the page has room for by the size of the records read so far (a fetch of 512
        # sent 16x the page)
        before = bus_counts(server.monitor_url)["connections"]["reader"][1]
        got3, _, more3 = await history_page(rjs, 0, 10_000, lambda r: True, Pager(budget=20 * len(recs[0]) + 16))
        sent = bus_counts(server.monitor_url)["connections"]["reader"][1] - before
        assert 15 <= len(got3) <= 20 and more3 and sent <= len(got3) + 12, (len(got3), sent)
    finally:
        for c in (writer, reader):
            if c is not None:
                await c.close()


async def test_the_scale_harness_counts_what_an_operators_full_listing_costs_the_admission(monitored_server):
    """``loadtest.scale.cli_list_all``: the real CLI pages through 4 live and 600
    archived jobs served by a real admission; the monitor's count of what was
    delivered to the admission meanwhile is reported, and is about one message
    per archived job (the history records, the requests and the API replies)."""
    server = monitored_server
    nc = adm = svc = None
    try:
        nc = await connect(server.url, name="gearshift-admission", retry_for=2)
        await ensure_infra(nc)
        adm, svc = await start_admission(nc)
        live = [await submit(nc, f"l{i}") for i in range(4)]
        await archived(nc.jetstream(), 600, "h")
        env = {**os.environ, "GEARSHIFT_NATS_URL": server.url}
        listed, got = await asyncio.to_thread(cli_list_all, env, server.monitor_url)
        assert got["rc"] == 0 and got["listed"] == 604 == len(listed)
        assert set(live) <= {j["job_id"] for j in listed}
        assert 600 <= got["delivered_to_admission"] <= 600 + 60, got
        assert got["delivered_per_job_listed"] == round(got["delivered_to_admission"] / 604, 2)
    finally:
        if svc is not None:
            await svc.stop()
            await adm.close()
        if nc is not None:
            await nc.close()
