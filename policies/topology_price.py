"""Topology in the performance a policy is told (issue 23 item 1): the one pricing the
simulator's policies and the optimizer's both get.

``TopologyPricedOracle(base, links, slowdown)`` wraps a policy's oracle:

- a placement's inter-node links run at the bandwidth of the coarsest level its
  nodes span (``bus_schema.topology.span_level``, priced by ``LinkFactors``: the
  cluster's ``bandwidth``, e.g. ``cluster=0.25``): the base's throughput is divided
  by ``slowdown(spec, plan, per_node, factor)``, the step time with the inter-node
  bandwidth times ``factor`` over the step time at the fitted bandwidth (the
  performance model's own communication terms: ``PerfModelOracle.slowdown`` live,
  the fitted predictor in the simulator; both ``perfmodel.catalog.with_nic_scale``);
- a placement of hypothetical nodes (``_n0``...: the shapes policies price before
  choosing nodes) is priced by the level such a gang can get: the finest level
  with a group of that many nodes with room for its GPUs per node, by the free
  GPUs of the round's nodes (``set_free``; before any: of that many nodes at all;
  none: ``cluster``). A gang ``policies.topology.arrange`` could not keep off slow
  links is not believed fast;
- with ``islands``, the nodes of one ``nvlink-domain`` are one NVLink island: the
  base is asked about one node holding the island's GPUs, so tensor parallelism
  across them is planned and priced as inside one node (only on real nodes: a
  hypothetical shape's nodes may land in any domain).

Node paths come with the round's nodes (``set_paths``); a change of paths changes
``spec_key``/``answers_token``, so policies' cached curves are rebuilt. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gearshift.bus_schema.topology import CLUSTER, NODE, LinkFactors, Path, island_of, levels_of, span_level
from gearshift.policies.api import Placement

Slowdown = Callable[[Any, Any, tuple[int, ...], float], float]


class TopologyPricedOracle:
    """See the module."""

    def __init__(self, base: Any, links: LinkFactors, slowdown: Slowdown, paths: Mapping[str, Path] | None = None,
                 islands: bool = False):
        self.base = base
        self.links = links
        self.slowdown_of = slowdown
        self.islands = islands
        self.version = 0  # set_paths changes: part of spec_key / answers_token
        self.paths: dict[str, Path] = {}
        self._by_nodes: list[tuple[str, int]] = []
        self._free: dict[str, int] | None = None  # the round's free GPUs per node (set_free)
        self._room: dict[int, list[tuple[str, int]]] = {}  # GPUs per node -> _by_nodes among nodes with room
        self._ratio: dict[tuple, float] = {}
        self.set_paths(paths or {})
        self.version = 0
        for name in ("memory_parts",):
            if hasattr(base, name):
                setattr(self, name, getattr(base, name))
        if hasattr(base, "throughput_many"):
            self.throughput_many = self._many
        if hasattr(base, "spec_key"):
            self.spec_key = self._spec_key
        if hasattr(base, "answers_token"):
            self.answers_token = self._answers_token
        if hasattr(base, "plans"):
            self.plans = self._plans

    # ---- the cluster
    def set_paths(self, paths: Mapping[str, Path]) -> None:
        """Each node's path (the round's nodes); unchanged paths change nothing."""
        got = {n: tuple(p) for n, p in paths.items() if p}
        if got == self.paths:
            return
        self.paths = got
        self.version += 1
        levels = levels_of(got.values())
        self._by_nodes = []  # (level, nodes in its largest group), finest first
        for i in range(len(levels) - 1, -1, -1):
            sizes: dict[Path, int] = {}
            for p in got.values():
                if len(p) > i and p[i][0] == levels[i]:
                    sizes[p[: i + 1]] = sizes.get(p[: i + 1], 0) + 1
            self._by_nodes.append((levels[i], max(sizes.values(), default=0)))

    def set_free(self, free: Mapping[str, int] | None) -> None:
        """The round's free GPUs per node (None: price every shape at its best)."""
        got = dict(free) if free is not None else None
        if got == self._free:
            return
        old, was = self._room, self._free
        self._free, self._room = got, {}
        if (was is None) != (got is None) or any(self._level_table(g) != self._level_table(g, old) for g in set(old) | set(self._room)):
            self.version += 1

    def _level_table(self, per_node: int, cache: dict | None = None) -> list[tuple[str, int]]:
        """(level, most nodes with ``per_node`` GPUs free in one of its groups), finest first."""
        cache = self._room if cache is None else cache
        got = cache.get(per_node)
        if got is None and cache is self._room:
            free = self._free
            got = []
            levels = levels_of(self.paths.values())
            for i in range(len(levels) - 1, -1, -1):
                sizes: dict[Path, int] = {}
                for n, p in self.paths.items():
                    if len(p) > i and p[i][0] == levels[i] and (free is None or free.get(n, 0) >= per_node):
                        sizes[p[: i + 1]] = sizes.get(p[: i + 1], 0) + 1
                got.append((levels[i], max(sizes.values(), default=0)))
            cache[per_node] = got
        return got or []

    def level_for(self, nodes: int, per_node: int = 0) -> str:
        """The finest level with a group of ``nodes`` nodes with room for ``per_node``
        GPUs each (``set_free``; one node: ``node``)."""
        if nodes <= 1:
            return NODE
        table = self._level_table(per_node) if self._free is not None else self._by_nodes
        return next((lv for lv, size in table if size >= nodes), CLUSTER)

    def level_of(self, placement: Sequence[Placement]) -> str:
        """The level ``placement`` spans: its nodes' own when they all have paths, else
        the best a gang of that many nodes can have."""
        parts = [p for p in placement if p.gpus > 0]
        paths = [self.paths.get(p.node) for p in parts]
        if len(parts) > 1 and all(p is not None for p in paths):
            return span_level(paths)  # type: ignore[arg-type]
        return self.level_for(len(parts), max((p.gpus for p in parts), default=0))

    def island_view(self, placement: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """``placement`` with the parts on one NVLink island merged into one (``islands``)."""
        if not self.islands or len(placement) < 2 or any(p.node not in self.paths for p in placement):
            return placement
        merged: dict[object, Placement] = {}
        for i, p in enumerate(placement):
            key = island_of(self.paths[p.node])
            key = key if key is not None else ("node", i)
            had = merged.get(key)
            merged[key] = p if had is None else Placement(had.node, had.gpus + p.gpus, had.cpus + p.cpus, had.gpu_type)
        return placement if len(merged) == len(placement) else tuple(merged.values())

    # ---- the answers
    def factor(self, placement: Sequence[Placement]) -> float:
        return self.links.factor(self.level_of(placement))

    def link_slowdown(self, spec: Any, plan: Any, placement: tuple[Placement, ...], f: float) -> float:
        """``slowdown`` of ``plan`` on ``placement`` at factor ``f`` (cached; one node: 1.0)."""
        if f == 1.0 or len(placement) < 2:
            return 1.0
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        key = (spec.model, spec.global_batch, getattr(spec, "cpus_per_gpu", None), plan, per_node, f)
        r = self._ratio.get(key)
        if r is None:
            if len(self._ratio) > 200_000:
                self._ratio.clear()
            r = self._ratio[key] = self.slowdown_of(spec, plan, per_node, f)
        return r

    def throughput(self, job: Any, plan: Any, placement: tuple[Placement, ...]) -> float:
        f = self.factor(placement)
        placement = self.island_view(placement)
        v = self.base.throughput(job, plan, placement)
        return v / self.link_slowdown(job.spec, plan, placement, f) if v > 0 else v

    def _many(self, job: Any, plans: Sequence[Any], placement: tuple[Placement, ...]) -> list[float]:
        f = self.factor(placement)
        placement = self.island_view(placement)
        got = self.base.throughput_many(job, plans, placement)
        return [float(v) / self.link_slowdown(job.spec, p, placement, f) if v > 0 else float(v)
                for p, v in zip(plans, got)]

    def _plans(self, job: Any, placement: tuple[Placement, ...]) -> list[Any]:
        return self.base.plans(job, self.island_view(placement))

    def _spec_key(self, spec: Any) -> object:
        key = self.base.spec_key(spec)
        return key if self.version == 0 else (key, "paths", self.version)

    def _answers_token(self) -> Any:
        token = self.base.answers_token()
        return token if self.version == 0 else (token, self.version)


def ratio_slowdown(step_time: Callable[..., float]) -> Slowdown:
    """A ``Slowdown`` from a step-time predictor ``step_time(spec, plan, per_node,
    nic_scale=...)`` (the simulator's fitted one): step at ``factor`` over step at 1;
    1.0 where either is unknown (0)."""

    def slowdown(spec: Any, plan: Any, per_node: tuple[int, ...], factor: float) -> float:
        base = step_time(spec, plan, per_node)
        slow = step_time(spec, plan, per_node, nic_scale=factor) if base > 0 else 0.0
        return slow / base if base > 0 and slow > 0 else 1.0

    return slowdown
