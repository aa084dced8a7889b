"""A topology for the simulator (issue 23 item 1): where each node sits, what a
placement's links cost, and whether the policies' decisions are arranged by it.

    python -m sim.cli --trace rubick-base --cluster 16x8 --topology rack=4,nvlink-domain=2 \\
        --bandwidth cluster=0.25 [--topology-flat]

``--topology rack=4,nvlink-domain=2``: the nodes, in order, split evenly into 4
racks, each rack into 2 NVLink domains (levels coarse to fine). Or a cluster file
(``--cluster-file``, JSON): ``{"cluster": "16x8", "topology": {"rack": 4,
"nvlink-domain": 2}, "bandwidth": {"cluster": 0.25}}``, or explicit paths per node
(``"paths": ["rack=r0/nvlink-domain=a", ...]``). ``--topology-interleaved``
(``"interleaved": true``): node i is in the i-th coarsest group round-robin, so node
order (which a flat placer follows) tells nothing of the topology.

Ground truth prices the level a placement spans: its step time times the fitted
model's ratio of the step with the inter-node bandwidth scaled by that level's
factor (``bus_schema.topology.LinkFactors``; ``cluster=0.25``: across racks a
quarter of in-rack) to the step at the fitted bandwidth (without a fitted model the
truth is not changed). Topology-aware (the default) hands the policies each node's
path, a belief that prices a gang by the level it needs (``policies.topology_price``,
the optimizer's pricing too), and
runs ``policies.topology.arrange`` on every decision (the same step as the
optimizer's) with every job preferring the coarsest level whose links are as fast as
any (``rack`` with ``cluster=0.25``: a gang is moved off slow links, not finer for
nothing); flat
(``topology_aware=False``) places as if there were no topology, and pays for it.
The result counts how often each level was spanned by a grant
(``SimTopology.spans``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

from gearshift.bus_schema.topology import (
    LinkFactors, Path, TopologyError, check_level, format_path, levels_of, parse_factors, parse_path, span_level,
)
from gearshift.policies.api import Decision, NodeState, Placement
from gearshift.policies.topology_price import TopologyPricedOracle, ratio_slowdown


def split_paths(nodes: int, counts: Sequence[tuple[str, int]], field: str = "topology",
                interleaved: bool = False) -> list[Path]:
    """Paths of ``nodes`` nodes split evenly: ``[("rack", 4), ("nvlink-domain", 2)]`` = 4
    racks of 2 domains each (values ``r0``, ``r0n1``...: level initial + index). Nodes
    in order fill the first group first; ``interleaved``: node i goes to slot i of a
    round-robin over the coarsest groups (node order then says nothing of topology)."""
    groups = 1
    for lv, k in counts:
        check_level(lv, f"{field}.{lv}")
        if k < 1:
            raise TopologyError(f"{field}.{lv}", f"{k} must be >= 1")
        groups *= k
    if groups == 0 or nodes % groups:
        raise TopologyError(field, f"{nodes} nodes do not split evenly into {groups} groups")
    out = []
    for j in range(nodes):
        top = counts[0][1] if counts else 1
        i = (j % top) * (nodes // top) + j // top if interleaved else j
        path, size, value = [], nodes, ""
        for lv, k in counts:
            size //= k
            value += f"{lv[0]}{(i // size) % k}"
            path.append((lv, value))
        out.append(tuple(path))
    return out


def parse_counts(text: str, field: str = "topology") -> list[tuple[str, int]]:
    """``"rack=4,nvlink-domain=2"`` -> ``[("rack", 4), ("nvlink-domain", 2)]``."""
    out = []
    for part in text.split(","):
        lv, eq, k = part.strip().partition("=")
        if not eq or not k.strip().isdigit():
            raise TopologyError(field, f"{part.strip()!r} is not LEVEL=COUNT (e.g. rack=4,nvlink-domain=2)")
        out.append((lv.strip(), int(k)))
    return out


@dataclass(slots=True)
class SimTopology:
    """Each node's path (in ``ClusterSpec.node_list`` order) and the links' factors."""

    paths: list[Path]
    links: LinkFactors = field(default_factory=LinkFactors)
    aware: bool = True

    @classmethod
    def split(cls, nodes: int, counts: str, bandwidth: str = "", aware: bool = True,
              interleaved: bool = False) -> SimTopology:
        return cls(split_paths(nodes, parse_counts(counts), interleaved=interleaved), parse_factors(bandwidth), aware)

    def label(self) -> str:
        levels = levels_of(self.paths)
        sizes = [len({p[: i + 1] for p in self.paths}) for i in range(len(levels))]
        bw = ",".join(f"{k}={v:g}" for k, v in self.links.factors.items())
        return "/".join(f"{lv}x{n}" for lv, n in zip(levels, sizes)) + (f" bw {bw}" if bw else "") + \
            ("" if self.aware else " (placed flat)")


def load_cluster_file(path: str, default_nodes: int | None = None) -> tuple[str | None, SimTopology | None]:
    """A cluster file (JSON, see the module): (cluster text or None, topology or None)."""
    try:
        doc = json.loads(FsPath(path).read_text())
    except (OSError, ValueError) as e:
        raise TopologyError("cluster-file", f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise TopologyError("cluster-file", f"{path}: expected a JSON object")
    cluster = doc.get("cluster")
    bw = doc.get("bandwidth") or {}
    if not isinstance(bw, dict):
        raise TopologyError("bandwidth", "expected an object of LEVEL: FACTOR")
    links = LinkFactors(bw)
    if "paths" in doc:
        paths = [parse_path(str(p), f"paths[{i}]") for i, p in enumerate(doc["paths"] or [])]
        return cluster, SimTopology(paths, links)
    topo = doc.get("topology")
    if topo is None:
        return cluster, None
    if not isinstance(topo, dict):
        raise TopologyError("topology", "expected an object of LEVEL: COUNT")
    nodes = default_nodes
    if cluster:
        from gearshift.sim.trace import parse_cluster

        nodes = parse_cluster(cluster).nodes
    if nodes is None:
        raise TopologyError("cluster", "a topology of counts needs the cluster's size")
    counts = [(k, int(v)) for k, v in topo.items()]
    return cluster, SimTopology(split_paths(nodes, counts, interleaved=bool(doc.get("interleaved"))), links)


class TopologyStep:
    """What the simulator does with a topology each round and each grant."""

    def __init__(self, topo: SimTopology, names: Sequence[str], predictor: Any = None):
        if len(topo.paths) != len(names):
            raise TopologyError("topology", f"{len(topo.paths)} paths for {len(names)} nodes")
        self.topo = topo
        self.paths = dict(zip(names, topo.paths))
        self.predictor = predictor
        self.spans: dict[str, int] = {}
        self.priced: TopologyPricedOracle | None = None  # the policies' oracle (belief), told the free GPUs
        self.slow_gpu_s = 0.0  # GPU-seconds lost to slow links: held x (1 - 1/slowdown), per grant
        self._held: dict[str, tuple[float, int, float]] = {}  # job -> (granted at, GPUs, slowdown)
        # what every job prefers when topology-aware: the coarsest level whose links are as
        # fast as any (finer levels cost no less; a gang moved finer gains nothing)
        levels = levels_of(topo.paths)
        best = max((topo.links.factor(lv) for lv in levels), default=1.0)
        self.prefer = next((lv for lv in levels if topo.links.factor(lv) >= best), "node")
        # ground truth's pricing: the policies' (policies.topology_price) on the truth's predictor
        self.truth = TopologyPricedOracle(None, topo.links, ratio_slowdown(predictor), self.paths) \
            if predictor is not None else None

    def nodes(self, nodes: list[NodeState]) -> list[NodeState]:
        """The policies' node view: with paths when topology-aware."""
        if self.topo.aware:
            for n in nodes:
                n.topology = self.paths[n.name]
            if self.priced is not None:
                self.priced.set_free({n.name: n.gpus_free for n in nodes})
        return nodes

    def belief(self, base: Any, predictor: Any) -> Any:
        """The policies' oracle: priced by the level a gang spans when topology-aware
        (``policies.topology_price``, the optimizer's pricing)."""
        if not self.topo.aware or predictor is None:
            return base
        self.priced = TopologyPricedOracle(base, self.topo.links, ratio_slowdown(predictor), self.paths)
        return self.priced

    def arrange(self, decision: Decision, nodes: list[NodeState], views: Sequence[Any]) -> None:
        if self.topo.aware:
            from gearshift.policies.topology import arrange

            arrange(decision, nodes, {v.job_id: v for v in views}, prefer=self.prefer)

    def price(self, spec: Any, plan: Any, placement: tuple[Placement, ...], step_time: float,
              held: tuple[str, float] | None = None) -> float:
        """Ground truth's step time on ``placement``, its links priced by the level it
        spans; ``held``: (job, now) of the grant, timed until ``released``."""
        level = span_level([self.paths[p.node] for p in placement])
        self.spans[level] = self.spans.get(level, 0) + 1
        f = self.topo.links.factor(level)
        r = 1.0
        if f != 1.0 and step_time > 0 and self.truth is not None:
            r = self.truth.link_slowdown(spec, plan, placement, f)
        if held is not None:
            self._held[held[0]] = (held[1], sum(p.gpus for p in placement), r)
        return step_time * r

    def released(self, job: str, t: float) -> None:
        got = self._held.pop(job, None)
        if got is not None and got[2] > 1.0:
            self.slow_gpu_s += max(0.0, t - got[0]) * got[1] * (1.0 - 1.0 / got[2])


def describe_paths(paths: Sequence[Path]) -> list[str]:
    return [format_path(p) for p in paths]
