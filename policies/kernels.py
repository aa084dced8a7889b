"""The allocation search's inner loops: numba kernels and a numpy reference.

Problem (one round): each job j has candidates k (rows of padded arrays) with
GPUs ``cg``, CPUs per GPU ``cc``, nodes spanned ``cm`` (symmetric: cg/cm GPUs
on each), utility ``u`` (< 0: not allowed) and resource cost ``cost``.
Candidate ``stay[j]`` (if >= 0) means "keep the exact current placement"
(CSR ``hold_ptr/hold_node/hold_g/hold_c``). Choose at most one candidate per
job and nodes for it so that no node is over-allocated, maximising the sum of
utilities.

Algorithm:
1. Seeds, in the given order: pinned jobs keep their placement; guaranteed
   jobs get their seed candidate or, failing that, the cheapest allowed one
   that fits (``seed_any``; ties in cost go to the lower row). Seeded jobs marked ``fixed`` never change again.
   Jobs marked ``unseat`` then give back what they were seeded on and enter the greedy
   from nothing, like any running job: they held it only against the seeds after them.
2. Greedy by normalised marginal gain: repeatedly take the job whose next
   step up its curve (any candidate with higher utility) has the best
   utility gained per unit of cost; move it there if it fits (its own
   resources are released first), else mark that candidate dead for it.
   Optionally some nodes hold room for a waiting job (``room_g``/``room_c``:
   the GPUs and CPUs of each node that new placements may take; a large number
   where nothing is reserved): a candidate not marked ``backfill`` (one that
   would not finish before the waiting job can start) takes a node only within
   its room, and gives it back when it is released. Staying where a job runs is
   never limited by it.
   Optionally jobs belong to groups (``group``, -1: none) with GPU budgets
   (``budget``): a step that would take a group's jobs past its budget is dead
   too (the greedy only adds to a group's use, so it stays dead). Rubick's
   groups are tenants, budgets their fair shares (``Rubick.budget``).
Node choice for a candidate: the job's own nodes first, then nodes whose
free capacity nobody running still holds, then best fit (tightest node), then
lowest index. Everything is deterministic, so both implementations agree
exactly (tests check it).

``greedy_allocate`` fixes dtypes and dispatches; ``greedy_numpy`` is the
reference (vectorised per step, Python loop over steps).
"""

from __future__ import annotations

import numpy as np
from numba import njit

EPS = 1e-12


def _as(a, dt):
    return np.ascontiguousarray(a, dtype=dt)


# ---------------------------------------------------------------- numba
@njit(cache=True)
def _holds_fit(j, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c):
    for t in range(hold_ptr[j], hold_ptr[j + 1]):
        n = hold_node[t]
        if free_g[n] < hold_g[t] or free_c[n] < hold_c[t]:
            return False
    return True


@njit(cache=True)
def _adjust(n, dg, dc, free_g, free_c, hist):
    hist[free_g[n]] -= 1
    free_g[n] += dg
    free_c[n] += dc
    hist[free_g[n]] += 1


@njit(cache=True)
def _release(j, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c, sign, hist,
             room_g, room_c, bf):
    k = level[j]
    if k < 0:
        return
    if k == stay[j]:
        for t in range(hold_ptr[j], hold_ptr[j + 1]):
            _adjust(hold_node[t], sign * hold_g[t], sign * hold_c[t], free_g, free_c, hist)
    else:
        per = cg[j, k] // cm[j, k]
        for i in range(cm[j, k]):
            _adjust(out_nodes[j, i], sign * per, sign * per * cc[j, k], free_g, free_c, hist)
            if not bf[j, k]:
                room_g[out_nodes[j, i]] += sign * per
                room_c[out_nodes[j, i]] += sign * per * cc[j, k]


@njit(cache=True)
def _taken(n, i, picked):
    """n is one of picked[0:i]."""
    for q in range(i):
        if picked[q] == n:
            return True
    return False


@njit(cache=True)
def _choose_nodes(j, k, cg, cc, cm, hold_ptr, hold_node, free_g, free_c, res_g, res_c, own, picked, hist, big,
                  room_g, room_c, bf):
    """Fill picked[0:m] with nodes for candidate k of job j; False if none."""
    N = free_g.shape[0]
    m = cm[j, k]
    per = cg[j, k] // m
    need_c = per * cc[j, k]
    # Quick reject from the free-GPU histogram: fewer than m nodes have room.
    enough = 0
    for f in range(per, hist.shape[0]):
        enough += hist[f]
    if enough < m:
        return False
    for t in range(hold_ptr[j], hold_ptr[j + 1]):
        own[hold_node[t]] = True
    ok = True
    for i in range(m):
        best = np.int64(-1)
        best_key = np.int64(0)
        # The lowest key wins: tier (the job's own nodes, then nodes nobody else holds,
        # then the rest), then the GPUs left over, then the node's index. An own node
        # beats every other (tier 0), so the job's few own nodes are looked at first and
        # the pass over every node is skipped when one will do. (The room checks are
        # written out in both loops: as a called helper the search ran 7-12x slower.)
        for t in range(hold_ptr[j], hold_ptr[j + 1]):
            n = hold_node[t]
            if free_g[n] >= per and free_c[n] >= need_c and (bf[j, k] or (room_g[n] >= per and room_c[n] >= need_c)) \
                    and not _taken(n, i, picked):
                key = (free_g[n] - per) * N + n
                if best < 0 or key < best_key:
                    best = n
                    best_key = key
        if best < 0:
            for n in range(N):
                if free_g[n] < per or free_c[n] < need_c:
                    continue
                if not bf[j, k] and (room_g[n] < per or room_c[n] < need_c):
                    continue
                if _taken(n, i, picked):
                    continue
                if own[n]:
                    tier = 0
                elif free_g[n] - res_g[n] >= per and free_c[n] - res_c[n] >= need_c:
                    tier = 1
                else:
                    tier = 2
                key = tier * big + (free_g[n] - per) * N + n
                if best < 0 or key < best_key:
                    best = n
                    best_key = key
                    if tier == 1 and free_g[n] == per:
                        break  # no own node fits: nothing after this one can have a lower key
        if best < 0:
            ok = False
            break
        picked[i] = best
    for t in range(hold_ptr[j], hold_ptr[j + 1]):
        own[hold_node[t]] = False
    return ok


@njit(cache=True)
def _try_move(j, k, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c,
              free_g, free_c, res_g, res_c, own, picked, decided, hist, big, room_g, room_c, bf):
    """Move job j to candidate k if it fits (releasing what it holds first)."""
    if not decided[j]:
        # From now on j's old holding is no longer "someone else's".
        for t in range(hold_ptr[j], hold_ptr[j + 1]):
            res_g[hold_node[t]] -= hold_g[t]
            res_c[hold_node[t]] -= hold_c[t]
        decided[j] = True
    _release(j, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c, 1, hist,
             room_g, room_c, bf)
    if k == stay[j]:
        ok = _holds_fit(j, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c)
    else:
        ok = _choose_nodes(j, k, cg, cc, cm, hold_ptr, hold_node, free_g, free_c, res_g, res_c, own, picked, hist, big,
                           room_g, room_c, bf)
    if ok:
        old = level[j]
        level[j] = k
        if k != stay[j]:
            for i in range(cm[j, k]):
                out_nodes[j, i] = picked[i]
        _release(j, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c, -1, hist,
                 room_g, room_c, bf)
        return True
    _release(j, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c, -1, hist,
             room_g, room_c, bf)
    return False


@njit(cache=True)
def _best_step(j, level, u, cost, nk, dead):
    lv = level[j]
    cu = 0.0 if lv < 0 else u[j, lv]
    cc0 = 0.0 if lv < 0 else cost[j, lv]
    best = -1.0
    bk = -1
    for k in range(nk[j]):
        if dead[j, k] or u[j, k] < 0.0 or u[j, k] <= cu + EPS:
            continue
        dc = cost[j, k] - cc0
        gain = u[j, k] - cu
        r = gain / dc if dc > 1e-9 else gain * 1e9
        if r > best:
            best = r
            bk = k
    return best, bk


@njit(cache=True)
def _before(r1, j1, r2, j2):
    return r1 > r2 or (r1 == r2 and j1 < j2)


@njit(cache=True)
def _hpush(hr, hj, hv, size, r, j, v):
    i = size
    hr[i] = r
    hj[i] = j
    hv[i] = v
    while i > 0:
        p = (i - 1) // 2
        if _before(hr[i], hj[i], hr[p], hj[p]):
            hr[i], hr[p] = hr[p], hr[i]
            hj[i], hj[p] = hj[p], hj[i]
            hv[i], hv[p] = hv[p], hv[i]
            i = p
        else:
            break
    return size + 1


@njit(cache=True)
def _hpop(hr, hj, hv, size):
    size -= 1
    hr[0] = hr[size]
    hj[0] = hj[size]
    hv[0] = hv[size]
    i = 0
    while True:
        a = 2 * i + 1
        b = a + 1
        m = i
        if a < size and _before(hr[a], hj[a], hr[m], hj[m]):
            m = a
        if b < size and _before(hr[b], hj[b], hr[m], hj[m]):
            m = b
        if m == i:
            break
        hr[i], hr[m] = hr[m], hr[i]
        hj[i], hj[m] = hj[m], hj[i]
        hv[i], hv[m] = hv[m], hv[i]
        i = m
    return size


@njit(cache=True)
def _greedy_nb(cg, cc, cm, u, cost, nk, stay, hold_ptr, hold_node, hold_g, hold_c,
               seed_order, seed, seed_any, fixed, cap_g, cap_c, group, budget, room_g0, room_c0, bf, unseat):
    J, K = u.shape
    N = cap_g.shape[0]
    room_g = room_g0.copy()
    room_c = room_c0.copy()
    gused = np.zeros(budget.shape[0])
    free_g = cap_g.copy()
    free_c = cap_c.copy()
    res_g = np.zeros(N, np.int64)
    res_c = np.zeros(N, np.int64)
    for j in range(J):
        for t in range(hold_ptr[j], hold_ptr[j + 1]):
            res_g[hold_node[t]] += hold_g[t]
            res_c[hold_node[t]] += hold_c[t]
    M = 1
    for j in range(J):
        for k in range(nk[j]):
            if cm[j, k] > M:
                M = cm[j, k]
    level = np.full(J, -1, np.int64)
    out_nodes = np.full((J, M), -1, np.int64)
    dead = np.zeros((J, K), np.bool_)
    decided = np.zeros(J, np.bool_)
    own = np.zeros(N, np.bool_)
    picked = np.zeros(M, np.int64)
    frozen = fixed.copy()
    hist = np.zeros(cap_g.max() + 1, np.int64)
    for n in range(N):
        hist[free_g[n]] += 1
    big = np.int64(cap_g.max() + 2) * N
    # 1. seeds
    for s in range(seed_order.shape[0]):
        j = seed_order[s]
        k = seed[j]
        ok = False
        if k >= 0:
            ok = _try_move(j, k, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c,
                           free_g, free_c, res_g, res_c, own, picked, decided, hist, big, room_g, room_c, bf)
        if not ok and seed_any[j]:
            # cheapest allowed candidate that fits (rows need not be sorted by cost)
            tried = np.zeros(nk[j], np.bool_)
            for _ in range(nk[j]):
                k2 = -1
                for q in range(nk[j]):
                    if tried[q] or u[j, q] < 0.0 or q == k:
                        continue
                    if k2 < 0 or cost[j, q] < cost[j, k2]:
                        k2 = q
                if k2 < 0:
                    break
                tried[k2] = True
                if _try_move(j, k2, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c,
                             free_g, free_c, res_g, res_c, own, picked, decided, hist, big, room_g, room_c, bf):
                    ok = True
                    break
        if not ok:
            # Could not seed: a pinned job loses its pin; a guaranteed job
            # cannot be admitted this round (it must not take less).
            frozen[j] = seed_any[j]
        elif group[j] >= 0:  # a seed counts against its group's budget, never blocked by it
            gused[group[j]] += cg[j, level[j]]
    # unseated seeds: they kept their place while the seeds after them were placed, and
    # now compete in the greedy like any running job (from nothing, staying free of charge)
    for j in range(J):
        if unseat[j]:
            if level[j] >= 0:
                if group[j] >= 0:
                    gused[group[j]] -= cg[j, level[j]]
                _release(j, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c, free_g, free_c,
                         1, hist, room_g, room_c, bf)
                level[j] = -1
            if decided[j]:
                for t in range(hold_ptr[j], hold_ptr[j + 1]):
                    res_g[hold_node[t]] += hold_g[t]
                    res_c[hold_node[t]] += hold_c[t]
                decided[j] = False
            frozen[j] = False
    # 2. greedy by marginal gain per cost; a lazy max-heap of (ratio, -job)
    # replaces the argmax scan (stale entries are skipped by version), with
    # the same tie-break as the reference's argmax: the lowest job index.
    cap = J + 2 * J * K + 1
    hr = np.empty(cap)
    hj = np.empty(cap, np.int64)
    hv = np.empty(cap, np.int64)
    version = np.zeros(J, np.int64)
    step = np.full(J, -1, np.int64)
    size = 0
    for j in range(J):
        if not frozen[j]:
            r, step[j] = _best_step(j, level, u, cost, nk, dead)
            if step[j] >= 0 and r > 0.0:
                size = _hpush(hr, hj, hv, size, r, j, version[j])
    while size > 0:
        r = hr[0]
        j = hj[0]
        v = hv[0]
        size = _hpop(hr, hj, hv, size)
        if v != version[j]:
            continue
        k = step[j]
        g = group[j]
        was = 0 if level[j] < 0 else cg[j, level[j]]
        if g >= 0 and gused[g] - was + cg[j, k] > budget[g] + 1e-9:
            dead[j, k] = True  # past its group's budget (the greedy only adds to a group's use)
        elif not _try_move(j, k, level, stay, cg, cc, cm, out_nodes, hold_ptr, hold_node, hold_g, hold_c,
                           free_g, free_c, res_g, res_c, own, picked, decided, hist, big, room_g, room_c, bf):
            dead[j, k] = True
        elif g >= 0:
            gused[g] += cg[j, k] - was
        version[j] += 1
        r, step[j] = _best_step(j, level, u, cost, nk, dead)
        if step[j] >= 0 and r > 0.0:
            size = _hpush(hr, hj, hv, size, r, j, version[j])
    return level, out_nodes


# ---------------------------------------------------------------- numpy reference
def greedy_numpy(cg, cc, cm, u, cost, nk, stay, hold_ptr, hold_node, hold_g, hold_c,
                 seed_order, seed, seed_any, fixed, cap_g, cap_c, group, budget, room_g0, room_c0, bf, unseat):
    J, K = u.shape
    room_g = room_g0.astype(np.int64).copy()
    room_c = room_c0.astype(np.int64).copy()
    gused = np.zeros(len(budget))
    N = cap_g.shape[0]
    free_g = cap_g.astype(np.int64).copy()
    free_c = cap_c.astype(np.int64).copy()
    res_g = np.zeros(N, np.int64)
    res_c = np.zeros(N, np.int64)
    np.add.at(res_g, hold_node, hold_g)
    np.add.at(res_c, hold_node, hold_c)
    valid_mask = np.arange(K)[None, :] < nk[:, None]
    M = int(max(1, cm[valid_mask].max(initial=1)))
    level = np.full(J, -1, np.int64)
    out_nodes = np.full((J, M), -1, np.int64)
    dead = np.zeros((J, K), bool)
    decided = np.zeros(J, bool)
    idx = np.arange(N, dtype=np.int64)

    def hold(j):
        s = slice(hold_ptr[j], hold_ptr[j + 1])
        return hold_node[s], hold_g[s], hold_c[s]

    def release(j, sign):
        k = level[j]
        if k < 0:
            return
        if k == stay[j]:
            hn, hg, hc = hold(j)
            np.add.at(free_g, hn, sign * hg)
            np.add.at(free_c, hn, sign * hc)
        else:
            per = cg[j, k] // cm[j, k]
            nodes = out_nodes[j, : cm[j, k]]
            free_g[nodes] += sign * per
            free_c[nodes] += sign * per * cc[j, k]
            if not bf[j, k]:
                room_g[nodes] += sign * per
                room_c[nodes] += sign * per * cc[j, k]

    def choose(j, k):
        m = int(cm[j, k])
        per = cg[j, k] // m
        need_c = per * cc[j, k]
        ok = (free_g >= per) & (free_c >= need_c)
        if not bf[j, k]:
            ok &= (room_g >= per) & (room_c >= need_c)
        if ok.sum() < m:
            return None
        tier = np.where((free_g - res_g >= per) & (free_c - res_c >= need_c), 1, 2)
        tier[hold(j)[0]] = 0
        big = np.int64(cap_g.max() + 2) * N
        key = tier * big + (free_g - per) * N + idx
        key = np.where(ok, key, np.iinfo(np.int64).max)
        sel = np.argpartition(key, m - 1)[:m]
        return sel[np.argsort(key[sel])]

    def try_move(j, k):
        if not decided[j]:
            hn, hg, hc = hold(j)
            np.subtract.at(res_g, hn, hg)
            np.subtract.at(res_c, hn, hc)
            decided[j] = True
        release(j, 1)
        if k == stay[j]:
            hn, hg, hc = hold(j)
            ok = bool(np.all(free_g[hn] >= hg) and np.all(free_c[hn] >= hc))
            picked = None
        else:
            picked = choose(j, k)
            ok = picked is not None
        if ok:
            level[j] = k
            if picked is not None:
                out_nodes[j, : len(picked)] = picked
        release(j, -1)
        return ok

    def best_step(j):
        lv = level[j]
        cu = 0.0 if lv < 0 else u[j, lv]
        c0 = 0.0 if lv < 0 else cost[j, lv]
        n = nk[j]
        uu = u[j, :n]
        allowed = (~dead[j, :n]) & (uu >= 0.0) & (uu > cu + EPS)
        if not allowed.any():
            return -1.0, -1
        dc = cost[j, :n] - c0
        gain = uu - cu
        with np.errstate(divide="ignore", invalid="ignore"):
            r = np.where(dc > 1e-9, gain / np.where(dc > 1e-9, dc, 1.0), gain * 1e9)
        r = np.where(allowed, r, -np.inf)
        k = int(np.argmax(r))
        return (float(r[k]), k) if r[k] > -1.0 else (-1.0, -1)

    frozen = fixed.copy()
    for j in seed_order:
        k = seed[j]
        ok = bool(k >= 0 and try_move(j, k))
        if not ok and seed_any[j]:
            n = nk[j]
            for k2 in np.argsort(cost[j, :n], kind="stable"):
                if u[j, k2] < 0.0 or k2 == k:
                    continue
                if try_move(j, int(k2)):
                    ok = True
                    break
        if not ok:
            frozen[j] = seed_any[j]
        elif group[j] >= 0:
            gused[group[j]] += cg[j, level[j]]
    for j in np.flatnonzero(unseat).tolist():
        if level[j] >= 0:
            if group[j] >= 0:
                gused[group[j]] -= cg[j, level[j]]
            release(j, 1)
            level[j] = -1
        if decided[j]:
            hn, hg, hc = hold(j)
            np.add.at(res_g, hn, hg)
            np.add.at(res_c, hn, hc)
            decided[j] = False
        frozen[j] = False
    ratio = np.full(J, -1.0)
    step = np.full(J, -1, np.int64)
    for j in range(J):
        if not frozen[j]:
            ratio[j], step[j] = best_step(j)
    while True:
        cand = np.where(step >= 0, ratio, -1.0)
        j = int(np.argmax(cand))
        if cand[j] <= 0.0:
            break
        k = int(step[j])
        g = group[j]
        was = 0 if level[j] < 0 else cg[j, level[j]]
        if g >= 0 and gused[g] - was + cg[j, k] > budget[g] + 1e-9:
            dead[j, k] = True
        elif not try_move(j, k):
            dead[j, k] = True
        elif g >= 0:
            gused[g] += cg[j, k] - was
        ratio[j], step[j] = best_step(j)
    return level, out_nodes


def greedy_allocate(cg, cc, cm, u, cost, nk, stay, hold_ptr, hold_node, hold_g, hold_c,
                    seed_order, seed, seed_any, fixed, cap_g, cap_c, group=None, budget=None,
                    room_g=None, room_c=None, backfill=None, *, unseat=None, use_numba: bool = True):
    """Dtype-fixing front door; returns (chosen candidate per job or -1,
    nodes per job padded with -1). ``group`` (per job, -1: none) and ``budget`` (GPUs
    per group): the greedy never takes a group's jobs past its budget (seeds count
    against it but are never refused); None: no groups. ``room_g``/``room_c`` (per
    node) and ``backfill`` (per job and candidate): what new placements of
    candidates not marked ``backfill`` may take of each node; None: no limit."""
    i8, f8, b1 = np.int64, np.float64, np.bool_
    if group is None:
        group, budget = np.full(len(nk), -1), np.zeros(0)
    if room_g is None:
        room_g, room_c = np.asarray(cap_g), np.asarray(cap_c)
        backfill = np.ones(np.shape(u), bool)
    args = (
        _as(cg, i8), _as(cc, i8), _as(cm, i8), _as(u, f8), _as(cost, f8), _as(nk, i8), _as(stay, i8),
        _as(hold_ptr, i8), _as(hold_node, i8), _as(hold_g, i8), _as(hold_c, i8),
        _as(seed_order, i8), _as(seed, i8), _as(seed_any, b1), _as(fixed, b1), _as(cap_g, i8), _as(cap_c, i8),
        _as(group, i8), _as(budget, f8), _as(room_g, i8), _as(room_c, i8), _as(backfill, b1),
        _as(np.zeros(len(nk), bool) if unseat is None else unseat, b1),
    )
    if use_numba:
        return _greedy_nb(*args)
    return greedy_numpy(*args)


def warm_up() -> None:
    """Compile (or load from cache) the kernels before serving rounds."""
    one = np.ones((1, 1))
    greedy_allocate(
        np.ones((1, 1)), np.ones((1, 1)), np.ones((1, 1)), one, one, np.ones(1), np.full(1, -1),
        np.zeros(2), np.zeros(0), np.zeros(0), np.zeros(0), np.zeros(0), np.full(1, -1),
        np.zeros(1), np.zeros(1), np.full(1, 8), np.full(1, 8),
    )
