"""A performance oracle that learns from what runs (the same code live and in simulation).

``LearningOracle(base)`` wraps any ``PerfOracle`` (the fitted model) and takes
observations of configurations that actually ran:

    oracle.observe(spec, plan, placement, step_time=0.42)   # seconds per step
    oracle.observe(spec, plan, placement, oom=True)         # out of memory at start

* An observed speed *replaces* the prediction for that configuration (model,
  global batch, plan, per-node GPU counts). Other CPU-thread counts on the same
  configuration keep the model's CPU sensitivity, scaled to the observation.
* It also refits, online, one scale factor per (model, plan family): the
  geometric mean of observed/predicted over the family's observed
  configurations, shrunk towards 1 by a prior worth ``prior`` observations.
  Unobserved configurations of that family are predicted as model x factor.
  (The model's own parameters are not refitted per observation: a joint fit takes
  seconds; this one-parameter correction is what changes between rounds.)
* An out-of-memory start marks the plan infeasible for that model, batch and GPU
  type on any placement (memory per GPU depends on the plan, not on where it
  runs), and with it every plan that needs at least as much memory by the belief's
  own accounting, part by part: weights, gradients, optimizer state, activations
  per GPU (``policies.memory_rule``). A configuration that ran, and any that needs
  no more of any part, stays feasible. The oracle answers 0 for the ruled-out ones and
  policies stop choosing them.

Each observation that changes an answer bumps ``revision`` and the model's entry
in ``spec_key``, so policies' cached curves for that model are rebuilt. The rebuild
is cheap: the base's own answers are remembered (by the base's ``spec_key``, the
request's CPUs/GPU, the placement and the plan; a refit changes the base's key) and
only the correction above is applied again.

Live, the optimizer feeds it from the agents' STEPPED/EXITED reports (step time
between reports of one generation) and OOM exits; in simulation, the engine
feeds it what the ground truth reveals once a job trains (and OOM launches).
"""

from __future__ import annotations

import math
from typing import Any

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.api import JobView, Placement, placement_type
from gearshift.policies.memory_rule import OomRule
from gearshift.policies.protocols import BatchOracle, KeyedOracle, PlanningOracle, TokenedOracle, supports

CHANGE_TOL = 0.02  # an observation within 2% of the current answer changes nothing


def plan_family(plan: Plan) -> str:
    """Rubick's plan families: 3D, zero-offload, zero-dp, gc, ga."""
    if plan.tp > 1 or plan.pp > 1:
        return "3D"
    if plan.offload:
        return "zero-offload"
    if plan.zero:
        return "zero-dp"
    if plan.grad_ckpt:
        return "gc"
    return "ga"


def _norm(plan: Plan, batch: int) -> tuple:
    mb = plan.micro_batch or (batch // max(1, plan.dp * plan.ga))
    return (plan.dp, plan.tp, plan.pp, plan.zero, bool(plan.offload), plan.ga, mb, bool(plan.grad_ckpt))


def _request(spec: JobSpec) -> tuple | None:
    """The job's own plan, normalised (the OOM rule never rules it out by inference)."""
    return _norm(spec.plan, spec.global_batch) if spec.plan is not None else None


def _model_of(spec: JobSpec) -> tuple:
    m = spec.model
    return (m.name, m.params, m.layers, m.hidden, m.seq_len, int(spec.global_batch))


class LearningOracle:
    def __init__(self, base: Any, prior: float = 1.0):
        self.base = base
        self.prior = prior
        self.revision = 0
        # (model, plan, per_node) -> (observed samples/s, the model's prediction then)
        self._exact: dict[tuple, tuple[float, float]] = {}
        self._mem = OomRule(base)  # what OOMs (and runs) say about which plans fit
        self._oom_models: set[tuple] = set()  # models with an OOM (answers depend on the request)
        self._fam: dict[tuple, dict[tuple, float]] = {}  # (model, family) -> {config: log ratio}
        self._factor: dict[tuple, float] = {}  # (model, family) -> refitted scale
        self._version: dict[tuple, int] = {}  # model -> changes
        # The base model's own answers, remembered: what an observation changes is the
        # correction on top of them, so a policy's rebuild after a revision bump costs
        # lookups, not model evaluations. (base's key, CPUs/GPU, placement) -> {plan: samples/s}
        self._raw: dict[tuple, dict] = {}
        self._base_keys: dict[int, tuple] = {}  # id(spec) -> (spec, key), for bases without spec_key
        self._models: dict[int, tuple] = {}  # id(spec) -> (spec, _model_of(spec))
        self._exact_at: dict[tuple, dict] = {}  # (model, per_node) -> {plan: what _exact holds}
        if supports(base, PlanningOracle):
            self.plans = base.plans
        # the base's optional capabilities (policies.protocols), found once
        self._base_key = base.spec_key if supports(base, KeyedOracle) else None
        self._base_many = base.throughput_many if supports(base, BatchOracle) else None
        self._base_token = base.answers_token if supports(base, TokenedOracle) else None

    # ------------------------------------------------------------ learning
    def observe(self, job: JobView | JobSpec, plan: Plan, placement: tuple[Placement, ...], *,
                step_time: float | None = None, oom: bool = False) -> bool:
        """Record what one configuration did; True if any answer changed."""
        spec = job.spec if isinstance(job, JobView) else job
        ck = self.config_key(spec, plan, placement)
        if ck is None:
            return False
        model, pkey, per_node, gt = ck  # (gt: memory and speed differ by GPU type)
        tm = model + (gt,)
        if oom:
            self._oom_models.add(model)
            return self._bump(model) if self._mem.oom(spec, tm, pkey, plan) else False
        if step_time is None or not step_time > 0 or not math.isfinite(step_time):
            return False
        relaxed = self._mem.ran(spec, tm, pkey, plan)  # it fits, and so does what needs no more
        observed = spec.global_batch / step_time
        old = self._exact.get(ck)
        if old is not None and abs(observed / old[0] - 1) <= CHANGE_TOL:  # (the prediction is not needed then)
            return self._bump(model) if relaxed else False
        predicted = float(self._base_one(job, plan, placement))
        self._exact[ck] = self._exact_at.setdefault((model, per_node, gt), {})[pkey] = (observed, predicted)
        if predicted > 0:  # the model's error here refits the family's scale
            fk = (model, plan_family(plan), gt)
            logs = self._fam.setdefault(fk, {})
            logs[(pkey, per_node)] = math.log(observed / predicted)
            self._factor[fk] = math.exp(sum(logs.values()) / (len(logs) + self.prior))
        return self._bump(model)

    @staticmethod
    def config_key(spec: JobSpec, plan: Plan, placement: tuple[Placement, ...]) -> tuple | None:
        """The configuration an observation is of: (model and batch, normalised plan, GPUs
        per node, GPU type); None when the placement does not hold the plan's GPUs."""
        if len(placement) == 1:  # (one node: the same values, without the generators)
            one = placement[0]
            per_node, gt = ((one.gpus,) if one.gpus > 0 else ()), one.gpu_type or ""
        else:
            per_node, gt = tuple(sorted(p.gpus for p in placement if p.gpus > 0)), placement_type(placement)
        if not per_node or sum(per_node) != plan.gpus:
            return None
        return _model_of(spec), _norm(plan, spec.global_batch), per_node, gt

    def _bump(self, model: tuple) -> bool:
        self._version[model] = self._version.get(model, 0) + 1
        self.revision += 1
        return True

    def answers_token(self) -> tuple | None:
        """Changes whenever any answer may change: every change of what it learnt
        bumps ``revision``; the base says its own (None: the base cannot tell)."""
        own = self._base_token
        base = own() if own is not None else None
        return None if base is None else (self.revision, base)

    def infeasible(self, spec: JobSpec, plan: Plan, gpu_type: str = "") -> bool:
        """Ruled out by what ran out of memory (and not freed by what ran)?"""
        return self._mem.blocked(spec, _model_of(spec) + (gpu_type,), _norm(plan, spec.global_batch), plan,
                                 _request(spec))

    def observed(self, spec: JobSpec, plan: Plan, placement: tuple[Placement, ...]) -> float | None:
        """Observed samples/s of exactly this configuration, if it ran."""
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        got = self._exact.get((_model_of(spec), _norm(plan, spec.global_batch), per_node, placement_type(placement)))
        return got[0] if got else None

    # ------------------------------------------------------------ answering
    def spec_key(self, spec: JobSpec) -> object:
        own = self._base_key
        if own is not None:
            base = own(spec)
        else:  # what any oracle's answer may depend on (never shared across models)
            from gearshift.policies.candidates import spec_key

            base = spec_key(spec)
        hit = self._models.get(id(spec))  # asked for every job whenever the revision moves
        if hit is None or hit[0] is not spec:
            if len(self._models) > 100_000:
                self._models.clear()
            hit = self._models[id(spec)] = (spec, _model_of(spec))
        model = hit[1]
        if spec.plan is not None and model in self._oom_models:  # its request is spared (memory_rule)
            return ("learned", base, self._version.get(model, 0), _request(spec))
        return ("learned", base, self._version.get(model, 0))

    def _adjust(self, spec: JobSpec, plan: Plan, placement: tuple[Placement, ...], t: float) -> float:
        if not self._version:
            return t
        model = _model_of(spec)
        if model not in self._version:
            return t
        pkey = _norm(plan, spec.global_batch)
        gt = placement_type(placement)
        tm = model + (gt,)
        if self._mem.has_oom(tm) and self._mem.blocked(spec, tm, pkey, plan, _request(spec)):
            return 0.0
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        if t <= 0:  # the model's (or the regime's) "may not run" stands
            return t
        got = self._exact.get((model, pkey, per_node, gt))
        if got is not None:
            observed, then = got
            # The observation replaces the prediction; other CPU counts on the same
            # configuration keep the model's CPU sensitivity around it.
            return observed * (t / then) if then > 0 else observed
        return t * self._factor.get((model, plan_family(plan), gt), 1.0)

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        return self._adjust(job.spec, plan, placement, self._base_one(job, plan, placement))

    def _base_one(self, job: JobView | JobSpec, plan: Plan, placement: tuple[Placement, ...]) -> float:
        """The base's answer for one plan, remembered (``_memo``) while its key for the spec stands."""
        spec = job.spec if isinstance(job, JobView) else job
        memo = self._memo(spec, placement, "one")
        t = memo.get(plan)
        if t is None:
            view = job if isinstance(job, JobView) else JobView(job_id="_", spec=spec, submitted_at=0.0)
            t = memo[plan] = self.base.throughput(view, plan, placement)
        return t

    def throughput_many(self, job: JobView, plans, placement: tuple[Placement, ...]):
        memo = self._memo(job.spec, placement, "many")  # plan -> (base's answer, normalised plan, family)
        missing = [p for p in plans if p not in memo]
        if missing:
            many = self._base_many
            got = many(job, missing, placement) if many is not None else [self.base.throughput(job, p, placement) for p in missing]
            batch = job.spec.global_batch
            for p, t in zip(missing, got):
                memo[p] = (float(t), _norm(p, batch), plan_family(p))
        rows = [memo[p] for p in plans]
        if not self._version or _model_of(job.spec) not in self._version:
            return [r[0] for r in rows]
        return self._adjust_many(job.spec, placement, plans, rows)

    def _memo(self, spec: JobSpec, placement: tuple[Placement, ...], how: str) -> dict:
        """The base's remembered answers for this spec (by what the base says they
        depend on) and placement. A base whose key changes (a new fit) misses."""
        own = self._base_key
        if own is not None:
            bkey = own(spec)
        else:
            hit = self._base_keys.get(id(spec))
            if hit is None or hit[0] is not spec:
                from gearshift.policies.candidates import spec_key

                if len(self._base_keys) > 100_000:
                    self._base_keys.clear()
                hit = self._base_keys[id(spec)] = (spec, spec_key(spec))
            bkey = hit[1]
        key = (how, bkey, spec.cpus_per_gpu, tuple((p.node, p.gpus, p.cpus, p.gpu_type) for p in placement))
        memo = self._raw.get(key)
        if memo is None:
            if len(self._raw) > 20_000:  # old fits' answers
                self._raw.clear()
            memo = self._raw[key] = {}
        return memo

    def _adjust_many(self, spec: JobSpec, placement: tuple[Placement, ...], plans, rows: list[tuple]) -> list[float]:
        """``_adjust`` over many plans of one model on one placement: the same
        answers, the per-call work done once."""
        model = _model_of(spec)
        gt = placement_type(placement)
        tm = model + (gt,)
        blocked = (self._mem.blocked_many(spec, tm, [(r[1], p) for r, p in zip(rows, plans)], _request(spec))
                   if self._mem.has_oom(tm) else None)
        per_node = tuple(sorted(p.gpus for p in placement if p.gpus > 0))
        here = self._exact_at.get((model, per_node, gt))
        factors = {}
        out = []
        for i, (t, pkey, fam) in enumerate(rows):
            if blocked is not None and blocked[i]:
                out.append(0.0)
            elif t <= 0:
                out.append(t)
            else:
                got = here.get(pkey) if here else None
                if got is not None:
                    observed, then = got
                    out.append(observed * (t / then) if then > 0 else observed)
                else:
                    f = factors.get(fam)
                    if f is None:
                        f = factors[fam] = self._factor.get((model, fam, gt), 1.0)
                    out.append(t * f)
        return out
