"""Materialised views against a real nats-server: revisions, sync, and node
liveness by the server's clock, never the agent's."""

from __future__ import annotations

import asyncio
import time

import pytest

from gearshift.bus.views import NodesView
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import GpuReport, NodeReport


def report(node: str, ts: float) -> bytes:
    return codec.encode(NodeReport(node=node, ts=ts, gpus=[GpuReport(index=0, uuid=f"{node}-0")], cpus=4))


async def test_liveness_uses_the_servers_clock_not_the_agents(nc):
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    view = await NodesView(nc.jetstream(), subj.NODES_BUCKET).start()
    try:
        await kv.put("quiet", report("quiet", time.time()))  # an honest clock, but it goes silent
        await view.sync()
        quiet_ts = view.entries["quiet"][2]
        while True:  # until the server's own stamps put "quiet" more than 1.2 s in the past
            await kv.put("skewed", report("skewed", time.time() - 3600))  # its clock is an hour behind
            rev = await view.sync()
            if view.entries["skewed"][2] - quiet_ts > 1.2:
                break
            await asyncio.sleep(0.1)
        assert rev == view.revision and view.get("skewed") is not None
        alive, silent = view.alive(timeout=1.0)
        assert [n.node for n in alive] == ["skewed"]  # heard from just now, whatever its clock says
        assert [n.node for n, _ in silent] == ["quiet"] and silent[0][1] >= 1.0
        assert view.age("skewed") < 1.0
        assert view.capacity() == (2, 1)
        await kv.delete("quiet")
        await view.sync()
        assert view.get("quiet") is None and view.capacity() == (1, 1)
    finally:
        await view.stop()


async def test_the_fast_reply_parser_agrees_with_nats_py(nc):
    from gearshift.bus.views import _seq_and_ts

    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    for i in range(3):
        await kv.put(f"n{i}", b"{}")
    sub = await nc.jetstream().subscribe(f"$KV.{subj.NODES_BUCKET}.>", ordered_consumer=True)
    try:
        for _ in range(3):
            msg = await sub.next_msg(timeout=5)
            md = msg.metadata
            assert _seq_and_ts(msg) == (md.sequence.stream, pytest.approx(md.timestamp.timestamp(), abs=1e-5))
    finally:
        await sub.unsubscribe()


async def test_the_admissions_capacity_counts_gpus_as_the_full_view_does(nc):
    from gearshift.bus.views import NodeCapacity

    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)

    def report(node: str, gpus: int) -> bytes:
        return codec.encode(NodeReport(node=node, ts=time.time(), cpus=8,
                                       gpus=[GpuReport(index=i, uuid=f"{node}-{i}", name="NVIDIA A100")
                                             for i in range(gpus)]))

    await kv.put("n1", report("n1", 8))
    await kv.put("n2", report("n2", 4))
    now = [0.0]
    full = await NodesView(nc.jetstream(), subj.NODES_BUCKET).start()
    light = await NodeCapacity(nc.jetstream(), subj.NODES_BUCKET, every=30.0, clock=lambda: now[0]).start()
    try:
        assert light.capacity() == full.capacity() == (12, 8)
        await kv.put("n2", report("n2", 16))  # a node that grew
        await kv.delete("n1")
        await full.sync()
        assert light.capacity() == (12, 8) and not light.stale()  # read, not watched: a heartbeat costs it nothing
        now[0] = 31.0
        assert light.stale()
        await light.refresh()
        assert light.capacity() == full.capacity() == (16, 16) and not light.stale()
        reports = await light.reports()
        assert [r.node for r in reports] == ["n2"] and len(reports[0].gpus) == 16
    finally:
        await full.stop()
        await light.stop()


def test_marks_are_taken_once_and_a_flood_of_them_says_look_at_everything():
    from gearshift.bus.views import Marks

    m = Marks(limit=3)
    m.add("a")
    m.add("b")
    m.add("a")
    assert m.take() == {"a", "b"} and m.take() == set()
    for k in "wxyz":  # more than the limit: a standby nobody takes from stays small
        m.add(k)
    assert not m.keys and m.take() is None  # the reader looks at everything instead
    m.add("q")
    assert m.take() == {"q"}


async def test_with_facts_a_heartbeat_marks_a_node_only_when_its_facts_change(nc):
    """``NodesView(facts=...)``: the optimizer's rounds look at the nodes whose facts
    (GPUs, health, reservations, CPUs, type, topology) changed, not at every heartbeat."""
    from gearshift.bus_schema.messages import GpuHealth
    from gearshift.services.round_state import node_facts

    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    view = await NodesView(nc.jetstream(), subj.NODES_BUCKET, facts=node_facts).start()

    def rep(node: str, ts: float, util: float = 0.0, health: GpuHealth = GpuHealth.OK) -> bytes:
        return codec.encode(NodeReport(node=node, ts=ts, cpus=4, gpus=[
            GpuReport(index=0, uuid=f"{node}-0", utilization=util, health=health)]))

    try:
        await kv.put("a", rep("a", 1.0))
        await kv.put("b", rep("b", 1.0))
        await view.sync()
        assert view.dirty.take() == {"a", "b"}  # new nodes
        for i in range(5):  # heartbeats: time and utilisation move, nothing a round reads
            await kv.put("a", rep("a", 2.0 + i, util=10.0 * i))
            await kv.put("b", rep("b", 2.0 + i, util=5.0 * i))
        await view.sync()
        assert view.dirty.take() == set()
        assert view.get("a").ts == 6.0  # the report itself is current
        await kv.put("b", rep("b", 9.0, health=GpuHealth.XID))  # a GPU fails: a fact
        await view.sync()
        assert view.dirty.take() == {"b"} and view.facts["b"] == node_facts(view.get("b"))
        assert view.facts["b"][1] == (0,)  # its GPU 0 is not healthy
        await kv.delete("a")
        await view.sync()
        assert view.dirty.take() == {"a"} and "a" not in view.facts
    finally:
        await view.stop()


async def test_a_burst_of_changes_gives_the_event_loop_back_every_few_messages(nc):
    """nats-py hands a subscription's queued messages over without a pause: a view must
    yield now and then (``views.YIELD_EVERY``) or a burst holds every request behind it."""
    from gearshift.bus import views

    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    n = 3 * views.YIELD_EVERY + 5
    for i in range(n):
        await kv.put(f"n{i}", report(f"n{i}", time.time()))
    sub = await nc.jetstream().subscribe(f"$KV.{subj.NODES_BUCKET}.>", ordered_consumer=True)
    msgs = [await sub.next_msg(timeout=5) for _ in range(n)]
    await sub.unsubscribe()
    view = NodesView(nc.jetstream(), subj.NODES_BUCKET)  # fed by hand: the burst in one go
    ran = 0

    async def other_work() -> None:
        nonlocal ran
        while True:
            ran += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(other_work())
    await asyncio.sleep(0)
    before = ran
    for m in msgs:
        await view._on_msg(m)
    during = ran - before
    task.cancel()
    assert len(view.entries) == n
    assert during == n // views.YIELD_EVERY  # once per YIELD_EVERY messages, and only then
