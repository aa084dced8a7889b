"""Outboxes cleared lazily and off the request path still deliver every event
exactly once: after a crash between the record write and the publish, after
a restart, and when a finished record leaves for the history store."""

from __future__ import annotations

import asyncio

import msgspec

from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobCompleted, JobRecord, JobSpec, JobState, JobSubmitted, ModelSpec
from gearshift.services.fencing import Fence
from gearshift.services.jobstore import JobStore, with_event
from gearshift.services.optimizer import Optimizer
from gearshift.services.outbox import OutboxFlusher
from wait import eventually


def record(job_id: str) -> JobRecord:
    spec = JobSpec(name=job_id, global_batch=8, steps=10, gpus=1,
                   model=ModelSpec(name="gpt2", params=1560, layers=24, hidden=1920, seq_len=1024))
    rec = JobRecord(job_id=job_id, spec=spec, submitted_at=1.0)
    return with_event(rec, JobSubmitted, ts=1.0, name=job_id, tenant="default", gpus=1)


async def events(nc) -> list[tuple[str, str]]:
    """Every job event in GS_EVENTS: (subject, message id). (The stream holds other
    subjects too: a leader's epoch mark, round events.)"""
    js = nc.jetstream()
    info = await js.stream_info("GS_EVENTS", subjects_filter="gs.evt.job.>")
    want = sum((info.state.subjects or {}).values())
    out = []
    if not want:
        return out
    sub = await js.subscribe("gs.evt.job.>", ordered_consumer=True)
    try:
        while len(out) < want:
            msg = await sub.next_msg(timeout=5)
            out.append((msg.subject, msg.headers["Nats-Msg-Id"]))
    finally:
        await sub.unsubscribe()
    return out


async def _count_at_least(nc, n: int) -> bool:
    return len(await events(nc)) >= n


async def test_a_crash_before_the_publish_loses_no_event_and_duplicates_none(nc):
    store = await JobStore(nc).open()
    # submits acknowledged (the admission writes the record, its event in the outbox) while
    # no optimizer led, or its leader died before its flusher got to them
    for i in range(5):
        assert await store.create(record(f"jc{i}"), flush=False) is not None
    # one of them had been published already (the leader died before its next write of it)
    await store.publish(record("jc0"))
    assert len(await events(nc)) == 1
    opt = await Optimizer(nc, interval=3600, lease_ttl=2).open()  # a new leader: every outbox at the start
    stop = asyncio.Event()
    task = asyncio.create_task(opt.run(stop))
    try:
        want = sorted((f"gs.evt.job.jc{i}.submitted", f"jc{i}:1") for i in range(5))
        await eventually(lambda: _count_at_least(nc, 5), timeout=15)
        assert sorted(await events(nc)) == want  # each once
        await store.create(record("jc5"), flush=False)  # submitted while it leads: published from its view
        await eventually(lambda: _count_at_least(nc, 6), timeout=15)
        assert sorted(await events(nc)) == sorted([*want, ("gs.evt.job.jc5.submitted", "jc5:1")])
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_the_flusher_publishes_a_burst_once_each_and_clears_the_outboxes(nc):
    store = await JobStore(nc).open()
    flusher = OutboxFlusher(store, parallel=8, batch=16).start()
    for i in range(40):
        rec = record(f"jb{i}")
        flusher.add(rec, await store.create(rec, flush=False))
    await flusher.idle()
    await flusher.stop()
    got = await events(nc)
    assert len(got) == 40 and len(set(got)) == 40
    for i in range(40):
        assert (await store.get(f"jb{i}"))[0].outbox == []


async def test_lazy_clear_drops_published_events_with_the_next_write(nc):
    store = await JobStore(nc).open()
    store.lazy_clear = True
    rev = await store.create(record("jl"), flush=False)
    kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
    before = (await kv.get("jl")).revision
    await store.flush("jl", have=(record("jl"), rev))  # published, not cleared: no write
    assert (await kv.get("jl")).revision == before
    assert codec.decode((await kv.get("jl")).value, JobRecord).outbox != []

    def finish(r: JobRecord) -> JobRecord:
        r = msgspec.structs.replace(r, state=JobState.CANCELLED, finished_at=2.0)
        return with_event(r, JobCompleted, ts=2.0)

    new = await store.update("jl", finish, flush=False)  # the next write clears job.submitted
    assert [e.seq for e in new.outbox] == [2]
    stored = codec.decode((await kv.get("jl")).value, JobRecord)
    assert [e.seq for e in stored.outbox] == [2]
    # archiving publishes what is left and stores the record without an outbox
    assert await store.archive(stored)
    got = await events(nc)
    assert [m for _, m in got] == ["jl:1", "jl:2"]
    hist, _ = await store.get("jl")
    assert hist.outbox == [] and hist.state == JobState.CANCELLED
    # a publish of the same events again (a new leader's flush) is dropped by the stream
    other = await JobStore(nc).open()
    await other.publish(stored)  # returns once the stream acknowledged each (stored or dropped as a duplicate)
    assert len(await events(nc)) == 2


async def test_archiving_many_moves_them_with_one_fenced_batch(nc):
    store = await JobStore(nc).open()
    store.fence = Fence(nc, [subj.JOBS_BUCKET], "test-leader")
    await store.fence.take()
    done = []
    for i in range(3):
        r = msgspec.structs.replace(record(f"ja{i}"), state=JobState.COMPLETED, finished_at=2.0)
        await store.create(r, flush=False)
        done.append(r)
    js = nc.jetstream()
    before = (await js.stream_info("KV_" + subj.JOBS_BUCKET)).state.last_seq
    assert await store.archive_many(done) == 3
    assert (await js.stream_info("KV_" + subj.JOBS_BUCKET)).state.last_seq == before + 4  # 3 deletes + the fence mark
    for i in range(3):
        assert await store.get(f"ja{i}", history=False) is None
        hist, _ = await store.get(f"ja{i}")
        assert hist.state == JobState.COMPLETED and hist.outbox == []
    assert sorted(m for _, m in await events(nc)) == ["ja0:1", "ja1:1", "ja2:1"]  # what was left in the outboxes


async def test_a_record_published_again_while_its_events_are_in_flight_sends_each_once(nc):
    """The outbox flusher, a round and a report turn may each publish the same
    record at once: the later calls wait for the one in flight and send only
    what it left (issue 24: under load every event went out about twice)."""
    store = await JobStore(nc).open()
    sent = []

    async def seen(m):
        sent.append((m.subject, m.headers["Nats-Msg-Id"]))

    sub = await nc.subscribe("gs.evt.job.>", cb=seen)
    rec = record("jd0")
    later = with_event(rec, JobCompleted, ts=2.0, steps_done=10)  # the same record written again, one more event
    await asyncio.gather(store.publish(rec), store.publish(rec), store.publish(later), store.publish(rec))
    await nc.flush()
    await eventually(lambda: _count_at_least(nc, 2), timeout=10)
    assert sorted(sent) == [("gs.evt.job.jd0.completed", "jd0:2"), ("gs.evt.job.jd0.submitted", "jd0:1")]
    assert store.events_sent == 2 and store.published["jd0"] == 2
    await store.publish(later)  # all acknowledged: nothing to send
    assert store.events_sent == 2
    await sub.unsubscribe()
