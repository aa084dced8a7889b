"""The heartbeat's KV copy (issue 24): written when what the services act on
changed, and at least every ``REFRESH_BEATS`` beats; the subject carries every
beat. Driven beat by beat against a real nats-server, no sleeping."""

from __future__ import annotations

from types import SimpleNamespace

import structlog

from gearshift.agent.heartbeat import REFRESH_BEATS, Heartbeat, report_state
from gearshift.agent.probe import FakeProbe
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import GpuReport, NodeReport


async def _heartbeat(nc, probe, runs, reserved) -> Heartbeat:
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    return Heartbeat(nc, "n1", probe, cpus=8, address="127.0.0.1", interval=1.0, runs=runs, reserved=reserved,
                     log=structlog.get_logger(), nodes_kv=lambda: kv, memory=lambda: (100, 50))


async def _kv_revision(nc) -> int:
    info = await nc.jetstream().stream_info(f"KV_{subj.NODES_BUCKET}")
    return info.state.last_seq


async def test_readings_alone_refresh_the_copy_every_few_beats_and_every_beat_goes_on_the_subject(nc):
    probe = FakeProbe(2, node="n1")
    hb = await _heartbeat(nc, probe, {}, set())
    sub = await nc.subscribe(subj.node_heartbeat("n1"))
    writes = []
    beats = 3 * REFRESH_BEATS + 1
    for k in range(beats):  # only the utilisation moves
        probe.script[0] = GpuReport(index=0, uuid="GPU-0", name="Fake GPU", memory_total=80 * 2**30,
                                    utilization=float(k))
        before = await _kv_revision(nc)
        await hb.beat()
        writes.append(await _kv_revision(nc) > before)
    assert writes == [k % REFRESH_BEATS == 0 for k in range(beats)]
    got = [codec.decode((await sub.next_msg(timeout=2)).data, NodeReport) for _ in range(beats)]
    assert [r.gpus[0].utilization for r in got] == [float(k) for k in range(beats)]  # every beat, readings live
    entry = await (await nc.jetstream().key_value(subj.NODES_BUCKET)).get("n1")
    stored = codec.decode(entry.value, NodeReport)
    assert stored.gpus[0].utilization == float(3 * REFRESH_BEATS)  # the last write's readings
    await sub.unsubscribe()


async def test_a_change_of_state_is_written_at_its_beat(nc):
    runs: dict = {}
    reserved: set[int] = set()
    hb = await _heartbeat(nc, FakeProbe(4, node="n1"), runs, reserved)
    await hb.beat()  # the first beat writes
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)
    changes = [
        lambda: reserved.add(2),
        lambda: setattr(hb, "alloc_rev", 7),
        lambda: runs.__setitem__("j1", SimpleNamespace(job_id="j1", generation=3)),  # what it reads of a Run
        lambda: reserved.discard(2),
    ]
    for change in changes:
        change()
        before = await _kv_revision(nc)
        await hb.beat()
        assert await _kv_revision(nc) == before + 1  # written at once, not at the refresh
    stored = codec.decode((await kv.get("n1")).value, NodeReport)
    assert stored.alloc_rev == 7 and stored.running == ["j1@3"] and stored.reserved == []
    assert report_state(stored) == report_state(await hb.report())


async def test_a_failed_write_is_tried_again_at_the_next_beat(nc):
    probe = FakeProbe(1, node="n1")
    hb = await _heartbeat(nc, probe, {}, set())
    kv = await nc.jetstream().key_value(subj.NODES_BUCKET)

    class Down:
        async def put(self, key, value):
            raise ConnectionError("no server")

    hb.nodes_kv = lambda: Down()
    try:
        await hb.beat()
    except ConnectionError:
        pass
    hb.nodes_kv = lambda: kv
    before = await _kv_revision(nc)
    await hb.beat()  # nothing changed since the failed beat, and still written
    assert await _kv_revision(nc) == before + 1
