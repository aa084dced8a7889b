"""Moves that buy nothing, given back.

The greedy (``kernels.py``) places jobs one step at a time, and a running job
climbs back to its own allocation only when its turn comes: by then a job that
starts or switches may have taken one of its nodes, and the running job is
sent, with the same plan and the same GPUs and CPUs per node, to another node
of the same kind. That move changes no speed and costs a restart. On
rubick-base (measured) 162 of the 884 changes rubick made to running jobs were
such moves; with them given back, 68 of 764 remain (the job that took the node
stays where it ran, or does not fit where the moved job was sent).

``give_back_moves`` undoes them after the search: a job moved with no change
of shape gets back each node it lost, and the jobs that took it go where the
moved job was sent, when every one of them moves or starts anyway in this
round (so none of them pays a restart it would not have paid), the two nodes
are alike (GPU type, locality domain, topology path: no job's speed changes)
and the capacity holds. Only a job that gets every node back is changed: it
is then kept where it runs. A job "moved" to the very nodes it holds is kept.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from gearshift.policies.api import JobView, NodeState


def _part(c) -> tuple[int, int]:
    """(GPUs, CPUs) candidate ``c`` takes on each of its nodes (``Candidate.placement_shape``)."""
    per = c.per_node  # the first part of its shape (``placement.symmetric_shape``), not built
    return per, per * c.cpus_per_gpu


def _same_shape(c, j: JobView) -> bool:
    """Candidate ``c`` is ``j``'s own plan with the same GPUs and CPUs on each of as many nodes."""
    return (c.plan == j.plan and c.nodes == len(j.placement)
            and all((p.gpus, p.cpus) == _part(c) for p in j.placement))


def give_back_moves(pb, level: np.ndarray, out_nodes: np.ndarray, jobs: list[JobView],
                    nodes: list[NodeState]) -> int:
    """Give moved jobs their nodes back (module docstring), editing ``level`` (a job given
    back is at its "stay") and ``out_nodes`` (the nodes of the jobs that took them) in
    place. Returns how many jobs were given back."""
    rows, stay = pb.rows, pb.stay
    # (a job whose node is gone has no "stay" to go back to)
    moved = [i for i in np.flatnonzero(pb.running & (stay >= 0) & (level >= 0) & (level != stay)).tolist()
             if _same_shape(rows[i][int(level[i])], jobs[i])]
    if not moved:
        return 0
    ix = {n.name: q for q, n in enumerate(nodes)}
    kind = [(n.gpu_type, n.domain, n.topology) for n in nodes]
    parts: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)  # node -> job -> (GPUs, CPUs)
    for i in np.flatnonzero(level >= 0).tolist():
        if level[i] == stay[i]:
            for p in jobs[i].placement:
                parts[ix[p.node]][i] = (p.gpus, p.cpus)
        else:
            c = rows[i][int(level[i])]
            for q in range(c.nodes):
                parts[int(out_nodes[i, q])][i] = _part(c)
    given = 0
    for i in moved:
        c = rows[i][int(level[i])]
        held = [ix[p.node] for p in jobs[i].placement]
        sent = [int(out_nodes[i, q]) for q in range(c.nodes)]
        lost = [o for o in held if o not in sent]
        spare = [m for m in sent if m not in held]
        pairs = _pairs(i, lost, spare, parts, kind, level, stay, pb.cap_g, pb.cap_c)
        if pairs is None:
            continue
        for o, m, others in pairs:
            for k in others:
                parts[m][k] = parts[o].pop(k)
                row = out_nodes[k]
                row[row == o] = m
            parts[o][i] = parts[m].pop(i)
        level[i] = stay[i]
        given += 1
    return given


def _pairs(i, lost, spare, parts, kind, level, stay, cap_g, cap_c):
    """For each node ``i`` lost, a node it was sent to and the jobs on the lost node,
    so that they can trade places; None when one of the lost nodes has none."""
    out, taken = [], set()
    for o in lost:
        others = [k for k in parts[o] if k != i]
        if any(level[k] == stay[k] for k in others):  # a job kept there would have to move
            return None
        g = sum(parts[o][k][0] for k in others)
        cpu = sum(parts[o][k][1] for k in others)
        for m in spare:
            if m in taken or kind[m] != kind[o]:
                continue
            if any(k in parts[m] for k in others):  # a job holds one part a node
                continue
            used_g = sum(v[0] for v in parts[m].values()) - parts[m][i][0]
            used_c = sum(v[1] for v in parts[m].values()) - parts[m][i][1]
            if used_g + g > cap_g[m] or used_c + cpu > cap_c[m]:
                continue
            out.append((o, m, others))
            taken.add(m)
            break
        else:
            return None
    return out
