"""Job views kept across rounds, by the optimizer (``services.policy_bridge``) and
the simulator (``sim.views``) alike.

A round hands its policy one ``JobView`` per live job. Building every view again
every round is work proportional to the queue, most of it for jobs nothing
happened to. So a view is built (``make_job_view``, by the caller's ``build``) only
when what it was built from changed, which the caller tells by a *token*: the
record object itself live (a new record per KV revision), the record's version in
the simulator. Otherwise the kept view is refreshed in place, only in what moves
with time, exactly as ``make_job_view`` computes it: a running job's steps done and
its attained service (GPU-seconds of ended allocations + the current one's GPUs x
time since it started). A pending job's view does not move.

Keeping the same view objects also lets policies' caches keyed by a view's parts
(``policies.rubick_problem``) hold while nothing changed.

A caller that keeps views can also say so (``RoundJobs``): its list of a round tells
how it follows the one it handed before (the positions gone, the views built anew;
every other view the same object, holding the same), so a policy's per-job columns
(``Carried``) follow it in work proportional to what changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any

import numpy as np
from numba import njit

from gearshift.policies.api import JobView

_PLACEMENT = attrgetter("placement")

Kept = tuple  # (token, moves, attained_before, view, gpus, since): see KeptViews


class KeptViews:
    """job id -> (token, moves, attained_before, view, gpus, since): the view built
    from ``token``; ``moves``: its steps done and attained service move with time (it
    runs); ``gpus``/``since``: its placement's GPUs and ``last_switch_at``, 0/None when
    its attained service does not grow (``attained_service``'s terms, kept)."""

    __slots__ = ("_kept", "get")

    def __init__(self) -> None:
        self._set({})

    def _set(self, kept: dict[str, Kept]) -> None:
        self._kept = kept
        # get(job_id) -> the kept entry of ``job_id`` (see the class), None if none is
        # kept: the dict's own lookup, as callers ask it for every running job every round
        self.get = kept.get

    def view(self, job_id: str, token: Any, now: float, steps_done: float, attained_before: float, moves: bool,
             build: Callable[[], JobView]) -> JobView:
        """The view of ``job_id`` at ``now``: the kept one if it was built from ``token``
        (its steps set to ``steps_done`` and attained service to ``now`` if it moves),
        else ``build()``, kept under ``token``."""
        hit = self._kept.get(job_id)
        if hit is None or not (hit[0] is token or hit[0] == token):
            return self.put(job_id, token, moves, attained_before, build())
        return self.refresh(hit, now, steps_done)

    @staticmethod
    def refresh(hit: Kept, now: float, steps_done: float) -> JobView:
        """A kept view (``get``'s entry) at ``now``: if it moves, its steps are
        ``steps_done`` and its attained service what ``attained_service`` (and so
        ``make_job_view``) computes, bit for bit: the same sum and product."""
        v = hit[3]
        if hit[1]:
            v.steps_done = steps_done
            if hit[5] is not None:
                dt = now - hit[5]
                v.attained_service = hit[2] + hit[4] * (dt if dt > 0.0 else 0.0)
        return v

    def put(self, job_id: str, token: Any, moves: bool, attained_before: float, view: JobView) -> JobView:
        """Keep ``view``, built from ``token``."""
        grows = bool(view.placement) and view.last_switch_at is not None
        self._kept[job_id] = (token, moves, attained_before, view, sum(p.gpus for p in view.placement) if grows else 0,
                              view.last_switch_at if grows else None)
        return view

    def drop(self, job_ids: Iterable[str]) -> None:
        """Forget the views of these jobs."""
        for job_id in job_ids:
            self._kept.pop(job_id, None)

    def keep(self, job_ids: set[str] | dict) -> None:
        """Forget the views of jobs not in ``job_ids`` (ended, archived)."""
        if len(self._kept) > len(job_ids):
            self._set({k: v for k, v in self._kept.items() if k in job_ids})

    def __len__(self) -> int:
        return len(self._kept)


class RoundJobs(list):
    """One round's job views (a list, in the caller's order) that say how they follow
    the list the caller handed the round before (``base``; None: they do not say):
    ``base`` less the jobs at positions ``gone`` (ascending), in ``base``'s order, then
    the jobs that joined; ``fresh``: the positions (ascending) whose view is not the
    object ``base`` had for that job (built anew: it joined, started, stopped or moved),
    the joined ones included. Every other view is the very object ``base`` had, with
    the same spec, placement and plan (its steps done and attained service may have
    moved). The caller drops ``base``'s own ``base``, so no chain of rounds is held."""

    __slots__ = ("base", "gone", "fresh")

    def __init__(self, views: Iterable[JobView] = (), base: RoundJobs | None = None,
                 gone: Sequence[int] = (), fresh: Sequence[int] = ()):
        super().__init__(views)
        self.base = base
        self.gone = gone
        self.fresh = fresh


def follows(jobs: Sequence[JobView], last: object) -> RoundJobs | None:
    """``jobs`` when it says how it follows ``last`` (the list handed the round
    before), else None."""
    return jobs if type(jobs) is RoundJobs and last is not None and jobs.base is last else None


class Carried:
    """Columns by position in a caller's lists of job views, carried from one list
    to the next: ``ids`` (job ids) and ``running`` (1 where the job holds an allocation,
    bytes: ``np.frombuffer`` reads them as booleans).
    ``follow(jobs)``: the fresh positions of ``jobs`` when it follows the last list
    followed (``RoundJobs``), after carrying both (gone rows out, the rest in order,
    fresh rows read from their views); None, with both read from every view, when
    it does not."""

    __slots__ = ("last", "ids", "running", "gone")

    def __init__(self) -> None:
        self.last: Sequence[JobView] | None = None
        self.ids: list[str] = []
        self.running = bytearray()
        self.gone: list[str] = []  # the ids of the jobs gone at the last ``follow`` that followed

    def follow(self, jobs: Sequence[JobView]) -> Sequence[int] | None:
        told = follows(jobs, self.last)
        self.last = jobs
        if told is None:
            self.ids = [j.job_id for j in jobs]
            self.running = bytearray(map(bool, map(_PLACEMENT, jobs)))
            self.gone = []
            return None
        ids, running = self.ids, self.running  # (changed in place)
        self.gone = [ids[p] for p in told.gone]
        for p in reversed(told.gone):
            del ids[p]
            del running[p]
        fresh = told.fresh
        more = len(told) - len(ids)
        ids.extend([""] * more)
        running.extend(bytes(more))
        for p in fresh:
            j = told[p]
            ids[p] = j.job_id
            running[p] = 1 if j.placement else 0
        return fresh


@njit(cache=True)
def split(perm, running):
    """The positions ``perm`` puts in order, split by ``running[position]``: (the running
    ones' positions, in order; their places in the order; the places of the others)."""
    n = len(perm)
    held = np.empty(n, np.int64)
    held_at = np.empty(n, np.int64)
    walk = np.empty(n, np.int64)
    a = b = 0
    for k in range(n):
        i = perm[k]
        if running[i]:
            held[a] = i
            held_at[a] = k
            a += 1
        else:
            walk[b] = k
            b += 1
    return held[:a], held_at[:a], walk[:b]


def carry(column: np.ndarray, jobs: RoundJobs, fill: Any) -> np.ndarray:
    """``column`` (by position in ``jobs.base``) by position in ``jobs``, a new array:
    the gone rows out, the rest in order, the joined rows ``fill``."""
    out = np.empty(len(jobs), column.dtype)
    src = dst = 0
    for g in jobs.gone:  # (the stretches between them, as slices)
        k = g - src
        out[dst:dst + k] = column[src:g]
        dst += k
        src = g + 1
    k = len(column) - src
    out[dst:dst + k] = column[src:]
    out[dst + k:] = fill
    return out
