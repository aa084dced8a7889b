"""The report consumer: agents' RunReports from the durable stream, a turn
of them applied under the round lock (``ReportApplier``: each job's reports
in order, the records written as atomic batches, then the allocations they
release or end, then their events) and acked only after its state change is
written (a crash before the ack redelivers it; applying twice is a no-op
because stale generations and repeated kinds change nothing). A turn that
fails (a write the server did not answer in time, say) is not acked: its
reports are asked back (``nak``, after ``RETRY_S``) and the consumer goes on.
A turn holding a report that failed before is applied one job at a time
(``_one_job_at_a_time``): a report that fails every time (a bug, or data the
code cannot take) is then asked back alone, later each time (``backoff``, up
to ``RETRY_MAX_S``), instead of failing every turn it is fetched with and
holding every other job's reports back. Nothing is dropped: it is logged each
time, and applied once what failed is fixed. A failure of the bus itself (a
timeout, a lost connection) stops the pass and asks the rest back at once.
A deposed leader's turn ends it (``Deposed``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gearshift.bus import observe
from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.log import get_logger
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import ACTIVE_STATES, JobRecord, JobState, RunReport
from gearshift.services import lifecycle
from gearshift.services.alloc_writer import AllocWriter, bounded
from gearshift.services.fencing import Deposed
from gearshift.services.jobstore import JobStore

log = get_logger(service="optimizer")
RETRY_S = 1.0  # a failed turn's reports come back after this long
RETRY_MAX_S = 60.0  # a report that keeps failing comes back at most this long after
# the bus, not the report: what every job's apply would meet now
BUS_ERRORS = (TimeoutError, nats.errors.NoRespondersError, nats.errors.StaleConnectionError,
              nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
              nats.errors.OutboundBufferLimitError, ConnectionError)


def backoff(delivered: int) -> float:
    """How long a report that failed on its ``delivered``-th delivery waits to come back."""
    return min(RETRY_MAX_S, RETRY_S * 2 ** max(0, delivered - 1))


def _delivered(msg: Any) -> int:
    try:
        return int(msg.metadata.num_delivered)
    except Exception:  # not a JetStream message (tests' stand-ins)
        return 1


async def consume_reports(js: Any, apply: Callable[[RunReport], Awaitable[None]], lock: asyncio.Lock,
                          running: Callable[[], bool], *, batch: int = 512, parallel: int = 64,
                          apply_many: Callable[[list[RunReport]], Awaitable[None]] | None = None,
                          turn_gap: float = 0.0) -> None:
    """Each turn takes what is waiting (up to ``batch``) and applies it under
    the lock, ``parallel`` jobs at a time: a round holds the lock for seconds
    at scale, so a turn must not be a handful of reports (a thousand agents
    report hundreds a second). ``apply_many``: applies a whole turn at once
    (each job's reports in order), then all are acked. ``turn_gap``: seconds
    between the end of a turn and the next fetch, so reports that come close
    together are one turn (one commit of their records, not one each)."""
    psub = await js.pull_subscribe(
        subj.REPORTS_SUBJECTS,
        durable="optimizer",
        stream=subj.REPORTS_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=30),
    )
    one = apply_many or (lambda reports: _in_order(reports, apply))  # a job's reports, when one at a time
    try:
        while running():  # nats-py's fetch can swallow a cancel: check a flag too
            try:
                msgs = await psub.fetch(1, timeout=1)  # wait for work outside the lock
            except asyncio.CancelledError:
                raise
            except Exception:  # timeout: nothing to do
                continue
            # Not during a round: a round decides from the records it read at
            # its start, and a report settling a drain meanwhile would have its
            # fresh allocation deleted by that round's reconcile.
            async with lock:
                try:
                    # the rest of what waits, fetched once the lock is ours: fetched
                    # messages must not sit out a long round past their ack wait
                    msgs += await psub.fetch(batch - 1, timeout=0.05)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    pass
                try:
                    if any(_delivered(m) > 1 for m in msgs):  # it failed before: one job at a time
                        await _one_job_at_a_time(msgs, one)
                    elif apply_many is not None:
                        await _apply_turn(msgs, apply_many)
                    else:
                        await _apply_all(msgs, apply, parallel)
                except (asyncio.CancelledError, Deposed):
                    raise
                except Exception:
                    log.exception("report turn failed; its reports come back", reports=len(msgs))
                    await _ask_back(msgs, RETRY_S, "turn")
            if turn_gap > 0:
                await asyncio.sleep(turn_gap)
    finally:
        # a pull subscription left open blocks drain() on shutdown
        await psub.unsubscribe()


async def _decoded(msgs: list) -> list[tuple[Any, RunReport]]:
    good = []
    for msg in msgs:
        try:
            good.append((msg, codec.decode(msg.data, RunReport)))
        except msgspec.MsgspecError:
            log.warning("dropping malformed run report", subject=msg.subject)
            await msg.term()
    return good


def _by_job(decoded: list[tuple[Any, RunReport]]) -> dict[str, list[tuple[Any, RunReport]]]:
    """(message, report) pairs grouped by job, each job's in the order they came."""
    by_job: dict[str, list] = {}
    for msg, report in decoded:
        by_job.setdefault(report.job_id, []).append((msg, report))
    return by_job


async def _ask_back(msgs: list, delay: float, why: str) -> None:
    """Not acked: the server delivers these again after ``delay`` s (counted by ``why``)."""
    observe.REPORT_RETRIES.labels(why).inc(len(msgs))
    await asyncio.gather(*(m.nak(delay=delay) for m in msgs), return_exceptions=True)


async def _in_order(reports: list[RunReport], apply: Callable[[RunReport], Awaitable[None]]) -> None:
    for r in reports:
        await apply(r)


async def _one_job_at_a_time(msgs: list, apply_many: Callable[[list[RunReport]], Awaitable[None]]) -> None:
    """A turn that failed before, applied job by job: each job's reports acked once
    applied, or asked back alone (``backoff``) when they fail. A bus failure asks back
    every job not yet applied, at once, and ends the pass."""
    jobs = list(_by_job(await _decoded(msgs)).items())
    for i, (job_id, items) in enumerate(jobs):
        try:
            await apply_many([r for _, r in items])
        except (asyncio.CancelledError, Deposed):
            raise
        except BUS_ERRORS:
            log.warning("report turn failed on the bus; the rest come back", jobs=len(jobs) - i, exc_info=True)
            await _ask_back([m for _, rest in jobs[i:] for m, _ in rest], RETRY_S, "bus")
            return
        except Exception:
            delivered = max(_delivered(m) for m, _ in items)
            log.exception("a job's reports failed again; they come back alone", job_id=job_id,
                          reports=len(items), delivered=delivered, retry_s=backoff(delivered))
            await _ask_back([m for m, _ in items], backoff(delivered), "job")
            continue
        await asyncio.gather(*(m.ack() for m, _ in items))


async def _apply_turn(msgs: list, apply_many: Callable[[list[RunReport]], Awaitable[None]]) -> None:
    good = await _decoded(msgs)
    await apply_many([r for _, r in good])
    await asyncio.gather(*(msg.ack() for msg, _ in good))


async def _apply_all(msgs: list, apply: Callable[[RunReport], Awaitable[None]], parallel: int) -> None:
    """Reports of one job in order, different jobs' concurrently (at most
    ``parallel`` at a time); each acked once applied."""
    by_job = _by_job(await _decoded(msgs))
    sem = asyncio.Semaphore(parallel)

    async def one_job(items: list) -> None:
        async with sem:
            for msg, report in items:
                await apply(report)
                await msg.ack()

    results = await asyncio.gather(*(one_job(v) for v in by_job.values()), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r


class ReportApplier:
    """Agents' reports -> record changes (``services.lifecycle``), each job's
    reports in order: the records written together (``JobStore.update_many``),
    then the allocations they release or end, then their events."""

    def __init__(self, store: JobStore, writer: AllocWriter, hint: Callable[[str], Any], models: Any, *,
                 max_retries: Callable[[], int], parallel: int, clock: Clock = SYSTEM):
        self.store = store
        self.clock = clock  # what stamps the changes reports make
        self.writer = writer
        self.hint = hint
        self.models = models  # services.policy_bridge.LiveModels: what ran teaches it
        self.max_retries = max_retries
        self.parallel = parallel

    async def apply(self, reports: list[RunReport]) -> bool:
        """Apply a turn; True when a job ended or released GPUs (a round should run)."""
        by_job: dict[str, list[RunReport]] = {}
        for r in reports:
            by_job.setdefault(r.job_id, []).append(r)
        outcomes: dict[str, list[lifecycle.Outcome]] = {}
        retries = self.max_retries()

        def change_for(job_id: str, mine: list[RunReport]) -> Callable[[JobRecord], JobRecord | None]:
            def change(rec: JobRecord) -> JobRecord | None:
                outs = outcomes[job_id] = []
                cur = rec
                for r in mine:
                    if not lifecycle.drains(cur, r):
                        self.models.observe_report(cur, r)  # what ran teaches the oracle (policies.learning)
                    out = lifecycle.apply_report(cur, r, max_retries=retries, now=self.clock.now())
                    outs.append(out)
                    if out.new is not None:
                        cur = out.new
                return None if cur is rec else cur
            return change

        jobs = list(by_job)
        got = await self.store.update_many([(j, change_for(j, by_job[j]), self.hint(j)) for j in jobs],
                                           parallel=self.parallel, publish=False)
        puts, deletes, kick = [], [], False
        for job_id, new in zip(jobs, got):
            outs = outcomes.get(job_id, [])
            released = any(o.released for o in outs)
            ended = any(o.ended for o in outs)
            kick = kick or released or ended
            if new is None:
                continue
            last = by_job[job_id][-1]
            # one line per job per move: debug (each move is a job.* event on the durable
            # stream); a failure stays at info
            (log.info if new.state == JobState.FAILED else log.debug)(
                "job state", job_id=job_id, state=new.state.value, generation=last.generation,
                kind=last.kind.value, draining=[p.node for p in new.draining])
            if ended and new.state not in ACTIVE_STATES:
                deletes.append(job_id)
            elif released:
                puts.append(new)
        await self.writer.write_many(puts, deletes)
        await bounded([self.store.publish(r) for r in got if r is not None and r.outbox], self.parallel)
        return kick
