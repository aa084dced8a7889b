"""An agent's watch of its node's allocations stays in touch: a consumer that cannot
be made again at once is made at the next check, and one that no longer hands over
what it holds is made again from the current values. Real nats-server; the faults
(a JetStream API that answers "unavailable" once, as during a cluster's election)
are injected."""

from __future__ import annotations

import asyncio
import contextlib
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


@contextlib.asynccontextmanager
async def _watching(js, nc):
    """A watch of n1 that has heard its first allocation ("a"), with every change it
    hands over in ``seen`` (key, operation) and the last per key in ``got``."""
    kv = await nc.jetstream().key_value(subj.ALLOC_BUCKET)
    await kv.put("n1.a", b"1")
    watch = await NodeAllocWatch(js, "n1", check_every=0.2).start()
    w = SimpleNamespace(watch=watch, kv=kv, got={}, seen=[])

    async def collect():
        async for e in watch:
            if e is not None:
                w.got[e.key] = e
                w.seen.append((e.key, e.operation))

    task = asyncio.create_task(collect())
    try:
        await eventually(lambda: "a" in w.got, timeout=10)
        yield w
    finally:
        await watch.stop()
        task.cancel()


async def _pause(watch):
    """Stop the watch's pump (it fetches nothing until ``_resume``)."""
    pump, watch._task = watch._task, None
    pump.cancel()
    await asyncio.gather(pump, return_exceptions=True)


def _resume(watch):
    watch._task = asyncio.create_task(watch._pump())


async def test_a_watch_whose_consumer_could_not_be_made_again_tries_at_the_next_check(nc):
    """The consumer looked unreachable once and making a new one failed once. The
    watch had let go of the old one, which the server still answered for: it looked
    sound from then on, every fetch timed out, and the agent never heard of its node's
    allocations again (a drain there ended only at --drain-timeout)."""
    js = _Flaky(nc.jetstream())
    async with _watching(js, nc) as w:
        w.watch._psub = _Unreachable(w.watch._psub)
        js.fail = 1
        await eventually(lambda: js.fail == 0 and w.watch._psub is not None and w.watch.remade >= 1, timeout=20)
        await w.kv.put("n1.b", b"2")
        await w.kv.delete("n1.a")
        await eventually(lambda: "b" in w.got and w.got["a"].operation == "DEL", timeout=20)


async def test_a_consumer_that_delivered_what_never_arrived_is_made_again(nc):
    """What a consumer delivers with no acks is gone once sent: sent to a connection that
    was going down, it never reaches the watch. Here another subscriber takes a change
    from the watch's own consumer; the watch sees the consumer delivered past what it got
    and reads again from there."""
    async with _watching(nc.jetstream(), nc) as w:
        name = (await w.watch._psub.consumer_info()).name
        await _pause(w.watch)  # a stranger pulls from its consumer meanwhile

        async def no_pull_waiting():
            return (await w.watch._psub.consumer_info()).num_waiting == 0

        await eventually(no_pull_waiting, timeout=10)  # the watch's last pull expired
        await w.kv.put("n1.b", b"2")
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.KV_{subj.ALLOC_BUCKET}.{name}", b'{"batch": 1}', reply=inbox)
        taken = await sub.next_msg(timeout=5)
        assert taken.subject.endswith("n1.b")
        await sub.unsubscribe()
        _resume(w.watch)
        await eventually(lambda: "b" in w.got, timeout=20)
        assert w.watch.remade >= 1


async def test_a_remade_watch_replays_a_write_and_its_withdrawal_it_missed(nc):
    """The consumer is lost (a server restart loses ephemeral ones) while an allocation
    is written and withdrawn. The new one starts after the last change that reached the
    watch, so the agent hears both, not the tombstone alone, and can say it never
    started that generation."""
    js = nc.jetstream()
    async with _watching(js, nc) as w:
        await _pause(w.watch)
        await js.delete_consumer(f"KV_{subj.ALLOC_BUCKET}", (await w.watch._psub.consumer_info()).name)
        await w.kv.put("n1.c", b"3")
        await w.kv.delete("n1.c")
        _resume(w.watch)
        await eventually(lambda: ("c", "DEL") in w.seen, timeout=20)
        assert [op for k, op in w.seen if k == "c"] == [None, "DEL"]
        assert w.seen.count(("a", None)) == 1  # what it had heard is not heard again


def test_a_consumer_is_sound_when_what_it_delivered_arrived_and_nothing_waits():
    def info(delivered, pending):
        return SimpleNamespace(delivered=SimpleNamespace(stream_seq=delivered), num_pending=pending)

    assert stalled(info(7, 0), 7) is None
    assert stalled(info(0, 0), 0) is None
    assert "delivered up to sequence 9, received up to 7" in stalled(info(9, 0), 7)
    assert "3 pending" in stalled(info(7, 3), 7)
    assert stalled(SimpleNamespace(delivered=None, num_pending=0), 0) is None
