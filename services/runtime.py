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


class NotAuthorized(ServerUnavailable):
    """The server refused the credentials (an unknown nkey, a wrong password)."""


def auth_options() -> dict[str, Any]:
    """Credentials from the environment: ``GEARSHIFT_CREDS`` (a file with
    an nkey seed, see ``services.auth``), ``GEARSHIFT_USER`` +
    ``GEARSHIFT_PASSWORD``; TLS from ``GEARSHIFT_TLS_CA``. None set: no auth."""
    from . import auth

    return auth.connect_options()


def _current_user() -> str | None:
    from . import auth

    try:
        return auth.current_creds().get("user")
    except ValueError:
        return None


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, ConnectionRefusedError) or "Connect call failed" in text or "refused" in text.lower():
        return "connection refused"
    return text


async def connect(url: str | None = None, name: str = "gearshift", *, retry_for: float = 5.0,
                  identity: str | None = None, **kw: Any) -> NATS:
    """Connect, retrying for ``retry_for`` seconds; then reconnect forever.

    nats-py reports each failed attempt to ``error_cb`` (by default as a
    logged traceback): here they become one log line each, and the last one
    is what ``ServerUnavailable`` says. Refused credentials fail at once."""
    url = server_url(url)
    # "nats://a:1,nats://b:2": a server list (a cluster); the client fails over
    servers: str | list[str] = [u.strip() for u in url.split(",") if u.strip()] if "," in url else url
    seen: list[BaseException] = []
    refused = asyncio.Event()
    user_cb = kw.pop("error_cb", None)

    async def on_error(exc: Exception) -> None:
        seen.append(exc)
        del seen[:-5]
        if isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower():
            refused.set()
        if user_cb is not None:
            await user_cb(exc)
        elif not refused.is_set():
            # stdlib logging (stderr), as nats-py's own default, but one line instead of a traceback
            logging.getLogger("gearshift.nats").warning("nats error: %s", _describe(exc))

    kw = {**auth_options(), **kw}
    # count connection errors and reconnections (gearshift_bus_errors_total), then call ours and the caller's
    kw.update(observe.bus_callbacks(on_error, kw.pop("reconnected_cb", None)))
    deadline = time.monotonic() + retry_for
    nc = NATS()
    # nats-py retries the first connect by itself (max_reconnect_attempts=-1):
    # bounded here by the deadline, and cut short when the server refuses the user
    connecting = asyncio.ensure_future(nc.connect(
        servers,
        name=name,
        connect_timeout=min(2.0, max(0.5, retry_for)),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        **kw,
    ))
    gave_up = asyncio.ensure_future(refused.wait())
    # a TLS handshake that fails verification would otherwise be retried forever
    done, _ = await asyncio.wait({connecting, gave_up}, timeout=max(0.5, retry_for),
                                 return_when=asyncio.FIRST_COMPLETED)
    gave_up.cancel()
    if connecting in done and connecting.exception() is None:
        return nc
    connecting.cancel()
    try:
        await nc.close()
    except Exception:
        pass
    if refused.is_set():
        who = identity or kw.get("user") or _current_user() or "anonymous"
        raise NotAuthorized(f"the server at {url} refused the credentials of user {who!r} (authorization violation)")
    last = seen[-1] if seen else (connecting.exception() if connecting.done() and not connecting.cancelled() else None)
    raise ServerUnavailable(f"no NATS server answers at {url} ({_describe(last)})")


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
    subj.NODE_MODES_BUCKET: dict(history=1),
    subj.QUEUES_BUCKET: dict(history=5),
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
    from bus_schema import contract

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


# ------------------------------------------------------------------ client side
class ServiceCallError(Exception):
    def __init__(self, code: str, message: str, field: str | None = None):
        super().__init__(f"{message}" + (f" (field: {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field


async def call(nc: NATS, subject: str, request: Any, reply_type: Any = None, timeout: float = 5.0) -> Any:
    """Request-reply with a typed reply (by default the one the bus contract
    names for the subject); error replies raise ServiceCallError."""
    if reply_type is None:
        from bus_schema import contract

        reply_type = contract.reply_type(subject)
        if reply_type is None:
            raise ValueError(f"{subject} is not a request subject of the bus contract")
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
class GcClock:
    """Seconds this process spent in the garbage collector (``gc.callbacks``)."""

    total = 0.0
    _started = 0.0

    @classmethod
    def install(cls) -> None:
        import gc

        if cls._hook not in gc.callbacks:
            gc.callbacks.append(cls._hook)

    @classmethod
    def _hook(cls, phase: str, info: dict) -> None:
        if phase == "start":
            cls._started = time.perf_counter()
        elif cls._started:
            cls.total += time.perf_counter() - cls._started


GC_THRESHOLD = 50_000  # young-generation allocations between collections (Python's default: 700)


def tune_gc() -> None:
    """Count the time spent collecting (``GcClock``; the optimizer logs it per
    round as ``gc_ms``), freeze what is alive after start-up and collect the
    young generation every ``GC_THRESHOLD`` allocations instead of 700
    (``GEARSHIFT_GC_THRESHOLD=N`` sets N; 0 keeps Python's defaults). Services
    hold tens of thousands of records in their views; with Python's defaults
    their collections were the tail of submit latency at 2,000 nodes
    (``loadtest.scale``, same command, idle 2-core box: submit p99 108 ms with
    the defaults, 37 ms with 50,000; round p99 with >= 5,000 live jobs 1.88 s
    and 1.20 s; peak RSS unchanged within 3%)."""
    import gc

    GcClock.install()
    raw = os.environ.get("GEARSHIFT_GC_THRESHOLD")
    try:
        first = GC_THRESHOLD if raw is None or raw.strip() == "" else int(raw)
    except ValueError:  # one line, no traceback
        raise SystemExit(f"GEARSHIFT_GC_THRESHOLD: expected a whole number of allocations (0: Python's defaults), "
                         f"got {raw!r}") from None
    if first > 0:
        gc.freeze()
        gc.set_threshold(first, 20, 100)


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run ``main(stop)`` on uvloop; SIGTERM/SIGINT set ``stop``."""
    configure_logging()
    tune_gc()

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
