"""The bus briefly away (JetStream electing a leader after a server of a cluster went
down, its API not answering): a service answers 503 / 504 with a clear message, not a
500 "internal error", and ``gearshift.client.Client`` asks a read again, never a write.

Seen in ``loadtest.chaos`` (its cluster scenario's accounting check): ``gearshift usage``
right after a cluster server came back failed with "error (500): internal error:
ServiceUnavailableError". A real nats-server and real services' endpoints (``bus.server``)
here; the handlers raise what nats-py raises in those moments.
"""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from gearshift.bus.client import ServiceCallError, call
from gearshift.bus.server import Endpoint, serve
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobState,
    NodeList,
    SubmitReply,
    SubmitRequest,
    UsageGroup,
    UsageReply,
    UsageRequest,
)
from gearshift.client import Client


async def _no_wait(_seconds: float) -> None:
    """The client's waits between tries, spent at once (the retry's schedule is tenacity's)."""


class Flaky:
    """A handler that meets ``exc`` on its first ``times`` calls, then answers ``reply``."""

    def __init__(self, exc: Exception, times: int, reply):
        self.exc, self.times, self.reply, self.calls = exc, times, reply, 0

    async def __call__(self, _req):
        self.calls += 1
        if self.calls <= self.times:
            raise self.exc
        return self.reply


USAGE = UsageReply(since=0.0, until=1.0, by="tenant", groups=[], total=UsageGroup(key="total"))


@pytest.mark.parametrize("exc, code, says", [
    (nats.js.errors.ServiceUnavailableError(), "503", "the bus is briefly unavailable"),
    (nats.errors.NoRespondersError(), "503", "the bus is briefly unavailable"),
    (nats.errors.TimeoutError(), "504", "timed out waiting for the bus"),
])
async def test_a_transient_bus_error_is_a_clear_503_or_504_not_an_internal_error(nc, exc, code, says):
    h = Flaky(exc, 1, USAGE)
    svc = await serve(nc, "flaky", [Endpoint("usage", subj.ADMISSION_USAGE, UsageRequest, h)])
    try:
        with pytest.raises(ServiceCallError) as got:
            await call(nc, subj.ADMISSION_USAGE, UsageRequest(since=0.0))
        assert got.value.code == code and says in got.value.message and "internal error" not in got.value.message
        assert isinstance(await call(nc, subj.ADMISSION_USAGE, UsageRequest(since=0.0)), UsageReply)
        # a bug is still a 500
        h.exc, h.times, h.calls = ValueError("a bug"), 1, 0
        with pytest.raises(ServiceCallError) as got:
            await call(nc, subj.ADMISSION_USAGE, UsageRequest(since=0.0))
        assert got.value.code == "500"
    finally:
        await svc.stop()


async def test_the_client_asks_a_read_again_and_not_a_write(nc):
    usage = Flaky(nats.js.errors.ServiceUnavailableError(), 3, USAGE)
    nodes = Flaky(nats.errors.TimeoutError(), 100, NodeList(nodes=[]))
    submit = Flaky(nats.js.errors.ServiceUnavailableError(), 1, SubmitReply(job_id="j1", created=True, state=JobState.PENDING))
    svc = await serve(nc, "flaky", [Endpoint("usage", subj.ADMISSION_USAGE, UsageRequest, usage),
                                    Endpoint("nodes", subj.ADMISSION_NODES, None, nodes),
                                    Endpoint("submit", subj.ADMISSION_SUBMIT, SubmitRequest, submit)])
    try:
        c = Client(nc, sleep=_no_wait)
        # a read met the bus away three times, then was answered: one call for the caller
        rep = await c.usage(0.0)
        assert isinstance(rep, UsageReply) and usage.calls == 4 and c.retries == 3
        # a read that keeps failing gives up (at most 30 tries) with the service's own message
        with pytest.raises(ServiceCallError) as got:
            await c.nodes()
        assert got.value.code == "504" and nodes.calls == 30
        # a write is not asked again: the caller decides (a retried submit could make two jobs)
        with pytest.raises(ServiceCallError) as got:
            await c._call(subj.ADMISSION_SUBMIT, SubmitRequest(spec=_spec()), SubmitReply, "submit")
        assert got.value.code == "503" and submit.calls == 1
        # reads asked once when the caller wants no retry
        usage.calls, usage.times = 0, 1
        with pytest.raises(ServiceCallError):
            await Client(nc, read_retry_s=0).usage(0.0)
        assert usage.calls == 1
    finally:
        await svc.stop()


def _spec():
    from gearshift.bus_schema.messages import JobSpec, ModelSpec

    return JobSpec(name="t", model=ModelSpec(name="m", params=10, layers=2, hidden=64, seq_len=16), global_batch=8, gpus=1, steps=1)
