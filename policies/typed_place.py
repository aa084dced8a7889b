"""Placing one job on nodes of one GPU type it accepts (mixed clusters, issue 13).

The sharing parts (``sharing``, ``fairshare``) and the priority-class check
(``classes``) place jobs themselves when they repair a policy's decision. On a
mixed cluster a job runs on nodes of a single type, one its ``JobSpec.gpu_types``
accepts (empty: any); nodes say their type in ``NodeState.gpu_type``. Both are
read with ``getattr`` so the parts work on clusters and specs without types.
"""

from __future__ import annotations

from gearshift.policies.placement import Ledger


def _type(node) -> str:
    return getattr(node, "gpu_type", "") or ""


def place(ledger: Ledger, job, plan, prefer: tuple[str, ...] = ()) -> tuple | None:
    """Room for ``plan`` (a tensor-parallel group never spans nodes) on one accepted GPU
    type, the type of ``prefer``'s nodes first, then the one with most free GPUs."""
    cpg = job.spec.cpus_per_gpu or 1
    groups: dict[str, list] = {}
    for n in ledger.nodes:
        groups.setdefault(_type(n), []).append(n)
    accepted = tuple(getattr(job.spec, "gpu_types", ()) or ())
    if len(groups) <= 1 and (not accepted or "" in groups):
        return ledger.place(plan.gpus, cpg, prefer=prefer, unit=plan.tp)
    kind = {n.name: _type(n) for n in ledger.nodes}
    first = next((kind[p] for p in prefer if p in kind), None)
    order = sorted((t for t in groups if not accepted or t in accepted),
                   key=lambda t: (t != first, -sum(ledger.free_g[n.name] for n in groups[t]), t))
    for t in order:
        sub = Ledger(groups[t])
        for d in ("free_g", "free_c", "res_g", "res_c"):
            setattr(sub, d, {n.name: getattr(ledger, d)[n.name] for n in groups[t]})
        spot = sub.place(plan.gpus, cpg, prefer=prefer, unit=plan.tp)
        if spot is not None:
            return spot
    return None


def per_type(ledger: Ledger, job, cands: list, node_of=lambda v: v.placement) -> list[list]:
    """``cands`` (jobs whose GPUs could make room for ``job``) as the orders to try:
    on a mixed cluster first those on each GPU type ``job`` accepts, the type with
    the most free GPUs first (GPUs freed on another type cannot join them: a job runs
    on one type), then all of them; on one type, just ``cands``."""
    kind = {n.name: _type(n) for n in ledger.nodes}
    if len(set(kind.values())) <= 1:
        return [cands]
    accepted = tuple(getattr(job.spec, "gpu_types", ()) or ())
    types = sorted({t for t in kind.values() if not accepted or t in accepted},
                   key=lambda t: (-sum(ledger.free_g[n] for n, k in kind.items() if k == t), t))
    out = []
    for t in types:
        on = [v for v in cands if node_of(v) and all(kind.get(p.node) == t for p in node_of(v))]
        if on:
            out.append(on)
    return out + [cands]


def node_type(node) -> str:
    return _type(node)


def type_of(ledger: Ledger, placement) -> str:
    """The GPU type of the nodes a placement is on ("" untyped)."""
    kind = {n.name: _type(n) for n in ledger.nodes}
    return kind.get(placement[0].node, "") if placement else ""


def accepted_types(ledger: Ledger, job) -> set[str]:
    """The cluster's GPU types ``job`` may run on."""
    accepted = tuple(getattr(job.spec, "gpu_types", ()) or ())
    return {_type(n) for n in ledger.nodes if not accepted or _type(n) in accepted}
