"""Progress lines through ``GS_PROGRESS``: the agents' core publishes are kept,
the last one of each job; the optimizer's leader takes them in bulk
(``ProgressFeed``), the admission reads them by job (``last_lines``). Real
nats-server."""

from __future__ import annotations

import msgspec
from wait import eventually

from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobProgress, JobRecord, JobSpec, JobState, ModelSpec
from gearshift.services.progress_lines import ProgressFeed, last_lines, with_live


def _line(job: str, steps: int, generation: int = 1) -> JobProgress:
    return JobProgress(job_id=job, generation=generation, node="n0", ts=float(steps), steps_done=steps, steps=100)


async def _publish(nc, *lines: JobProgress) -> None:
    """Publish as the agents do (core NATS, no ack), then wait until the stream holds
    the last of them: the server takes a core publish into the stream after it has
    answered the flush, so a read straight after the flush can miss it (CI did). One
    connection's publishes are stored in order, so the last one stored means all are."""
    for p in lines:
        await nc.publish(subj.job_progress(p.job_id), codec.encode(p))
    await nc.flush()
    last, js = lines[-1], nc.jetstream()

    async def stored() -> bool:
        return (await last_lines(js, [last.job_id])).get(last.job_id) == last

    await eventually(stored, timeout=10)


def _feed(nc, got: list[list[JobProgress]], **kw) -> ProgressFeed:
    return ProgressFeed(nc.jetstream(), got.append, wait=0.05, **kw)


async def test_the_leader_takes_the_last_line_of_each_job_then_only_what_came_since(nc):
    await _publish(nc, _line("a", 10), _line("a", 20), _line("b", 5), _line("a", 30))
    got: list[list[JobProgress]] = []
    feed = _feed(nc, got)
    try:
        assert await feed.take() == 2
        assert {(p.job_id, p.steps_done) for p in got[0]} == {("a", 30), ("b", 5)}  # one batch, the last of each
        await _publish(nc, _line("b", 6), _line("c", 1))
        assert await feed.take() == 2
        assert [(p.job_id, p.steps_done) for p in got[1]] == [("b", 6), ("c", 1)]
        assert await feed.take() == 0 and len(got) == 2  # nothing new: nothing handed over
    finally:
        await feed.stop()


async def test_a_line_that_does_not_decode_is_skipped(nc):
    await nc.publish(subj.job_progress("bad"), b"not a progress line")
    await _publish(nc, _line("a", 7))
    got: list[list[JobProgress]] = []
    feed = _feed(nc, got)
    try:
        assert await feed.take() == 1
        assert [p.job_id for p in got[0]] == ["a"]
    finally:
        await feed.stop()


async def test_a_consumer_that_is_gone_is_made_again_from_the_last_lines(nc):
    js = nc.jetstream()
    await _publish(nc, _line("a", 10))
    got: list[list[JobProgress]] = []
    feed = _feed(nc, got, check_every=0.0)  # every empty fetch asks whether the consumer exists
    try:
        assert await feed.take() == 1 and feed.made == 1
        info = await feed._psub.consumer_info()
        await js.delete_consumer(subj.PROGRESS_STREAM, info.name)  # as a server restart or a long pause would
        await _publish(nc, _line("a", 11))

        async def heard() -> bool:
            await feed.take()
            return any(p.steps_done == 11 for batch in got for p in batch)

        await eventually(heard, timeout=20)
        assert feed.made == 2
    finally:
        await feed.stop()


def _rec(job: str, state: JobState, generation: int = 1) -> JobRecord:
    spec = JobSpec(name=job, model=ModelSpec(name="m", params=100, layers=4, hidden=256, seq_len=128), gpus=1,
                   global_batch=8, steps=100)
    return JobRecord(job_id=job, spec=spec, state=state, generation=generation, submitted_at=0.0)


async def test_get_and_list_read_the_lines_of_running_jobs_of_their_generation(nc):
    js = nc.jetstream()
    await _publish(nc, _line("run", 40, generation=2), _line("old", 9, generation=1), _line("wait", 3))
    recs = [_rec("run", JobState.RUNNING, 2), _rec("old", JobState.RUNNING, 2), _rec("wait", JobState.PENDING),
            _rec("none", JobState.RUNNING)]
    out = await with_live(js, recs)
    assert [r.job_id for r in out] == ["run", "old", "wait", "none"]  # the records, in their order
    assert out[0].live is not None and out[0].live.steps_done == 40
    assert out[1].live is None  # a line of an earlier generation is not this run's
    assert out[2].live is None and out[3].live is None
    assert set(await last_lines(js, ["run", "wait", "none"])) == {"run", "wait"}


async def test_without_the_stream_records_are_answered_without_live_progress(nc):
    js = nc.jetstream()
    await _publish(nc, _line("run", 40))
    await js.delete_stream(subj.PROGRESS_STREAM)
    rec = _rec("run", JobState.RUNNING)
    assert await with_live(js, [rec]) == [rec]


def test_live_keeps_the_record_else():
    from gearshift.services.progress_lines import live

    rec = _rec("a", JobState.RUNNING, 3)
    assert live(rec, None) is rec
    assert live(rec, _line("a", 5, generation=3)) == msgspec.structs.replace(rec, live=_line("a", 5, generation=3))


async def test_a_take_that_fails_is_logged_and_the_feed_goes_on(nc):
    import asyncio

    await _publish(nc, _line("a", 1))
    calls: list[int] = []

    def on_lines(lines):
        calls.append(len(lines))
        if len(calls) == 1:
            raise RuntimeError("a bug in what takes the lines")

    feed = ProgressFeed(nc.jetstream(), on_lines, wait=0.05)
    rounds = iter(range(3))
    task = asyncio.create_task(feed.run(lambda: next(rounds, None) is not None, every=0.0))
    try:
        await _publish(nc, _line("a", 2))
        await eventually(lambda: task.done(), timeout=10)
        assert task.exception() is None  # the failure did not end the feed
        assert calls[0] >= 1
    finally:
        await feed.stop()
