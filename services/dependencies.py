"""Job dependencies (``spec.after``) and arrays (``spec.array``).

A job may wait for others of its tenant (Slurm's ``--dependency``): each
``Dependency`` names a job submitted before it and how that job must end
(``completed``, ``failed``, or ``finished``: any end). Admission checks the
names at submit (``check_after``): unknown ids, other tenants' jobs and cycles
are refused with the field named, and a dependency on an array (its id
prefix) becomes one on each element (``JobRecord.after``).

The optimizer's round gates the waiting jobs (``DependencyGate``): a pending
job whose ``after`` is not all met is not handed to the policy, and explain
says what it waits for. Each round judges every unmet dependency from the
parent's record (the jobs view, else ``gs_jobs`` / the history store by key:
one read per edge, once, since the verdict is written) and writes the
verdict into the dependent's record: ``after_met`` grows, or the job is
cancelled with the reason when a parent ended otherwise. The state lives in
the records, not in a callback: a new leader recomputes the same verdicts,
and a verdict written twice is the same write (the change is a function of
the record and the parents' ends).

Cancel cascades: a job cancelled with ``cascade`` (the default) carries the
flag, and its dependents are cancelled whatever their condition, with it set
in turn, so the whole subtree goes. Without it the dependents are judged by
their condition (a cancelled job is ``finished``, neither ``completed`` nor
``failed``). A job cancelled because a dependency broke carries ``cascade``
too: a pipeline broken upstream stops; an ``on: finished`` stage after a
stage that never ran does not run either.

An array submit creates ``<id>-0`` .. ``<id>-<N-1>``, the same spec and an
``array_index`` each; the agent gets it as ``GEARSHIFT_ARRAY_INDEX``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from gearshift.bus_schema.messages import (
    MAX_ARRAY,
    DependOn,
    Dependency,
    JobCancelled,
    JobRecord,
    JobSpec,
    JobState,
)
from gearshift.bus_schema.validate import SpecError
from gearshift.services.alloc_writer import ARRAY_ENV, array_env, bounded  # noqa: F401 (one home for the env)
from gearshift.services.jobstore import with_event

SHOWN = 4  # dependencies a waiting reason names (then "+N more")
MAX_WALK = 10_000  # ancestors the cycle check follows


def array_ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i}" for i in range(n)]


# ------------------------------------------------------------------ verdicts (pure)
MET, WAIT, BROKEN = "met", "wait", "broken"


def verdict(dep: Dependency, parent: JobRecord | None) -> str:
    """Is ``dep`` met by ``parent`` as it is now (None: no such job any more)?"""
    if parent is None:
        return BROKEN
    if not parent.terminal:
        return WAIT
    if parent.state == JobState.CANCELLED and parent.cascade:
        return BROKEN
    if dep.on == DependOn.FINISHED:
        return MET
    if dep.on == DependOn.COMPLETED:
        return MET if parent.state == JobState.COMPLETED else BROKEN
    return MET if parent.state == JobState.FAILED else BROKEN


def broken_reason(dep: Dependency, parent: JobRecord | None) -> str:
    if parent is None:
        return f"cancelled: dependency {dep.job} is no longer known"
    if parent.state == JobState.CANCELLED and parent.cascade:
        return f"cancelled: dependency {dep.job} was cancelled"
    return f"cancelled: dependency {dep.job} ended {parent.state.value}, needed {dep.on.value}"


def resolve(rec: JobRecord, parents: dict[str, JobRecord | None], ts: float) -> JobRecord | None:
    """The record with the verdicts on its unmet dependencies whose parent is
    in ``parents``: those met added to ``after_met``, or CANCELLED (reason,
    cascade) when one broke. None: nothing to write."""
    if not rec.waits_on_dependencies:
        return None
    met = set(rec.after_met)
    newly: list[str] = []
    for dep in rec.after:
        if dep.job in met or dep.job not in parents:
            continue
        parent = parents[dep.job]
        v = verdict(dep, parent)
        if v == BROKEN:
            why = broken_reason(dep, parent)
            new = msgspec.structs.replace(rec, state=JobState.CANCELLED, finished_at=ts, reason=why, cascade=True,
                                          after_met=[*rec.after_met, *newly])
            return with_event(new, JobCancelled, ts=ts, reason=why)
        if v == MET:
            newly.append(dep.job)
            met.add(dep.job)
    if not newly:
        return None
    return msgspec.structs.replace(rec, after_met=[*rec.after_met, *newly])


def waiting_reason(rec: JobRecord, parents: dict[str, JobRecord | None]) -> str:
    """What ``gearshift explain`` says of a job that waits on dependencies."""
    met = set(rec.after_met)
    todo = [d for d in rec.after if d.job not in met]
    parts = []
    for d in todo[:SHOWN]:
        p = parents.get(d.job)
        parts.append(f"{d.job} ({p.state.value if p is not None else '?'}; needs {d.on.value})")
    more = f", +{len(todo) - SHOWN} more" if len(todo) > SHOWN else ""
    return f"waiting for dependencies: {', '.join(parts)}{more}"


# ------------------------------------------------------------------ submit checks
Find = Callable[[str], Awaitable[JobRecord | None]]


def finder(view: Any, store: Any) -> Find:
    """A job's record: the jobs view's, else gs_jobs' or the history store's by key."""

    async def find(job: str) -> JobRecord | None:
        rec = view.get(job)
        if rec is not None:
            return rec
        got = await store.get(job)
        return None if got is None else got[0]

    return find


async def check_after(spec: JobSpec, job_id: str, own_ids: list[str], find: Find) -> list[Dependency]:
    """``spec.after`` with arrays expanded to their elements; SpecError naming
    the first bad field: an unknown id or another tenant's job (the same words:
    another tenant's ids do not leak), the job itself (``job_id``, an array's
    prefix, or one of ``own_ids``), or a cycle."""
    own = {job_id, *own_ids}
    out: list[Dependency] = []
    seen: set[str] = set()
    for i, dep in enumerate(spec.after or []):
        field = f"after[{i}].job"
        if dep.job in own:
            raise SpecError(field, f"cycle: job {dep.job} is this submission itself")
        parent = await find(dep.job)
        if parent is None:
            ids = await _array_elements(dep.job, spec.tenant, find)
            if ids is None:
                raise SpecError(field, f"no job {dep.job} of tenant {spec.tenant}")
        elif parent.spec.tenant != spec.tenant:
            raise SpecError(field, f"no job {dep.job} of tenant {spec.tenant}")
        else:
            ids = [dep.job]
        for job in ids:
            if job not in seen:
                seen.add(job)
                out.append(Dependency(job=job, on=dep.on))
    if len(out) > MAX_ARRAY:
        raise SpecError("after", f"{len(out)} dependencies (arrays expanded); at most {MAX_ARRAY}")
    await _check_acyclic(out, own, find)
    return out


async def _array_elements(prefix: str, tenant: str, find: Find) -> list[str] | None:
    """The element ids of array ``prefix`` of ``tenant``, or None if it is none."""
    first = await find(f"{prefix}-0")
    if first is None or first.array_index != 0 or not first.spec.array or first.spec.tenant != tenant:
        return None
    return array_ids(prefix, first.spec.array)


async def _check_acyclic(deps: list[Dependency], own: set[str], find: Find) -> None:
    """No ancestor of the new jobs is one of them. Parents exist before their
    dependents, so only an id reused across its retention could close a
    cycle; the walk follows live ancestors only (an ended job waits on nothing)."""
    todo = [d.job for d in deps]
    seen: set[str] = set()
    while todo and len(seen) < MAX_WALK:
        job = todo.pop()
        if job in seen:
            continue
        seen.add(job)
        if job in own:
            raise SpecError("after", f"cycle: {job} waits, through its dependencies, on this submission")
        rec = await find(job)
        if rec is not None and not rec.terminal:
            todo.extend(d.job for d in rec.after if d.job not in seen)


# ------------------------------------------------------------------ the round's gate
class DependencyGate:
    """Each round: the verdicts on waiting jobs' dependencies written into their
    records (``resolve``), and the jobs still waiting with their reasons
    (``blocked``), which the round keeps from its policy."""

    def __init__(self, store: Any, entries: dict[str, Any], hint: Callable[[str], Any], clock: Any, parallel: int = 32):
        self.store = store
        self.entries = entries  # the jobs view's (record, revision, ts) per id in gs_jobs
        self.hint = hint
        self.clock = clock
        self.parallel = parallel
        self.blocked: dict[str, str] = {}
        self.history_reads = 0  # parents read by key because the view no longer had them

    async def _parent(self, job_id: str) -> JobRecord | None:
        e = self.entries.get(job_id)
        if e is not None:
            return e[0]
        self.history_reads += 1
        got = await self.store.get(job_id)  # gs_jobs (a view behind), else the history store
        return None if got is None else got[0]

    async def gate(self, records: dict[str, JobRecord], candidates: Any = None) -> int:
        """Write the verdicts; keep ``records`` current; return how many changed.
        ``candidates``: the jobs that may wait on dependencies (None: every record is looked at)."""
        recs = records.values() if candidates is None else [records[j] for j in sorted(candidates) if j in records]
        waiting = [r for r in recs if r.after and r.waits_on_dependencies]
        self.blocked = {}
        if not waiting:
            return 0
        parents: dict[str, JobRecord | None] = {}
        for rec in waiting:
            met = set(rec.after_met)
            for d in rec.after:
                if d.job not in met and d.job not in parents:
                    parents[d.job] = await self._parent(d.job)
        ts = self.clock.now()
        todo = [r for r in waiting if resolve(r, parents, ts) is not None]
        got = await bounded([self.store.update(r.job_id, lambda x: resolve(x, parents, ts), hint=self.hint(r.job_id))
                             for r in todo], self.parallel)
        for new in got:
            if new is not None:
                records[new.job_id] = new
        for rec in waiting:
            rec = records[rec.job_id]
            if rec.waits_on_dependencies:
                self.blocked[rec.job_id] = waiting_reason(rec, parents)
        return sum(1 for g in got if g is not None)
