"""Allocation writes: ``gs_alloc`` derived from the job records, fenced by
the leader's epoch, many at once with bounded parallelism.

Each allocation is stored under the job id (what the optimizer reconciles
and tools read) and under ``<node>.<job>`` for every node of its placement
(what that node's agent watches; ``services.auth_alloc``). A round's
allocations go out as a few atomic batches, fenced once each
(``write_many``); a single one as concurrent fenced writes. Which copies
exist comes from a materialised view of the bucket, not from a scan per
write. ``reconcile`` makes the bucket agree with the live records every
round, so a crash between a record write and its allocation heals.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any

from gearshift.bus.alloc_watch import node_key
from gearshift.bus.clock import SYSTEM, Clock
from gearshift.bus.views import KvView, Marks
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import ACTIVE_STATES, Allocation, JobRecord, Plan
from gearshift.services.fencing import Fence

DEFAULT_STEP_TIME = 0.1
DEFAULT_PARALLEL = 32
ARRAY_ENV = "GEARSHIFT_ARRAY_INDEX"  # an array element's index (services.dependencies)


def array_env(rec: JobRecord) -> dict[str, str] | None:
    """The job's env as launched: an array element's has its index."""
    if rec.array_index is None:
        return rec.spec.env
    return {**(rec.spec.env or {}), ARRAY_ENV: str(rec.array_index)}


def emulated_step_time(rec: JobRecord, plan: Plan) -> float:
    """Seconds per step for the emulated worker: the spec's step time at its
    requested GPUs, scaled linearly to the plan's GPUs."""
    base = rec.spec.step_time or DEFAULT_STEP_TIME
    return base * rec.spec.gpus / max(1, plan.gpus)


def allocation_for(rec: JobRecord, clock: Clock = SYSTEM) -> Allocation:
    """The allocation ``rec`` implies, stamped ``created_at`` by ``clock``."""
    assert rec.plan is not None
    return Allocation(
        job_id=rec.job_id, generation=rec.generation, plan=rec.plan, placement=rec.placement, reason=rec.reason,
        created_at=clock.now(), command=rec.spec.command, env=array_env(rec),
        step_time=emulated_step_time(rec, rec.plan), steps=rec.spec.steps, global_batch=rec.spec.global_batch,
        grace=rec.spec.checkpoint_grace,
    )


def _decode(data: bytes) -> Allocation | None:
    try:
        return codec.decode(data, Allocation)
    except Exception:
        return None


class AllocView(KvView[Allocation]):
    """``gs_alloc`` with, per job, the node keys holding its copies."""

    def __init__(self, js: Any):
        super().__init__(js, subj.ALLOC_BUCKET, _decode)
        self.copies: dict[str, set[str]] = {}
        self.dirty = Marks()  # jobs whose key or a copy changed since ``reconcile`` last took them
        # node copy key -> the sequence of its delete: an agent whose heartbeat says it acted
        # on that (``NodeReport.alloc_rev``) and runs nothing of the job has none of it left
        self.withdrawn: dict[str, int] = {}

    def changed(self, key: str, old: Allocation | None, new: Allocation) -> None:
        self.dirty.add(key.split(".", 1)[1] if "." in key else key)
        if "." in key:
            self.copies.setdefault(key.split(".", 1)[1], set()).add(key)
            self.withdrawn.pop(key, None)

    def tombstone(self, key: str, seq: int) -> None:
        self.dirty.add(key.split(".", 1)[1] if "." in key else key)
        if "." in key:
            self.withdrawn[key] = seq

    def forget_withdrawn(self, live_jobs: Any) -> None:
        """Drop the deletes of jobs no longer live (no drain of theirs is left to settle)."""
        self.withdrawn = {k: s for k, s in self.withdrawn.items() if k.split(".", 1)[1] in live_jobs}

    def removed(self, key: str, old: Allocation) -> None:
        if "." in key:
            job = key.split(".", 1)[1]
            keys = self.copies.get(job)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self.copies[job]

    def jobs(self) -> dict[str, Allocation]:
        return {k: e[0] for k, e in self.entries.items() if "." not in k}


async def bounded(coros: Iterable[Awaitable[Any]], limit: int = DEFAULT_PARALLEL) -> list[Any]:
    """Run ``coros`` concurrently, at most ``limit`` at a time; the first
    exception is raised once all have ended."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Awaitable[Any]) -> Any:
        async with sem:
            return await c

    results = await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


class AllocWriter:
    def __init__(self, fence: Fence, view: AllocView, *, parallel: int = DEFAULT_PARALLEL, clock: Clock = SYSTEM):
        self.fence = fence
        self.clock = clock
        self.view = view
        self.parallel = parallel
        self.bucket = subj.ALLOC_BUCKET

    def _put_writes(self, rec: JobRecord) -> list[tuple[str, bytes | None]]:
        """The job key, its node copies, and deletes of copies on nodes it left."""
        data = codec.encode(allocation_for(rec, self.clock))
        keep = {node_key(p.node, rec.job_id) for p in rec.placement}
        stale = self.view.copies.get(subj.token(rec.job_id), set()) - keep
        return [(rec.job_id, data), *((k, data) for k in sorted(keep)), *((k, None) for k in sorted(stale))]

    def _delete_writes(self, job_id: str) -> list[tuple[str, bytes | None]]:
        return [(k, None) for k in [job_id, *sorted(self.view.copies.get(subj.token(job_id), set()))]]

    async def _each(self, writes: list[tuple[str, bytes | None]]) -> None:
        await bounded([self.fence.put(self.bucket, k, d) if d is not None else self.fence.delete(self.bucket, k)
                       for k, d in writes], self.parallel)

    async def put(self, rec: JobRecord) -> None:
        await self._each(self._put_writes(rec))

    async def delete(self, job_id: str) -> None:
        await self._each(self._delete_writes(job_id))

    async def write_many(self, puts: list[JobRecord], deletes: list[str], *, most: int = 500) -> None:
        """A round's allocation writes as atomic batches of about ``most`` keys,
        fenced once each (a commit costs the server a disk sync, so one per
        key would cap a round at a few dozen writes a second). One job's keys
        never straddle two batches."""
        jobs = [self._put_writes(r) for r in puts] + [self._delete_writes(j) for j in deletes]
        batch: list[tuple[str, bytes | None]] = []
        for writes in jobs:
            if batch and len(batch) + len(writes) > most:
                await self.fence.batch(self.bucket, batch)
                batch = []
            batch.extend(writes)
        await self.fence.batch(self.bucket, batch)

    async def reconcile(self, live: dict[str, JobRecord], *, copies: bool = True, jobs: set[str] | None = None) -> int:
        """Make ``gs_alloc`` agree with the live records (a lookup per job), and
        with ``copies`` the node copies with the job keys (a pass over every
        key). ``jobs``: look only at these jobs and those whose allocation changed
        since the last look (``AllocView.dirty``): what can disagree since a pass
        that found everything in order (not with ``copies``). Returns the writes made.

        The view is brought up to date first: with ``copies`` by asking the server
        (a stream-info request), else up to this leader's own last acknowledged
        write (``Fence.written``), the bucket's only writer while it leads."""
        if copies:
            await self.view.sync()
        else:
            await self.view.catch_up(self.fence.written.get(self.bucket, 0))
        dirty = self.view.dirty.take()
        if jobs is not None and dirty is not None and not copies:
            return await self._reconcile_some(live, jobs | dirty)
        allocs = self.view.jobs()
        todo: list[Awaitable[Any]] = []
        handled: set[str] = set()  # jobs whose keys and copies are rewritten whole
        for job_id, rec in live.items():
            a = allocs.get(job_id)
            if rec.state in ACTIVE_STATES and not rec.draining:
                if a is None or a.generation != rec.generation:
                    todo.append(self.put(rec))
                    handled.add(subj.token(job_id))
            elif a is not None:
                todo.append(self.delete(job_id))
                handled.add(subj.token(job_id))
        for job_id in allocs.keys() - live.keys():
            todo.append(self.delete(job_id))
            handled.add(subj.token(job_id))
        if not copies:
            await bounded(todo, self.parallel)
            return len(todo)
        self.view.forget_withdrawn({subj.token(j) for j in live})
        # node copies that disagree with their job key
        for key, (alloc, _, _) in list(self.view.entries.items()):
            if "." not in key:
                continue
            node, job = key.split(".", 1)
            if job in handled:
                continue
            a = allocs.get(job)
            if a is None or node not in {subj.token(n) for n in a.nodes()}:
                todo.append(self.fence.delete(self.bucket, key))
            elif alloc.generation != a.generation:
                todo.append(self.fence.put(self.bucket, key, codec.encode(a)))
        for job, a in allocs.items():
            if job in handled:
                continue
            have = self.view.copies.get(job, set())
            for n in a.nodes():
                if node_key(n, job) not in have:
                    todo.append(self.fence.put(self.bucket, node_key(n, job), codec.encode(a)))
        await bounded(todo, self.parallel)
        return len(todo)

    async def _reconcile_some(self, live: dict[str, JobRecord], jobs: set[str]) -> int:
        """``reconcile``'s job-key pass over ``jobs`` only."""
        todo: list[Awaitable[Any]] = []
        for job_id in sorted(jobs):
            rec = live.get(job_id)
            a = self.view.get(job_id)
            if rec is not None and rec.state in ACTIVE_STATES and not rec.draining:
                if a is None or a.generation != rec.generation:
                    todo.append(self.put(rec))
            elif a is not None:
                todo.append(self.delete(job_id))
        await bounded(todo, self.parallel)
        return len(todo)
