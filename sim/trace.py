"""What a trace is to the simulator: jobs with submit times, and a cluster shape."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from gearshift.bus_schema.messages import JobSpec


@dataclass(slots=True, frozen=True)
class NodeGroup:
    """``nodes`` alike nodes: ``gpus_per_node`` GPUs of ``gpu_type``, ``cpus_per_node`` CPUs."""

    gpu_type: str
    nodes: int
    gpus_per_node: int
    cpus_per_node: int

    def label(self) -> str:
        own = f"{self.nodes}x{self.gpus_per_node}"
        if self.cpus_per_node != self.gpus_per_node * DEFAULT_CPUS_PER_GPU:
            own += f":{self.cpus_per_node}"
        return f"{self.gpu_type}:{own}" if self.gpu_type else own


@dataclass(slots=True, frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs, ``cpus_per_node`` CPUs; a mixed cluster
    (``mixed``) lists its ``groups`` of alike nodes, and then ``gpus_per_node`` /
    ``cpus_per_node`` are the largest node's. ``gpu_type``: a homogeneous cluster's
    type ("" = untyped, the performance model's reference GPU)."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int
    gpu_type: str = ""
    groups: tuple[NodeGroup, ...] = ()

    @staticmethod
    def mixed(groups) -> "ClusterSpec":
        """A cluster of node groups, e.g. ``ClusterSpec.mixed([NodeGroup("a100", 8, 8, 96),
        NodeGroup("v100", 8, 8, 96)])``; one group is a homogeneous cluster."""
        groups = tuple(groups)
        if not groups:
            raise ValueError("a cluster needs at least one node group")
        if len(groups) == 1:
            g = groups[0]
            return ClusterSpec(g.nodes, g.gpus_per_node, g.cpus_per_node, g.gpu_type)
        return ClusterSpec(sum(g.nodes for g in groups), max(g.gpus_per_node for g in groups),
                           max(g.cpus_per_node for g in groups), "", groups)

    def node_groups(self) -> tuple[NodeGroup, ...]:
        return self.groups or (NodeGroup(self.gpu_type, self.nodes, self.gpus_per_node, self.cpus_per_node),)

    def node_list(self) -> list[tuple[str, str, int, int]]:
        """(name, GPU type, GPUs, CPUs) of every node, in order: n000, n001, ..."""
        out = []
        for g in self.node_groups():
            for _ in range(g.nodes):
                out.append((f"n{len(out):03d}", g.gpu_type, g.gpus_per_node, g.cpus_per_node))
        return out

    @property
    def gpu_types(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(g.gpu_type for g in self.node_groups()))

    @property
    def gpus(self) -> int:
        return sum(g.nodes * g.gpus_per_node for g in self.node_groups())

    def label(self) -> str:
        if self.groups:
            return ",".join(g.label() for g in self.groups)
        own = f"{self.nodes}x{self.gpus_per_node}"
        return f"{self.gpu_type}:{own}" if self.gpu_type else own


_CLUSTER_RE = re.compile(r"^\s*(?:([a-z0-9]+)\s*:\s*)?(\d+)\s*x\s*(\d+)\s*(?::\s*(\d+))?\s*$")

# Rubick's testbed nodes have 96 vCPUs for 8 GPUs; keep that ratio by default.
DEFAULT_CPUS_PER_GPU = 12


def parse_cluster(text: str) -> ClusterSpec:
    """``"8x8"`` = 8 nodes of 8 GPUs; ``"32x4:16"`` adds 16 CPUs per node;
    ``"a100:8x8,v100:8x8"`` = 8 nodes of 8 A100s and 8 of 8 V100s (TYPE:NODESxGPUS[:CPUS],
    types from ``bus_schema.gputypes.GPU_TYPES``)."""
    from gearshift.bus_schema.gputypes import GPU_TYPES

    groups = []
    for part in text.split(","):
        m = _CLUSTER_RE.match(part.lower())
        if not m:
            raise ValueError(f"cluster {text!r}: expected [TYPE:]NODESxGPUS[:CPUS][,...], e.g. 8x8, 32x4:16 "
                             f"or a100:8x8,v100:8x8")
        gtype = m.group(1) or ""
        if gtype and gtype not in GPU_TYPES:
            raise ValueError(f"cluster {text!r}: unknown GPU type {gtype!r}; known: {', '.join(GPU_TYPES)}")
        nodes, gpn = int(m.group(2)), int(m.group(3))
        if nodes < 1 or gpn < 1:
            raise ValueError(f"cluster {text!r}: nodes and GPUs per node must be >= 1")
        cpus = int(m.group(4)) if m.group(4) else gpn * DEFAULT_CPUS_PER_GPU
        groups.append(NodeGroup(gtype, nodes, gpn, cpus))
    if len(groups) > 1 and not all(g.gpu_type for g in groups):
        raise ValueError(f"cluster {text!r}: every group of a mixed cluster needs its GPU type (TYPE:NODESxGPUS)")
    return ClusterSpec.mixed(groups)


@dataclass(slots=True)
class TraceJob:
    job_id: str
    submit: float  # seconds from trace start
    spec: JobSpec
    # Key of the measured-speed table for this job's model ("" if none exists).
    truth_key: str = ""


@dataclass(slots=True)
class Trace:
    name: str
    jobs: list[TraceJob]
    cluster: ClusterSpec  # the cluster the trace was made for
    # Job ids whose metrics count (None = all). Blox tracks a window of ids.
    tracked: frozenset[str] | None = None
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.jobs.sort(key=lambda j: (j.submit, j.job_id))
        ids = [j.job_id for j in self.jobs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"trace {self.name}: duplicate job ids")

    def head(self, n: int) -> "Trace":
        """The first ``n`` jobs by submit time (for quick runs and tests)."""
        jobs = self.jobs[:n]
        keep = {j.job_id for j in jobs}
        tracked = None if self.tracked is None else frozenset(self.tracked & keep)
        return Trace(self.name, list(jobs), self.cluster, tracked, self.note, dict(self.extra))
