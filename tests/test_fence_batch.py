"""A fenced atomic batch (``Fence.batch``): every key of an allocation is
stored, or none is, and none once a newer leader holds the epoch."""

from __future__ import annotations

import pytest
from nats.js.errors import KeyNotFoundError

from bus_schema import subjects as subj
from services.fencing import Deposed, Fence
from services.jobstore import kv_snapshot


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
