"""``gearshift.client``: the public Python client of a gearshift cluster.

Outside tools (dashboards, exporters, notebooks) and the ``gearshift`` command
use it; it speaks only the bus contract (``bus_schema.contract``, printed by
``gearshift schema``)::

    from gearshift.client import Client

    client = await Client.connect("nats://127.0.0.1:4222", creds="tools.creds")
    async for ev in client.durable_events("my-exporter"):   # resumes after a restart
        print(ev.event.kind, ev.event.job_id)
        await ev.ack()

Every call is typed (``msgspec`` structs of ``bus_schema``). A refusal by a
service raises ``ServiceCallError`` (``code``, ``message``, ``field``). A read
(get, list, usage, nodes, queues, explain) answered 503 or 504 (no service
answers, JetStream without a leader for a moment, a time-out) is asked again
for up to ``read_retry_s`` (10 s); a write never is. A
subject the identity may not use raises ``ServiceCallError`` with code
``"403"`` at once (the server's permission error, not a time-out); no server
raises ``ServerUnavailable`` and bad credentials ``NotAuthorized``.

Credentials: ``creds=`` (a gearshift credentials file, see ``services.auth``)
or ``GEARSHIFT_CREDS``; a tenant identity's requests go to its own
``gs.admission.<verb>.<tenant>`` subjects by themselves.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import tenacity
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from gearshift.bus.auth import current_creds, load_creds, tenant_subject
from gearshift.bus.client import ServiceCallError, call, connect
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    ExplainReply,
    JobList,
    JobRecord,
    JobSpec,
    ListRequest,
    NodeList,
    NodeShare,
    Plan,
    QueueList,
    ReconfigureReply,
    ReconfigureRequest,
    SubmitReply,
    SubmitRequest,
    UsageReply,
    UsageRequest,
)
from gearshift.bus_schema.ops import LogsReply, LogsRequest, NodeMode, NodeModeReply, NodeModeRequest
from gearshift.spec_file import SpecFileError, load_spec, load_spec_text

T = TypeVar("T")

__all__ = ["Client", "DeliveredEvent", "SpecFileError", "load_spec", "load_spec_text", "ServiceCallError"]


_VIOLATION = re.compile(r"permissions violation for (\w+) to \"?([^\"\s']+)", re.IGNORECASE)


@dataclass
class DeliveredEvent:
    """One event from a durable consumer; ``ack()`` once it is handled, so a
    restarted consumer resumes after it."""

    subject: str
    stream_seq: int
    event: Any
    msg: Any
    acked: bool = False

    async def ack(self) -> None:
        await self.msg.ack_sync()
        self.acked = True


READ_RETRY_S = 10.0  # how long a read is tried again while the bus or its service is briefly away
RETRY_CODES = frozenset(("503", "504"))  # no service answers, JetStream without a leader, timed out


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, ServiceCallError) and exc.code in RETRY_CODES


class Client:
    def __init__(self, nc: Any, timeout: float = 5.0, tenant: str | None = None, user: str | None = None,
                 read_retry_s: float = READ_RETRY_S, sleep: Any = asyncio.sleep):
        self.nc = nc
        self.timeout = timeout
        # a tenant identity asks on gs.admission.<verb>.<tenant> (services.auth)
        self.tenant = tenant
        self.user = user
        self._refused: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
        # Reads (get, list, usage, nodes, queues, explain) answered 503/504 are asked again
        # for up to ``read_retry_s`` (a service restarting, JetStream electing a leader after a
        # server of a cluster went down); writes are not, as a retried write could act twice, nor
        # an agent's logs, whose 503 says that agent is gone (``cli_ops`` asks the next node).
        # ``sleep``: how the waits between tries are spent (tests pass one that returns at once).
        self.read_retry_s = read_retry_s
        self._sleep = sleep
        self.retries = 0  # reads asked again

    @classmethod
    async def connect(cls, url: str | None = None, retry_for: float = 3.0, creds: str | Path | None = None,
                      timeout: float = 5.0) -> "Client":
        """Connect with ``creds`` (a credentials file), else ``GEARSHIFT_CREDS``."""
        data = load_creds(creds) if creds is not None else current_creds()
        holder: dict[str, Client] = {}

        async def on_error(exc: Exception) -> None:
            m = _VIOLATION.search(str(exc))
            if m and "c" in holder:
                holder["c"]._refused.put_nowait((m.group(1).lower(), m.group(2)))

        extra: dict[str, Any] = {"error_cb": on_error}
        if creds is not None:
            from gearshift.bus.auth import connect_options

            extra.update(connect_options(data))
        nc = await connect(url, name="gearshift-client", retry_for=retry_for, identity=data.get("user"), **extra)
        client = cls(nc, timeout=timeout, tenant=data.get("tenant"), user=data.get("user"))
        holder["c"] = client
        return client

    async def close(self) -> None:
        await self.nc.drain()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _subject(self, subject: str) -> str:
        return tenant_subject(subject, self.tenant)

    async def _guard(self, aw: Awaitable[T], what: str) -> T:
        """Await ``aw``, but fail at once if the server refuses one of our
        subjects meanwhile (NATS reports that asynchronously; the request
        would otherwise wait for its time-out)."""
        while not self._refused.empty():
            self._refused.get_nowait()  # an old refusal: not this call's
        task = asyncio.ensure_future(aw)
        refused = asyncio.ensure_future(self._refused.get())
        try:
            done, _ = await asyncio.wait({task, refused}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            kind, subject = refused.result()
            task.cancel()
            who = f"identity {self.user!r}" if self.user else "this identity"
            raise ServiceCallError("403", f"permission denied: {who} may not {what} ({kind} to {subject} refused "
                                          "by the server)")
        finally:
            refused.cancel()

    async def _call(self, subject: str, request: Any, reply_type: Any, what: str) -> Any:
        return await self._guard(call(self.nc, subject, request, reply_type, self.timeout), what)

    async def _read(self, subject: str, request: Any, reply_type: Any, what: str) -> Any:
        """``_call`` for a request that changes nothing: tried again on 503/504 for up to
        ``read_retry_s`` (waits from 0.1 s doubling to 1 s, and at most 30 tries; 0: one try)."""

        def count(_state: Any) -> None:
            self.retries += 1

        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(_retryable), reraise=True, sleep=self._sleep, before_sleep=count,
            stop=tenacity.stop_after_delay(self.read_retry_s) | tenacity.stop_after_attempt(30),
            wait=tenacity.wait_exponential(multiplier=0.1, max=1.0))
        return await retrying(self._call, subject, request, reply_type, what)

    # ------------------------------------------------------------ jobs
    async def submit(self, spec: JobSpec, token: str | None = None) -> SubmitReply:
        return await self._call(self._subject(subj.ADMISSION_SUBMIT), SubmitRequest(spec=spec, token=token),
                                SubmitReply, "submit jobs")

    async def jobs(self, tenant: str | None = None, states: list[str] | None = None,
                   limit: int | None = None, **filters: Any) -> list[JobRecord]:
        """Every job that matches (at most ``limit``), page after page;
        ``filters``: ``node``, ``all`` (the history store too); see ListRequest."""
        out: dict[str, JobRecord] = {}
        async for page in self.job_pages(tenant, states, limit, **filters):
            for rec in page:  # a job archived while paging comes twice: its final record wins
                out.pop(rec.job_id, None)
                out[rec.job_id] = rec
        jobs = list(out.values())
        return jobs[:limit] if limit is not None else jobs

    async def job_pages(self, tenant: str | None = None, states: list[str] | None = None,
                        limit: int | None = None, **filters: Any) -> AsyncIterator[list[JobRecord]]:
        cursor, got_n = None, 0
        while True:
            req = ListRequest(tenant=tenant, states=states or None, cursor=cursor, **filters)
            if limit is not None:
                req = msgspec.structs.replace(req, limit=max(1, limit - got_n))
            page = await self._read(self._subject(subj.ADMISSION_LIST), req, JobList, "list jobs")
            got_n += len(page.jobs)
            yield page.jobs
            if page.next_cursor is None or (limit is not None and got_n >= limit):
                return
            cursor = page.next_cursor

    async def job(self, job_id: str) -> JobRecord:
        return await self._read(self._subject(subj.ADMISSION_GET), {"job_id": job_id}, JobRecord, "read jobs")

    async def cancel(self, job_id: str, cascade: bool = True) -> JobRecord:
        """Cancel a job; with ``cascade`` the jobs that wait on it too (``services.dependencies``)."""
        return await self._call(self._subject(subj.ADMISSION_CANCEL), {"job_id": job_id, "cascade": cascade},
                                JobRecord, "cancel jobs")

    async def usage(self, since: float, until: float | None = None, by: str = "tenant",
                    tenant: str | None = None) -> UsageReply:
        """What jobs used: those that finished in ``[since, until]`` (and the live ones, if ``until`` is None)."""
        req = UsageRequest(since=since, until=until, by=by, tenant=tenant)
        return await self._read(self._subject(subj.ADMISSION_USAGE), req, UsageReply, "read usage")

    async def nodes(self) -> NodeList:
        return await self._read(subj.ADMISSION_NODES, None, NodeList, "list nodes")

    # ------------------------------------------------------------ operators
    async def explain(self) -> ExplainReply:
        return await self._read(subj.OPTIMIZER_EXPLAIN, None, ExplainReply, "ask the optimizer")

    async def reconfigure(self, job_id: str, plan: Plan | None, placement: list[NodeShare] | None = None,
                          reason: str = "") -> ReconfigureReply:
        """Pin ``plan`` (on ``placement`` if given) for a job; ``plan=None`` unpins."""
        req = ReconfigureRequest(job_id=job_id, plan=plan, placement=placement or [], reason=reason)
        return await self._call(subj.OPTIMIZER_RECONFIGURE, req, ReconfigureReply, "reconfigure jobs")

    async def node_modes(self, node: str | None = None, mode: NodeMode | str | None = None,
                         reason: str = "") -> NodeModeReply:
        """Cordon / drain / uncordon (``mode``) a node; without ``mode``: read them."""
        req = NodeModeRequest(node=node, mode=NodeMode(mode) if mode is not None else None, reason=reason)
        return await self._call(subj.OPTIMIZER_NODE, req, NodeModeReply, "change nodes")

    async def logs(self, node: str, job_id: str, rank: int | None = None, generation: int | None = None,
                   tail_bytes: int = 16 * 1024) -> LogsReply:
        req = LogsRequest(job_id=job_id, rank=rank, generation=generation, tail_bytes=tail_bytes)
        return await self._call(subj.agent_command(node, "logs"), req, LogsReply, "read logs")

    async def queues(self):
        return (await self._read(subj.ADMISSION_QUEUES, None, QueueList, "list queues")).queues

    async def set_queue(self, queue: dict):
        """``queue``: QueueSpec fields (admission decodes and checks them)."""

        return (await self._call(subj.ADMISSION_SET_QUEUE, msgspec.json.encode(queue), QueueList,
                                 "change queues")).queues

    # ------------------------------------------------------------ events
    async def events(self, follow: bool = False, subject: str = subj.EVENTS_SUBJECTS) -> AsyncIterator[tuple[str, int, Any]]:
        """(subject, stream sequence, event) from the start of the stream; with
        ``follow`` keeps waiting for new ones, else stops once caught up."""
        js = self.nc.jetstream()
        info = await self._guard(js.stream_info(subj.EVENTS_STREAM), "read the event stream")
        if info.state.messages == 0 and not follow:
            return
        sub = await self._guard(js.subscribe(subject, stream=subj.EVENTS_STREAM, ordered_consumer=True,
                                             deliver_policy=DeliverPolicy.ALL), "read the event stream")
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0 if not follow else 3600)
                except asyncio.TimeoutError:
                    if follow:
                        continue
                    return
                ev = codec.decode_event(msg.data)
                yield msg.subject, msg.metadata.sequence.stream, ev
                if not follow and msg.metadata.num_pending == 0:
                    return
        finally:
            await _quietly(sub.unsubscribe())

    async def durable_events(self, name: str, subject: str = subj.EVENTS_SUBJECTS, batch: int = 64,
                             idle_stop: float | None = None) -> AsyncIterator[DeliveredEvent]:
        """Events through a durable consumer ``name`` on ``GS_EVENTS``: the
        server remembers what was acked, so after a restart the same name
        resumes with the first event not acked (at least once: an event handled
        but not acked before a crash comes again; de-duplicate on
        ``(job_id, seq)``). ``idle_stop``: return after that many seconds
        with nothing new (default: wait forever)."""
        js = self.nc.jetstream()
        config = ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL, ack_wait=60)
        psub = await self._guard(js.pull_subscribe(subject, durable=name, stream=subj.EVENTS_STREAM, config=config),
                                 "own a durable consumer")
        idle = 0.0
        pending: list[DeliveredEvent] = []
        try:
            while True:
                try:
                    msgs = await psub.fetch(batch, timeout=1.0)
                except asyncio.TimeoutError:
                    idle += 1.0
                    if idle_stop is not None and idle >= idle_stop:
                        return
                    continue
                idle = 0.0
                pending = [DeliveredEvent(m.subject, m.metadata.sequence.stream, codec.decode_event(m.data), m)
                           for m in msgs]
                for item in pending:
                    yield item
        finally:
            # a consumer stopped mid-batch hands back what it did not ack, so
            # the next run gets it at once (not after the ack wait)
            for item in pending:
                if not item.acked:
                    await _quietly(item.msg.nak())
            await _quietly(psub.unsubscribe())


async def _quietly(aw: Awaitable[Any]) -> None:
    """Clean-up that may find the connection already closing."""
    try:
        await aw
    except Exception:
        pass
