"""The serving side of the bus: nats.micro endpoints where every handler
decodes its request with msgspec, and any bad input becomes an error reply
naming the field, never a crash. An endpoint must be a row of the bus contract."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from gearshift.bus import VERSION, observe
from gearshift.bus.client import ERROR_CODE_HEADER, ERROR_HEADER
from gearshift.bus.log import get_logger
from gearshift.bus_schema import codec, contract
from gearshift.bus_schema.messages import MAX_MESSAGE_BYTES, ErrorReply


class RequestError(Exception):
    """A client error: becomes an error reply with a code and the field."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def bad_request(message: str, field: str | None = None) -> RequestError:
    return RequestError("400", message, field)


# What a handler meets when the bus, not the request, is at fault for a moment: JetStream
# with no leader (an election after a server of a cluster went down, or a restart), its API
# not answering, a publish with no acknowledgement. Answered 503 / 504, not 500 "internal
# error", so a caller knows that the same request may work a moment later
# (``gearshift.client.Client`` retries its reads on them).
TRANSIENT = (nats.js.errors.ServiceUnavailableError, nats.js.errors.NoStreamResponseError,
             nats.errors.NoRespondersError, nats.errors.TimeoutError)


def transient_error(exc: Exception) -> RequestError:
    if isinstance(exc, nats.errors.TimeoutError):
        return RequestError("504", "timed out waiting for the bus (JetStream did not answer in time); retry")
    return RequestError("503", f"the bus is briefly unavailable (JetStream: {type(exc).__name__}); retry")


async def respond_error(req: Request, err: RequestError) -> None:
    body = codec.encode(ErrorReply(code=err.code, error=err.message, field=err.field))
    await req.respond(body, headers={ERROR_CODE_HEADER: err.code, ERROR_HEADER: err.message[:1024]})


Handler = Callable[[Any], Awaitable[Any]]


@dataclass
class Endpoint:
    """One request-reply endpoint: subject, request type (None = no body), handler."""

    name: str
    subject: str
    request_type: Any
    handler: Handler
    with_subject: bool = False  # handler(payload, subject): the subject carries who asks
    # requests handled concurrently (each in its own task) instead of one after
    # another: for handlers that wait on the bus and are safe to overlap (submit)
    concurrent: bool = False


def _wrap(ep: Endpoint, log: Any) -> Callable[[Request], Awaitable[None]]:
    async def handle(req: Request) -> None:
        started = time.perf_counter()
        with structlog.contextvars.bound_contextvars(endpoint=ep.name):
            try:
                if len(req.data) > MAX_MESSAGE_BYTES:
                    raise RequestError("413", f"message of {len(req.data)} bytes exceeds {MAX_MESSAGE_BYTES}")
                if ep.request_type is None:
                    payload = None
                else:
                    if not req.data:
                        raise bad_request("empty request body: expected a JSON object")
                    try:
                        payload = codec.decode(req.data, ep.request_type)
                    except msgspec.ValidationError as exc:
                        raise bad_request(str(exc), codec.error_field(exc)) from None
                    except msgspec.DecodeError as exc:
                        raise bad_request(f"invalid JSON: {exc}") from None
                result = await (ep.handler(payload, req.subject) if ep.with_subject else ep.handler(payload))
                await req.respond(codec.encode(result))
                log.debug("request", ms=round((time.perf_counter() - started) * 1e3, 2))
                observe.request(ep.name, "200", time.perf_counter() - started)
            except RequestError as err:
                log.info("request rejected", code=err.code, error=err.message, field=err.field)
                observe.request(ep.name, err.code, time.perf_counter() - started)
                await respond_error(req, err)
            except TRANSIENT as exc:  # the bus itself, briefly: a clear 503/504 the caller may retry
                err = transient_error(exc)
                log.warning("request failed: the bus is briefly unavailable", code=err.code, error=str(exc))
                observe.request(ep.name, err.code, time.perf_counter() - started)
                await respond_error(req, err)
            except Exception as exc:  # a bug must not kill the service
                log.exception("request failed")
                observe.request(ep.name, "500", time.perf_counter() - started)
                await respond_error(req, RequestError("500", f"internal error: {type(exc).__name__}: {exc}"))

    if not ep.concurrent:
        return handle
    running: set[asyncio.Task] = set()

    async def spawn(req: Request) -> None:
        task = asyncio.create_task(handle(req))
        running.add(task)
        task.add_done_callback(running.discard)

    return spawn


def check_endpoint(ep: Endpoint) -> None:
    """An endpoint must be a row of the bus contract (``bus_schema.contract``)
    with the same request type: a service cannot drift from what outside tools read."""
    pattern = ep.subject.replace("*", "<any>")
    route = contract.route_for(pattern, contract.REQUEST)
    if route is None:
        raise ValueError(f"endpoint {ep.name}: subject {ep.subject} is not in the bus contract (bus_schema.contract)")
    if route.request is not ep.request_type:
        raise ValueError(f"endpoint {ep.name}: request type {getattr(ep.request_type, '__name__', None)} differs from "
                         f"the contract's {getattr(route.request, '__name__', None)} for {route.subject}")


async def serve(nc: NATS, name: str, endpoints: list[Endpoint], description: str = "", metadata: dict | None = None):
    """Register a nats.micro service (discoverable via $SRV.PING/INFO/STATS)."""
    log = get_logger(service=name)
    for ep in endpoints:
        check_endpoint(ep)
    metadata = dict(metadata or {})
    if observe.current_url():  # `nats micro info <name>` tells where to scrape
        metadata["metrics"] = observe.current_url()
    svc = await add_service(
        nc,
        ServiceConfig(name=name, version=VERSION, description=description, metadata=metadata),
    )
    for ep in endpoints:
        await svc.add_endpoint(EndpointConfig(name=ep.name, subject=ep.subject, handler=_wrap(ep, log)))
    return svc
