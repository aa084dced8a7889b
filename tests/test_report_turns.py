"""The optimizer's report consumer (``services.report_consumer.consume_reports``)
against a real nats-server: a turn that fails is not acked, its reports come
back and are applied, and the consumer goes on; a deposed leader's turn ends it."""

from __future__ import annotations

import asyncio

import pytest
from test_optimizer import report, wait_for

from gearshift.bus_schema.messages import RunReportKind
from gearshift.services import report_consumer
from gearshift.services.fencing import Deposed


async def test_a_failed_turn_gives_its_reports_back_and_the_consumer_goes_on(nc, monkeypatch):
    monkeypatch.setattr(report_consumer, "RETRY_S", 0.05)
    turns: list[list[str]] = []

    async def apply_many(reports):
        turns.append(sorted(f"{r.job_id}:{r.kind.value}" for r in reports))
        if len(turns) == 1:
            raise TimeoutError("a write the server did not answer in time")

    for j in ("a", "b"):
        await report(nc, j, 1, "n0", RunReportKind.STARTED)
    running = True
    task = asyncio.create_task(report_consumer.consume_reports(
        nc.jetstream(), None, asyncio.Lock(), lambda: running, apply_many=apply_many))
    try:
        await wait_for(lambda: asyncio.sleep(0, len(turns) >= 2), timeout=10)
        assert turns[0] == turns[1] == ["a:started", "b:started"]  # the failed turn's reports, again
        await report(nc, "c", 1, "n0", RunReportKind.STARTED)
        await wait_for(lambda: asyncio.sleep(0, ["c:started"] in turns), timeout=10)
        assert not task.done()
        await asyncio.sleep(0.3)  # acked this time: nothing comes back
        assert turns[2:] == [["c:started"]]
    finally:
        running = False
        await asyncio.wait_for(task, 5)


async def test_a_deposed_leaders_turn_ends_the_consumer(nc):
    async def apply_many(reports):
        raise Deposed("a newer leader holds gs_jobs")

    await report(nc, "a", 1, "n0", RunReportKind.STARTED)
    with pytest.raises(Deposed):
        await asyncio.wait_for(report_consumer.consume_reports(
            nc.jetstream(), None, asyncio.Lock(), lambda: True, apply_many=apply_many), 10)
