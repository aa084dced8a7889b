"""The admission service: submit, cancel, get, list jobs (and list nodes).

Thin by design: decode (the runtime turns bad input into an error reply that
names the field), check the spec against the cluster, write the record with
compare-and-set, its event in the job's outbox. A submit awaits one write,
the record's, and makes no other: the optimizer's leader publishes the event
(``services.outbox``).

Nothing here scans a bucket per request: the capacity, the live jobs per
tenant and the lists come from materialised views (``services.views``) kept
current by KV watches; lists are paged (``services.paging``).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from typing import Annotated, Any, ClassVar

import msgspec

from gearshift.bus import observe
from gearshift.bus.client import connect
from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.config import PosInt, ServiceConfig, defaults, load, option
from gearshift.bus.infra import ensure_infra
from gearshift.bus.log import get_logger
from gearshift.bus.process import run_service
from gearshift.bus.server import Endpoint, RequestError, bad_request, serve
from gearshift.bus.views import JobsView, KvView, NodeCapacity
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobCancelled,
    JobCancelRequested,
    JobList,
    JobRecord,
    JobRef,
    JobSpec,
    JobState,
    JobSubmitted,
    ListRequest,
    NodeList,
    NodeReport,
    QueueList,
    QueueSpec,
    SubmitReply,
    SubmitRequest,
    UsageReply,
    UsageRequest,
)
from gearshift.bus_schema.validate import DEFAULT_MAX_CHECKPOINT_GRACE_S, SpecError, check_spec
from gearshift.policies.queues import ShareConfig
from gearshift.services import dependencies, progress_lines
from gearshift.services.usage import usage as window_usage
from gearshift.services.dependencies import bounded
from gearshift.services.jobstore import JobStore, with_event
from gearshift.services.paging import BadCursor, list_page
from gearshift.services.queues import QueueStore, most_gpus, to_core


class AdmissionConfig(ServiceConfig):
    """gearshift job admission: validates, stores and lists the jobs clients submit."""

    service: ClassVar[str] = "admission"
    max_gpus: Annotated[PosInt | None, option("largest job the cluster could ever hold")] = None
    max_checkpoint_grace: Annotated[float, option(
        "longest checkpoint grace (s, SIGTERM to SIGKILL) a job may ask for")] = DEFAULT_MAX_CHECKPOINT_GRACE_S
    max_jobs_per_tenant: Annotated[PosInt, option(
        "live (not finished) jobs a tenant may have; more are refused with 429",
        env="GEARSHIFT_MAX_JOBS_PER_TENANT")] = 1000


log = get_logger(service="admission")

# a spec without ``tenant`` has this one
DEFAULT_TENANT = next(f.default for f in msgspec.structs.fields(JobSpec) if f.name == "tenant")


def job_id_for(tenant: str, token: str | None) -> str:
    """Deterministic for a client token (idempotent submit), random otherwise."""
    if token is None:
        return "j" + secrets.token_hex(6)
    return "j" + hashlib.sha256(f"{tenant}\0{token}".encode()).hexdigest()[:12]


def same_submission(rec: JobRecord, req: SubmitRequest) -> SubmitReply:
    """The reply to a submit whose token made ``rec`` already (409: another spec)."""
    if rec.spec != req.spec:
        raise RequestError("409", f"token {req.token!r} was used for a different job spec ({rec.job_id})", "token")
    return SubmitReply(job_id=rec.job_id, created=False, state=rec.state)


async def create_record(store: JobStore, job_id: str, req: SubmitRequest, ts: float,
                        after: list, array: int | None) -> SubmitReply | None:
    """Write one new record (an array's element: its index from its id), its
    ``job.submitted`` event in its outbox (the optimizer's leader publishes it:
    ``services.outbox``); None when written, else the reply of the submission
    that got there first."""
    spec = req.spec
    index = int(job_id.rsplit("-", 1)[1]) if array else None
    rec = JobRecord(job_id=job_id, spec=spec, token=req.token, submitted_at=ts, reason="waiting: submitted",
                    after=after, array_index=index)
    rec = with_event(rec, JobSubmitted, ts=ts, name=spec.name, tenant=spec.tenant, gpus=spec.gpus,
                     guaranteed=spec.guaranteed)
    rev = await store.create(rec, flush=False)
    if rev is not None:
        return None
    existing = await store.get(job_id)  # a concurrent submit with the same token won the race
    assert existing is not None
    return same_submission(existing[0], req)


class SpecCheck:
    """A submitted spec against the cluster (``check_spec``): the GPUs it may ask
    for come from the configured maximum or the registered nodes, read by a
    ``NodeCapacity`` (not watched: heartbeats cost the admission nothing). A spec
    refused only for want of capacity is checked again against the nodes read now:
    one may have registered since the last read."""

    def __init__(self, nodes: NodeCapacity, max_gpus: int | None, max_grace: float):
        self.nodes_view = nodes
        self.max_gpus = max_gpus
        self.max_checkpoint_grace = max_grace
        self._refreshing: asyncio.Task | None = None  # a read of the nodes under way

    def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()

    async def check(self, spec: JobSpec) -> None:
        """Raise a 400 naming the field, or return."""
        if self.nodes_view.capacity()[1] is None:  # no node read yet: look again (an empty bucket is one request)
            await self.nodes_view.refresh()
        for fresh in (False, True):
            max_gpus, per_node = self._capacity()
            try:
                check_spec(spec, max_gpus=max_gpus, max_gpus_per_node=per_node, max_grace=self.max_checkpoint_grace)
                return
            except SpecError as err:
                refused = err
            if fresh or not self._fits_without_capacity(spec):
                break
            await self.nodes_view.refresh()
        raise bad_request(f"spec.{refused.field}: {refused.message}", f"spec.{refused.field}")

    def _capacity(self) -> tuple[int | None, int | None]:
        """(most GPUs a job could ever get, GPUs per node) from config and registered nodes."""
        if self.nodes_view.stale() and self._refreshing is None:  # read again, off the request path
            self._refreshing = asyncio.create_task(self._refresh())
        total, per_node = self.nodes_view.capacity()
        if self.max_gpus is not None:
            return self.max_gpus, per_node
        if per_node is None:
            return None, None  # no node has registered yet: nothing to compare with
        return total, per_node

    async def _refresh(self) -> None:
        try:
            await self.nodes_view.refresh()
        except Exception as exc:  # the next stale read tries again
            log.warning("reading the nodes' capacity failed", error=str(exc) or type(exc).__name__)
        finally:
            self._refreshing = None

    def _fits_without_capacity(self, spec: JobSpec) -> bool:
        try:
            check_spec(spec, max_grace=self.max_checkpoint_grace)
        except SpecError:
            return False
        return True


_D = defaults(AdmissionConfig)  # the keyword defaults below are the config's, written once


class Admission:
    def __init__(self, nc: Any, *, max_gpus: int | None = _D.max_gpus, max_jobs_per_tenant: int = _D.max_jobs_per_tenant,
                 clock: Clock = SYSTEM, max_checkpoint_grace: float = _D.max_checkpoint_grace):
        self.nc = nc
        self.clock = clock  # stamps submitted_at / finished_at
        self.store = JobStore(nc)
        self.max_gpus = max_gpus
        self.max_jobs_per_tenant = max_jobs_per_tenant
        self.max_checkpoint_grace = max_checkpoint_grace
        self.jobs_view: JobsView | None = None
        self.nodes_view: NodeCapacity | None = None
        self._created: dict[str, set[str]] = {}  # tenant -> ids created here, not yet in the view
        self.queues = QueueStore(nc)
        # progress lines' lookups, with a short timeout: a server that does not answer (an
        # election) delays a get by at most that, then the record is answered without them
        self._lines_js = nc.jetstream(timeout=progress_lines.LOOKUP_TIMEOUT_S)
        self.queues_view: KvView[QueueSpec] | None = None  # the submit check reads this, not the bucket
        self._share: tuple[int, Any] = (-1, None)  # (view revision, ShareConfig built from it)
        self.check: SpecCheck | None = None  # specs against the cluster (set by open)

    async def open(self) -> "Admission":
        await self.store.open()
        await self.queues.open()
        js = self.nc.jetstream()
        self.jobs_view = await JobsView(js, subj.JOBS_BUCKET).start()
        self.nodes_view = await NodeCapacity(js, subj.NODES_BUCKET).start()  # GPU counts, read when needed
        self.check = SpecCheck(self.nodes_view, self.max_gpus, self.max_checkpoint_grace)
        self.queues_view = await KvView(js, subj.QUEUES_BUCKET, lambda b: codec.decode(b, QueueSpec),
                                        skip=lambda k: k.startswith("_") or "." in k).start()
        return self

    async def close(self) -> None:
        if self.check is not None:
            self.check.close()
        for view in (self.jobs_view, self.nodes_view, self.queues_view):
            if view is not None:
                await view.stop()

    async def with_live(self, records: list[JobRecord]) -> list[JobRecord]:
        """The records, the running ones with their latest progress line (``GS_PROGRESS``)."""
        return await progress_lines.with_live(self._lines_js, records)

    async def _one_live(self, rec: JobRecord) -> JobRecord:
        return (await self.with_live([rec]))[0]

    async def nodes(self) -> list[NodeReport]:
        assert self.nodes_view is not None
        return sorted(await self.nodes_view.reports(), key=lambda n: n.node)

    def _live_count(self, tenant: str) -> int:
        """Live jobs of ``tenant``: the view's counter, plus those created here
        that the view has not seen yet (a burst of submits cannot slip past)."""
        assert self.jobs_view is not None
        mine = self._created.get(tenant)
        if mine:
            mine -= {j for j in mine if j in self.jobs_view.entries}
        return self.jobs_view.tenant_live[tenant] + len(mine or ())

    # ------------------------------------------------------------ endpoints
    async def submit(self, req: SubmitRequest) -> SubmitReply:
        spec = req.spec
        assert self.check is not None
        await self.check.check(spec)
        await self._check_quota(spec)
        job_id = job_id_for(spec.tenant, req.token)
        ids = dependencies.array_ids(job_id, spec.array) if spec.array else [job_id]
        if req.token is not None:
            existing = await self.store.get(ids[0])
            if existing is not None:
                if spec.array is None:
                    return same_submission(existing[0], req)
                same_submission(existing[0], req)  # 409 if the token was used for another spec
                ids = [j for j, got in zip(ids, await bounded([self.store.get(j) for j in ids], 32)) if got is None]
                if not ids:  # a retry of a complete array
                    return SubmitReply(job_id=job_id, created=False, state=JobState.PENDING, array=spec.array)
        after = []
        if spec.after:
            try:  # the view first, then gs_jobs and the history store by key (no scan)
                after = await dependencies.check_after(spec, job_id, ids, dependencies.finder(self.jobs_view, self.store))
            except SpecError as err:
                raise bad_request(f"spec.{err.field}: {err.message}", f"spec.{err.field}") from None
        live = self._live_count(spec.tenant)
        if live + len(ids) > self.max_jobs_per_tenant:
            raise RequestError("429", f"tenant {spec.tenant} has {live} live jobs, the limit is "
                               f"{self.max_jobs_per_tenant}", "spec.tenant")
        # counted before the first await: submits run concurrently, and a burst
        # must not slip past the limit between the check and the write
        mine = self._created.setdefault(spec.tenant, set())
        fresh = [j for j in ids if j not in mine]
        mine.update(ids)
        ts = self.clock.now()
        try:
            made = await bounded([create_record(self.store, j, req, ts, after, spec.array) for j in ids], 32)
        except BaseException:
            mine.difference_update(fresh)
            raise
        if spec.array is None and made[0] is not None:
            return made[0]  # a concurrent submit with the same token won the race
        log.info("job submitted", job_id=job_id, name=spec.name, gpus=spec.gpus, tenant=spec.tenant,
                 array=spec.array, after=len(after))
        return SubmitReply(job_id=job_id, created=True, state=JobState.PENDING, array=spec.array or 0)

    async def cancel(self, ref: JobRef) -> JobRecord:
        got = await self.store.get(ref.job_id)
        if got is None:
            raise RequestError("404", f"no job {ref.job_id}", "job_id")
        conflict: list[str] = []

        def change(rec: JobRecord) -> JobRecord | None:
            ts = self.clock.now()
            if rec.terminal:
                conflict.append(f"job {rec.job_id} is already {rec.state.value}")
                return None
            if rec.state == JobState.CANCELLING:
                return None
            if rec.state == JobState.PENDING:
                rec = msgspec.structs.replace(rec, state=JobState.CANCELLED, finished_at=ts, reason="cancelled by user",
                                              cascade=ref.cascade)
                return with_event(rec, JobCancelled, ts=ts)
            rec = msgspec.structs.replace(rec, state=JobState.CANCELLING, reason="cancel requested: stopping",
                                          cascade=ref.cascade)
            return with_event(rec, JobCancelRequested, ts=ts)

        new = await self.store.update(ref.job_id, change)
        if conflict:
            raise RequestError("409", conflict[0], "job_id")
        if new is None:  # already cancelling
            got = await self.store.get(ref.job_id)
            assert got is not None
            new = got[0]
        else:
            # Wake the optimizer so the processes stop now, not at the next tick.
            await self.nc.publish(subj.OPTIMIZER_KICK, b"")
        log.info("job cancel", job_id=ref.job_id, state=new.state.value)
        return new

    async def get(self, ref: JobRef) -> JobRecord:
        got = await self.store.get(ref.job_id)
        if got is None:
            raise RequestError("404", f"no job {ref.job_id}", "job_id")
        return await self._one_live(got[0])

    async def list(self, req: ListRequest) -> JobList:
        states = set(req.states or [])
        known = {s.value for s in JobState}
        bad = states - known
        if bad:
            raise bad_request(f"unknown state(s) {sorted(bad)}; known: {sorted(known)}", "states")
        assert self.jobs_view is not None
        await self.jobs_view.sync()  # a list right after a submit shows it
        try:
            jobs, cursor = await list_page(self.nc.jetstream(), self.jobs_view, req)
        except BadCursor as err:
            raise bad_request(str(err), "cursor") from None
        return JobList(jobs=await self.with_live(jobs), next_cursor=cursor)

    async def usage(self, req: UsageRequest) -> UsageReply:
        if req.until is not None and req.until < req.since:
            raise bad_request(f"until ({req.until:.0f}) is before since ({req.since:.0f})", "until")
        return await window_usage(self.nc.jetstream(), self.jobs_view, req, self.clock.now())

    async def usage_as(self, req: UsageRequest, subject: str) -> UsageReply:
        tenant = self._tenant_of(subject)
        if req.tenant not in (None, tenant):
            raise RequestError("403", f"tenant {tenant} may not see the usage of tenant {req.tenant}", "tenant")
        return await self.usage(msgspec.structs.replace(req, tenant=tenant))

    async def list_nodes(self, _: None) -> NodeList:
        return NodeList(nodes=await self.nodes())

    # ------------------------------------------------------------ tenant queues (issue 13)
    async def _check_quota(self, spec) -> None:
        """Admit only jobs their tenant's quota (+ what its cohort could lend) can ever hold."""
        most = most_gpus(self._share_config(), spec.tenant)
        if most is not None and spec.gpus > most:
            raise bad_request(f"spec.gpus: {spec.gpus} GPUs is more than tenant {spec.tenant} can ever hold "
                              f"(quota + what its cohort can lend = {most})", "spec.gpus")

    def _share_config(self) -> Any:
        """The tenant queues from the view, rebuilt only when the bucket changed."""

        assert self.queues_view is not None
        rev, cfg = self._share
        if rev != self.queues_view.revision or cfg is None:
            cfg = ShareConfig()
            for q in sorted(self.queues_view.values(), key=lambda q: q.tenant):
                cfg = cfg.with_queue(to_core(q))
            self._share = (self.queues_view.revision, cfg)
        return cfg

    async def get_queues(self, _: None) -> QueueList:
        return QueueList(queues=await self.queues.all())

    async def set_queue(self, q: QueueSpec) -> QueueList:
        await self.queues.put(q)
        assert self.queues_view is not None
        await self.queues_view.sync()  # the next submit is checked against it
        log.info("queue set", tenant=q.tenant, quota=q.quota, weight=q.weight, cohort=q.cohort)
        await self.nc.publish(subj.OPTIMIZER + ".kick", b"")
        return QueueList(queues=await self.queues.all())

    # ------------------------------------------------------------ tenant endpoints
    # ``gs.admission.<verb>.<tenant>``: with authorisation on, the server lets
    # only that tenant's user (and the admin) publish there, so the last token
    # says who asks. A job of another tenant reads as absent (no leak of ids).
    @staticmethod
    def _tenant_of(subject: str) -> str:
        return subject.rsplit(".", 1)[1]

    async def _own(self, job_id: str, tenant: str) -> JobRecord:
        got = await self.store.get(job_id)
        if got is None or got[0].spec.tenant != tenant:
            raise RequestError("404", f"no job {job_id}", "job_id")
        return await self._one_live(got[0])

    async def submit_as(self, req: SubmitRequest, subject: str) -> SubmitReply:
        tenant = self._tenant_of(subject)
        if req.spec.tenant == DEFAULT_TENANT and tenant != DEFAULT_TENANT:
            # a tenant's spec without ``tenant`` (the default) is its own job
            req = msgspec.structs.replace(req, spec=msgspec.structs.replace(req.spec, tenant=tenant))
        if req.spec.tenant != tenant:
            raise RequestError("403", f"tenant {tenant} may not submit jobs of tenant {req.spec.tenant}", "spec.tenant")
        return await self.submit(req)

    async def get_as(self, ref: JobRef, subject: str) -> JobRecord:
        return await self._own(ref.job_id, self._tenant_of(subject))

    async def cancel_as(self, ref: JobRef, subject: str) -> JobRecord:
        await self._own(ref.job_id, self._tenant_of(subject))
        return await self.cancel(ref)

    async def list_as(self, req: ListRequest, subject: str) -> JobList:
        tenant = self._tenant_of(subject)
        if req.tenant not in (None, tenant):
            raise RequestError("403", f"tenant {tenant} may not list jobs of tenant {req.tenant}", "tenant")
        return await self.list(msgspec.structs.replace(req, tenant=tenant))

    def endpoints(self) -> list[Endpoint]:
        return [
            Endpoint("submit", subj.ADMISSION_SUBMIT, SubmitRequest, self.submit, concurrent=True),
            Endpoint("cancel", subj.ADMISSION_CANCEL, JobRef, self.cancel),
            Endpoint("get", subj.ADMISSION_GET, JobRef, self.get),
            Endpoint("list", subj.ADMISSION_LIST, ListRequest, self.list),
            Endpoint("nodes", subj.ADMISSION_NODES, None, self.list_nodes),
            Endpoint("usage", subj.ADMISSION_USAGE, UsageRequest, self.usage),
            Endpoint("usage-tenant", subj.ADMISSION_USAGE + ".*", UsageRequest, self.usage_as, with_subject=True),
            Endpoint("queues", subj.ADMISSION_QUEUES, None, self.get_queues),
            Endpoint("setqueue", subj.ADMISSION_SET_QUEUE, QueueSpec, self.set_queue),
            Endpoint("submit-tenant", subj.ADMISSION_SUBMIT + ".*", SubmitRequest, self.submit_as, with_subject=True,
                     concurrent=True),
            Endpoint("cancel-tenant", subj.ADMISSION_CANCEL + ".*", JobRef, self.cancel_as, with_subject=True),
            Endpoint("get-tenant", subj.ADMISSION_GET + ".*", JobRef, self.get_as, with_subject=True),
            Endpoint("list-tenant", subj.ADMISSION_LIST + ".*", ListRequest, self.list_as, with_subject=True),
        ]


async def start_admission(nc: Any, **options: Any) -> tuple[Admission, Any]:
    await ensure_infra(nc)
    adm = await Admission(nc, **options).open()
    svc = await serve(nc, "admission", adm.endpoints(), "gearshift job admission")
    return adm, svc


async def amain(stop: asyncio.Event, url: str | None = None, max_gpus: int | None = _D.max_gpus,
                max_jobs_per_tenant: int = _D.max_jobs_per_tenant,
                max_checkpoint_grace: float = _D.max_checkpoint_grace) -> None:
    nc = await connect(url, name="gearshift-admission")
    obs = await observe.serve_http("admission", "admission", nc)
    adm, svc = await start_admission(nc, max_gpus=max_gpus, max_jobs_per_tenant=max_jobs_per_tenant,
                                     max_checkpoint_grace=max_checkpoint_grace)
    obs.set_ready()
    log.info("admission ready", url=nc.connected_url.geturl() if nc.connected_url else url)
    await stop.wait()
    await svc.stop()
    await adm.close()
    await obs.close()
    await nc.drain()


def main(argv: list[str] | None = None) -> None:
    cfg = load(AdmissionConfig, argv)  # flags, GEARSHIFT_ADMISSION_<FIELD>, --config FILE
    run_service(lambda stop: amain(stop, cfg.server, cfg.max_gpus, cfg.max_jobs_per_tenant, cfg.max_checkpoint_grace))


if __name__ == "__main__":
    main()
