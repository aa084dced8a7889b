"""Placement parts: where a job's GPUs go, given free capacity per node."""

from __future__ import annotations

from .api import NodeState, Placement


def first_fit(
    gpus: int, cpus_per_gpu: int, free_gpus: dict[str, int], free_cpus: dict[str, int], nodes: list[NodeState]
) -> tuple[Placement, ...] | None:
    """Consolidated first fit: one node if any can hold the job, else the
    fewest nodes (largest free blocks first). ``None`` if it cannot fit.

    ``free_gpus``/``free_cpus`` are read, not changed; see ``take``.
    """
    for n in nodes:
        if free_gpus[n.name] >= gpus and free_cpus[n.name] >= gpus * cpus_per_gpu:
            return (Placement(n.name, gpus, gpus * cpus_per_gpu),)
    # Spread: largest free blocks first so the job spans as few nodes as possible.
    order = sorted(nodes, key=lambda n: -free_gpus[n.name])
    out: list[Placement] = []
    left = gpus
    for n in order:
        if left == 0:
            break
        g = min(free_gpus[n.name], left, free_cpus[n.name] // cpus_per_gpu if cpus_per_gpu else left)
        if g <= 0:
            continue
        out.append(Placement(n.name, g, g * cpus_per_gpu))
        left -= g
    return tuple(out) if left == 0 else None


def take(placement: tuple[Placement, ...], free_gpus: dict[str, int], free_cpus: dict[str, int]) -> None:
    for p in placement:
        free_gpus[p.node] -= p.gpus
        free_cpus[p.node] -= p.cpus


def largest_block(free_gpus: dict[str, int]) -> int:
    return max(free_gpus.values(), default=0)
