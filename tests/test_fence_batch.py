"""A fenced atomic batch (``Fence.batch``): every key of an allocation is
stored, or none is, and none once a newer leader holds the epoch."""

from __future__ import annotations

import pytest
from nats.js.errors import KeyNotFoundError

from gearshift.bus.kv import kv_snapshot
from gearshift.bus_schema import subjects as subj
from gearshift.services.fencing import Deposed, Fence


async def test_a_batch_writes_and_deletes_all_its_keys_at_once(nc):
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    fence = Fence(nc, [subj.ALLOC_BUCKET], "leader")
    await fence.take()
    await fence.batch(subj.ALLOC_BUCKET, [("j1", b"a"), ("n0.j1", b"a"), ("n1.j1", b"a")])
    assert {k: v for k, (v, _) in (await kv_snapshot(kv)).items()} == {"j1": b"a", "n0.j1": b"a", "n1.j1": b"a"}
    # moved to n2: the new copy and the stale ones' deletes in one batch
    await fence.batch(subj.ALLOC_BUCKET, [("j1", b"b"), ("n2.j1", b"b"), ("n0.j1", None), ("n1.j1", None)])
    assert {k: v for k, (v, _) in (await kv_snapshot(kv)).items()} == {"j1": b"b", "n2.j1": b"b"}


async def test_a_deposed_leaders_batch_is_refused_whole(nc):
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    old, new = Fence(nc, [subj.ALLOC_BUCKET], "old"), Fence(nc, [subj.ALLOC_BUCKET], "new")
    await old.take()
    await old.batch(subj.ALLOC_BUCKET, [("j1", b"1"), ("n0.j1", b"1")])
    await new.take()
    with pytest.raises(Deposed):
        await old.batch(subj.ALLOC_BUCKET, [("j2", b"x"), ("n0.j2", b"x"), ("j1", None)])
    assert old.refused == 1
    for key in ("j2", "n0.j2"):  # nothing of the refused batch was stored
        with pytest.raises(KeyNotFoundError):
            await kv.get(key)
    assert (await kv.get("j1")).value == b"1"
    await new.batch(subj.ALLOC_BUCKET, [("j2", b"y"), ("n0.j2", b"y")])
    assert (await kv.get("n0.j2")).value == b"y"


async def test_a_batch_of_compare_and_sets_is_all_or_nothing_and_fenced(nc):
    from nats.js.errors import KeyWrongLastSequenceError

    kv = await nc.jetstream().key_value(subj.JOBS_BUCKET)
    old, new = Fence(nc, [subj.JOBS_BUCKET], "old"), Fence(nc, [subj.JOBS_BUCKET], "new")
    await old.take()
    revs = [await kv.put(f"r{i}", b"0") for i in range(3)]
    got = await old.update_many(subj.JOBS_BUCKET, [(f"r{i}", b"1", revs[i]) for i in range(3)])
    assert [(await kv.get(f"r{i}")).revision for i in range(3)] == got
    # one record moved meanwhile: the whole batch is refused as a conflict, nothing written
    await kv.put("r1", b"other")
    with pytest.raises(KeyWrongLastSequenceError):
        await old.update_many(subj.JOBS_BUCKET, [(f"r{i}", b"2", got[i]) for i in range(3)])
    assert [(await kv.get(f"r{i}")).value for i in range(3)] == [b"1", b"other", b"1"]
    # deposed: refused whole, and said so
    await new.take()
    with pytest.raises(Deposed):
        await old.update_many(subj.JOBS_BUCKET, [("r0", b"3", got[0])])
    assert (await kv.get("r0")).value == b"1"


async def test_update_many_applies_every_change_even_from_stale_hints(nc):
    import msgspec
    from test_outbox import record

    from gearshift.bus_schema.messages import JobState
    from gearshift.services.jobstore import JobStore

    store = await JobStore(nc).open()
    store.fence = Fence(nc, [subj.JOBS_BUCKET], "leader")
    await store.fence.take()
    hints = {}
    for i in range(4):
        rec = record(f"u{i}")
        hints[rec.job_id] = (rec, await store.create(rec, flush=False))
    await store.update("u2", lambda r: msgspec.structs.replace(r, reason="moved"))  # u2's hint is stale now

    def cancel(r):
        return msgspec.structs.replace(r, state=JobState.CANCELLED, finished_at=2.0)

    got = await store.update_many([(j, cancel, hints[j]) for j in sorted(hints)], chunk=2)
    assert [r.state for r in got] == [JobState.CANCELLED] * 4
    for j in hints:
        rec, _ = await store.get(j)
        assert rec.state == JobState.CANCELLED
    assert (await store.get("u2"))[0].reason == "moved"  # the conflict was re-read, not overwritten
    assert store.conflicts >= 1
