"""Running jobs' progress lines as the services read them: from ``GS_PROGRESS``.

An agent publishes each running job's ``JobProgress`` on core NATS every few
seconds (``agent/progress.py``; 1 s by default). Delivered line by line, every
line reached the admission and the optimizer, so what each service took in grew
with the running jobs times the lines' rate, whether anyone asked or not. The
stream keeps the last line of each job (in memory, ``bus.infra``), and each
service reads it when it needs it:

- the optimizer's leader takes every line that came since, in one bulk fetch a
  second (``ProgressFeed``). A new leader starts from the last line of every
  job, where before it had none until each job's next line;
- the admission reads the lines of the running jobs a ``get`` or a ``list``
  answers, by direct get (``last_lines``), and keeps none in memory.

Measured (``python -m loadtest.scale --nodes 2000 --gpus-per-node 8 --jobs 6000
--rate 200 --job-seconds 40 --probe-rates none --progress-interval 1``, one run
each, same box): the admission's CPU per job while submitting 0.997 -> 0.815 ms,
the optimizer's and nats-server's unchanged within the runs' spread (2.20 ->
2.26, 1.24 -> 1.29). At the scale harness's 5 s lines no change stands out of
the spread.

Tools and the dashboard still subscribe to the core subject: the stream does
not change what is published.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gearshift.bus.log import get_logger
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobProgress, JobRecord, JobState

log = get_logger(service="progress")
READ_EVERY_S = 1.0  # the leader reads the lines at most this often: a round sees them at most this late
FETCH_WAIT_S = 0.25  # how long a fetch waits when no line is there
CHECK_EVERY_S = 30.0  # with nothing fetched, the consumer is asked whether it still exists this often
BATCH = 2048
INACTIVE_S = 60.0  # the server drops the consumer of a leader that stopped reading
LOOKUP_TIMEOUT_S = 1.0  # a get's lookup of a line: past this, the record is answered without it
LOOKUP_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, ConnectionError)


def decode_lines(msgs: Iterable[Any]) -> list[JobProgress]:
    """The lines of fetched messages; one that does not decode is skipped (lossy by design)."""
    out = []
    for m in msgs:
        try:
            out.append(codec.decode(m.data, JobProgress))
        except msgspec.MsgspecError:
            continue
    return out


class ProgressFeed:
    """The leader's reader of ``GS_PROGRESS``: an ephemeral pull consumer that
    starts at the last line of each job, then every ``READ_EVERY_S`` hands what
    came since to ``on_lines`` in one batch. A consumer that fails or is gone
    (a server restart, a leader that paused past ``INACTIVE_S``) is made again
    from the last line of each job: a line older than one already taken changes
    nothing (``PolicyStep.on_progress`` keeps the newest)."""

    def __init__(self, js: Any, on_lines: Callable[[list[JobProgress]], None], *, batch: int = BATCH,
                 wait: float = FETCH_WAIT_S, check_every: float = CHECK_EVERY_S):
        self.js = js
        self.on_lines = on_lines
        self.batch = batch
        self.wait = wait
        self.check_every = check_every
        self._psub: Any = None
        self._checked = 0.0  # monotonic time of the last consumer check
        self.made = 0  # consumers made

    async def _subscribe(self) -> Any:
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
                             inactive_threshold=INACTIVE_S, mem_storage=True)
        psub = await self.js.pull_subscribe(subj.PROGRESS_SUBJECTS, stream=subj.PROGRESS_STREAM, config=cfg)
        self.made += 1
        self._checked = time.monotonic()
        return psub

    async def take(self) -> int:
        """Every line waiting now (fetches of up to ``batch`` until a short one),
        handed over; the count."""
        n = 0
        try:
            if self._psub is None:
                self._psub = await self._subscribe()
            while True:
                try:
                    msgs = await self._psub.fetch(self.batch, timeout=self.wait)
                except TimeoutError:  # nothing there (nats-py's is one too)
                    await self._check()
                    return n
                lines = decode_lines(msgs)
                if lines:
                    self.on_lines(lines)
                n += len(lines)
                if len(msgs) < self.batch:
                    return n
        except LOOKUP_ERRORS as exc:
            log.warning("progress lines not read; the consumer is made again", error=str(exc) or type(exc).__name__)
            await self.stop()
            return n

    async def _check(self) -> None:
        """Nothing came: after ``check_every``, ask whether the consumer still exists."""
        if self._psub is None or time.monotonic() - self._checked < self.check_every:
            return
        self._checked = time.monotonic()
        try:
            await self._psub.consumer_info()
        except nats.js.errors.NotFoundError:
            log.info("progress consumer gone; made again")
            await self.stop()

    async def run(self, running: Callable[[], bool], every: float = READ_EVERY_S) -> None:
        """``take`` every ``every`` seconds while ``running()``; a take that fails for
        a reason of its own is logged and the next one goes on (the lines are lossy)."""
        while running():
            try:
                await self.take()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("progress lines not taken")
            await asyncio.sleep(every)

    async def stop(self) -> None:
        psub, self._psub = self._psub, None
        if psub is not None:
            try:
                await psub.unsubscribe()
            except Exception:  # already gone with its connection or its consumer
                pass


def live(rec: JobRecord, line: JobProgress | None) -> JobRecord:
    """The record with its latest progress line, if it runs that generation."""
    if line is None or rec.state != JobState.RUNNING or line.generation != rec.generation:
        return rec
    return msgspec.structs.replace(rec, live=line)


async def last_lines(js: Any, job_ids: Iterable[str], parallel: int = 32) -> dict[str, JobProgress]:
    """The last line of each job, by direct get (any server of the stream answers);
    a job without one, or a lookup that fails, is left out: its record is answered
    without live progress."""
    ids = list(dict.fromkeys(job_ids))
    gate = asyncio.Semaphore(parallel)

    async def one(job_id: str) -> JobProgress | None:
        async with gate:
            try:
                raw = await js.get_last_msg(subj.PROGRESS_STREAM, subj.job_progress(job_id), direct=True)
                return codec.decode(raw.data, JobProgress)
            except nats.js.errors.NotFoundError:
                return None
            except (*LOOKUP_ERRORS, msgspec.MsgspecError) as exc:
                log.debug("progress line not read", job_id=job_id, error=str(exc) or type(exc).__name__)
                return None

    got = await asyncio.gather(*(one(j) for j in ids))
    return {j: p for j, p in zip(ids, got) if p is not None and p.job_id == j}


async def with_live(js: Any, records: list[JobRecord]) -> list[JobRecord]:
    """Records, the running ones with their latest progress line."""
    running = [r.job_id for r in records if r.state == JobState.RUNNING]
    lines = await last_lines(js, running) if running else {}
    return [live(r, lines.get(r.job_id)) for r in records]
