"""SRTF's order for a whole round at once, on arrays (issue 22, the simulator fast).

SRTF's key, ``(-class, seconds left, submitted at, job id)``, is asked for every live
job in every round. As Python tuples that is a tuple per job and a sort of tuples,
about a third of a Blox load-8 SRTF round. Here:

- ``SpecRows``: each spec's numbers (its class, steps, and the factor and divisor of
  its seconds left) as a column of a float array, made once per spec and found again
  by ``id(spec)`` (the key ``ordering.RequestSpeeds`` remembers speeds by; the specs
  are held, so an id seen stays that object's), so a round makes columns only for the
  specs it has not seen;
- ``srtf_order``: one numba kernel computes every job's seconds left (the same scalar
  expressions as ``ordering.SrtfKey.many_by_class``, in the same order, compiled
  without fast-math: the same IEEE results) and sorts by class, seconds left and
  submission time (one stable merge sort on the three keys, ``_merge_order``:
  ``np.lexsort``'s order); ``order_positions`` then puts each run of jobs equal in all three in
  job-id order, so the result is exactly ``sorted`` on the tuples.

A NaN anywhere (Python's sort has no order to agree with there) and the caller sorts
the tuples itself. Pure: numpy and numba.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np
from numba import njit

_SPEC = attrgetter("spec")


class SpecRows:
    """Columns of per-spec numbers (``rows``: width x capacity), one per spec seen.

    ``at(jobs, make, owner)``: the column of each job's spec, ``make(i)`` called for a
    spec not seen before. ``owner``: what the columns were made under (the speeds'
    memo, new when the oracle's answers change); another owner and all are made
    again, as when the specs held outgrow the list asked about.

    A round's list is mostly the last one's with some jobs gone and some appended
    (live jobs in arrival order, in the simulator and the optimizer alike), so the
    columns are first followed along the last round's list (``follow``, one pass on
    the spec ids); only the specs it does not find are looked up by id. The specs
    are held, so an id seen stays that object's."""

    __slots__ = ("width", "rows", "_owner", "_index", "_held", "_last_ids", "_last_at")

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

    def at(self, jobs: Sequence, make: Callable[[int], Sequence[float]], owner: object) -> np.ndarray:
        n = len(jobs)
        if owner is not self._owner or len(self._held) > 4 * n + 4096:
            self._owner = owner
            self._reset()
        ids = np.fromiter(map(id, map(_SPEC, jobs)), np.int64, n)
        at, missing = follow(self._last_ids, self._last_at, ids)
        if missing:
            index = self._index
            for i in np.flatnonzero(at < 0).tolist():
                spec = jobs[i].spec
                k = index.get(id(spec))
                if k is None:
                    k = index[id(spec)] = len(self._held)
                    if k == self.rows.shape[1]:
                        self.rows = np.concatenate([self.rows, np.empty_like(self.rows)], axis=1)
                    self.rows[:, k] = make(i)
                    self._held.append(spec)
                at[i] = k
        self._last_ids, self._last_at = ids, at
        return at


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
def srtf_order(rows, at, done, submitted):
    """(positions by class, seconds left, submitted at; whether any two neighbours tie
    in all three: 1, 0, or -1 for a NaN). ``rows[:, at[i]]`` is job i's (-class,
    steps, factor, divisor); seconds left = (max(0, steps - done) x factor) / divisor."""
    n = len(at)
    cls = np.empty(n)
    secs = np.empty(n)
    for i in range(n):
        c = at[i]
        left = rows[1, c] - done[i]
        if not left > 0.0:
            left = 0.0
        s = left * rows[2, c] / rows[3, c]
        if s != s or submitted[i] != submitted[i]:
            return np.empty(0, np.int64), -1
        cls[i] = rows[0, c]
        secs[i] = s
    perm = _merge_order(cls, secs, submitted)
    for k in range(n - 1):
        a, b = perm[k], perm[k + 1]
        if cls[a] == cls[b] and secs[a] == secs[b] and submitted[a] == submitted[b]:
            return perm, 1
    return perm, 0


@njit(cache=True)
def _before(a, b, cls, secs, sub):
    """Is ``a`` strictly before ``b`` by (class, seconds left, submitted at)?"""
    if cls[a] != cls[b]:
        return cls[a] < cls[b]
    if secs[a] != secs[b]:
        return secs[a] < secs[b]
    return sub[a] < sub[b]


@njit(cache=True)
def _merge_order(cls, secs, sub):
    """The positions sorted by (class, seconds left, submitted at), equals in position
    order: one stable bottom-up merge sort on the three keys, the order three stable
    sorts give (last key first, ``np.lexsort``'s) in a third of the passes. No NaN
    (the caller refuses them): the comparisons are then a total preorder."""
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
                if _before(src[j], src[i], cls, secs, sub):  # only a strictly earlier right one goes first
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
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


def order_positions(perm: list[int], same: Callable[[int, int], bool], name: Callable[[int], str]) -> list[int]:
    """``perm`` with every run of neighbours equal by ``same`` put in ``name`` order."""
    k, n = 0, len(perm)
    while k < n - 1:
        end = k
        while end + 1 < n and same(perm[end], perm[end + 1]):
            end += 1
        if end > k:
            perm[k:end + 1] = sorted(perm[k:end + 1], key=name)
        k = end + 1
    return perm
