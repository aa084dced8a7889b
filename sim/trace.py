"""What a trace is to the simulator: jobs with submit times, and a cluster shape."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from bus_schema.messages import JobSpec


@dataclass(slots=True, frozen=True)
class ClusterSpec:
    """Homogeneous nodes: ``nodes`` x ``gpus_per_node`` GPUs, ``cpus_per_node`` CPUs."""

    nodes: int
    gpus_per_node: int
    cpus_per_node: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def label(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


_CLUSTER_RE = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*(?::\s*(\d+))?\s*$")

# Rubick's testbed nodes have 96 vCPUs for 8 GPUs; keep that ratio by default.
DEFAULT_CPUS_PER_GPU = 12


def parse_cluster(text: str) -> ClusterSpec:
    """``"8x8"`` = 8 nodes of 8 GPUs; ``"32x4:16"`` adds 16 CPUs per node."""
    m = _CLUSTER_RE.match(text)
    if not m:
        raise ValueError(f"cluster {text!r}: expected NODESxGPUS[:CPUS], e.g. 8x8 or 32x4:16")
    nodes, gpn = int(m.group(1)), int(m.group(2))
    if nodes < 1 or gpn < 1:
        raise ValueError(f"cluster {text!r}: nodes and GPUs per node must be >= 1")
    cpus = int(m.group(3)) if m.group(3) else gpn * DEFAULT_CPUS_PER_GPU
    return ClusterSpec(nodes, gpn, cpus)


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
