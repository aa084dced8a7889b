"""Placement parts: where a job's GPUs go, given free capacity per node."""

from __future__ import annotations

from itertools import compress
from operator import attrgetter

from gearshift.policies.api import NodeState, NodeStates, Placement

_SHAPE = attrgetter("name", "gpus_total", "cpus_total", "domain", "gpu_type")  # what a Ledger reads of a node
_POSITIVE = (0).__lt__


def first_fit(
    gpus: int, cpus_per_gpu: int, free_gpus: dict[str, int], free_cpus: dict[str, int], nodes: list[NodeState],
    unit: int = 1,
) -> tuple[Placement, ...] | None:
    """Consolidated first fit: one node if any can hold the job, else the
    fewest nodes (largest free blocks first). ``None`` if it cannot fit.

    ``free_gpus``/``free_cpus`` are read, not changed; see ``take``. Each
    node's share is a multiple of ``unit`` (a tensor-parallel group stays on
    one node).
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
        g -= g % unit
        if g <= 0:
            continue
        out.append(Placement(n.name, g, g * cpus_per_gpu))
        left -= g
    return tuple(out) if left == 0 else None


def packed(gpus: int, per_node: int) -> tuple[int, ...]:
    """GPU counts of ``gpus`` packed onto nodes of ``per_node``: full nodes first,
    the rest on one more node (a request's natural, compact placement)."""
    if gpus <= 0:
        return ()
    full, rest = divmod(gpus, per_node)
    return (per_node,) * full + ((rest,) if rest else ())


def compact_shape(gpus: int, per_node: int, cpus_per_gpu: int, gpu_type: str = "") -> tuple[Placement, ...]:
    """A hypothetical placement (nodes ``_n0``, ``_n1``...) of ``gpus`` packed
    (``packed``), ``cpus_per_gpu`` CPUs per GPU: what policies ask an oracle about."""
    return tuple(Placement(f"_n{i}", g, g * cpus_per_gpu, gpu_type) for i, g in enumerate(packed(gpus, per_node)))


def symmetric_shape(per_node: int, nodes: int, cpus_per_gpu: int, gpu_type: str = "") -> tuple[Placement, ...]:
    """A hypothetical placement of ``per_node`` GPUs on each of ``nodes`` nodes
    (``_n0``, ``_n1``...), as 3D-parallel plans need."""
    return tuple(Placement(f"_n{i}", per_node, per_node * cpus_per_gpu, gpu_type) for i in range(nodes))


def take(placement: tuple[Placement, ...], free_gpus: dict[str, int], free_cpus: dict[str, int]) -> None:
    for p in placement:
        free_gpus[p.node] -= p.gpus
        free_cpus[p.node] -= p.cpus


def largest_block(free_gpus: dict[str, int]) -> int:
    return max(free_gpus.values(), default=0)


class Ledger:
    """Free GPUs/CPUs per node while a round builds its desired state.

    ``reserved`` holds what running jobs not yet decided still occupy: other
    jobs avoid those GPUs when they can, so deciding jobs in priority order
    does not needlessly evict (or migrate) a lower-priority job.
    """

    def __init__(self, nodes: list[NodeState]):
        self.nodes = nodes
        names = [n.name for n in nodes]  # the same dicts as {n.name: ... for n in nodes}, built from one pass
        self.order = dict(zip(names, range(len(names))))
        self.domain = dict(zip(names, [n.domain for n in nodes]))
        self.types = dict(zip(names, [n.gpu_type for n in nodes]))
        self.free_g = dict(zip(names, [n.gpus_total for n in nodes]))
        self.free_c = dict(zip(names, [n.cpus_total for n in nodes]))
        self.res_g = dict.fromkeys(names, 0)
        self.res_c = dict.fromkeys(names, 0)

    # ---- bookkeeping
    def reserve(self, placement: tuple[Placement, ...], sign: int = 1) -> None:
        for p in placement:
            if p.node in self.res_g:
                self.res_g[p.node] += sign * p.gpus
                self.res_c[p.node] += sign * p.cpus

    def fits(self, placement: tuple[Placement, ...]) -> bool:
        return all(
            p.node in self.free_g and self.free_g[p.node] >= p.gpus and self.free_c[p.node] >= p.cpus
            for p in placement
        )

    def take(self, placement: tuple[Placement, ...]) -> None:
        take(placement, self.free_g, self.free_c)

    def give(self, placement: tuple[Placement, ...]) -> None:
        for p in placement:
            self.free_g[p.node] += p.gpus
            self.free_c[p.node] += p.cpus

    def total_free(self) -> int:
        return sum(self.free_g.values())

    def largest_block(self) -> int:
        return largest_block(self.free_g)

    # ---- choosing nodes
    def place(
        self, gpus: int, cpus_per_gpu: int, *, nodes: int | None = None, prefer: tuple[str, ...] = (),
        unit: int = 1,
    ) -> tuple[Placement, ...] | None:
        """Find room for ``gpus`` GPUs with ``cpus_per_gpu`` CPUs each.

        ``nodes=m`` asks for a symmetric shape (``gpus/m`` on each of m
        nodes, as 3D-parallel plans need); ``None`` means consolidated: one
        node if possible, else the fewest nodes. Preference, in order: the
        job's own nodes (``prefer``), capacity nobody reserved, best fit (the
        tightest node that holds the part, to keep large blocks whole), one
        locality domain. ``unit``: every node's share is a multiple of it (a
        plan's tensor-parallel degree: a TP group never spans nodes). Does not
        take the resources.
        """
        if gpus <= 0 or unit < 1 or gpus % unit:
            return None
        # Not enough free GPUs in all: no shape below could hold them (each takes a node's part
        # only where that node has at least as many free; a node's room never exceeds its free).
        # A queue on a full cluster asks this every round.
        if sum(filter(_POSITIVE, self.free_g.values())) < gpus:  # (the free GPUs of nodes with some, in C)
            return None
        if nodes is not None:
            if gpus % nodes or (gpus // nodes) % unit:
                return None
            return self._place_symmetric(gpus // nodes, cpus_per_gpu, nodes, prefer)
        one = self._place_symmetric(gpus, cpus_per_gpu, 1, prefer)
        if one is not None:
            return one
        return self._place_spread(gpus, cpus_per_gpu, prefer, unit)

    def _score(self, name: str, need_g: int, need_c: int, prefer: tuple[str, ...]) -> tuple:
        unreserved = self.free_g[name] - self.res_g[name] >= need_g and self.free_c[name] - self.res_c[name] >= need_c
        return (name not in prefer, not unreserved, self.free_g[name] - need_g, self.order[name])

    def _place_symmetric(
        self, per_node: int, cpus_per_gpu: int, m: int, prefer: tuple[str, ...]
    ) -> tuple[Placement, ...] | None:
        need_c = per_node * cpus_per_gpu
        free_g, free_c = self.free_g, self.free_c
        # the nodes with the GPUs (picked in C: on a busy cluster few have them), then the CPUs
        ok = [n for n in compress(free_g, map(per_node.__le__, free_g.values())) if free_c[n] >= need_c]
        if len(ok) < m:
            return None
        if m == 1:  # the first of the best: what a stable sort puts first
            n = ok[0] if len(ok) == 1 else min(ok, key=lambda n: self._score(n, per_node, need_c, prefer))
            return (Placement(n, per_node, need_c, self.types[n]),)
        ok.sort(key=lambda n: self._score(n, per_node, need_c, prefer))
        if m > 1:
            # Keep a multi-node job inside one locality domain when one holds it.
            by_dom: dict[str, list[str]] = {}
            for n in ok:
                by_dom.setdefault(self.domain[n], []).append(n)
            for dom_nodes in sorted(by_dom.values(), key=lambda v: self._score(v[0], per_node, need_c, prefer)):
                if len(dom_nodes) >= m:
                    ok = dom_nodes
                    break
        return tuple(Placement(n, per_node, need_c, self.types[n]) for n in ok[:m])

    def _place_spread(self, gpus: int, cpus_per_gpu: int, prefer: tuple[str, ...],
                      unit: int = 1) -> tuple[Placement, ...] | None:
        rooms = {}
        for n, fg in self.free_g.items():
            g = min(fg, self.free_c[n] // cpus_per_gpu if cpus_per_gpu else fg)
            rooms[n] = g - g % unit
        if sum(r for r in rooms.values() if r > 0) < gpus:  # the walk below would not place them all
            return None
        order = sorted(self.free_g, key=lambda n: (n not in prefer, -rooms[n], self.order[n]))
        out: list[Placement] = []
        left = gpus
        for n in order:
            if left == 0:
                break
            g = min(rooms[n], left)
            if g > 0:
                out.append(Placement(n, g, g * cpus_per_gpu, self.types[n]))
                left -= g
        return tuple(out) if left == 0 else None


class Ledgers:
    """Fresh ``Ledger`` s round after round for nodes of the same shape (names, totals,
    domains, types: all a Ledger reads of them): the first built from the nodes, the
    next ones copies of its dicts (the read-only ones shared), equal to
    ``Ledger(nodes)``."""

    __slots__ = ("_shape", "_base", "_named", "same")

    def __init__(self) -> None:
        self._shape: list | None = None
        self._base: Ledger | None = None
        self._named: object = None  # the shape the last nodes named (api.NodeStates), if they did
        self.same = False  # the last ``fresh`` was for nodes of the shape of the one before

    def fresh(self, nodes: list[NodeState]) -> Ledger:
        named = nodes.shape if type(nodes) is NodeStates else None
        if named is not None and named is self._named and self._base is not None:
            self.same = True  # (the same shape, as the nodes say)
        else:
            shape = list(map(_SHAPE, nodes))
            self.same = shape == self._shape and self._base is not None
            if not self.same:
                self._shape, self._base = shape, Ledger(nodes)
            self._named = named
        b = self._base
        led = Ledger.__new__(Ledger)
        led.nodes, led.order, led.domain, led.types = nodes, b.order, b.domain, b.types
        led.free_g, led.free_c, led.res_g, led.res_c = b.free_g.copy(), b.free_c.copy(), b.res_g.copy(), b.res_c.copy()
        return led


def describe(placement: tuple[Placement, ...]) -> str:
    return ", ".join(f"{p.node}:{p.gpus}" for p in placement)
