"""A small async client over the bus, used by the CLI, the demo and tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from nats.js.api import DeliverPolicy

from bus_schema import codec, subjects as subj
from bus_schema.messages import (
    JobList, JobRecord, JobSpec, ListRequest, NodeList, SubmitReply, SubmitRequest,
)
from bus_schema.validate import SpecError, check_spec
from services.auth import current_creds, tenant_subject
from services.runtime import call, connect


class SpecFileError(ValueError):
    pass


def load_spec(path: str | Path) -> JobSpec:
    """Read a JSON or YAML job spec; errors name the field and the problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise SpecFileError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        if p.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = msgspec.json.decode(text)
    except Exception as exc:
        raise SpecFileError(f"{path}: not valid {'YAML' if p.suffix in ('.yaml', '.yml') else 'JSON'}: {exc}") from None
    try:
        spec = msgspec.convert(data, JobSpec)
    except msgspec.ValidationError as exc:
        field = codec.error_field(exc)
        raise SpecFileError(f"{path}: {field or 'spec'}: {exc}") from None
    try:
        check_spec(spec)
    except SpecError as exc:
        raise SpecFileError(f"{path}: {exc.field}: {exc.message}") from None
    return spec


class Client:
    def __init__(self, nc: Any, timeout: float = 5.0, tenant: str | None = None):
        self.nc = nc
        self.timeout = timeout
        # a tenant identity asks on gs.admission.<verb>.<tenant> (services.auth)
        self.tenant = tenant

    @classmethod
    async def connect(cls, url: str | None = None, retry_for: float = 3.0) -> "Client":
        tenant = current_creds().get("tenant")
        return cls(await connect(url, name="gearshift-cli", retry_for=retry_for), tenant=tenant)

    def _subject(self, subject: str) -> str:
        return tenant_subject(subject, self.tenant)

    async def close(self) -> None:
        await self.nc.drain()

    async def submit(self, spec: JobSpec, token: str | None = None) -> SubmitReply:
        return await call(self.nc, self._subject(subj.ADMISSION_SUBMIT), SubmitRequest(spec=spec, token=token),
                          SubmitReply, self.timeout)

    async def jobs(self, tenant: str | None = None, **filters: Any) -> list[JobRecord]:
        """Every job that matches, page after page (``filters``: states, node,
        all, limit = page size; see ListRequest)."""
        out: list[JobRecord] = []
        async for page in self.job_pages(tenant=tenant, **filters):
            out.extend(page)
        return out

    async def job_pages(self, tenant: str | None = None, **filters: Any) -> AsyncIterator[list[JobRecord]]:
        cursor = None
        while True:
            req = ListRequest(tenant=tenant, cursor=cursor, **filters)
            got = await call(self.nc, self._subject(subj.ADMISSION_LIST), req, JobList, self.timeout)
            yield got.jobs
            if got.next_cursor is None:
                return
            cursor = got.next_cursor

    async def job(self, job_id: str) -> JobRecord:
        return await call(self.nc, self._subject(subj.ADMISSION_GET), {"job_id": job_id}, JobRecord, self.timeout)

    async def cancel(self, job_id: str) -> JobRecord:
        return await call(self.nc, self._subject(subj.ADMISSION_CANCEL), {"job_id": job_id}, JobRecord, self.timeout)

    async def nodes(self) -> NodeList:
        return await call(self.nc, subj.ADMISSION_NODES, None, NodeList, self.timeout)

    async def events(self, follow: bool = False, subject: str = subj.EVENTS_SUBJECTS) -> AsyncIterator[tuple[str, int, Any]]:
        """(subject, stream sequence, event) from the start of the stream; with
        ``follow`` keeps waiting for new ones, else stops once caught up."""
        js = self.nc.jetstream()
        info = await js.stream_info(subj.EVENTS_STREAM)
        if info.state.messages == 0 and not follow:
            return
        sub = await js.subscribe(subject, stream=subj.EVENTS_STREAM, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
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
            await sub.unsubscribe()
