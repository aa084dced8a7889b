"""Exact optimum of a round's allocation problem, as a MILP (scipy HiGHS).

Same candidates, utilities, holdings and hard rules as the greedy search in
``kernels.py``: at most one candidate per job; symmetric placement (a chosen
candidate puts cg/cm GPUs on each of cm distinct nodes); a "stay" candidate
occupies exactly the job's current holding; node GPU and CPU capacities;
pinned jobs keep their holding; a running guaranteed job keeps an allowed
candidate. Not a constraint here: the FIFO order in which the greedy admits
pending guaranteed jobs, so the optimum is an upper bound for it.

Only for small instances (the optimality check): variables grow with
jobs x candidates x nodes.
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix


def milp_optimum(
    pb, time_limit: float = 30.0, admitted: np.ndarray | None = None, pinned: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """Return (optimal objective, chosen candidate per job or -1).

    ``admitted`` (optional, bool per job) fixes which guaranteed jobs run:
    admission of guaranteed jobs is a rule (FIFO, only if the guarantee can
    be kept), not something the search optimises, so the check compares the
    search given the same admissions. ``pinned`` likewise overrides which
    jobs must keep their holding (a guarantee may evict a pinned job).
    """
    pins = pb.pinned if pinned is None else pinned
    J, _ = pb.u.shape
    N = pb.cap_g.shape[0]
    var_x: list[tuple[int, int]] = []  # (job, cand)
    var_z: list[tuple[int, int, int]] = []  # (job, cand, node)
    for j in range(J):
        for k in range(pb.nk[j]):
            if pb.u[j, k] < 0:
                continue
            var_x.append((j, k))
    xi = {jk: i for i, jk in enumerate(var_x)}
    nx = len(var_x)
    for j, k in var_x:
        if k == pb.stay[j]:
            continue
        per = pb.cg[j, k] // pb.cm[j, k]
        for n in range(N):
            if pb.cap_g[n] >= per and pb.cap_c[n] >= per * pb.cc[j, k]:
                var_z.append((j, k, n))
    nv = nx + len(var_z)
    c = np.zeros(nv)
    for i, (j, k) in enumerate(var_x):
        c[i] = -pb.u[j, k]
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(entries, lb, ub):
        nonlocal r
        for col, v in entries:
            rows.append(r)
            cols.append(col)
            vals.append(v)
        lo.append(lb)
        hi.append(ub)
        r += 1

    # one candidate per job; pinned and running guaranteed jobs must hold one
    for j in range(J):
        ent = [(xi[(j, k)], 1.0) for k in range(pb.nk[j]) if (j, k) in xi]
        must = bool(pins[j]) or (bool(pb.seed_any[j]) and pb.stay[j] >= 0 and (j, pb.stay[j]) in xi)
        hi_ = 1.0
        if admitted is not None and pb.seed_any[j]:
            must = bool(admitted[j])
            hi_ = 1.0 if admitted[j] else 0.0
        if pins[j] and (j, pb.stay[j]) in xi and (admitted is None or not pb.seed_any[j] or admitted[j]):
            add([(xi[(j, pb.stay[j])], 1.0)], 1.0, 1.0)
        if ent:
            add(ent, 1.0 if must else 0.0, hi_)
    # symmetric placement: sum_n z = m * x
    by_x: dict[tuple[int, int], list[int]] = {}
    for zi, (j, k, n) in enumerate(var_z):
        by_x.setdefault((j, k), []).append(nx + zi)
    for (j, k), zs in by_x.items():
        add([(z, 1.0) for z in zs] + [(xi[(j, k)], -float(pb.cm[j, k]))], 0.0, 0.0)
    for j, k in var_x:
        if k != pb.stay[j] and (j, k) not in by_x:
            add([(xi[(j, k)], 1.0)], 0.0, 0.0)
    # node capacities
    g_ent: list[list] = [[] for _ in range(N)]
    c_ent: list[list] = [[] for _ in range(N)]
    for zi, (j, k, n) in enumerate(var_z):
        per = pb.cg[j, k] // pb.cm[j, k]
        g_ent[n].append((nx + zi, float(per)))
        c_ent[n].append((nx + zi, float(per * pb.cc[j, k])))
    for j in range(J):
        s = pb.stay[j]
        if s < 0 or (j, s) not in xi:
            continue
        for t in range(pb.hold_ptr[j], pb.hold_ptr[j + 1]):
            n = pb.hold_node[t]
            g_ent[n].append((xi[(j, s)], float(pb.hold_g[t])))
            c_ent[n].append((xi[(j, s)], float(pb.hold_c[t])))
    for n in range(N):
        if g_ent[n]:
            add(g_ent[n], -np.inf, float(pb.cap_g[n]))
            add(c_ent[n], -np.inf, float(pb.cap_c[n]))
    A = coo_matrix((vals, (rows, cols)), shape=(r, nv)).tocsr()
    res = milp(
        c, constraints=LinearConstraint(A, lo, hi), integrality=np.ones(nv), bounds=Bounds(0, 1),
        options={"time_limit": time_limit, "disp": False},
    )
    if res.x is None:
        raise RuntimeError(f"MILP failed: {res.message}")
    level = np.full(J, -1, np.int64)
    for i, (j, k) in enumerate(var_x):
        if res.x[i] > 0.5:
            level[j] = k
    return float(-res.fun), level
