"""The dashboard follows the bus only while somebody looks (services.dashboard):
nothing is delivered to it with no page open, a page's first request loads the
current jobs and nodes, and ``LINGER_S`` after the last page it lets go again.
A real nats-server with its monitor counts what reaches the dashboard."""

from __future__ import annotations

import asyncio

from gearshift.bus.client import connect
from gearshift.bus.clock import ManualClock
from gearshift.bus.infra import ensure_infra
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import GpuReport, JobRecord, JobSpec, ModelSpec, NodeReport
from gearshift.services.dashboard import Dashboard
from loadtest.scale import bus_counts


def _record(job_id: str) -> bytes:
    spec = JobSpec(name=job_id, gpus=1, global_batch=16, steps=100,
                   model=ModelSpec(name="gpt2", params=1560, layers=24, hidden=1920, seq_len=1024))
    return codec.encode(JobRecord(job_id=job_id, spec=spec, reason="waiting"))


def _delivered(server, name: str = "dash") -> int:
    return bus_counts(server.monitor_url)["connections"][name][1]


async def _settled(*conns) -> None:
    """Every message sent so far has reached the server, and what it sent back has arrived."""
    for c in conns:
        await c.flush()
    await asyncio.sleep(0)


async def test_the_dashboard_reads_the_bus_only_while_a_page_looks(monitored_server):
    server = monitored_server
    writer = dash_nc = dash = None
    try:
        writer = await connect(server.url, name="writer", retry_for=2)
        await ensure_infra(writer)
        js = writer.jetstream()
        jobs = await js.key_value(subj.JOBS_BUCKET)
        nodes = await js.key_value(subj.NODES_BUCKET)
        await nodes.put("n0", codec.encode(NodeReport(node="n0", ts=1.0, cpus=8,
                                                      gpus=[GpuReport(index=0, uuid="u0")])))
        await jobs.put("a1", _record("a1"))
        dash_nc = await connect(server.url, name="dash", retry_for=2)
        clock = ManualClock(1000.0)
        dash = await Dashboard(dash_nc, server.url, require_login=False, clock=clock).start()
        before = _delivered(server)
        for i in range(30):  # nobody looks: none of this reaches the dashboard
            await jobs.put(f"b{i}", _record(f"b{i}"))
            await writer.publish(f"gs.job.b{i}.progress", b"{}")
        await _settled(writer, dash_nc)
        assert not dash.following
        assert _delivered(server) - before == 0

        # a page asks: the current jobs and nodes are in the view when it is answered
        assert await dash.follow() is None
        snap = dash.view.snapshot()
        assert {q["job_id"] for q in snap["queue"]} >= {"a1", "b0", "b29"}
        assert [n["node"] for n in snap["nodes"]] == ["n0"]
        await jobs.put("c1", _record("c1"))  # and what changes from then on
        for _ in range(200):
            if "c1" in {q["job_id"] for q in dash.view.snapshot()["queue"]}:
                break
            await asyncio.sleep(0.01)
        assert "c1" in {q["job_id"] for q in dash.view.snapshot()["queue"]}

        # a page that follows the stream keeps it however long it stays
        dash.clients.add(asyncio.Queue())
        clock.advance(10 * Dashboard.LINGER_S)
        assert not await dash.close_if_idle() and dash.following
        dash.clients.clear()
        dash.seen()  # the page left now
        clock.advance(Dashboard.LINGER_S - 1)
        assert not await dash.close_if_idle() and dash.following
        clock.advance(2)
        assert await dash.close_if_idle() and not dash.following
        assert dash.view.snapshot()["queue"] == []  # forgotten: it would go stale

        await _settled(writer, dash_nc)
        before = _delivered(server)
        for i in range(30):
            await jobs.put(f"d{i}", _record(f"d{i}"))
            await writer.publish(f"gs.job.d{i}.progress", b"{}")
        await _settled(writer, dash_nc)
        assert _delivered(server) - before == 0

        # the next page loads it afresh, with what changed meanwhile
        assert await dash.follow() is None
        assert {q["job_id"] for q in dash.view.snapshot()["queue"]} >= {"a1", "c1", "d29"}
    finally:
        if dash is not None:
            await dash.close()
        for c in (dash_nc, writer):
            if c is not None:
                await c.close()


async def test_a_page_is_told_when_the_bus_cannot_be_read(nats_server):
    """Without the control plane's buckets the page gets a reason, and the next
    request tries again (it works once they exist)."""
    nc = dash = None
    try:
        nc = await connect(nats_server.url, name="dash", retry_for=2)
        dash = await Dashboard(nc, nats_server.url, require_login=False, clock=ManualClock(0.0)).start()
        why = await dash.follow()
        assert why is not None and why.startswith("the dashboard cannot read the bus") and not dash.following
        await ensure_infra(nc)
        assert await dash.follow() is None and dash.following
    finally:
        if dash is not None:
            await dash.close()
        if nc is not None:
            await nc.close()
