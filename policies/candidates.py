"""Allocation candidates: a job's sensitivity curve, made discrete.

A candidate is (GPUs, CPU threads per GPU, nodes it spans, best plan,
predicted throughput). Placements are symmetric (GPUs/nodes on each node), as
3D-parallel plans need and as Rubick's placements are. The list for one job
is the Pareto front of throughput against resource cost, so walking it is
walking the job's sensitivity curve, knees included.

Candidates depend only on the job's model, batch, request and the cluster
shape, so they are cached across jobs and rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gearshift.bus_schema.messages import Plan
from gearshift.bus_schema.plan_support import supported
from gearshift.policies.api import JobView, PerfOracle, Placement, default_plan
from gearshift.policies.placement import symmetric_shape
from gearshift.policies.plans import candidate_plans, scaled_user_plan
from gearshift.policies.protocols import BatchOracle, KeyedOracle, PlanningOracle, RevisedOracle, supports


@dataclass(slots=True, frozen=True)
class Candidate:
    gpus: int
    cpus_per_gpu: int
    nodes: int
    plan: Plan
    throughput: float

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    def placement_shape(self) -> tuple[Placement, ...]:
        return symmetric_shape(self.per_node, self.nodes, self.cpus_per_gpu)

    def describe(self) -> str:
        where = "1 node" if self.nodes == 1 else f"{self.nodes} nodes"
        return f"{self.plan.label()} on {self.gpus} GPUs ({where}, {self.cpus_per_gpu} CPUs/GPU)"


@dataclass(slots=True, frozen=True)
class CandidateSpace:
    """What a policy may vary. rubick: everything; rubick-r: GPUs and plan;
    rubick-n: GPUs only, the user's plan scaled in data parallelism."""

    gpus_per_node: int = 8
    cpus_per_node: int = 96
    total_gpus: int = 64
    n_nodes: int = 8
    vary_plan: bool = True
    vary_cpu: bool = True
    vary_locality: bool = True
    max_scale: float = 2.0  # a job may grow to max(gpus_per_node, max_scale x request)
    cpu_levels: tuple[int, ...] = (1, 2, 4, 8, 12, 16)
    tolerance: float = 0.01  # a step must gain 1% to count (Rubick's knee tolerance)
    max_candidates: int = 32

    def gpu_counts(self, requested: int) -> list[int]:
        G = self.gpus_per_node
        cap = min(self.total_gpus, max(G, int(self.max_scale * requested)))
        counts = {requested} if requested <= self.total_gpus else set()
        g = 1
        while g <= min(G, cap):
            counts.add(g)
            g *= 2
        for k in (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
            if k * G <= cap:
                counts.add(k * G)
        return sorted(counts)

    def node_options(self, gpus: int) -> list[int]:
        G = self.gpus_per_node
        m0 = -(-gpus // G)
        while m0 <= self.n_nodes and gpus % m0:
            m0 += 1
        if m0 > self.n_nodes:
            return []
        out = [m0]
        if self.vary_locality and gpus % (2 * m0) == 0 and 2 * m0 <= self.n_nodes:
            out.append(2 * m0)
        return out

    def cpu_options(self, job: JobView, per_node: int) -> list[int]:
        req = job.spec.cpus_per_gpu or max(1, min(4, self.cpus_per_node // self.gpus_per_node))
        limit = self.cpus_per_node // max(per_node, 1)
        if not self.vary_cpu:
            return [min(req, limit)] if limit >= 1 else []
        return sorted({c for c in (*self.cpu_levels, req) if c <= limit})


def oracle_key(spec, perf) -> object:
    """``spec_key`` plus what the oracle says its answers for this spec depend on
    (a learning oracle's per-model revision): for policies' own speed caches."""
    return (spec_key(spec), perf.spec_key(spec)) if supports(perf, KeyedOracle) else spec_key(spec)


def spec_key(spec) -> object:
    """What an oracle's answer may depend on: the spec minus identity and
    progress fields (name, steps, tenant, priority, guarantee, command)."""
    import msgspec

    return msgspec.structs.replace(
        spec, name="_", steps=1, guaranteed=False, tenant="default", priority=0, command=None, env=None
    )


@dataclass
class CandidateCache:
    space: CandidateSpace
    store: dict = field(default_factory=dict)
    _keys: dict = field(default_factory=dict)  # id(spec) -> (spec, key): specs outlive rounds
    _seen: set = field(default_factory=set)  # keys asked for since the last sweep
    _intern: dict = field(default_factory=dict)  # key -> the one object for equal keys
    slack: int = 1000  # unused entries tolerated beyond twice the used ones
    # (oracle, does it learn): asked once per oracle, not once per job and round (1-1.5 us each)
    _learns: tuple = (None, False)

    def key(self, job: JobView, perf: PerfOracle | None = None) -> object:
        """An oracle may say what its answers depend on (``perf.spec_key(spec)``);
        jobs with equal keys share candidates."""
        hit = self._keys.get(id(job.spec))
        # An oracle that learns says so with ``revision``: its keys change with it.
        if self._learns[0] is not perf:
            self._learns = (perf, supports(perf, RevisedOracle))
        rev = perf.revision if self._learns[1] else 0
        if hit is not None and hit[0] is job.spec and hit[1] is perf:
            if hit[3] == rev:
                return hit[2]
            # a new revision: the key is asked again, but one equal to the last is the
            # same object, so what callers built from it (by identity) stays valid
            o = perf.spec_key(job.spec) if supports(perf, KeyedOracle) else None
            if o == hit[4]:
                self._keys[id(job.spec)] = (job.spec, perf, hit[2], rev, o)
                return hit[2]
            k = self._key(job, perf, o)
        else:
            k, o = self._key(job, perf)
        if len(self._keys) > 100_000:
            self._keys.clear()
            self._intern.clear()
        k = self._intern.setdefault(k, k)  # jobs of equal keys share one (callers may tell them by identity)
        self._keys[id(job.spec)] = (job.spec, perf, k, rev, o)
        return k

    def _key(self, job: JobView, perf: PerfOracle | None, *own_key) -> tuple[object, object] | object:
        """The key and the oracle's own part of it (None without ``spec_key``);
        given that part (``own_key``), the key alone."""
        if not supports(perf, KeyedOracle):
            k, o = spec_key(job.spec), None
        else:
            s = job.spec  # what the candidate grid itself depends on, besides speed
            o = own_key[0] if own_key else perf.spec_key(s)
            k = ("oracle", o, s.gpus, s.plan, s.cpus_per_gpu, s.reconfigurable, s.plan_support)
        return k if own_key else (k, o)

    def sweep(self) -> bool:
        """Call once a round: drop entries no job asked for since the last sweep
        when they outnumber those asked for (a learning oracle's every revision
        makes new keys; the old ones would pile up). True if it dropped any: a
        caller's tables built from dropped lists go with them. Entries are pure
        functions of their key, so a dropped one comes back the same if asked."""
        seen, self._seen = self._seen, set()
        if len(self.store) <= 2 * len(seen) + self.slack:
            return False
        self.store = {k: v for k, v in self.store.items() if k in seen}
        self._intern = {k: k for k in self._intern if k in seen}
        return True

    def asked(self, key: object) -> None:
        """A key asked for again by a caller that kept its candidates (``get`` notes its own):
        ``sweep`` keeps its entry."""
        self._seen.add(key)

    def get(self, job: JobView, perf: PerfOracle) -> list[Candidate]:
        k = self.key(job, perf)
        self._seen.add(k)
        got = self.store.get(k)
        if got is None:
            got = build_candidates(job, perf, self.space)
            self.store[k] = got
        return got


def _plans_for(job: JobView, perf: PerfOracle, space: CandidateSpace, shape: tuple[Placement, ...]) -> list[Plan]:
    gpus = sum(p.gpus for p in shape)
    if not space.vary_plan or not job.spec.reconfigurable:
        p = scaled_user_plan(job.spec, gpus)
        return [p] if p is not None and supported(job.spec, p) else []
    if supports(perf, PlanningOracle):
        plans = list(perf.plans(job, shape))
    else:
        share = min(p.gpus for p in shape)
        plans = list(candidate_plans(job.spec.global_batch, job.spec.model.layers, gpus, share))
    # A plan must use exactly the shape's GPUs (the simulator and the service
    # refuse a plan/placement mismatch); never trust an enumerator on this.
    # Nor a plan the job's script does not run (JobSpec.plan_support).
    return [p for p in plans if p.gpus == gpus and supported(job.spec, p)]


def _evaluate(job: JobView, perf: PerfOracle, plans: list[Plan], shape: tuple[Placement, ...]) -> list[float]:
    if plans and supports(perf, BatchOracle):
        return [float(t) for t in perf.throughput_many(job, plans, shape)]
    return [perf.throughput(job, p, shape) for p in plans]


def _shape(gpus: int, nodes: int, cpg: int) -> tuple[Placement, ...]:
    return symmetric_shape(gpus // nodes, nodes, cpg)


def best_plan(job: JobView, perf: PerfOracle, space: CandidateSpace, gpus: int, nodes: int, cpg: int) -> tuple[Plan | None, float]:
    shape = _shape(gpus, nodes, cpg)
    plans = _plans_for(job, perf, space, shape)
    best, best_thr = None, 0.0
    for p, t in zip(plans, _evaluate(job, perf, plans, shape)):
        if t > best_thr:
            best, best_thr = p, t
    return best, best_thr


def build_candidates(job: JobView, perf: PerfOracle, space: CandidateSpace, top_plans: int = 3) -> list[Candidate]:
    """Every (GPUs, nodes, CPUs/GPU) point with its best plan. The plan space
    is searched in full at the first CPU level; other CPU levels re-rank only
    the ``top_plans`` best plans there plus the best CPU-offload plan (CPU
    threads change the ranking mostly through offload), which keeps the
    oracle calls per job small."""
    raw: list[Candidate] = []
    for g in space.gpu_counts(job.spec.gpus):
        for m in space.node_options(g):
            per = g // m
            levels = space.cpu_options(job, per)
            if not levels:
                continue
            req = job.spec.cpus_per_gpu or 4
            first = min(levels, key=lambda c: (abs(c - req), c))
            shape = _shape(g, m, first)
            plans = _plans_for(job, perf, space, shape)
            thr = _evaluate(job, perf, plans, shape)
            ranked = sorted(range(len(plans)), key=lambda i: -thr[i])
            keep = [plans[i] for i in ranked[:top_plans] if thr[i] > 0]
            off = [plans[i] for i in ranked if plans[i].offload]
            if off and off[0] not in keep:
                keep.append(off[0])
            if ranked and thr[ranked[0]] > 0:
                raw.append(Candidate(g, first, m, plans[ranked[0]], thr[ranked[0]]))
            for c in levels:
                if c == first or not keep:
                    continue
                sh = _shape(g, m, c)
                tt = _evaluate(job, perf, keep, sh)
                i = max(range(len(keep)), key=lambda i: tt[i])
                if tt[i] > 0:
                    raw.append(Candidate(g, c, m, keep[i], tt[i]))
    return pareto(raw, space)


def resource_cost(c: Candidate, cpus_per_gpu_cluster: float) -> float:
    """GPU-equivalents: GPUs plus CPUs weighed by how scarce they are per GPU."""
    return c.gpus + c.gpus * c.cpus_per_gpu / cpus_per_gpu_cluster


def pareto(raw: list[Candidate], space: CandidateSpace) -> list[Candidate]:
    """Per node count, keep candidates that beat every cheaper one by the
    tolerance; then keep the best ``max_candidates`` by throughput."""
    cpg = space.cpus_per_node / space.gpus_per_node
    out: list[Candidate] = []
    for m in sorted({c.nodes for c in raw}):
        group = sorted((c for c in raw if c.nodes == m), key=lambda c: (resource_cost(c, cpg), -c.throughput))
        best = 0.0
        for c in group:
            if c.throughput > best * (1.0 + space.tolerance):
                out.append(c)
                best = c.throughput
    if len(out) > space.max_candidates:
        out.sort(key=lambda c: -c.throughput)
        out = out[: space.max_candidates]
    out.sort(key=lambda c: (resource_cost(c, cpg), c.nodes))
    return out
