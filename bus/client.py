"""The calling side of the bus: connect, and typed request-reply.

- ``connect``: NATS with reconnects, and a clear error when no server answers;
  refused credentials fail at once.
- ``call``: request-reply whose reply type comes from the bus contract; an
  error reply raises ``ServiceCallError``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NATS

from gearshift.bus import auth, headers, observe
from gearshift.bus_schema import codec, contract
from gearshift.bus_schema.messages import ErrorReply

headers.install()  # nats-py's header parsing, faster (bus.headers)

DEFAULT_URL = "nats://127.0.0.1:4222"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"


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
    return auth.connect_options()


def _current_user() -> str | None:
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
