"""Ground truth (how fast a job really runs) and belief (what a policy may know).

Ground truth, ``GroundTruth.step_time(job, plan, placement)``, in seconds per step; the
first source that applies wins, and each result is tagged with its source:

1. ``measured``: the Rubick placements table of the job's model has a row for the
   plan's family (``rubick_catalog.rubick_family``) on this placement (per-node GPU
   counts, order ignored) with a non-zero ``iter_time``. Used as is, no noise.
2. ``request``: the job runs exactly the plan it asked for, on its GPU count, packed
   onto the fewest nodes: the trace's own duration/steps (``spec.step_time``). For
   Blox/ITP/Philly/Tiresias jobs this is the only measured point. No noise.
3. ``perfmodel``: a predictor (the fitted performance model, when one is given) for
   this (plan, placement), times noise (below). For a job whose model has no tables
   (Blox, Philly, ITP, Tiresias, Pollux traces: generic model specs) the prediction is
   used as a ratio to the prediction for the job's request, times the request's
   measured step time; if the model says the request itself cannot run, the
   ``scaled`` rule below is used instead. A predicted 0 means the plan does not
   fit in memory; the job then holds its GPUs without progress (an OOM loop) and is
   counted in ``stalled`` allocations.
4. ``scaled``: no predictor: the nearest measured row of the same model and plan
   family (same node count first, then nearest GPU count), else the job's request,
   scaled by (GPUs_anchor / GPUs)^SCALING_EXP (sub-linear speed-up), and slowed by
   CROSS_NODE_PENALTY per node beyond the anchor's; times noise.

Every source other than ``measured`` and ``request`` is also multiplied by
``unmeasured_slowdown`` (default 1; >1 makes unmeasured configurations slower than
the model believes, to test how much a policy's result leans on the model).

Noise: a log-normal factor exp(N(0, noise)) drawn from a hash of (seed, model or job,
plan family, placement), so it is the same every time the same configuration is
asked for and identical across runs with one seed. ``noise=0`` turns it off.
CPU threads do not change ground-truth speed: the measured tables do not record them.

Belief, ``BeliefOracle``: the ``PerfOracle`` policies get. It never reads the
measured tables. With a predictor (the fitted performance model) it returns the
predictor's throughput (for models the fit does not know, calibrated to the job's
request speed the same way as the truth); without one it delegates to ``policies.oracle.AnalyticOracle``
(a roofline model with no fitted numbers, plan- and memory-aware), so that
plan-choosing policies still see plans differ.
"""

from __future__ import annotations

import csv
import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import msgspec

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.api import JobView, Placement, placement_type
from gearshift.policies.placement import packed
from gearshift.sim.rubick_catalog import GLOBAL_BATCH, MODELS, placement_key, proxy_families, rubick_family
from gearshift.sim.trace import TraceJob

TABLES = Path(__file__).parent / "data" / "rubick" / "placements"

SCALING_EXP = 0.8
CROSS_NODE_PENALTY = 0.25

# predictor(spec, plan, gpus_per_node: tuple[int, ...]) -> seconds per step, 0 if infeasible.
# CPU threads per GPU travel in ``spec.cpus_per_gpu`` (``with_threads``).
Predictor = Callable[[JobSpec, Plan, tuple[int, ...]], float]

_THREADED: dict[tuple[int, int], JobSpec] = {}


def with_threads(spec: JobSpec, placement: tuple[Placement, ...]) -> JobSpec:
    """``spec`` with ``cpus_per_gpu`` = the CPU threads per GPU the placement gives
    (the spec's own value when the placement carries no CPUs)."""
    gpus = sum(p.gpus for p in placement)
    cpus = sum(p.cpus for p in placement)
    if not cpus or not gpus:
        return spec
    threads = max(1, cpus // gpus)
    if threads == spec.cpus_per_gpu:
        return spec
    key = (id(spec), threads)
    hit = _THREADED.get(key)
    if hit is None or hit.name != spec.name:
        hit = _THREADED[key] = msgspec.structs.replace(spec, cpus_per_gpu=threads)
    return hit


def load_tables(folder: Path = TABLES) -> dict[str, dict[tuple[str, str], float]]:
    """model -> {(family, placement key): seconds per iteration} from the placements CSVs."""
    out: dict[str, dict[tuple[str, str], float]] = {}
    for path in sorted(folder.glob("*.csv")):
        model = path.stem
        if model not in GLOBAL_BATCH:  # llama7b_bsz16 / t5_3B: other batch or model than the traces use
            continue
        rows: dict[tuple[str, str], list[float]] = {}
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                t = float(r["iter_time"] or 0)
                key = placement_key(int(c) for c in r["placement"].strip())
                if t > 0 and key:
                    rows.setdefault((r["exec_plan"].strip(), key), []).append(t)
        # A few (plan, placement) pairs were measured twice in different node orders; average them.
        out[model] = {k: sum(v) / len(v) for k, v in rows.items()}
    return out


def _unit_normal(*parts: object) -> float:
    """A standard normal draw determined by ``parts`` (Box-Muller on a hash)."""
    h = hashlib.sha256("|".join(map(str, parts)).encode()).digest()
    u1 = (int.from_bytes(h[:8], "big") + 1) / (2**64 + 2)
    u2 = int.from_bytes(h[8:16], "big") / 2**64
    return math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2)


def _same_kind(a: Plan, b: Plan) -> bool:
    """Same plan up to the micro-batch size (which the trace's plans leave open)."""
    return (a.dp, a.tp, a.pp, a.zero, a.offload, a.ga, a.grad_ckpt) == (b.dp, b.tp, b.pp, b.zero, b.offload, b.ga, b.grad_ckpt)


def _scaled(anchor_time: float, anchor_gpus: int, anchor_nodes: int, gpus: int, nodes: int) -> float:
    t = anchor_time * (anchor_gpus / gpus) ** SCALING_EXP
    return t * (1 + CROSS_NODE_PENALTY * max(0, nodes - anchor_nodes))


def _table_family(f: str) -> str:
    """A table's plan family in ``sim.extended.family`` terms."""
    if (len(f) == 3 and f.isdigit()) or f.startswith("tp"):
        return "3D"
    return "zero-offload" if f.startswith("zero-offload") else f


class GroundTruth:
    def __init__(self, gpus_per_node: int, noise: float = 0.05, seed: int = 0,
                 predictor: Predictor | None = None, tables: dict | None = None, unmeasured_slowdown: float = 1.0,
                 truth_predictor: Predictor | None = None, systematic: float = 0.0,
                 distance_slowdown: float = 0.0, headroom: float | None = None):
        """``predictor``: the belief's model (used for truth only when no
        ``truth_predictor`` is given, the old behaviour). ``truth_predictor``: the
        extended regime's source where nothing was measured (the all-rows fit), times
        ``systematic`` error per (model, family), ``1 + distance_slowdown x distance``
        and an OOM where ``sim.extended.memory_gb`` leaves less than ``headroom``."""
        if unmeasured_slowdown <= 0:
            raise ValueError("unmeasured_slowdown must be > 0")
        for name, v in (("systematic", systematic), ("distance_slowdown", distance_slowdown)):
            if v < 0:
                raise ValueError(f"{name} must be >= 0")
        if headroom is not None and not 0 <= headroom < 1:
            raise ValueError("headroom must be in [0, 1)")
        self.truth_predictor = truth_predictor
        self.systematic = systematic
        self.distance_slowdown = distance_slowdown
        self.headroom = headroom
        self.unmeasured_slowdown = unmeasured_slowdown
        self.gpus_per_node = gpus_per_node
        self.noise = noise
        self.seed = seed
        self.predictor = predictor
        self.tables = load_tables() if tables is None else tables
        self._cache: dict[tuple, tuple[float, str]] = {}
        self._placement: tuple[Placement, ...] = ()
        # family -> rows, per model, for the nearest-row fallback
        self._by_family: dict[str, dict[str, list[tuple[tuple[int, ...], float]]]] = {}
        for model, rows in self.tables.items():
            fam: dict[str, list] = {}
            for (f, key), t in rows.items():
                fam.setdefault(f, []).append((tuple(int(c) for c in key), t))
            self._by_family[model] = fam
        # (family, GPUs) measured per model: the extended truth's distance
        self._measured_at = {m: sorted({(_table_family(f), sum(int(c) for c in key)) for f, key in rows})
                             for m, rows in self.tables.items()}

    def _noise(self, *parts: object) -> float:
        if self.noise <= 0:
            return 1.0
        return math.exp(self.noise * _unit_normal(self.seed, *parts))

    def step_time(self, job: TraceJob, plan: Plan, placement: tuple[Placement, ...]) -> tuple[float, str]:
        if len(placement) == 1:  # (one node: the same values, without the generators)
            p = placement[0]
            per_node = (p.gpus,) if p.gpus > 0 else ()
            threads = p.cpus // max(1, p.gpus if p.gpus > 0 else 0)
            gtype = p.gpu_type or ""
        else:
            per_node = tuple(sorted((p.gpus for p in placement if p.gpus > 0)))
            threads = sum(p.cpus for p in placement) // max(1, sum(per_node))
            gtype = placement_type(placement)
        # The job's own step time is part of the key even for tabled models: the
        # ``request`` source returns it (jobs of one model have different ones).
        ck = (job.job_id if not job.truth_key else job.truth_key, job.spec.step_time,
              job.spec.plan, job.spec.gpus, plan, per_node, threads, gtype)
        hit = self._cache.get(ck)
        if hit is None:
            self._placement = placement
            hit = self._compute(job, plan, per_node)
            if hit[1] not in ("measured", "request"):
                hit = (hit[0] * self.unmeasured_slowdown, hit[1])
            if gtype:
                hit = self._on_type(job, plan, gtype, hit)
            self._cache[ck] = hit
        return hit

    def _on_type(self, job: TraceJob, plan: Plan, gtype: str, hit: tuple[float, str]) -> tuple[float, str]:
        """The reference GPU's truth moved to ``gtype`` (``sim.gputruth``): out of memory
        where the independent estimate leaves under 10% of the type's memory free,
        else slower or faster by the measured (or spec) ratio. Tagged ``source@type``."""
        from gearshift.sim import extended as ext
        from gearshift.sim import gputruth

        t, source = hit
        if t <= 0:
            return hit
        if job.truth_key.startswith("gavel:") and gtype in gputruth.MEASURED_TYPES:
            # Gavel's own job types: its measured steps/s on this type, as a ratio to the
            # reference the rest of the truth was built on (plan and placement effects kept)
            jt, gpus = job.truth_key[6:], plan.gpus
            here, ref = gputruth.gavel_measured(jt, gpus, gtype), gputruth.gavel_request_speed(jt, gpus)
            if here is not None and ref:
                return (0.0, f"oom@{gtype}") if here <= 0 else (t * ref / here, f"{source}@{gtype}")
        mem = gputruth.memory_gb(gtype)
        if mem < ext.GPU_MEM_GB and ext.memory_gb(job.spec.model, job.spec.global_batch, plan) > mem * 0.9:
            return 0.0, f"oom@{gtype}"
        factor, kind = gputruth.speed_factor(gtype, job.spec.model.name)
        if kind == "reference":
            return hit
        return t / factor, f"{source}@{gtype}"

    def _compute(self, job: TraceJob, plan: Plan, per_node: tuple[int, ...]) -> tuple[float, str]:
        spec = job.spec
        gpus, nodes = sum(per_node), len(per_node)
        family = rubick_family(plan)
        key = placement_key(per_node)
        table = self.tables.get(job.truth_key)
        if table and family and key:
            t = table.get((family, key))
            if t:  # the measurement x this run's noise (belief never saw the noise)
                return t * self._noise(job.truth_key, family, key), "measured"
        req_plan = spec.plan or Plan(dp=spec.gpus)
        req_nodes = len(packed(spec.gpus, self.gpus_per_node))
        if spec.step_time and _same_kind(plan, req_plan) and gpus == spec.gpus and nodes <= req_nodes:
            return spec.step_time, "request"
        who = job.truth_key or job.job_id
        noise = self._noise(who, family or plan.label(), key or per_node)
        if self.predictor is not None:
            pred = self.truth_predictor or self.predictor
            t = pred(with_threads(spec, self._placement), plan, per_node)
            if table is None and spec.step_time:
                # No tables for this model: the model gives the ratio to the job's
                # measured request, not the absolute speed.
                ref = pred(spec, req_plan, packed(spec.gpus, self.gpus_per_node))
                if ref <= 0:  # the model cannot even run the measured request: not usable here
                    return _scaled(spec.step_time, spec.gpus, req_nodes, gpus, nodes) * noise, "scaled"
                t = spec.step_time * t / ref
            if t <= 0:
                return 0.0, "perfmodel"
            if self.truth_predictor is None:
                return t * noise, "perfmodel"
            return self._extended(job, plan, gpus, t * noise)
        if table is not None:
            return self._from_tables(job.truth_key, plan, family, per_node, key, noise)
        if spec.step_time:
            return _scaled(spec.step_time, spec.gpus, req_nodes, gpus, nodes) * noise, "scaled"
        raise ValueError(f"job {job.job_id}: no measured speed, no request speed and no predictor")

    def _extended(self, job: TraceJob, plan: Plan, gpus: int, t: float) -> tuple[float, str]:
        """The extended regime where nothing was measured (``sim.extended``)."""
        from gearshift.sim import extended as ext

        spec = job.spec
        if (self.headroom is not None and not self._ran(job, plan, gpus)
                and ext.runs_out_of_memory(spec.model, spec.global_batch, plan, self.headroom)):
            return 0.0, "extended"
        fam = ext.family(plan)
        who = job.truth_key or spec.model.name
        measured = self._measured_at.get(job.truth_key) or [(ext.family(spec.plan or Plan(dp=spec.gpus)), spec.gpus)]
        t *= ext.systematic(self.seed, who, fam, self.systematic)
        t *= 1.0 + self.distance_slowdown * ext.distance(gpus, fam, measured)
        return t, "extended"

    def _ran(self, job: TraceJob, plan: Plan, gpus: int) -> bool:
        """Is there evidence this plan fits in memory: the job's own request, or a
        measured row of its family (memory per GPU depends on the plan, not on the
        placement) on as many GPUs (3D: the same PP-TP-DP digits)."""
        req = job.spec.plan or Plan(dp=job.spec.gpus)
        if _same_kind(plan, req) and gpus == job.spec.gpus:
            return True
        family = rubick_family(plan)
        rows = self._by_family.get(job.truth_key, {}).get(family or "", [])
        return any(sum(shape) == gpus for shape, _ in rows)

    def measured_config(self, spec: JobSpec, plan: Plan, per_node: tuple[int, ...]) -> bool:
        """Is (plan, placement) measured for this job's model, or the job's own request
        (the measured regime's rule for what a policy may choose)?"""
        per_node = tuple(sorted(g for g in per_node if g > 0))
        table = self.tables.get(spec.model.name)
        if table:
            family, key = rubick_family(plan), placement_key(per_node)
            if family and key and table.get((family, key)):
                return True
        req_plan = spec.plan or Plan(dp=spec.gpus)
        return (_same_kind(plan, req_plan) and sum(per_node) == spec.gpus
                and len(per_node) <= len(packed(spec.gpus, self.gpus_per_node)))

    def _from_tables(self, model: str, plan: Plan, family: str | None, per_node: tuple[int, ...],
                     key: str | None, noise: float) -> tuple[float, str]:
        """Ground truth for a Rubick model from related measured rows (no predictor)."""
        gpus, nodes = sum(per_node), len(per_node)
        table = self.tables[model]
        fams, factor = ([family], 1.0) if family else proxy_families(plan)
        if not fams:
            return 0.0, "infeasible"
        if family is None and key:
            ts = [table.get((f, key)) for f in fams]
            if all(ts):
                return max(ts) * factor * noise, "proxy"
        rows_by_fam = self._by_family.get(model, {})
        is_3d = plan.tp > 1 or plan.pp > 1
        times = []
        for f in fams:
            rows = rows_by_fam.get(f, [])
            if is_3d:
                # Another 3D shape of this model that shards the model no finer than this
                # plan is evidence that this one fits; its time, scaled, stands in.
                shard = plan.tp * plan.pp
                rows = [r for g, rs in rows_by_fam.items() if len(g) == 3 and g.isdigit()
                        and int(g[0]) * int(g[1]) <= shard for r in rs] if not rows else rows
            elif f in ("zero-dp", "zero-offload", "zero-offload+gc"):
                rows = [r for r in rows if sum(r[0]) <= gpus]  # ZeRO memory per GPU falls with GPUs
            if not rows:
                return 0.0, "infeasible"  # never measured running: no evidence it fits in memory
            shape, t = min(rows, key=lambda r: (abs(math.log(sum(r[0]) / gpus)), abs(len(r[0]) - nodes), -r[1]))
            times.append(_scaled(t, sum(shape), len(shape), gpus, nodes))
        return max(times) * factor * noise, "scaled"

    def request_step_time(self, job: TraceJob) -> float:
        """Seconds per step of the job's own request on its natural placement (guarantee target)."""
        plan = job.spec.plan or Plan(dp=job.spec.gpus)
        pl = tuple(Placement(f"n{i}", g) for i, g in enumerate(packed(job.spec.gpus, self.gpus_per_node)))
        return self.step_time(job, plan, pl)[0]


def _where(placement: tuple[Placement, ...], per_node: tuple[int, ...]) -> tuple:
    """The placement's part of a belief's cache key: GPUs per node, CPU threads per GPU
    and the GPU type (worked out once for all the plans asked on one placement)."""
    return per_node, sum(p.cpus for p in placement) // sum(per_node), placement_type(placement)


def _answer_key(spec: JobSpec, plan: Plan, where: tuple) -> tuple:
    """What a belief's answer depends on: ``BeliefOracle``'s cache key (one answer per key,
    asked one plan at a time or many); ``where`` from ``_where``."""
    return (spec.model.name, spec.global_batch, spec.step_time, spec.gpus, spec.plan, plan, *where)


class BeliefOracle:
    """The ``PerfOracle`` handed to policies: the fitted model, never the tables.

    ``allowed(spec, plan, per_node)``: the measured regime's rule; a configuration
    it refuses is answered 0 (may not be chosen)."""

    def __init__(self, gpus_per_node: int, predictor: Predictor | None = None,
                 allowed: Callable[[JobSpec, Plan, tuple[int, ...]], bool] | None = None):
        self.allowed = allowed
        self.gpus_per_node = gpus_per_node
        self.predictor = predictor
        self._cache: dict[tuple, float] = {}
        self._analytic = None
        self._live = None  # the optimizer's own oracle class, for the models the fit knows
        if predictor is None:
            from gearshift.policies.oracle import AnalyticOracle

            self._analytic = AnalyticOracle(gpus_per_node=gpus_per_node)
            self.spec_key = self._analytic_key
        else:
            # The same plan space as the optimizer's oracle (perfmodel.enumerate_plans),
            # so a policy weighs the same plans live and in simulation.
            try:
                from gearshift.policies.oracle import PerfModelOracle

                self._live = PerfModelOracle()
                self.plans = self._live.plans
            except ImportError:
                pass

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        spec = job.spec
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        if not per_node:
            return 0.0
        if self._analytic is not None:
            if self.allowed is not None and not self.allowed(spec, plan, per_node):
                return 0.0
            return self._analytic.throughput(job, plan, placement)
        where = _where(placement, per_node)
        ck = _answer_key(spec, plan, where)
        v = self._cache.get(ck)
        if v is None:
            if self.allowed is not None and not self.allowed(spec, plan, per_node):
                v = 0.0
            elif self._live is not None and spec.model.name in MODELS:
                # bit for bit what the optimizer's PerfModelOracle answers (same fit, same kernel)
                v = float(self._live.throughput(job, plan, placement))
            else:
                v = self._compute(with_threads(spec, placement), plan, per_node)
                gtype = where[2]
                if gtype and v > 0:  # a model the fit does not know: the type's spec-based compute ratio
                    from gearshift.perfmodel.gputypes import compute_slowdown

                    v /= compute_slowdown(gtype)
            self._cache[ck] = v
        return v

    def throughput_many(self, job: JobView, plans, placement: tuple[Placement, ...]) -> list[float]:
        """``throughput`` for many plans on one placement, the same answers: the plans
        the fit answers and the cache lacks go to the optimizer's oracle in one batch
        (one ``predict`` call instead of one each; a policy's candidate curve asks
        hundreds of plans per shape, and one at a time that was most of a run's time)."""
        spec = job.spec
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        if self._analytic is not None or self._live is None or spec.model.name not in MODELS or not per_node:
            return [self.throughput(job, p, placement) for p in plans]
        gpus = sum(per_node)
        where = _where(placement, per_node)
        out: list[float] = [0.0] * len(plans)
        todo: list[tuple[int, tuple]] = []
        for i, plan in enumerate(plans):
            ck = _answer_key(spec, plan, where)
            v = self._cache.get(ck)
            if v is None:
                if plan.gpus != gpus or (self.allowed is not None and not self.allowed(spec, plan, per_node)):
                    v = self._cache[ck] = 0.0  # what ``PerfModelOracle.throughput`` answers a mismatch
                else:
                    todo.append((i, ck))
                    continue
            out[i] = v
        if todo:
            got = self._live.throughput_many(job, [plans[i] for i, _ in todo], placement)
            for (i, ck), t in zip(todo, got):
                out[i] = self._cache[ck] = float(t)
        return out

    def _analytic_key(self, spec: JobSpec) -> object:
        """What its answers for ``spec`` depend on through the analytic model
        (``protocols.KeyedOracle``; it has ``spec_key`` only then): the model and the
        global batch (all ``AnalyticOracle`` reads of a spec), with the request (plan,
        GPUs) when the measured regime's rule is on. So jobs of one model and batch
        share the learning oracle's remembered answers. Through the fit it keeps no key
        (a keyless oracle: the learning oracle and the candidates key by the spec minus
        its identity, and a topology-priced oracle over it stays keyless as before)."""
        if self.allowed is None:
            return ("analytic", spec.model, spec.global_batch)
        return ("analytic", spec.model, spec.global_batch, spec.plan, spec.gpus)

    def answers_token(self) -> int:
        """Its answers never change during a run (a fixed fit and a fixed rule), unless
        the optimizer's oracle it answers through gets a new fit."""
        return self._live.answers_token() if self._live is not None else 0

    def memory_parts(self, spec: JobSpec, plans: list[Plan]) -> list[tuple[float, float]] | None:
        """The belief's memory accounting (what the learning oracle's OOM rule reads):
        the optimizer's, or the analytic oracle's without a fitted model."""
        src = self._live if self._live is not None else self._analytic
        return src.memory_parts(spec, plans) if src is not None else None

    def _compute(self, spec: JobSpec, plan: Plan, per_node: tuple[int, ...]) -> float:
        t = self.predictor(spec, plan, per_node)
        if spec.model.name not in MODELS and spec.step_time:
            # A model the fit does not know: calibrate to the speed the job reports for
            # its own request (what a running job tells the scheduler), as the truth does.
            req_plan = spec.plan or Plan(dp=spec.gpus)
            req_nodes = len(packed(spec.gpus, self.gpus_per_node))
            ref = self.predictor(spec, req_plan, packed(spec.gpus, self.gpus_per_node))
            if ref <= 0:
                t = _scaled(spec.step_time, spec.gpus, req_nodes, sum(per_node), len(per_node))
            elif t > 0:
                t = spec.step_time * t / ref
        return spec.global_batch / t if t > 0 else 0.0
