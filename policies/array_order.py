"""SRTF's order for a whole round at once, on arrays (issue 22, the simulator fast).

SRTF's key, ``(-class, seconds left, submitted at, job id)``, is asked for every live
job in every round. As Python tuples that is a tuple per job and a sort of tuples,
about a third of a Blox load-8 SRTF round. Here:

- ``SpecRows``: each spec's numbers (its class, steps, and the factor and divisor of
  its seconds left) as a column of a float array, made once per spec and found again
  along the last round's list (``follow``) or by ``id(spec)`` (the key
  ``ordering.RequestSpeeds`` remembers speeds by; the specs are held, so an id seen
  stays that object's), so a round makes columns only for the specs it has not seen;
- ``srtf_order``: one numba kernel computes every job's seconds left (the same scalar
  expressions as ``ordering.SrtfKey.many_by_class``, in the same order, compiled
  without fast-math: the same IEEE results), sorts by class and seconds left (one
  stable merge sort, ``_merge_order``) and finds the runs of jobs equal in both;
- ``break_ties``: each run (about one job in 150 in Blox load 8) in (submitted at,
  job id) order, reading only those jobs' submission times. Tuples compare their
  later parts only where the earlier ones are equal, so the result is exactly
  ``sorted`` on the tuples.

A NaN in seconds left, or in a submission time the order compares (Python's sort has
no order to agree with there), and the caller sorts the tuples itself. Pure: numpy and numba.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np
from numba import njit

from gearshift.policies.views import carry, follows

_SPEC = attrgetter("spec")
_NO_IDS = np.empty(0, np.int64)


class SpecRows:
    """Columns of per-spec numbers (``rows``: width x capacity), one per spec seen.

    ``at(jobs, make, owner)``: the column of each job's spec, ``make(i)`` called for a
    spec not seen before. ``owner``: what the columns were made under (the speeds'
    memo, new when the oracle's answers change); another owner and all are made
    again, as when the specs held outgrow the list asked about.

    A round's list is mostly the last one's with some jobs gone and some appended
    (live jobs in arrival order, in the simulator and the optimizer alike). When it
    says so (``policies.views.RoundJobs``) the last list's columns are carried, and
    only the views it names fresh are looked up; otherwise the columns are followed
    along the last round's list (``follow``, one pass on the spec ids), and only the
    specs it does not find are looked up by id. The specs are held, so an id seen
    stays that object's."""

    __slots__ = ("width", "rows", "_owner", "_index", "_held", "_last_ids", "_last_at", "_last_jobs", "told")

    def __init__(self, width: int):
        self.width = width
        self._owner: object = None
        self._reset()

    def _reset(self) -> None:
        self.rows = np.empty((self.width, 256))
        self._index: dict[int, int] = {}  # id(spec) -> column
        self._held: list = []  # the specs, by column
        self._last_ids = np.empty(0, np.int64)
        self._last_at = np.empty(0, np.intp)
        self._last_jobs: Sequence | None = None
        self.told = None

    def at(self, jobs: Sequence, make: Callable[[int], Sequence[float]], owner: object) -> np.ndarray:
        n = len(jobs)
        if owner is not self._owner or len(self._held) > 4 * n + 4096:
            self._owner = owner
            self._reset()
        told = self.told = follows(jobs, self._last_jobs)  # (read by the caller: how the list followed)
        self._last_jobs = jobs
        if told is not None:  # the last list's columns, carried: only the fresh views' specs looked up
            at = carry(self._last_at, told, -1)
            for i in told.fresh:
                at[i] = self._column(jobs[i].spec, i, make)
            ids = _NO_IDS  # (not kept along: a list that does not say how it follows is looked up afresh)
        else:
            ids = np.fromiter(map(id, map(_SPEC, jobs)), np.int64, n)
            at, missing = follow(self._last_ids, self._last_at, ids)
            if missing:
                for i in np.flatnonzero(at < 0).tolist():
                    at[i] = self._column(jobs[i].spec, i, make)
        self._last_ids, self._last_at = ids, at
        return at

    def _column(self, spec: object, i: int, make: Callable[[int], Sequence[float]]) -> int:
        """The column of ``spec`` (job ``i``'s), made by ``make(i)`` if it has none."""
        k = self._index.get(id(spec))
        if k is None:
            k = self._index[id(spec)] = len(self._held)
            if k == self.rows.shape[1]:
                self.rows = np.concatenate([self.rows, np.empty_like(self.rows)], axis=1)
            self.rows[:, k] = make(i)
            self._held.append(spec)
        return k


@njit(cache=True)
def follow(last_ids, last_at, ids):
    """(each of ``ids``' column where it is found in ``last_ids`` at or after the last
    one found, else -1; how many are -1). One pass when ``ids`` keeps ``last_ids``'
    order with some gone and some added; the search gives up once it has looked at
    more than 4 x both lengths (a list reordered: the caller looks the rest up)."""
    n, m = len(ids), len(last_ids)
    at = np.empty(n, np.intp)
    j = 0
    budget = 4 * (n + m)
    missing = 0
    for i in range(n):
        x = ids[i]
        k = j
        while k < m and last_ids[k] != x and budget > 0:
            k += 1
            budget -= 1
        if k < m and last_ids[k] == x:
            at[i] = last_at[k]
            j = k + 1
        else:
            at[i] = -1
            missing += 1
    return at, missing


@njit(cache=True)
def srtf_order(rows, at, done, hint):
    """(positions by class and seconds left, equals in position order; the runs of
    neighbours equal in both, as [start, end, start, end, ...]; False for a NaN, whose
    order Python's sort does not define). ``rows[:, at[i]]`` is job i's (-class, steps,
    factor, divisor); seconds left = (max(0, steps - done) x factor) / divisor.
    ``hint``: an order to start from (``renumber``: the last round's; empty: none),
    sorted by insertion when it is nearly right (``_from_hint``), else merged afresh:
    the same order either way."""
    n = len(at)
    cls = np.empty(n)
    secs = np.empty(n)
    for i in range(n):
        c = at[i]
        left = rows[1, c] - done[i]
        if not left > 0.0:
            left = 0.0
        s = left * rows[2, c] / rows[3, c]
        if s != s:
            return np.empty(0, np.int64), np.empty(0, np.int64), False
        cls[i] = rows[0, c]
        secs[i] = s
    perm, ok = _from_hint(cls, secs, hint)
    if not ok:
        perm = _merge_order(cls, secs)
    runs = []
    k = 0
    while k < n - 1:
        end = k
        while end + 1 < n and cls[perm[end]] == cls[perm[end + 1]] and secs[perm[end]] == secs[perm[end + 1]]:
            end += 1
        if end > k:
            runs.append(k)
            runs.append(end + 1)
        k = end + 1
    out = np.empty(len(runs), np.int64)
    for r in range(len(runs)):
        out[r] = runs[r]
    return perm, out, True


@njit(cache=True)
def renumber(last, gone, n):
    """The last round's order ``last`` (positions in the last list) in this list's
    positions: the ``gone`` ones (ascending) out, the rest renumbered (each less the
    gone ones before it), then the positions that joined (after the rest), ascending.
    Empty if that is not ``n`` positions."""
    out = np.empty(n, np.int64)
    g = len(gone)
    k = 0
    for p in last:
        j = np.searchsorted(gone, p)
        if j < g and gone[j] == p:
            continue
        if k == n:
            return np.empty(0, np.int64)
        out[k] = p - j
        k += 1
    for p in range(len(last) - g, n):
        if k == n:
            return np.empty(0, np.int64)
        out[k] = p
        k += 1
    if k != n:
        return np.empty(0, np.int64)
    return out


@njit(cache=True)
def _from_hint(cls, secs, hint):
    """``hint`` (a permutation of the positions) sorted by insertion on (class, seconds
    left, position), a total order, so the result is the merge sort's (equals in
    position order); (order, True), or (_, False) when ``hint`` is not a permutation of
    them or needs more than 8 shifts per position."""
    n = len(cls)
    if len(hint) != n:
        return hint, False
    seen = np.zeros(n, np.bool_)
    for p in hint:
        if p < 0 or p >= n or seen[p]:
            return hint, False
        seen[p] = True
    perm = hint.copy()
    budget = 8 * n
    for i in range(1, n):
        x = perm[i]
        j = i - 1
        while j >= 0:
            y = perm[j]
            if cls[y] < cls[x] or (cls[y] == cls[x] and (secs[y] < secs[x] or (secs[y] == secs[x] and y < x))):
                break
            perm[j + 1] = y
            j -= 1
            budget -= 1
        perm[j + 1] = x
        if budget < 0:
            return perm, False
    return perm, True


@njit(cache=True)
def _merge_order(cls, secs):
    """The positions sorted by (class, seconds left), equals in position order: one
    stable bottom-up merge sort on the two keys (``np.lexsort``'s order, in half its
    passes). No NaN (the caller refuses them): the comparisons are then a total
    preorder."""
    n = len(cls)
    src = np.arange(n)
    dst = np.empty(n, np.int64)
    width = 1
    while width < n:
        lo = 0
        while lo < n:
            mid = min(lo + width, n)
            hi = min(lo + 2 * width, n)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                a, b = src[j], src[i]  # only a strictly earlier right one goes first
                if cls[a] < cls[b] or (cls[a] == cls[b] and secs[a] < secs[b]):
                    dst[k] = a
                    j += 1
                else:
                    dst[k] = b
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
            lo = hi
        src, dst = dst, src
        width *= 2
    return src


def break_ties(perm: list[int] | np.ndarray, runs: list[int], submitted: Callable[[int], float],
               name: Callable[[int], str]) -> list[int] | np.ndarray | None:
    """``perm`` (a list or an integer array, changed in place) with each run ``[runs[2k],
    runs[2k + 1])`` of jobs equal in class and seconds left in (submitted at, name) order:
    what ``sorted`` on the whole tuples does, which compares the later parts only there.
    None for a NaN submission time in a run (Python's order is not defined there; the
    caller sorts the tuples)."""
    for s, e in zip(runs[::2], runs[1::2]):
        part = perm[s:e].tolist() if isinstance(perm, np.ndarray) else perm[s:e]
        if any(submitted(i) != submitted(i) for i in part):
            return None
        perm[s:e] = sorted(part, key=lambda i: (submitted(i), name(i)))
    return perm
