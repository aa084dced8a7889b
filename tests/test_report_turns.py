"""The optimizer's report consumer (``services.report_consumer.consume_reports``)
against a real nats-server: a turn that fails is not acked, its reports come
back and are applied, and the consumer goes on; a deposed leader's turn ends it."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from test_optimizer import report, wait_for

from gearshift.bus import observe
from gearshift.bus_schema.messages import RunReportKind
from gearshift.services import report_consumer
from gearshift.services.fencing import Deposed


def recorder(fails):
    """(turns, apply_many): each turn's reports as "job:kind", sorted; ``fails(turns,
    reports)`` says whether this turn raises (the exception it returns)."""
    turns: list[list[str]] = []

    async def apply_many(reports):
        turns.append(sorted(f"{r.job_id}:{r.kind.value}" for r in reports))
        why = fails(turns, reports)
        if why is not None:
            raise why

    return turns, apply_many


@contextlib.asynccontextmanager
async def consuming(nc, apply_many, jobs):
    """The report consumer on a real stream, with one STARTED report of each of ``jobs``
    waiting; stopped on the way out."""
    for j in jobs:
        await report(nc, j, 1, "n0", RunReportKind.STARTED)
    running = [True]
    task = asyncio.create_task(report_consumer.consume_reports(
        nc.jetstream(), None, asyncio.Lock(), lambda: running[0], apply_many=apply_many))
    try:
        yield task
    finally:
        running[0] = False
        await asyncio.wait_for(task, 5)


async def test_a_failed_turn_gives_its_reports_back_and_the_consumer_goes_on(nc, monkeypatch):
    monkeypatch.setattr(report_consumer, "RETRY_S", 0.05)
    turns, apply_many = recorder(
        lambda turns, _: TimeoutError("a write the server did not answer in time") if len(turns) == 1 else None)
    async with consuming(nc, apply_many, ("a", "b")) as task:
        await wait_for(lambda: asyncio.sleep(0, len(turns) >= 3), timeout=10)
        # the failed turn's reports, again: one job at a time now that they failed once
        assert turns[:3] == [["a:started", "b:started"], ["a:started"], ["b:started"]]
        await report(nc, "c", 1, "n0", RunReportKind.STARTED)
        await wait_for(lambda: asyncio.sleep(0, ["c:started"] in turns), timeout=10)
        assert not task.done()
        await asyncio.sleep(0.3)  # acked this time: nothing comes back
        assert turns[3:] == [["c:started"]]


async def test_a_deposed_leaders_turn_ends_the_consumer(nc):
    async def apply_many(reports):
        raise Deposed("a newer leader holds gs_jobs")

    await report(nc, "a", 1, "n0", RunReportKind.STARTED)
    with pytest.raises(Deposed):
        await asyncio.wait_for(report_consumer.consume_reports(
            nc.jetstream(), None, asyncio.Lock(), lambda: True, apply_many=apply_many), 10)


async def test_a_report_that_always_fails_is_asked_back_alone_and_the_others_go_on(nc, monkeypatch):
    """A report the code cannot take failed every turn it was fetched with, so no other
    job's reports were ever acked. A turn that failed before is now applied one job at a
    time: the others are applied and acked, the bad one comes back alone, each time later
    (``backoff``), and is never dropped."""
    monkeypatch.setattr(report_consumer, "RETRY_S", 0.05)
    turns, apply_many = recorder(lambda _, reports: ValueError("a report this code cannot take")
                                 if any(r.job_id == "bad" for r in reports) else None)

    def asked_back(why):
        return observe.REPORT_RETRIES.labels(why)._value.get()

    before = {w: asked_back(w) for w in ("turn", "job")}
    async with consuming(nc, apply_many, ("a", "bad", "b")) as task:
        await wait_for(lambda: asyncio.sleep(0, sum(t == ["bad:started"] for t in turns) >= 3), timeout=10)
        assert turns[0] == ["a:started", "b:started", "bad:started"]  # the whole turn failed once
        # then one job at a time: a and b applied (and acked: they never come again)
        assert turns.count(["a:started"]) == 1 and turns.count(["b:started"]) == 1
        assert asked_back("turn") - before["turn"] == 3  # what an operator sees on /metrics
        assert asked_back("job") - before["job"] >= 2
        await report(nc, "c", 1, "n0", RunReportKind.STARTED)  # new work is not held back
        await wait_for(lambda: asyncio.sleep(0, ["c:started"] in turns), timeout=10)
        assert not task.done()
    assert [report_consumer.backoff(n) for n in (1, 2, 3)] == [0.05, 0.1, 0.2]
    monkeypatch.setattr(report_consumer, "RETRY_S", 1.0)
    assert report_consumer.backoff(30) == report_consumer.RETRY_MAX_S


async def test_a_bus_failure_while_one_job_at_a_time_asks_the_rest_back_at_once(nc, monkeypatch):
    monkeypatch.setattr(report_consumer, "RETRY_S", 0.05)
    # the whole turn, then the first job alone: the server is away
    turns, apply_many = recorder(
        lambda turns, _: TimeoutError("the server did not answer") if len(turns) <= 2 else None)
    async with consuming(nc, apply_many, ("a", "b")):
        await wait_for(lambda: asyncio.sleep(0, len(turns) >= 4), timeout=10)
        # the bus failed on "a" alone: "b" was not tried then, and both came back together
        assert turns[:4] == [["a:started", "b:started"], ["a:started"], ["a:started"], ["b:started"]]
