"""``bus.publish``: JetStream publishes acknowledged for less CPU, with nats-py's
answers and errors, against a real nats-server."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from gearshift.bus.publish import publisher


async def test_sequences_duplicates_and_kv_compare_and_set(nc):
    js = nc.jetstream()
    await js.add_stream(name="P", subjects=["p.>"])
    pub = publisher(nc)
    assert publisher(nc) is pub  # one per connection
    a = await pub.publish("p.a", b"1", {"Nats-Msg-Id": "m1"})
    b = await pub.publish("p.b", b"2")
    assert b == a + 1
    dup = await pub.ack("p.a", b"1", {"Nats-Msg-Id": "m1"})
    assert dup.duplicate and (await js.stream_info("P")).state.messages == 2
    kv = await js.create_key_value(bucket="pkv")
    rev = await pub.update("pkv", "k", b"v1", 0)  # create
    assert (await kv.get("k")).value == b"v1" and (await kv.get("k")).revision == rev
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await pub.update("pkv", "k", b"v2", 0)  # exists already
    rev2 = await pub.update("pkv", "k", b"v2", rev)
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await pub.update("pkv", "k", b"v3", rev)  # moved on
    assert (await kv.get("k")).value == b"v2" and await pub.put("pkv", "k", b"v4") == rev2 + 1


async def test_errors_are_nats_pys(nc):
    pub = publisher(nc)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await pub.publish("nostream.x", b"1")
    js = nc.jetstream()
    await js.add_stream(name="E", subjects=["e.>"])
    with pytest.raises(nats.js.errors.BadRequestError) as err:  # a failed expected-sequence check
        await pub.publish("e.x", b"1", {"Nats-Expected-Last-Subject-Sequence": "99"})
    assert err.value.err_code == 10071
    async def ignore(_msg) -> None:
        pass

    await nc.subscribe("silent.>", cb=ignore)  # takes the message, never answers
    with pytest.raises(nats.errors.TimeoutError):
        await pub.publish("silent.x", b"1", timeout=0.1)
    assert not pub._pending and not pub._deadlines  # nothing left behind
