"""Room held for the job at the head of rubick's queue (``reserve``, on).

Pending guarantees (and best-effort jobs that starved, ``rubick_rules.starved_first``)
are seeded before the greedy, in queue order (``rubick_rules.queue_keys``), but only
into what the jobs that may not be moved leave: running guaranteed and kept starved
jobs (until they finish), jobs inside their minimum run time (until it ends) and the
seeds ahead of them. A job
that needs whole nodes (rubick-mt's 40- and 48-GPU llama30 guarantees) then waits
while the greedy starts best-effort jobs on the nodes that free up; each start is
pinned for the minimum run time, and with starts at different times some node it
needs always holds a pinned job. On rubick-mt (measured) the 22 guarantees of 40 or
more GPUs, which can only run one at a time, had 15,700 s in which one of them was
waiting and none was running, and the best-effort jobs started there were evicted
as soon as their pin ended, most of it spent restarting (a llama30 restart is
~530 s of a 600 s pin).

This is EASY backfilling on rubick's seeds. After a first search, the first job in
seed order that waits (``head``) gets a reservation: for its cheapest allowed
candidate (the one its seed tries first), each node's time at which enough of it
is free, counting only what cannot be moved (``blockers``: released at their
predicted finish, a pinned best-effort job at the end of its pin if sooner); the
candidate's nodes are the ones free soonest and ``T`` the latest of them. A second
search then keeps that room: a new placement (a start, a switch, a later seed) may
take a reserved node's GPUs and CPUs only as far as the head still fits at ``T``,
unless it is predicted to finish (its restart included) by ``T``; staying where a
job runs is never limited (at ``T`` the head's seed evicts it, as before). So the
GPUs do not sit idle: work that fits before ``T`` still runs there.

rubick-mt (measured, seed 0), with ``keep_starved`` and the queue by GPU-time: avg JCT
1,423 s with it against 1,689 s before either (seeds 1, 2: 1,386 / 1,411 against
1,773 / 1,757); extended: 1,465 s with it, 1,979 s without it (the rest unchanged).
Where no seed waits (rubick-base, rubick-bp: no guarantee) it does nothing.

Only what the live system knows: declared steps left (or learned, ``rubick_declared``),
the belief's speeds, each job's restart estimate, the pin times.
"""

from __future__ import annotations

import math

import numpy as np


def head_of_queue(pb, level: np.ndarray) -> int:
    """The first pending seed (guaranteed or starved) the search left waiting, or -1."""
    for i in pb.seed_order.tolist():
        if pb.seed_any[i] and pb.stay[i] < 0 and level[i] < 0 and (pb.u[i, : pb.nk[i]] >= 0).any():
            return i
    return -1


def cheapest(pb, i: int) -> int:
    """The allowed candidate the kernel's seed tries first: least cost, then lowest row."""
    n = int(pb.nk[i])
    ok = pb.u[i, :n] >= 0
    cost = np.where(ok, pb.cost[i, :n], np.inf)
    return int(np.argmin(cost))


def _placed(pb, i: int, level: np.ndarray, out_nodes: np.ndarray):
    """(node, GPUs, CPUs) of what job i holds after the search."""
    k = int(level[i])
    if k == pb.stay[i]:
        s = slice(pb.hold_ptr[i], pb.hold_ptr[i + 1])
        return list(zip(pb.hold_node[s].tolist(), pb.hold_g[s].tolist(), pb.hold_c[s].tolist()))
    per = int(pb.cg[i, k] // pb.cm[i, k])
    return [(int(out_nodes[i, q]), per, per * int(pb.cc[i, k])) for q in range(int(pb.cm[i, k]))]


def finish_in(pb, i: int, k: int, restart_left: float) -> float:
    """Seconds until job i would finish on candidate k, ``restart_left`` first."""
    thr = float(pb.thr[i, k])
    return restart_left + float(pb.left[i]) / thr if thr > 0 else math.inf


def blockers(pb, level, out_nodes, head: int, pinned_left: np.ndarray, restart_left: np.ndarray,
             protected: np.ndarray) -> list[tuple[int, int, int, float]]:
    """(node, GPUs, CPUs, seconds until released) of what the head's seed cannot evict."""
    out = []
    order = pb.seed_order.tolist()
    ahead = set(order[: order.index(head)])
    for i in np.flatnonzero(level >= 0).tolist():
        running = pb.stay[i] >= 0
        if running and (pb.guaranteed[i] or protected[i] or pb.pinned[i]):
            k = int(level[i])
            left = finish_in(pb, i, k, restart_left[i] if k == pb.stay[i] else pb.restarts[i])
            if pb.pinned[i] and not (pb.guaranteed[i] or protected[i]):
                left = min(left, pinned_left[i])
        elif not running and pb.seed_any[i] and i in ahead:
            left = finish_in(pb, i, int(level[i]), pb.restarts[i])
        else:
            continue
        out.extend((n, g, c, left) for n, g, c in _placed(pb, i, level, out_nodes))
    return out


def reservation(pb, head: int, blocked: list, cap_g: np.ndarray, cap_c: np.ndarray):
    """(T seconds from now, room_g, room_c) for the head's cheapest candidate, or None
    when it can never fit. room: what new placements that end after T may take per node."""
    k = cheapest(pb, head)
    m = int(pb.cm[head, k])
    per = int(pb.cg[head, k] // m)
    need_c = per * int(pb.cc[head, k])
    N = len(cap_g)
    on: list[list] = [[] for _ in range(N)]
    for n, g, c, t in blocked:
        on[n].append((t, g, c))
    avail = np.full(N, math.inf)
    for n in range(N):
        held = sorted(on[n])  # soonest release first
        used_g = sum(g for _, g, _ in held)
        used_c = sum(c for _, _, c in held)
        t_free = 0.0
        for t, g, c in held:  # release them in turn until the head fits
            if cap_g[n] - used_g >= per and cap_c[n] - used_c >= need_c:
                break
            used_g -= g
            used_c -= c
            t_free = t
        if cap_g[n] - used_g >= per and cap_c[n] - used_c >= need_c:
            avail[n] = t_free
    pick = np.argsort(avail, kind="stable")[:m]
    if len(pick) < m or not np.isfinite(avail[pick]).all():
        return None
    T = float(avail[pick].max())
    room_g = np.asarray(cap_g, np.int64).copy()
    room_c = np.asarray(cap_c, np.int64).copy()
    for n in pick.tolist():
        stay_g = sum(g for t, g, _ in on[n] if t > T)
        stay_c = sum(c for t, _, c in on[n] if t > T)
        room_g[n] = cap_g[n] - per - stay_g
        room_c[n] = cap_c[n] - need_c - stay_c
    return T, room_g, room_c


def backfill_ok(pb, T: float, ahead: np.ndarray) -> np.ndarray:
    """Per job and candidate: a new placement there ends (restart included) by T, or the
    job is ahead of the head in the queue."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ends = pb.restarts[:, None] + pb.left[:, None] / pb.thr
    ok = np.where(pb.thr > 0, ends <= T, False)
    return ok | ahead[:, None]


def reserve_room(pol, pb, level: np.ndarray, out_nodes: np.ndarray, jobs, now: float):
    """(room_g, room_c, backfill, head, T) for the kernel's second search (``greedy_allocate``'s
    room and backfill arguments, the head's row and seconds until it can start), or None
    when no seed waits or it can start now."""
    head = head_of_queue(pb, level)
    if head < 0:
        return None
    J = len(jobs)
    pinned_left = np.zeros(J)
    restart_left = np.zeros(J)
    for i in np.flatnonzero(pb.stay >= 0).tolist():
        since = jobs[i].switched_at if jobs[i].switched_at is not None else now
        restart_left[i] = max(0.0, since + pb.restarts[i] - now)
        if pb.pinned[i]:  # a guarded job's window runs from its last (re)start
            start = pol.run_from(jobs[i]) if pb.unseat is not None and pb.unseat[i] else since
            pinned_left[i] = max(0.0, start + pol.pin_window(jobs[i]) - now)
    protected = pb.protected if pb.protected is not None else np.zeros(J, bool)
    got = reservation(pb, head, blockers(pb, level, out_nodes, head, pinned_left, restart_left, protected),
                      pb.cap_g, pb.cap_c)
    if got is None or got[0] <= 0:
        return None
    T, room_g, room_c = got
    order = pb.seed_order.tolist()
    ahead = np.zeros(J, bool)
    ahead[order[: order.index(head)]] = True
    return room_g, room_c, backfill_ok(pb, T, ahead), head, T
