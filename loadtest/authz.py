"""Authorisation suite: ``python -m loadtest.authz --json``.

Starts a local cluster with authorisation on (real nats-server, admission,
optimizer, perfmodel and two agents, each with its own identity), then
connects as every role and tries every forbidden action we could think of
and every allowed one. A forbidden action counts as refused only if the
server reported a permissions violation for it (or admission answered 403 /
404) *and* it had no effect (no subscriber got the message, the KV value is
unchanged, the job is untouched). An allowed action must work.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import nats
from nats.js.api import ConsumerConfig, DeliverPolicy

from gearshift.bus import alloc_watch, auth
from gearshift.bus.client import ServiceCallError, call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    Allocation,
    JobList,
    JobRecord,
    JobSpec,
    ListRequest,
    ModelSpec,
    NodePlacement,
    Plan,
    SubmitReply,
    SubmitRequest,
)
from gearshift.services import auth_alloc

TENANTS = ["nlp", "vision"]


@dataclass
class Check:
    role: str
    action: str
    expect: str  # "refused" | "allowed"
    ok: bool
    detail: str = ""


class Identity:
    """One connection as one user, recording the server's permission errors."""

    def __init__(self, url: str, creds_path: Path):
        self.url = url
        self.creds = auth.load_creds(creds_path)
        self.errors: list[str] = []
        self.nc: Any = None

    async def __aenter__(self) -> "Identity":
        async def on_error(e: Exception) -> None:
            self.errors.append(str(e).lower())

        self.nc = await nats.connect(self.url, error_cb=on_error, allow_reconnect=False,
                                     **auth.connect_options(self.creds))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.nc.close()

    async def violation(self, kind: str, subject: str, wait: float = 1.0) -> bool:
        needle = f'permissions violation for {kind} to "{subject.lower()}"'
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if any(needle in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


async def arrived(got: list[Any], wait: float = 10.0, resend: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Wait for an allowed message itself, not a fixed time: a loaded machine delivers late.
    With ``resend``, the probe is sent again every half second meanwhile (core NATS has no
    delivery guarantee: one probe lost to a busy moment must not read as a refusal)."""
    deadline = time.monotonic() + wait
    next_send = time.monotonic() + 0.5
    while not got and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
        if resend is not None and not got and time.monotonic() >= next_send:
            await resend()
            next_send = time.monotonic() + 0.5


def spec(tenant: str, name: str) -> JobSpec:
    return JobSpec(name=name, model=ModelSpec(name="m", params=100, layers=4, hidden=256, seq_len=128),
                   global_batch=8, steps=100000, gpus=1, tenant=tenant, step_time=0.05)


class Probes:
    """The suite's state and its probes: is an action refused, and did it change nothing."""

    def __init__(self, url: str, auth_dir: Path):
        self.url = url
        self.dir = auth_dir
        self.checks: list[Check] = []
        self.admin: Any = None

    def ident(self, user: str) -> Identity:
        return Identity(self.url, self.dir / f"{user}.creds")

    def record(self, role: str, action: str, expect: str, ok: bool, detail: str = "") -> None:
        self.checks.append(Check(role, action, expect, bool(ok), detail))

    # ------------------------------------------------------------ probes
    async def refused_publish(self, who: Identity, role: str, subject: str, payload: bytes | None = None) -> None:
        payload = payload or f"forged-{uuid.uuid4().hex}".encode()
        got: list[Any] = []

        async def cb(msg: Any) -> None:
            if msg.data == payload:  # the real publisher of the subject may be busy too
                got.append(msg)

        sub = await self.admin.subscribe(subject, cb=cb)
        await self.admin.flush()
        await who.nc.publish(subject, payload)
        await who.nc.flush()
        refused = await who.violation("publish", subject)
        await asyncio.sleep(0.1)
        await sub.unsubscribe()
        self.record(role, f"publish {subject}", "refused", refused and not got,
                    f"violation={refused} delivered={len(got)}")

    async def refused_subscribe(self, who: Identity, role: str, subject: str, probe: str | None = None) -> None:
        got: list[Any] = []

        async def cb(msg: Any) -> None:
            got.append(msg)

        await who.nc.subscribe(subject, cb=cb)
        await who.nc.flush()
        refused = await who.violation("subscription", subject)
        await self.admin.publish(probe or subject.replace(">", "x").replace("*", "x"), b"secret")
        await self.admin.flush()
        await asyncio.sleep(0.2)
        self.record(role, f"subscribe {subject}", "refused", refused and not got,
                    f"violation={refused} received={len(got)}")

    async def refused_request(self, who: Identity, role: str, subject: str, body: bytes = b"{}",
                              effect: Callable[[], Awaitable[bool]] | None = None) -> None:
        answered = False
        try:
            await who.nc.request(subject, body, timeout=0.5)
            answered = True
        except Exception:
            pass
        refused = await who.violation("publish", subject)
        changed = await effect() if effect else False
        self.record(role, f"request {subject}", "refused", refused and not answered and not changed,
                    f"violation={refused} answered={answered} changed={changed}")

    async def kv_forged(self, bucket: str, key: str, forged: bytes) -> Callable[[], Awaitable[bool]]:
        async def changed() -> bool:
            return await self.kv_value(bucket, key) == forged

        return changed

    async def kv_value(self, bucket: str, key: str) -> bytes | None:
        kv = await self.admin.jetstream().key_value(bucket)
        try:
            return (await kv.get(key)).value
        except Exception:
            return None

    async def refused_kv_put(self, who: Identity, role: str, bucket: str, key: str) -> None:
        forged = f"forged-{uuid.uuid4().hex}".encode()
        subject = f"$KV.{bucket}.{key}"
        await self.refused_request(who, role, subject, forged, await self.kv_forged(bucket, key, forged))


class ClientChecks(Probes):
    """What tenants, outside tools and the dashboard may and may not do."""

    async def tenant_checks(self, jobs: dict[str, str]) -> None:
        role = "tenant-nlp"
        other = jobs["vision"]
        own_sub = lambda verb: f"{subj.ADMISSION}.{verb}.nlp"  # noqa: E731
        async with self.ident("tenant-nlp") as t:
            # allowed
            r = await call(t.nc, own_sub("submit"), SubmitRequest(spec=spec("nlp", "mine"), token="mine"), SubmitReply)
            self.record(role, "submit own job", "allowed", r.job_id is not None, r.job_id)
            rec = await call(t.nc, own_sub("get"), {"job_id": r.job_id}, JobRecord)
            self.record(role, "get own job", "allowed", rec.job_id == r.job_id)
            lst = await call(t.nc, own_sub("list"), ListRequest(), JobList)
            tenants = {j.spec.tenant for j in lst.jobs}
            self.record(role, "list sees only own jobs", "allowed", tenants == {"nlp"}, f"tenants={sorted(tenants)}")
            rec = await call(t.nc, own_sub("cancel"), {"job_id": r.job_id}, JobRecord)
            self.record(role, "cancel own job", "allowed", rec.state.value in ("cancelled", "cancelling"))

            # refused by admission (the subject names the tenant)
            async def refused_call(action: str, subject: str, body: Any, reply: Any, codes: tuple[str, ...]) -> None:
                try:
                    await call(t.nc, subject, body, reply)
                    self.record(role, action, "refused", False, "answered with a result")
                except ServiceCallError as exc:
                    theirs = codec.decode(await self.kv_value(subj.JOBS_BUCKET, other) or b"", JobRecord)
                    forged = [j for j in (await call(self.admin, subj.ADMISSION_LIST, ListRequest(), JobList)).jobs
                              if j.spec.name == "forged"]
                    untouched = theirs.state.value not in ("cancelling", "cancelled") and not forged
                    self.record(role, action, "refused", exc.code in codes and untouched,
                                f"{exc.code}: {exc.message}")

            await refused_call("submit a job of another tenant", own_sub("submit"),
                               SubmitRequest(spec=spec("vision", "forged")), SubmitReply, ("403",))
            await refused_call("get another tenant's job", own_sub("get"), {"job_id": other}, JobRecord, ("404",))
            await refused_call("cancel another tenant's job", own_sub("cancel"), {"job_id": other}, JobRecord, ("404",))
            await refused_call("list another tenant's jobs", own_sub("list"), ListRequest(tenant="vision"), JobList,
                               ("403",))
            # refused by the server
            for verb in ("submit", "get", "cancel", "list"):
                await self.refused_request(t, role, f"{subj.ADMISSION}.{verb}.vision", b"{}")
                await self.refused_request(t, role, f"{subj.ADMISSION}.{verb}", b"{}")
            await self.refused_request(t, role, subj.ADMISSION_NODES)
            await self.refused_request(t, role, subj.OPTIMIZER_ROUND)
            await self.refused_subscribe(t, role, "gs.admission.>", "gs.admission.submit.vision")
            await self.refused_subscribe(t, role, "_INBOX.>", "_INBOX.abc")
            await self.refused_subscribe(t, role, "_INBOX_tenant-vision.>", "_INBOX_tenant-vision.abc")
            await self.refused_subscribe(t, role, "gs.evt.>", "gs.evt.job.x.completed")
            await self.refused_request(t, role, f"$JS.API.CONSUMER.CREATE.{subj.EVENTS_STREAM}")
            await self.refused_request(t, role, f"$JS.API.STREAM.MSG.GET.KV_{subj.JOBS_BUCKET}",
                                       json.dumps({"last_by_subj": f"$KV.{subj.JOBS_BUCKET}.{other}"}).encode())
            await self.refused_kv_put(t, role, subj.JOBS_BUCKET, other)
            await self.refused_request(t, role, "gs.agent.node0.stop", b'{"job_id": "x", "generation": 1}')

    async def tools_checks(self) -> None:
        role = "tools"
        async with self.ident("tools") as o:
            js = o.nc.jetstream()
            n = 0
            try:
                sub = await js.subscribe("gs.evt.>", stream=subj.EVENTS_STREAM, ordered_consumer=True,
                                         deliver_policy=DeliverPolicy.ALL)
                while True:
                    msg = await sub.next_msg(timeout=2)
                    n += 1
                    if msg.metadata.num_pending == 0:
                        break
                await sub.unsubscribe()
            except Exception as exc:
                self.record(role, "replay the event stream", "allowed", False, repr(exc))
            else:
                self.record(role, "replay the event stream", "allowed", n > 0, f"{n} events")
            got: list[Any] = []

            async def cb(msg: Any) -> None:
                got.append(msg)

            await o.nc.subscribe("gs.evt.>", cb=cb)
            await o.nc.flush()
            async def probe() -> None:
                await self.admin.publish("gs.evt.round.probe", b"{}")
                await self.admin.flush()

            await probe()
            await arrived(got, resend=probe)
            self.record(role, "follow live events", "allowed", bool(got))

            await self.refused_request(o, role, "gs.evt.job.jforged.completed", b"{}")
            await self.refused_request(o, role, subj.ADMISSION_SUBMIT, codec.encode(SubmitRequest(spec=spec("nlp", "x"))))
            await self.refused_request(o, role, f"{subj.ADMISSION}.submit.nlp", b"{}")
            await self.refused_request(o, role, subj.ADMISSION_LIST, b"{}")
            await self.refused_request(o, role, subj.OPTIMIZER_ROUND)
            await self.refused_kv_put(o, role, subj.JOBS_BUCKET, "jforged")
            await self.refused_request(o, role, f"$JS.API.STREAM.MSG.GET.KV_{subj.JOBS_BUCKET}",
                                       json.dumps({"seq": 1}).encode())
            await self.refused_request(o, role, f"$JS.API.STREAM.DELETE.{subj.EVENTS_STREAM}")
            await self.refused_request(o, role, f"$JS.API.STREAM.PURGE.{subj.EVENTS_STREAM}")
            await self.refused_request(o, role, f"$JS.API.CONSUMER.CREATE.{subj.REPORTS_STREAM}")
            await self.tools_durable(o, role)
            await self.refused_subscribe(o, role, "gs.agent.>", "gs.agent.node0.stop")
            await self.refused_subscribe(o, role, "gs.report.>", "gs.report.node0.x")
            await self.refused_subscribe(o, role, "_INBOX.>", "_INBOX.abc")
            await self.refused_request(o, role, "gs.agent.node0.stop", b'{"job_id": "x", "generation": 1}')

    async def tools_durable(self, o: Identity, role: str) -> None:
        """A tool may own a durable consumer on the event stream: create it,
        fetch, ack (the server must record the ack), delete it."""
        js = o.nc.jetstream()
        name = "tools-authz"
        try:
            psub = await js.pull_subscribe(subj.EVENTS_SUBJECTS, durable=name, stream=subj.EVENTS_STREAM)
            msgs = await psub.fetch(1, timeout=3)
            for msg in msgs:
                await msg.ack_sync(timeout=3)
            info = await js.consumer_info(subj.EVENTS_STREAM, name)
            ok = bool(msgs) and info.ack_floor is not None and info.ack_floor.stream_seq >= 1
            await js.delete_consumer(subj.EVENTS_STREAM, name)
            self.record(role, "own a durable consumer of the event stream (create, fetch, ack, delete)", "allowed", ok,
                        f"ack_floor={info.ack_floor}")
        except Exception as exc:
            self.record(role, "own a durable consumer of the event stream (create, fetch, ack, delete)", "allowed",
                        False, repr(exc))

    async def dashboard_checks(self, jobs: dict[str, str]) -> None:
        """The dashboard's identity reads what the page shows and nothing else:
        no submit, no cancel (a person's own credentials do that), no KV write."""
        role = "dashboard"
        job = jobs["nlp"]
        async with self.ident("dashboard") as d:
            js = d.nc.jetstream()
            for bucket, key in ((subj.JOBS_BUCKET, job), (subj.NODES_BUCKET, "node0")):
                seen: list[str] = []
                try:
                    watcher = await (await js.key_value(bucket)).watchall()
                    try:
                        deadline = time.monotonic() + 10
                        while time.monotonic() < deadline and key not in seen:
                            try:
                                e = await asyncio.wait_for(watcher.__anext__(), 1)
                            except asyncio.TimeoutError:
                                continue
                            if e is not None:
                                seen.append(e.key)
                    finally:
                        await watcher.stop()
                    self.record(role, f"watch {bucket}", "allowed", key in seen, f"{len(seen)} keys")
                except Exception as exc:
                    self.record(role, f"watch {bucket}", "allowed", False, repr(exc))
            try:
                info = await js.stream_info(subj.EVENTS_STREAM)
                sub = await js.subscribe(subj.EVENTS_SUBJECTS, stream=subj.EVENTS_STREAM, ordered_consumer=True,
                                         config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                               opt_start_seq=max(1, info.state.last_seq)))
                msg = await sub.next_msg(timeout=5)
                await sub.unsubscribe()
                self.record(role, "follow the recent event stream", "allowed",
                            msg.metadata.sequence.stream == info.state.last_seq)
            except Exception as exc:
                self.record(role, "follow the recent event stream", "allowed", False, repr(exc))
            got: list[Any] = []

            async def cb(msg: Any) -> None:
                got.append(msg)

            await d.nc.subscribe("gs.job.*.progress", cb=cb)
            await d.nc.flush()
            await self.admin.publish(f"gs.job.{job}.progress", b"{}")
            await arrived(got)
            self.record(role, "receive live progress", "allowed", bool(got))

            async def untouched() -> bool:  # "changed" when the seeded job was cancelled
                rec = codec.decode(await self.kv_value(subj.JOBS_BUCKET, job) or b"", JobRecord)
                return rec.state.value in ("cancelling", "cancelled")

            await self.refused_request(d, role, subj.ADMISSION_SUBMIT, codec.encode(SubmitRequest(spec=spec("nlp", "x"))))
            await self.refused_request(d, role, f"{subj.ADMISSION}.submit.nlp", b"{}")
            await self.refused_request(d, role, subj.ADMISSION_CANCEL, json.dumps({"job_id": job}).encode(), untouched)
            await self.refused_request(d, role, f"{subj.ADMISSION}.cancel.nlp", json.dumps({"job_id": job}).encode(),
                                       untouched)
            await self.refused_request(d, role, subj.ADMISSION_LIST, b"{}")
            await self.refused_request(d, role, subj.ADMISSION_SET_QUEUE, b"{}")
            await self.refused_request(d, role, subj.OPTIMIZER_ROUND)
            await self.refused_request(d, role, subj.OPTIMIZER_NODE, b'{"node": "node0", "mode": "cordoned"}')
            await self.refused_kv_put(d, role, subj.JOBS_BUCKET, job)
            await self.refused_kv_put(d, role, subj.NODES_BUCKET, "node0")
            await self.refused_kv_put(d, role, subj.ALLOC_BUCKET, "node0.jforged")
            await self.refused_request(d, role, "gs.evt.job.jforged.completed", b"{}")
            await self.refused_request(d, role, f"$JS.API.STREAM.DELETE.{subj.EVENTS_STREAM}")
            await self.refused_request(d, role, f"$JS.API.STREAM.PURGE.KV_{subj.JOBS_BUCKET}")
            await self.refused_request(d, role, f"$JS.API.CONSUMER.DURABLE.CREATE.{subj.EVENTS_STREAM}.spy")
            await self.refused_request(d, role, f"$JS.API.CONSUMER.CREATE.KV_{subj.ALLOC_BUCKET}")
            await self.refused_request(d, role, f"$JS.API.STREAM.MSG.GET.KV_{subj.ALLOC_BUCKET}",
                                       json.dumps({"seq": 1}).encode())
            await self.refused_request(d, role, "gs.agent.node0.stop", b'{"job_id": "x", "generation": 1}')
            await self.refused_subscribe(d, role, "gs.agent.>", "gs.agent.node0.stop")
            await self.refused_subscribe(d, role, "gs.admission.>", "gs.admission.submit.nlp")
            await self.refused_subscribe(d, role, "_INBOX.>", "_INBOX.abc")
            # a durable consumer through the ephemeral subject: the server refuses it and none is made
            durable = {"stream_name": subj.EVENTS_STREAM, "config": {"durable_name": "spy", "ack_policy": "none",
                                                                   "deliver_subject": "_INBOX_dashboard.spy"}}
            reply = await d.nc.request(f"$JS.API.CONSUMER.CREATE.{subj.EVENTS_STREAM}", json.dumps(durable).encode(),
                                       timeout=3)
            try:
                await self.admin.jetstream().consumer_info(subj.EVENTS_STREAM, "spy")
                made = True
            except Exception:
                made = False
            self.record(role, "create a durable consumer on the event stream", "refused",
                        b'"error"' in reply.data and not made, reply.data.decode()[:120])


class Suite(ClientChecks):
    """Every role's checks against one authorised server."""

    # ------------------------------------------------------------ the suite
    async def run(self) -> None:
        self.admin = await nats.connect(self.url, **auth.connect_options(auth.load_creds(self.dir / "admin.creds")))
        try:
            jobs = await self.seed_jobs()
            await self.agent_checks()
            await self.tenant_checks(jobs)
            await self.tools_checks()
            await self.dashboard_checks(jobs)
            await self.service_checks()
        finally:
            await self.admin.close()

    async def seed_jobs(self) -> dict[str, str]:
        out = {}
        for t in TENANTS:
            r = await call(self.admin, subj.ADMISSION_SUBMIT, SubmitRequest(spec=spec(t, f"seed-{t}"), token=f"seed-{t}"),
                           SubmitReply)
            out[t] = r.job_id
        return out

    async def agent_checks(self) -> None:
        role = "agent-node0"
        async with self.ident("agent-node0") as a:
            js = a.nc.jetstream()
            # allowed: its own heartbeat, node key, reports, allocations, commands
            got: list[Any] = []

            async def cb(msg: Any) -> None:
                got.append(msg)

            s = await self.admin.subscribe("gs.node.node0.heartbeat", cb=cb)
            await self.admin.flush()  # the subscription is in place before the probe

            async def beat() -> None:
                await a.nc.publish("gs.node.node0.heartbeat", b"{}")
                await a.nc.flush()

            await beat()
            await arrived(got, resend=beat)
            await s.unsubscribe()
            self.record(role, "publish own heartbeat", "allowed", bool(got))
            kv_nodes = await js.key_value(subj.NODES_BUCKET)
            before = await self.kv_value(subj.NODES_BUCKET, "node0")
            try:
                await kv_nodes.put("node0", before or b"{}")
                self.record(role, "write own gs_nodes key", "allowed", True)
            except Exception as exc:
                self.record(role, "write own gs_nodes key", "allowed", False, repr(exc))
            try:
                ack = await js.publish("gs.report.node0.jauthz", b"not a report", timeout=2)
                self.record(role, "publish own run report", "allowed", ack.stream == subj.REPORTS_STREAM)
            except Exception as exc:
                self.record(role, "publish own run report", "allowed", False, repr(exc))
            alloc = Allocation(job_id="jauthz", generation=1, plan=Plan(dp=1),
                               placement=[NodePlacement(node="node1", gpus=[0], cpus=1)], steps=1)
            admin_alloc = await self.admin.jetstream().key_value(subj.ALLOC_BUCKET)
            # an allocation for node1 only: node0 must not see it; one for node0: it must
            await auth_alloc.put(admin_alloc, "jauthz-other", codec.encode(alloc), ["node1"])
            mine = Allocation(job_id="jauthz-mine", generation=10**6, plan=Plan(dp=1),
                              placement=[NodePlacement(node="node0", gpus=[0], cpus=1)], steps=1,
                              command=["/bin/true"])
            watch = await alloc_watch.node_alloc_watch(js, "node0")
            seen: list[str] = []
            try:
                await auth_alloc.put(admin_alloc, "jauthz-mine", codec.encode(mine), ["node0"])
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and "jauthz-mine" not in seen:
                    try:
                        e = await asyncio.wait_for(watch.__anext__(), 1)
                    except asyncio.TimeoutError:
                        continue
                    if e is not None:
                        seen.append(e.key)
            finally:
                await watch.stop()
                await auth_alloc.delete(admin_alloc, "jauthz-mine")
                await auth_alloc.delete(admin_alloc, "jauthz-other")
            self.record(role, "watch own allocations", "allowed", "jauthz-mine" in seen and "jauthz-other" not in seen,
                        f"seen={seen}")
            got.clear()
            # a command of the bus contract (the real agent answers it too: nothing runs there)
            await a.nc.subscribe("gs.agent.node0.checkpoint", cb=cb)
            await a.nc.flush()
            async def command() -> None:
                await self.admin.publish("gs.agent.node0.checkpoint", b'{"job_id": "jnone", "generation": 1}',
                                         reply=self.admin.new_inbox())
                await self.admin.flush()

            await command()
            await arrived(got, resend=command)
            self.record(role, "receive own commands", "allowed", bool(got))

            # refused
            await self.refused_publish(a, role, "gs.node.node1.heartbeat")
            await self.refused_kv_put(a, role, subj.NODES_BUCKET, "node1")
            await self.refused_request(a, role, "gs.report.node1.jauthz", b"{}")
            await self.refused_subscribe(a, role, "gs.agent.node1.>", "gs.agent.node1.stop")
            await self.refused_subscribe(a, role, "gs.agent.*.stop", "gs.agent.node1.stop")
            await self.refused_subscribe(a, role, "_INBOX.>", "_INBOX.abc")
            await self.refused_subscribe(a, role, "gs.evt.>", "gs.evt.job.x.completed")
            # the allocations of another node, and all of them
            f = f"$KV.{subj.ALLOC_BUCKET}.node1.>"
            api = f"$JS.API.CONSUMER.CREATE.KV_{subj.ALLOC_BUCKET}.spy.{f}"
            await self.refused_request(a, role, api, json.dumps({"stream_name": f"KV_{subj.ALLOC_BUCKET}", "config": {
                "name": "spy", "filter_subject": f, "ack_policy": "none", "deliver_policy": "last_per_subject"}}).encode())
            await self.refused_request(a, role, f"$JS.API.CONSUMER.CREATE.KV_{subj.ALLOC_BUCKET}", json.dumps(
                {"stream_name": f"KV_{subj.ALLOC_BUCKET}", "config": {"ack_policy": "none",
                                                                      "deliver_subject": "_INBOX_agent-node0.x"}}).encode())
            await self.refused_request(a, role, f"$JS.API.STREAM.MSG.GET.KV_{subj.ALLOC_BUCKET}",
                                       json.dumps({"last_by_subj": f"$KV.{subj.ALLOC_BUCKET}.node1.x"}).encode())
            await self.refused_kv_put(a, role, subj.ALLOC_BUCKET, "node0.jforged")
            await self.refused_kv_put(a, role, subj.JOBS_BUCKET, "jforged")
            await self.refused_request(a, role, subj.ADMISSION_SUBMIT,
                                       codec.encode(SubmitRequest(spec=spec("nlp", "forged"))))
            await self.refused_request(a, role, "gs.evt.job.jforged.completed", b"{}")
            await self.refused_request(a, role, f"$JS.API.STREAM.DELETE.{subj.EVENTS_STREAM}")
            await self.refused_request(a, role, "gs.agent.node1.stop", b'{"job_id": "x", "generation": 1}')

    async def service_checks(self) -> None:
        """Each service can do its own job and not another's."""
        async with self.ident("admission") as s:
            kv = await s.nc.jetstream().key_value(subj.JOBS_BUCKET)
            try:
                rev = await kv.create("jauthz-admission", b"{}")
                await kv.delete("jauthz-admission", last=rev)
                self.record("admission", "write gs_jobs", "allowed", True)
            except Exception as exc:
                self.record("admission", "write gs_jobs", "allowed", False, repr(exc))
            await self.refused_kv_put(s, "admission", subj.ALLOC_BUCKET, "node0.jforged")
            await self.refused_kv_put(s, "admission", subj.NODES_BUCKET, "node0")
            await self.refused_request(s, "admission", "gs.report.node0.jforged", b"{}")
            await self.refused_request(s, "admission", "gs.agent.node0.stop", b'{"job_id": "x", "generation": 1}')
        async with self.ident("perfmodel") as s:
            await self.refused_kv_put(s, "perfmodel", subj.JOBS_BUCKET, "jforged")
            await self.refused_kv_put(s, "perfmodel", subj.ALLOC_BUCKET, "node0.jforged")
            await self.refused_request(s, "perfmodel", "gs.agent.node0.stop", b'{"job_id": "x", "generation": 1}')
        async with self.ident("optimizer") as s:
            await self.refused_kv_put(s, "optimizer", subj.NODES_BUCKET, "node0")
            await self.refused_request(s, "optimizer", "gs.report.node0.jforged", b"{}")
            await self.refused_publish(s, "optimizer", "gs.node.node0.heartbeat")


async def run_suite(url: str, auth_dir: Path) -> list[Check]:
    suite = Suite(url, auth_dir)
    await suite.run()
    return suite.checks



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.authz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from gearshift.cluster import LocalCluster

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gs-authz-") as tmp:
        cluster = LocalCluster(nodes=2, gpus_per_node=2, port=-1, data_dir=tmp, auth=True, tenants=TENANTS,
                               interval=1.0, grace=2.0)
        with cluster:
            assert cluster.auth_dir is not None
            checks = asyncio.run(run_suite(cluster.url, cluster.auth_dir.root))
            dead = cluster.check_alive()
            logs = Path(cluster.log_dir or tmp)
            # which process hit which refusal: a service denied its own work is a broken rule, not a passed check
            violation_lines = [f"{f.stem}: {line.strip()[:300]}" for f in sorted(logs.glob("*.log"))
                               for line in f.read_text(errors="replace").splitlines()
                               if "permissions violation" in line.lower()]
            violations_in_services = len(violation_lines)
    refused = [c for c in checks if c.expect == "refused"]
    allowed = [c for c in checks if c.expect == "allowed"]
    summary = dict(
        forbidden_tried=len(refused), forbidden_refused=sum(c.ok for c in refused),
        allowed_tried=len(allowed), allowed_worked=sum(c.ok for c in allowed),
        roles=sorted({c.role for c in checks}), services_died=dead,
        permission_errors_in_service_logs=violations_in_services, permission_errors=violation_lines[:10], duration_s=round(time.monotonic() - t0, 1),
    )
    summary["ok"] = (summary["forbidden_refused"] == len(refused) and summary["allowed_worked"] == len(allowed)
                     and not dead and violations_in_services == 0)
    failures = [c.__dict__ for c in checks if not c.ok]
    if args.json:
        print(json.dumps({"summary": summary, "failures": failures, "checks": [c.__dict__ for c in checks]}, indent=2))
    else:
        for c in checks:
            print(f"{'ok  ' if c.ok else 'FAIL'} {c.role:<12} {c.expect:<8} {c.action}  {c.detail}")
        print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
