"""An agent's watch of its node's allocations stays in touch: a consumer that cannot
be made again at once is made at the next check, and one that no longer hands over
what it holds is made again from the current values. Real nats-server; the faults
(a JetStream API that answers "unavailable" once, as during a cluster's election)
are injected."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from wait import eventually

from gearshift.bus.alloc_watch import NodeAllocWatch, stalled
from gearshift.bus_schema import subjects as subj


class _Flaky:
    """A JetStream context whose next ``fail`` consumer creations fail."""

    def __init__(self, js):
        self.js, self.fail = js, 0

    def __getattr__(self, name):
        return getattr(self.js, name)

    async def pull_subscribe(self, *a, **kw):
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError("JetStream system temporarily unavailable")
        return await self.js.pull_subscribe(*a, **kw)


class _Unreachable:
    """A pull subscription whose next ``consumer_info`` fails; the rest is the real one."""

    def __init__(self, psub):
        self.psub, self.failed = psub, False

    def __getattr__(self, name):
        return getattr(self.psub, name)

    async def consumer_info(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("JetStream system temporarily unavailable")
        return await self.psub.consumer_info()


async def _collect(watch, got):
    async for e in watch:
        if e is not None:
            got[e.key] = e


async def test_a_watch_whose_consumer_could_not_be_made_again_tries_at_the_next_check(nc):
    """The consumer looked unreachable once and making a new one failed once. The
    watch had let go of the old one, which the server still answered for: it looked
    sound from then on, every fetch timed out, and the agent never heard of its node's
    allocations again (a drain there ended only at --drain-timeout)."""
    js = _Flaky(nc.jetstream())
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    await kv.put("n1.a", b"1")
    watch = await NodeAllocWatch(js, "n1", check_every=0.2).start()
    got: dict = {}
    task = asyncio.create_task(_collect(watch, got))
    try:
        await eventually(lambda: "a" in got, timeout=10)
        watch._psub = _Unreachable(watch._psub)
        js.fail = 1
        await eventually(lambda: js.fail == 0 and watch._psub is not None and watch.remade >= 1, timeout=20)
        await kv.put("n1.b", b"2")
        await kv.delete("n1.a")
        await eventually(lambda: "b" in got and got["a"].operation == "DEL", timeout=20)
    finally:
        await watch.stop()
        task.cancel()


async def test_a_consumer_that_delivered_what_never_arrived_is_made_again(nc):
    """What a consumer delivers with no acks is gone once sent: sent to a connection that
    was going down, it never reaches the watch. Here another subscriber takes a change
    from the watch's own consumer; the watch sees the consumer delivered past what it got
    and reads the current values again."""
    js = nc.jetstream()
    kv = await js.key_value(subj.ALLOC_BUCKET)
    await kv.put("n1.a", b"1")
    watch = await NodeAllocWatch(js, "n1", check_every=0.2).start()
    got: dict = {}
    task = asyncio.create_task(_collect(watch, got))
    try:
        await eventually(lambda: "a" in got, timeout=10)
        name = (await watch._psub.consumer_info()).name
        pump, watch._task = watch._task, None
        pump.cancel()  # the watch pauses; a stranger pulls from its consumer
        await asyncio.gather(pump, return_exceptions=True)

        async def no_pull_waiting():
            return (await watch._psub.consumer_info()).num_waiting == 0

        await eventually(no_pull_waiting, timeout=10)  # the watch's last pull expired
        await kv.put("n1.b", b"2")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.KV_{subj.ALLOC_BUCKET}.{name}", b'{"batch": 1}', reply=inbox)
        taken = await sub.next_msg(timeout=5)
        assert taken.subject.endswith("n1.b")
        await sub.unsubscribe()
        watch._task = asyncio.create_task(watch._pump())
        await eventually(lambda: "b" in got, timeout=20)
        assert watch.remade >= 1
    finally:
        await watch.stop()
        task.cancel()


async def test_a_remade_watch_replays_a_write_and_its_withdrawal_it_missed(nc):
    """The consumer is lost (a server restart loses ephemeral ones) while an allocation
    is written and withdrawn. The new one starts after the last change that reached the
    watch, so the agent hears both, not the tombstone alone, and can say it never
    started that generation."""
    js = nc.jetstream()
    kv = await js.key_value(subj.ALLOC_BUCKET)
    await kv.put("n1.a", b"1")
    watch = await NodeAllocWatch(js, "n1", check_every=0.2).start()
    seen: list = []

    async def collect():
        async for e in watch:
            if e is not None:
                seen.append((e.key, e.operation))

    task = asyncio.create_task(collect())
    try:
        await eventually(lambda: ("a", None) in seen, timeout=10)
        pump, watch._task = watch._task, None
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await js.delete_consumer(f"KV_{subj.ALLOC_BUCKET}", (await watch._psub.consumer_info()).name)
        await kv.put("n1.c", b"3")
        await kv.delete("n1.c")
        watch._task = asyncio.create_task(watch._pump())
        await eventually(lambda: ("c", "DEL") in seen, timeout=20)
        assert [op for k, op in seen if k == "c"] == [None, "DEL"]
        assert seen.count(("a", None)) == 1  # what it had heard is not heard again
    finally:
        await watch.stop()
        task.cancel()


def test_a_consumer_is_sound_when_what_it_delivered_arrived_and_nothing_waits():
    def info(delivered, pending):
        return SimpleNamespace(delivered=SimpleNamespace(stream_seq=delivered), num_pending=pending)

    assert stalled(info(7, 0), 7) is None
    assert stalled(info(0, 0), 0) is None
    assert "delivered up to sequence 9, received up to 7" in stalled(info(9, 0), 7)
    assert "3 pending" in stalled(info(7, 3), 7)
    assert stalled(SimpleNamespace(delivered=None, num_pending=0), 0) is None
