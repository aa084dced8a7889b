"""The live web dashboard: ``gearshift-dashboard [--port P]``.

A small aiohttp service that reads the bus and serves one plain HTML/JS
page (no build step): KV watches on ``gs_jobs`` and ``gs_nodes``, live
progress on ``gs.job.*.progress`` and the recent ``GS_EVENTS``, kept in a
``DashboardState``. The page gets the view as JSON (``/api/state``) and follows
changes and events over server-sent events (``/api/stream``).

Actions act *as the person at the page*: they sign in with their gearshift
credentials file (``POST /api/login``), the dashboard opens a NATS connection
with that identity, and a cancel is sent on it. So the NATS server and
admission decide, exactly as for ``gearshift cancel``: the admin and the
job's tenant may cancel, another tenant gets "no job", ``tools`` gets a
permissions violation. Without authorisation (``gearshift up --no-auth``)
anyone may.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar

import msgspec
from aiohttp import web
from msgspec import Meta
from nats.js.api import ConsumerConfig, DeliverPolicy

from gearshift.bus import auth, observe
from gearshift.bus.client import ServerUnavailable, ServiceCallError, call, connect
from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.config import ServiceConfig, load, option
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus.tasks import cancel_and_wait
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobProgress, JobRecord, NodeReport
from gearshift.services.dashboard_state import EVENTS, DashboardState


class DashboardConfig(ServiceConfig):
    """gearshift live web dashboard: jobs, nodes and events, and actions as the signed-in person."""

    service: ClassVar[str] = "dashboard"
    host: Annotated[str, Meta(min_length=1), option("address to listen on; 0.0.0.0 in a pod")] = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535), option(
        "port for the page; 0: any free port, whose URL is logged and announced")] = 0
    require_login: Annotated[bool | None, option(
        "actions need the person's credentials (default: on when the dashboard has credentials)",
        negative="--no-login",
        negative_help="anyone at the page may act with the dashboard's identity (only without authorisation)")] = None


log = get_logger(service="dashboard")
STATIC = Path(__file__).with_name("dashboard_static")
MAX_SESSIONS = 100


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Session:
    """One signed-in identity: its own NATS connection, so the server checks its permissions."""

    user: str
    role: str
    tenant: str | None
    nc: Any
    violations: list[asyncio.Future] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    async def on_error(self, exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            for fut in self.violations:
                if not fut.done():
                    fut.set_result(str(exc).removeprefix("nats: "))


class Dashboard:
    LINGER_S = 60.0  # the bus is followed this long after the last page was seen
    LOAD_WAIT_S = 30.0  # a page's first request waits at most this long for the current jobs and nodes

    def __init__(self, nc: Any, url: str | None, *, require_login: bool, clock: Clock = SYSTEM):
        self.nc = nc
        self.url = url
        self.require_login = require_login
        self.view = DashboardState()
        self.sessions: dict[str, Session] = {}
        self.clients: set[asyncio.Queue] = set()
        self.clock = clock
        self._tasks: list[asyncio.Task] = []
        self._subs: list[Any] = []
        self._following: asyncio.Task | None = None  # the bus followed: started by a page's request
        self._asked_at = 0.0  # the last request of a page (``clock``)
        self._idle: asyncio.Task | None = None
        self.started = False

    # ------------------------------------------------------------ bus
    async def start(self) -> "Dashboard":
        """Ready to serve pages. The bus is followed only while somebody looks: from a
        page's first request (``follow``) until ``LINGER_S`` after the last one
        (``close_if_idle``). Followed all the time, the view cost every deployment the
        decoding of every job revision, node report, event and progress line, with no
        page open (0.33 ms of CPU a submit in ``loadtest.submit_stall``; issue 24)."""
        self._idle = asyncio.create_task(self._close_when_idle(), name="dash-idle")
        self._idle.add_done_callback(_log_failure)
        self.started = True
        return self

    @property
    def following(self) -> bool:
        return self._following is not None

    async def follow(self) -> str | None:
        """Follow the bus if not yet, and return once the view holds the current jobs
        and nodes (at most ``LOAD_WAIT_S``: then what has arrived). Returns why it
        cannot follow (the bus refused), else None."""
        self.seen()
        if self._following is None:
            self._following = asyncio.create_task(self._open(), name="dash-open")
        try:
            await asyncio.wait_for(asyncio.shield(self._following), self.LOAD_WAIT_S)
        except asyncio.TimeoutError:
            log.warning("the view is still loading", waited_s=self.LOAD_WAIT_S)
        except Exception as exc:  # the next page's request tries again
            log.warning("cannot follow the bus", error=str(exc) or type(exc).__name__)
            await self._unfollow()
            return f"the dashboard cannot read the bus: {exc or type(exc).__name__}"
        return None

    async def _open(self) -> None:
        js = self.nc.jetstream()
        jobs_kv = await js.key_value(subj.JOBS_BUCKET)
        nodes_kv = await js.key_value(subj.NODES_BUCKET)
        loaded = [asyncio.Event(), asyncio.Event()]  # the jobs' and the nodes' watches past their current values
        self._tasks = [
            asyncio.create_task(self._watch(jobs_kv, JobRecord, self.view.put_job, loaded[0]), name="dash-jobs"),
            asyncio.create_task(self._watch(nodes_kv, NodeReport, self.view.put_node, loaded[1]), name="dash-nodes"),
            asyncio.create_task(self._follow_events(js), name="dash-events"),
            asyncio.create_task(self._push_state(), name="dash-push"),
        ]
        for t in self._tasks:
            t.add_done_callback(_log_failure)

        async def on_progress(msg: Any) -> None:
            try:
                self.view.put_progress(codec.decode(msg.data, JobProgress))
            except (msgspec.ValidationError, msgspec.DecodeError):
                pass

        self._subs.append(await self.nc.subscribe("gs.job.*.progress", cb=on_progress))
        log.info("following the bus: a page is open")
        await asyncio.gather(*(e.wait() for e in loaded))

    def seen(self) -> None:
        self._asked_at = self.clock.now()

    async def close_if_idle(self) -> bool:
        """Stop following the bus, and forget the view, when no page follows the stream
        and none asked for anything for ``LINGER_S``. True if it stopped."""
        if self._following is None or self.clients or self.clock.now() - self._asked_at < self.LINGER_S:
            return False
        await self._unfollow()
        self.view = DashboardState()  # stale from now on: the next page loads it afresh
        log.info("not following the bus: no page for a while", linger_s=self.LINGER_S)
        return True

    async def _close_when_idle(self) -> None:
        while True:
            await asyncio.sleep(self.LINGER_S / 4)
            await self.close_if_idle()

    async def _unfollow(self) -> None:
        following, self._following = self._following, None
        await cancel_and_wait([following, *self._tasks])
        self._tasks = []
        subs, self._subs = self._subs, []
        for s in subs:
            try:
                await s.unsubscribe()
            except Exception:  # the connection is going: nothing left to stop
                pass

    async def _watch(self, kv: Any, typ: Any, put: Any, loaded: asyncio.Event) -> None:
        watcher = await kv.watchall()
        try:
            await self._apply(watcher, typ, put, loaded)
        finally:
            loaded.set()  # a watch that ended lets a waiting page have what there is
            try:
                await watcher.stop()
            except Exception:
                pass

    async def _apply(self, watcher: Any, typ: Any, put: Any, loaded: asyncio.Event) -> None:
        async for entry in watcher:
            if entry is None:  # "initial values done"
                loaded.set()
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                put(None, entry.key)
                continue
            try:
                put(codec.decode(entry.value, typ), entry.key)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.warning("undecodable entry ignored", key=entry.key, error=str(exc))

    async def _follow_events(self, js: Any) -> None:
        info = await js.stream_info(subj.EVENTS_STREAM)
        start = max(1, info.state.last_seq - 5 * EVENTS + 1)  # the recent past, never all history
        sub = await js.subscribe(subj.EVENTS_SUBJECTS, stream=subj.EVENTS_STREAM, ordered_consumer=True,
                                 config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                       opt_start_seq=start))
        try:
            async for msg in sub.messages:
                try:
                    ev = codec.decode_event(msg.data)
                except (msgspec.ValidationError, msgspec.DecodeError):
                    continue
                item = self.view.put_event(msg.metadata.sequence.stream, msg.subject, ev)
                self._broadcast("bus", item)
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection is going: nothing left to stop
                pass

    async def _push_state(self) -> None:
        """Tell every page the view changed (at most 4 times a second)."""
        seen = -1
        while True:
            await asyncio.sleep(0.25)
            if self.view.version != seen and self.clients:
                seen = self.view.version
                self._broadcast("state", self.view.snapshot())

    def _broadcast(self, kind: str, data: Any) -> None:
        for q in list(self.clients):
            if q.qsize() < 100:  # a stalled page drops updates rather than growing memory
                q.put_nowait((kind, data))

    async def close(self) -> None:
        await cancel_and_wait([self._idle])
        await self._unfollow()
        for sess in self.sessions.values():
            await _close_quietly(sess.nc)

    # ------------------------------------------------------------ actions
    async def login(self, creds_text: str) -> tuple[str, Session]:
        try:
            creds = json.loads(creds_text)
            if not isinstance(creds, dict) or "user" not in creds or not ("nkey_seed" in creds or "password" in creds):
                raise ValueError("needs user and nkey_seed")
        except (ValueError, TypeError) as exc:
            raise Refused(400, f"not a gearshift credentials file: {exc}") from None
        sess = Session(user=str(creds["user"]), role=str(creds.get("role", "")), tenant=creds.get("tenant"), nc=None)
        # only this person's identity: nothing of the dashboard's own may remain in the options
        opts = {"inbox_prefix": "_INBOX", **auth.connect_options(creds)}
        # nats-py retries a refused password until its timeout: the first "Authorization
        # Violation" it reports is the answer
        refused: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_error(exc: Exception) -> None:
            if "authorization violation" in str(exc).lower() and not refused.done():
                refused.set_result(str(exc))
            await sess.on_error(exc)

        connecting = asyncio.create_task(connect(self.url, name=f"dashboard-{sess.user}", retry_for=3,
                                                 error_cb=on_error, **opts))
        done, _ = await asyncio.wait({connecting, refused}, timeout=15, return_when=asyncio.FIRST_COMPLETED)
        if connecting not in done:
            await cancel_and_wait([connecting])
            if not connecting.cancelled() and connecting.exception() is None:  # connected as it was cancelled
                await _close_quietly(connecting.result())
            if refused in done:
                raise Refused(401, "sign-in refused by the server: unknown identity or wrong key")
            raise Refused(504, "the NATS server did not answer the sign-in in time")
        try:
            sess.nc = connecting.result()
        except ServerUnavailable as exc:
            raise Refused(503, str(exc)) from None
        if len(self.sessions) >= MAX_SESSIONS:  # the oldest session goes
            oldest = min(self.sessions, key=lambda k: self.sessions[k].created)
            await _close_quietly(self.sessions.pop(oldest).nc)
        token = secrets.token_urlsafe(24)
        self.sessions[token] = sess
        return token, sess

    async def cancel(self, sess: Session | None, job_id: str) -> dict[str, Any]:
        if sess is None:
            if self.require_login:
                raise Refused(401, "sign in first: actions run with your own credentials")
            nc, tenant = self.nc, None
        else:
            nc, tenant = sess.nc, sess.tenant
        who = sess.user if sess else "anonymous"
        violation: asyncio.Future = asyncio.get_running_loop().create_future()
        if sess is not None:
            sess.violations.append(violation)
        # the bus call itself (the public client is a floor above the services)
        task = asyncio.create_task(call(nc, auth.tenant_subject(subj.ADMISSION_CANCEL, tenant), {"job_id": job_id},
                                        JobRecord))
        try:
            done, _ = await asyncio.wait({task, violation}, timeout=6, return_when=asyncio.FIRST_COMPLETED)
            if violation in done:
                task.cancel()
                raise Refused(403, f"{who} may not cancel jobs ({violation.result()})")
            if task not in done:
                task.cancel()
                raise Refused(504, "admission did not answer in time")
            try:
                rec = task.result()
            except ServiceCallError as exc:
                status = {"404": 404, "403": 403, "409": 409}.get(exc.code, 502)
                raise Refused(status, f"{who}: {exc.message}") from None
        finally:
            if sess is not None:
                sess.violations.remove(violation)
        log.info("cancel from the dashboard", job_id=job_id, user=who, state=rec.state.value)
        return {"job_id": rec.job_id, "state": rec.state.value, "by": who}


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("dashboard feed stopped", task=task.get_name(), error=repr(task.exception()))


async def _close_quietly(nc: Any) -> None:
    try:
        await nc.close()
    except Exception:
        pass


# ------------------------------------------------------------------ HTTP
def make_app(dash: Dashboard) -> web.Application:
    async def index(_req: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def state(_req: web.Request) -> web.Response:
        why = await dash.follow()
        if why is not None:
            return web.json_response({"error": why}, status=503)
        return web.json_response({**dash.view.snapshot(), "require_login": dash.require_login})

    async def stream(req: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        why = await dash.follow()
        if why is not None:
            return web.json_response({"error": why}, status=503)
        await resp.prepare(req)
        q: asyncio.Queue = asyncio.Queue()
        dash.clients.add(q)
        observe.DASH_CLIENTS.set(len(dash.clients))
        try:
            q.put_nowait(("state", dash.view.snapshot()))
            while True:
                try:
                    kind, data = await asyncio.wait_for(q.get(), timeout=15)
                    await resp.write(f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode())
                except asyncio.TimeoutError:
                    await resp.write(b": keep-alive\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            dash.clients.discard(q)
            dash.seen()  # its linger counts from when it left
            observe.DASH_CLIENTS.set(len(dash.clients))
        return resp

    def session_of(req: web.Request) -> Session | None:
        header = req.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            return None
        sess = dash.sessions.get(header.removeprefix("Bearer ").strip())
        if sess is None:
            raise Refused(401, "session expired: sign in again")
        return sess

    def refused(action: str, exc: Refused) -> web.Response:
        observe.DASH_ACTIONS.labels(action, "refused").inc()
        return web.json_response({"ok": False, "error": exc.message}, status=exc.status)

    async def login(req: web.Request) -> web.Response:
        try:
            body = await req.json()
            token, sess = await dash.login(str(body.get("creds", "")) if isinstance(body, dict) else "")
        except json.JSONDecodeError:
            return refused("login", Refused(400, "expected a JSON body {\"creds\": \"...\"}"))
        except Refused as exc:
            return refused("login", exc)
        observe.DASH_ACTIONS.labels("login", "ok").inc()
        return web.json_response({"ok": True, "token": token, "user": sess.user, "role": sess.role,
                                  "tenant": sess.tenant})

    async def cancel(req: web.Request) -> web.Response:
        try:
            job_id = subj.token(req.match_info["job_id"])
            result = await dash.cancel(session_of(req), job_id)
        except ValueError:
            return refused("cancel", Refused(400, "bad job id"))
        except Refused as exc:
            return refused("cancel", exc)
        observe.DASH_ACTIONS.labels("cancel", "ok").inc()
        return web.json_response({"ok": True, **result})

    app = web.Application()
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC)
    app.router.add_get("/api/state", state)
    app.router.add_get("/api/stream", stream)
    app.router.add_post("/api/login", login)
    app.router.add_post("/api/jobs/{job_id}/cancel", cancel)
    return app


async def amain(stop: asyncio.Event, args: DashboardConfig) -> None:
    nc = await connect(args.server, name="gearshift-dashboard")
    obs = await observe.serve_http("dashboard", "dashboard", nc)
    require_login = args.require_login if args.require_login is not None else bool(auth.current_creds())
    dash = await Dashboard(nc, args.server, require_login=require_login).start()
    runner = web.AppRunner(make_app(dash), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    try:
        await site.start()
    except OSError as exc:
        raise observe.MetricsPortBusy(f"dashboard: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}") from None
    host, port = runner.addresses[0][:2]
    page = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/"
    obs.announce(dashboard=page)
    obs.set_ready()
    log.info("dashboard serving", url=page, require_login=require_login)
    await stop.wait()
    await runner.cleanup()
    await dash.close()
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    cfg = load(DashboardConfig, argv)  # flags, GEARSHIFT_DASHBOARD_<FIELD>, --config FILE
    run_service(lambda stop: amain(stop, cfg))


if __name__ == "__main__":
    main()
