"""The small runtime every gearshift service shares.

- ``connect``: NATS with reconnects, and a clear error when no server answers.
- ``ensure_infra``: create-or-update the streams and KV buckets (idempotent).
- ``configure_logging``: structlog, JSON in services, console in the CLI.
- ``Endpoint``/``serve``: nats.micro registration where every handler decodes
  its request with msgspec, and any bad input becomes an error reply naming
  the field, never a crash.
- ``run_service``: uvloop, graceful shutdown on SIGTERM/SIGINT (drain, so
  in-flight requests finish).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from bus_schema import codec, subjects as subj
from bus_schema.messages import MAX_MESSAGE_BYTES, ErrorReply

from . import observe

VERSION = "0.1.0"
DEFAULT_URL = "nats://127.0.0.1:4222"


def server_url(explicit: str | None = None) -> str:
    return explicit or os.environ.get("GEARSHIFT_NATS_URL") or DEFAULT_URL


class ServerUnavailable(RuntimeError):
    pass


def auth_options() -> dict[str, Any]:
    """Credentials from the environment: ``GEARSHIFT_CREDS`` (a file with
    ``user``/``password`` lines, see ``services.auth``), ``GEARSHIFT_USER`` +
    ``GEARSHIFT_PASSWORD``; TLS from ``GEARSHIFT_TLS_CA``. None set: no auth."""
    from . import auth

    return auth.connect_options()


async def connect(url: str | None = None, name: str = "gearshift", *, retry_for: float = 5.0, **kw: Any) -> NATS:
    """Connect, retrying for ``retry_for`` seconds; then reconnect forever."""
    url = server_url(url)
    # "nats://a:1,nats://b:2": a server list (a cluster); the client fails over
    servers: str | list[str] = [u.strip() for u in url.split(",") if u.strip()] if "," in url else url
    kw = {**auth_options(), **kw}
    # count connection errors and reconnections (gearshift_bus_errors_total), then call the caller's callbacks
    kw.update(observe.bus_callbacks(kw.pop("error_cb", None), kw.pop("reconnected_cb", None)))
    deadline = time.monotonic() + retry_for
    last: Exception | None = None
    while True:
        nc = NATS()
        try:
            # bounded: a TLS handshake that fails verification would otherwise be retried forever
            await asyncio.wait_for(
                nc.connect(
                    servers,
                    name=name,
                    connect_timeout=2,
                    max_reconnect_attempts=-1,
                    reconnect_time_wait=0.5,
                    allow_reconnect=True,
                    **kw,
                ),
                timeout=max(2.0, deadline - time.monotonic()) + 3.0,
            )
            return nc
        except Exception as exc:  # nats raises several types for "nobody there"
            last = exc
            try:
                await nc.close()
            except Exception:
                pass
            if time.monotonic() >= deadline:
                raise ServerUnavailable(f"no NATS server answers at {url}: {exc or type(exc).__name__}") from last
            await asyncio.sleep(0.2)


# ------------------------------------------------------------------ infra
STREAMS = {
    subj.EVENTS_STREAM: dict(subjects=[subj.EVENTS_SUBJECTS], duplicate_window=3600.0),
    subj.REPORTS_STREAM: dict(subjects=[subj.REPORTS_SUBJECTS], duplicate_window=3600.0),
}
BUCKETS = {
    subj.JOBS_BUCKET: dict(history=5),
    subj.NODES_BUCKET: dict(history=1),
    subj.ALLOC_BUCKET: dict(history=5),
    subj.MODELS_BUCKET: dict(history=5),
    subj.LEASE_BUCKET: dict(history=1),
    subj.HISTORY_BUCKET: dict(history=1, ttl=subj.HISTORY_RETENTION_S),
}


def default_replicas() -> int:
    """Stream and bucket replicas: 1, or 3 on a NATS cluster (``GEARSHIFT_REPLICAS``)."""
    return int(os.environ.get("GEARSHIFT_REPLICAS") or 1)


async def ensure_infra(nc: NATS, replicas: int | None = None) -> None:
    """Create or update the streams and buckets; safe to call from every service."""
    replicas = replicas or default_replicas()
    js = nc.jetstream()
    for name, cfg in STREAMS.items():
        config = StreamConfig(
            name=name,
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=replicas,
            max_msg_size=MAX_MESSAGE_BYTES,
            **cfg,
        )
        try:
            await js.add_stream(config)
        except BadRequestError:
            await js.update_stream(config)
    for bucket, cfg in BUCKETS.items():
        try:
            await js.key_value(bucket)
        except (BucketNotFoundError, NotFoundError):
            try:
                await js.create_key_value(
                    KeyValueConfig(bucket=bucket, storage=StorageType.FILE, replicas=replicas, **cfg)
                )
            except BadRequestError:
                pass  # another service created it first


# ------------------------------------------------------------------ logging
def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """JSON lines for services, console for people. Safe to call twice."""
    fmt = fmt or os.environ.get("GEARSHIFT_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
    lvl = getattr(logging, (level or os.environ.get("GEARSHIFT_LOG_LEVEL") or "INFO").upper(), logging.INFO)
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks if fmt != "console" else structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**bind: Any) -> Any:
    # get_logger(**initial) stays lazy: binding now would freeze the
    # configuration in force at import time.
    return structlog.get_logger(**bind)


# ------------------------------------------------------------------ request handling
class RequestError(Exception):
    """A client error: becomes an error reply with a code and the field."""

    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field


def bad_request(message: str, field: str | None = None) -> RequestError:
    return RequestError("400", message, field)


ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"


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
            except Exception as exc:  # a bug must not kill the service
                log.exception("request failed")
                observe.request(ep.name, "500", time.perf_counter() - started)
                await respond_error(req, RequestError("500", f"internal error: {type(exc).__name__}: {exc}"))

    return handle


async def serve(nc: NATS, name: str, endpoints: list[Endpoint], description: str = "", metadata: dict | None = None):
    """Register a nats.micro service (discoverable via $SRV.PING/INFO/STATS)."""
    log = get_logger(service=name)
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


# ------------------------------------------------------------------ client side
class ServiceCallError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{message}" + (f" (field: {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field


async def call(nc: NATS, subject: str, request: Any, reply_type: Any, timeout: float = 5.0) -> Any:
    """Request-reply with a typed reply; error replies raise ServiceCallError."""
    data = b"" if request is None else (request if isinstance(request, bytes) else codec.encode(request))
    try:
        msg = await nc.request(subject, data, timeout=timeout)
    except nats.errors.NoRespondersError:
        observe.bus_error("no_responders")
        raise ServiceCallError("503", f"no service answers on {subject}") from None
    except nats.errors.TimeoutError:
        observe.bus_error("timeout")
        raise ServiceCallError("504", f"timed out after {timeout}s waiting for {subject}") from None
    headers = msg.headers or {}
    if ERROR_CODE_HEADER in headers:
        try:
            err = codec.decode(msg.data, ErrorReply)
            raise ServiceCallError(err.code, err.error, err.field)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise ServiceCallError(headers[ERROR_CODE_HEADER], headers.get(ERROR_HEADER, "error")) from None
    return codec.decode(msg.data, reply_type)


# ------------------------------------------------------------------ process
def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop; SIGTERM/SIGINT set ``stop``."""
    configure_logging()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        except observe.MetricsPortBusy as exc:  # one clear line, no traceback
            get_logger().error(str(exc))
            raise SystemExit(4) from None

    use_uvloop = os.environ.get("GEARSHIFT_LOOP", "uvloop") == "uvloop"
    if use_uvloop:
        import uvloop

        uvloop.run(runner())
    else:
        asyncio.run(runner())


def now() -> float:
    return time.time()
