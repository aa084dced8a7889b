"""``gearshift usage``: what jobs used over a window of time (admission's
``gs.admission.usage`` endpoint; the sums are ``bus_schema.usage``'s).

Finished jobs come from the ``GS_USAGE`` stream, one row per job (a message
holds the rows of the jobs one archive pass moved, ``JobStore.publish_usage``),
written when the jobs move to the history store, so the
stream is in the order jobs were archived, shortly after they finished. A
window ``[since, until]`` is read as a range of the stream: from the first
message stored at ``since`` (JetStream's own time index, ``BY_START_TIME``)
until one stored more than ``ARCHIVE_LAG_S`` after ``until``; the rows are
kept by their ``finished_at``. No read goes outside the window (plus the lag).
Jobs that finished but are not archived yet, and, when the window reaches
now, the live jobs' use so far, come from admission's jobs view.

A tenant sees only its own jobs (its subject says who asks; the stream read
is filtered by the tenant's subject), the admin all.
"""

from __future__ import annotations

import datetime
from typing import Any

from gearshift.bus.stream_range import stream_range
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import UsageBatch, UsageReply, UsageRequest, UsageRow
from gearshift.bus_schema.usage import aggregate, usage_row

ARCHIVE_LAG_S = 3600.0  # a job is archived at most this long after it finished (archive_after, a leader down)
# A job is archived ``archive_after`` (30 s) or more after it finished, and the server
# stamps the message then: a window read from ``since`` misses nothing unless the
# services' clocks run ahead of the server's by more than that.
CLOCK_SKEW_S = 0.0


async def window_rows(js: Any, since: float, until: float, tenant: str | None) -> tuple[list[UsageRow], int]:
    """Rows of jobs that finished in ``[since, until]``; and how many rows were read."""
    info = await js.stream_info(subj.USAGE_STREAM)
    if info.state.messages == 0:
        return [], 0
    start = datetime.datetime.fromtimestamp(max(0.0, since - CLOCK_SKEW_S), datetime.timezone.utc)
    stop = until + ARCHIVE_LAG_S
    rows: dict[str, UsageRow] = {}
    read = 0  # rows
    # a pull consumer: a window that ends before the stream does stops the reading,
    # and at most one fetch past it is delivered (``bus.stream_range``)
    async with stream_range(js, subj.USAGE_STREAM, subj.usage_subject(tenant) if tenant else subj.USAGE_SUBJECTS,
                            start_time=start) as msgs:
        async for msg in msgs:
            md = msg.metadata
            if md.timestamp.timestamp() > stop:
                break
            batch = codec.decode(msg.data, UsageBatch).rows
            read += len(batch)
            for row in batch:
                if row.finished_at is not None and since <= row.finished_at <= until:
                    rows[row.job_id] = row  # a row written twice (an archive retried) counts once
    return list(rows.values()), read


async def usage(js: Any, jobs_view: Any, req: UsageRequest, now: float) -> UsageReply:
    until = now if req.until is None else req.until
    rows, read = await window_rows(js, req.since, until, req.tenant)
    seen = {r.job_id for r in rows}
    live = 0
    for rec in jobs_view.values():  # in gs_jobs: not archived yet (or live)
        if rec.job_id in seen or (req.tenant is not None and rec.spec.tenant != req.tenant):
            continue
        if rec.terminal:
            if rec.finished_at is not None and req.since <= rec.finished_at <= until:
                rows.append(usage_row(rec))
        elif req.until is None:
            rows.append(usage_row(rec, now))
            live += 1
    groups, total = aggregate(rows, req.by, req.limit)
    return UsageReply(since=req.since, until=until, by=req.by, groups=groups, total=total, rows_read=read, live=live)
