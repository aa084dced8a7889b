"""Paged job lists that never exceed the payload limit.

A page is cut at ``limit`` jobs or when the next job would push the encoded
reply past ``budget`` bytes, whichever comes first; the cursor says where to
go on. Lists go through the jobs still in ``gs_jobs`` in submission order
(cursor ``l<submitted_at>|<job id>``); ``all`` lists then go through the history
store (finished jobs, in the order they were archived: cursor ``h<stream
sequence>``). Live jobs first, history last: a job is written to the history
store before it leaves ``gs_jobs``, so one archived while a client pages is
listed at least once (twice if it was archived after its live page: the client
keeps the later, final record). History first would miss a job archived after
the history pages and before its live page.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gearshift.bus.stream_range import stream_range
from gearshift.bus.views import JobsView
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import MAX_MESSAGE_BYTES, JobRecord, ListRequest

# what a reply may hold: the limit less room for the envelope and the cursor
BUDGET = MAX_MESSAGE_BYTES - 4096


class BadCursor(ValueError):
    pass


def keep_for(req: ListRequest) -> Callable[[JobRecord], bool]:
    states = set(req.states or [])
    prefix = None if req.array is None else req.array + "-"

    def keep(r: JobRecord) -> bool:
        return ((req.tenant is None or r.spec.tenant == req.tenant)
                and (prefix is None or (r.array_index is not None and r.job_id.startswith(prefix)))
                and (not states or r.state.value in states)
                and (req.node is None or any(p.node == req.node for p in r.placement)))

    return keep


def _live_pos(cursor: str) -> tuple[float, str]:
    try:
        ts, job_id = cursor[1:].split("|", 1)
        return float(ts), job_id
    except ValueError:
        raise BadCursor(f"malformed cursor {cursor!r}") from None


class Pager:
    EMPTY = 16  # a reply's bytes before any record

    def __init__(self, budget: int = BUDGET):
        self.budget = budget
        self.size = self.EMPTY

    def room(self, records: int) -> int:
        """About how many more records of the size of the ``records`` counted so far
        fit (one more than that: the one that does not fit ends the page); a
        large number before any was counted."""
        if records <= 0:
            return 1 << 30
        return int((self.budget - self.size) / ((self.size - self.EMPTY) / records)) + 1

    def add(self, rec: JobRecord) -> bool:
        """Room for ``rec``? (counts it if so)"""
        n = len(codec.encode(rec)) + 1
        if self.size + n > self.budget:
            return False
        self.size += n
        return True


async def list_page(js: Any, view: JobsView, req: ListRequest) -> tuple[list[JobRecord], str | None]:
    keep = keep_for(req)
    cursor = req.cursor
    if cursor is not None and not (cursor.startswith("l") or (req.all and cursor.startswith("h"))):
        raise BadCursor(f"malformed cursor {cursor!r}")
    pager = Pager()
    out: list[JobRecord] = []
    if cursor is None or cursor.startswith("l"):
        after_pos = _live_pos(cursor) if cursor else None
        while True:
            if len(out) >= req.limit:
                return out, f"l{out[-1].submitted_at!r}|{out[-1].job_id}"
            page, nxt = view.page(after_pos, min(500, req.limit - len(out)), keep)
            for rec in page:
                if not pager.add(rec):
                    return out, (f"l{out[-1].submitted_at!r}|{out[-1].job_id}" if out else None)
                out.append(rec)
            after_pos = nxt
            if nxt is None:
                break
        if not req.all:
            return out, None
        cursor = "h0"
        if len(out) >= req.limit:
            return out, cursor
    try:
        after = int(cursor[1:])
    except ValueError:
        raise BadCursor(f"malformed cursor {cursor!r}") from None
    recs, last, more = await history_page(js, after, req.limit - len(out), keep, pager)
    out.extend(recs)
    return out, (f"h{last}" if more else None)


async def history_page(js: Any, after: int, limit: int, keep: Callable[[JobRecord], bool],
                       pager: Pager) -> tuple[list[JobRecord], int, bool]:
    """Records of the history store after stream sequence ``after``: (records,
    last sequence read, more left)."""
    stream = f"KV_{subj.HISTORY_BUCKET}"
    info = await js.stream_info(stream)
    if info.state.messages == 0 or info.state.last_seq <= after:
        return [], after, False
    out: list[JobRecord] = []
    last = after
    # a pull consumer: a full page stops the reading, and nothing past it but at most
    # one fetch's worth is delivered (a push consumer sent the rest of the store;
    # ``bus.stream_range``)
    async with stream_range(js, stream, f"$KV.{subj.HISTORY_BUCKET}.>", start_seq=after + 1, chunk=512,
                            want=lambda: min(limit - len(out), pager.room(len(out))), timeout=5) as msgs:
        async for msg in msgs:
            seq = msg.metadata.sequence.stream
            op = (msg.headers or {}).get("KV-Operation")
            if op not in ("DEL", "PURGE") and msg.data:
                rec = codec.decode(msg.data, JobRecord)
                if keep(rec):
                    if len(out) >= limit or not pager.add(rec):
                        return out, last, True
                    out.append(rec)
            last = seq
            if msg.metadata.num_pending == 0:
                return out, last, False
            if len(out) >= limit:  # full: what is pending says whether there is more, unread
                return out, last, True
    return out, last, False
