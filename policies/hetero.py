"""Mixed GPU types for policies that know only one.

A job runs on nodes of one GPU type, among the types it accepts
(``JobSpec.gpu_types``). ``ByType`` runs one instance of a type-unaware policy per
type, on that type's nodes and the jobs it assigned there, and hands each instance a
``TypedOracle`` (the oracle answering for that type). Which type a job gets is the
``chooser``'s:

- ``"balance"`` (FIFO, LAS, Tiresias, AntMan, Synergy: they never modelled types):
  a running job stays where it runs; a waiting one goes to the accepted type with the
  least demand per GPU.
- ``"model"`` (rubick: type chosen with plan and resources from the performance
  model): an LP over (job, type) maximises the sum over jobs of GPUs x normalised speed
  (the job's best predicted speed on that type at its requested GPUs over its best
  type's), subject to each type's GPUs (requests of the jobs placed there; what a
  pinned job holds). A running job moving to another type is worth its speed there
  times T/(T+R) (T: time left there, R: the policy's restart cost), and
  a job inside its minimum run time does not move. Jobs the LP leaves without room
  wait where their speed over that type's queue is best. Within the type the policy
  then co-optimises plan, GPUs, CPUs and placement as before.

On a cluster of one type with no job restricting types, the inner policy is called
unchanged (the oracle typed when the nodes are).

Sia and Gavel model types themselves (``hetero = True``) and are not wrapped.
"""

from __future__ import annotations

import math
from operator import attrgetter

import numpy as np

from gearshift.policies.api import (
    Decision,
    JobView,
    NodeState,
    PerfOracle,
    Placement,
    ShapeMemo,
    accepts,
    default_plan,
    placement_type,
    with_type,
)
from gearshift.policies.candidates import spec_key as plain
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.placement import compact_shape
from gearshift.policies.views import follows
from gearshift.policies.protocols import (
    BatchOracle,
    BudgetedPolicy,
    KeyedOracle,
    ObservingOracle,
    PlanningOracle,
    RevisedOracle,
    SteadyPolicy,
    supports,
)


class TypedOracle:
    """``perf`` answering for GPU type ``gpu_type``: shapes without a type get it."""

    def __init__(self, perf, gpu_type: str):
        self.base = perf
        self.gpu_type = gpu_type
        # the base's capabilities (protocols), offered typed
        if supports(perf, PlanningOracle):
            self.plans = lambda job, placement: perf.plans(job, self._typed(placement))
        if supports(perf, BatchOracle):
            self.throughput_many = lambda job, plans, placement: perf.throughput_many(job, plans, self._typed(placement))
        if supports(perf, ObservingOracle):
            self.observe = perf.observe
        self._revised = supports(perf, RevisedOracle)
        self._own_key = perf.spec_key if supports(perf, KeyedOracle) else None

    @property
    def revision(self):
        return self.base.revision if self._revised else 0

    def _typed(self, placement: tuple[Placement, ...]) -> tuple[Placement, ...]:
        return placement if placement_type(placement) else with_type(placement, self.gpu_type)

    def throughput(self, job: JobView, plan, placement: tuple[Placement, ...]) -> float:
        return self.base.throughput(job, plan, self._typed(placement))

    def spec_key(self, spec) -> object:
        own = self._own_key

        return (self.gpu_type, own(spec) if own is not None else plain(spec))


_SPEC, _GPU_TYPES, _NODE_TYPE = attrgetter("spec"), attrgetter("gpu_types"), attrgetter("gpu_type")


def node_types(nodes: list[NodeState]) -> list[str]:
    return list(dict.fromkeys(map(_NODE_TYPE, nodes)))


def typed_oracle(perf: PerfOracle | None, gpu_type: str):
    """``perf`` answering for ``gpu_type`` (itself for no type): one ``TypedOracle`` per oracle
    and type, kept, so what policies cache by their oracle's identity (candidate keys,
    ``rubick_problem``'s memo) holds from round to round on typed nodes too (a new wrapper
    every round made every job's candidate key be asked again every round)."""
    if not gpu_type:
        return perf
    if perf is None:
        from gearshift.policies.oracle import AnalyticOracle

        perf = AnalyticOracle()
    hit = _TYPED.get((id(perf), gpu_type))
    if hit is None or hit[0] is not perf:
        if len(_TYPED) > 32:  # oracles come and go (a simulator's runs, each holding its caches): not kept alive
            _TYPED.clear()
        hit = _TYPED[id(perf), gpu_type] = (perf, TypedOracle(perf, gpu_type))
    return hit[1]


_TYPED: dict[tuple[int, str], tuple] = {}  # (id(oracle), type) -> (oracle, its TypedOracle): ``typed_oracle``


def best_speed(job: JobView, perf, gpus: int, gpn: int, cpg: int, gpu_type: str) -> float:
    """Best predicted samples/s of the job on ``gpus`` GPUs of a type, compactly placed:
    over the oracle's plans when the job may change plan, else its own plan."""
    shape = compact_shape(gpus, gpn, cpg, gpu_type)
    if job.spec.reconfigurable and supports(perf, PlanningOracle):
        plans = [p for p in perf.plans(job, shape) if p.gpus == gpus]
        if plans:
            vals = (perf.throughput_many(job, plans, shape) if supports(perf, BatchOracle)
                    else [perf.throughput(job, p, shape) for p in plans])
            return float(max(vals, default=0.0))
    plan = default_plan(job.spec)
    if plan.gpus != gpus:
        return 0.0
    return float(perf.throughput(job, plan, shape))


class ByType:
    def __init__(self, factory, name: str, chooser: str = "balance", restart_cost: float = 0.0,
                 min_run_time: float = 0.0, primary=None):
        """``factory()`` makes one more instance of the inner policy (one per type);
        ``primary``: an instance made already (the one single-type clusters use)."""
        if chooser not in ("balance", "model"):
            raise ValueError(f"chooser must be 'balance' or 'model', not {chooser!r}")
        self._forward: dict = {}
        self._factory = factory
        self._primary = primary if primary is not None else factory()
        self.name = name
        self.chooser = chooser
        self.restart_cost = restart_cost
        self.min_run_time = min_run_time
        self._inner: dict[str, object] = {}
        self._one = None  # the inner policy that decided the last round alone (one type), if one did
        self._speed: dict = {}
        self._asked: tuple = (None, True)  # the last list of jobs, whether any of them asked for a GPU type
        self._types = ShapeMemo()  # the nodes' GPU types, once per shape (api.NodeStates)
        self.last_types: dict[str, str] = {}

    _OWN = frozenset({"name", "chooser", "restart_cost", "min_run_time", "last_types", "schedule"})
    # Capabilities (policies.protocols) are declared by a class, never forwarded: a
    # wrapper offers one only where it carries it out for every type (BudgetedByType).
    _DECLARED = frozenset({"set_budget"})

    def __getattr__(self, attr):  # the inner policy's own attributes (last_stats, ...)
        if attr.startswith("_") or attr in self._DECLARED:
            raise AttributeError(attr)
        return getattr(self._primary, attr)

    def __setattr__(self, attr, value):
        """Setting an inner policy's attribute (sharing re-keys the ordering: ``key``)
        sets it on every instance, present and future."""
        if attr.startswith("_") or attr in self._OWN or "_primary" not in self.__dict__ \
                or not hasattr(self._primary, attr):
            object.__setattr__(self, attr, value)
            return
        self._forward[attr] = value
        for pol in {id(p): p for p in [self._primary, *self._inner.values()]}.values():
            setattr(pol, attr, value)

    def inner(self, gpu_type: str):
        got = self._inner.get(gpu_type)
        if got is None:
            got = self._primary if not self._inner else self._factory()
            for attr, value in self._forward.items():
                setattr(got, attr, value)
            self._inner[gpu_type] = got
        return got

    def steady_until(self) -> float:
        """``protocols.SteadyPolicy``: the inner policy's, when the last round had one
        type and no job asked for one (one inner policy decided it all), else -inf."""
        one = self._one
        return one.steady_until() if one is not None and supports(one, SteadyPolicy) else -math.inf

    def _ask_types(self, jobs: list[JobView]) -> bool:
        """Does any job ask for a GPU type? Of a list that follows the last one
        (``policies.views.RoundJobs``), where none did, only its fresh views are read."""
        last, asked = self._asked
        told = follows(jobs, last)
        if told is not None and not asked:
            asked = any(jobs[p].spec.gpu_types for p in told.fresh)
        else:
            asked = any(map(_GPU_TYPES, map(_SPEC, jobs)))  # every job: in C
        self._asked = (jobs, asked)
        return asked

    def schedule(self, now: float, nodes: list[NodeState], jobs: list[JobView], perf: PerfOracle | None) -> Decision:
        types = self._types.get(nodes, node_types)
        if len(types) <= 1 and not self._ask_types(jobs):
            t = types[0] if types else ""
            self._one = self.inner(t)
            return self._one.schedule(now, nodes, jobs, typed_oracle(perf, t))
        self._one = None
        assign = self.assign(now, nodes, jobs, perf, types)
        self.last_types = assign
        d = Decision()
        for t in types:
            tj = [j for j in jobs if assign.get(j.job_id) == t]
            if not tj:
                continue
            if "budget" in self._forward:
                self.inner(t).budget = self._budget_for(t, types, jobs, assign, d)
            sub = self.inner(t).schedule(now, [n for n in nodes if n.gpu_type == t], tj, typed_oracle(perf, t))
            for jid, a in sub.allocations.items():
                a.placement = with_type(tuple(a.placement), t)
                d.allocations[jid] = a
            for jid, why in sub.waiting.items():
                d.waiting[jid] = f"{why} [{t or 'untyped'} GPUs]"
        for j in jobs:
            if j.job_id not in assign:
                what = f"the GPU types it accepts ({', '.join(j.spec.gpu_types)})" if j.spec.gpu_types else "any GPU type"
                d.waiting[j.job_id] = (f"waiting: {j.spec.gpus} GPUs of {what} do not exist; the cluster has "
                                       + ", ".join(f"{t or 'untyped'} x{sum(n.gpus_total for n in nodes if n.gpu_type == t)}"
                                                   for t in types))
        return d

    def _budget_for(self, t: str, types, jobs, assign, d: Decision) -> dict[str, float] | None:
        """Type ``t``'s part of each tenant's budget (``Rubick.budget``, set on this wrapper
        by the sharing part), types decided in order: in proportion to the GPUs its jobs
        sent to ``t`` and the types after it ask for, of what the types decided before left
        it (the last type gets all that is left), so a tenant's parts add up to its budget."""
        total = self._forward.get("budget")
        if total is None:
            return None
        after = types[types.index(t):]
        by_id = {j.job_id: j for j in jobs}
        used: dict[str, float] = {}
        for jid, a in d.allocations.items():
            u = by_id[jid].spec.tenant
            used[u] = used.get(u, 0.0) + sum(p.gpus for p in a.placement)
        here: dict[str, float] = {}
        rest: dict[str, float] = {}
        for j in jobs:
            ty = assign.get(j.job_id)
            if ty in after:
                rest[j.spec.tenant] = rest.get(j.spec.tenant, 0.0) + j.spec.gpus
                if ty == t:
                    here[j.spec.tenant] = here.get(j.spec.tenant, 0.0) + j.spec.gpus
        out = {}
        for u, b in total.items():
            left = max(0.0, b - used.get(u, 0.0))
            out[u] = left if t == types[-1] or not rest.get(u) else left * here.get(u, 0.0) / rest[u]
        return out

    # ------------------------------------------------------------ choosing types
    def assign(self, now, nodes, jobs, perf, types) -> dict[str, str]:
        by_node = {n.name: n.gpu_type for n in nodes}
        cap = {t: sum(n.gpus_total for n in nodes if n.gpu_type == t) for t in types}
        out: dict[str, str] = {}
        current = {}
        for j in jobs:
            if j.running and j.placement and j.placement[0].node in by_node:
                current[j.job_id] = by_node[j.placement[0].node]
        if self.chooser == "model":
            return self._by_model(now, nodes, jobs, perf, types, cap, current)
        load = {t: 0.0 for t in types}
        for j in jobs:
            t = current.get(j.job_id)
            if t is not None:
                out[j.job_id] = t
                load[t] += j.gpus
        for j in jobs:
            if j.job_id in out:
                continue
            ok = [t for t in types if accepts(j.spec, t) and cap[t] >= j.spec.gpus]
            if not ok:
                continue
            t = min(ok, key=lambda t: (load[t] / max(cap[t], 1), types.index(t)))
            out[j.job_id] = t
            load[t] += j.spec.gpus
        return out

    def _speeds(self, job: JobView, perf, nodes, types) -> dict[str, float]:
        key = (id(job.spec), perf.revision if supports(perf, RevisedOracle) else 0)
        hit = self._speed.get(job.job_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        out = {}
        for t in types:
            tn = [n for n in nodes if n.gpu_type == t]
            gpn = max(n.gpus_total for n in tn)
            if not accepts(job.spec, t) or sum(n.gpus_total for n in tn) < job.spec.gpus:
                continue
            cpg = job.spec.cpus_per_gpu or max(1, min(4, max(n.cpus_total for n in tn) // max(gpn, 1)))
            out[t] = best_speed(job, typed_oracle(perf, t) or perf, job.spec.gpus, gpn, cpg, t)
        if len(self._speed) > 50_000:
            self._speed.clear()
        self._speed[job.job_id] = (key, out)
        return out

    def _by_model(self, now, nodes, jobs, perf, types, cap, current) -> dict[str, str]:
        from scipy.optimize import linprog

        perf = perf or AnalyticOracle()
        out: dict[str, str] = {}
        var: list[tuple[int, str, float]] = []  # (job index, type, value)
        fixed_load = {t: 0.0 for t in types}
        free_jobs = []
        for i, j in enumerate(jobs):
            speeds = self._speeds(j, perf, nodes, types)
            best = max(speeds.values(), default=0.0)
            cur = current.get(j.job_id)
            pinned = cur is not None and j.switched_at is not None and now - j.switched_at < self.min_run_time
            if cur is not None and (pinned or best <= 0 or len(speeds) < 2):
                out[j.job_id] = cur
                # a pinned job keeps what it holds (grown past its request, too); another
                # can be shrunk back to its request by the type's own policy
                fixed_load[cur] += j.gpus if pinned else min(j.gpus, j.spec.gpus)
                continue
            if best <= 0:
                if speeds:  # the model says it runs nowhere: let the type's policy say why
                    out[j.job_id] = next(iter(speeds))
                continue
            free_jobs.append(i)
            for t, s in speeds.items():
                v = s / best
                if cur is not None and t != cur and s > 0:
                    left = j.remaining_steps * j.spec.global_batch / s
                    v *= left / (left + self.restart_cost)
                var.append((i, t, v))
        if not var:
            return out
        n = len(var)
        # Each job's normalised speed weighted by its GPUs: what the type's GPUs deliver.
        # Unweighted, many small jobs that lose a little on the slow type would keep the
        # fast GPUs from a large job that runs nowhere else (it would wait for hours).
        c = -np.array([v * jobs[i].spec.gpus for i, _, v in var]) \
            - 1e-6 * np.array([1.0 if current.get(jobs[i].job_id) == t else 0.0 for i, t, _ in var])
        rows, b = [], []
        idx = {i: k for k, i in enumerate(free_jobs)}
        A = np.zeros((len(free_jobs) + len(types), n))
        for k, (i, t, _) in enumerate(var):
            A[idx[i], k] = 1.0
            A[len(free_jobs) + types.index(t), k] = jobs[i].spec.gpus
        b = [1.0] * len(free_jobs) + [max(0.0, cap[t] - fixed_load[t]) for t in types]
        r = linprog(c, A_ub=A, b_ub=np.array(b), bounds=[(0.0, 1.0)] * n, method="highs")
        x = r.x if r.status == 0 else np.zeros(n)
        share: dict[int, dict[str, float]] = {}
        value: dict[int, dict[str, float]] = {}
        for k, (i, t, v) in enumerate(var):
            share.setdefault(i, {})[t] = x[k]
            value.setdefault(i, {})[t] = v
        load = dict(fixed_load)
        leftovers = []
        for i in free_jobs:
            got = share.get(i, {})
            t, xt = max(got.items(), key=lambda kv: (kv[1], value[i][kv[0]]), default=(None, 0.0))
            if t is None or xt < 0.5:
                leftovers.append(i)
                continue
            out[jobs[i].job_id] = t
            load[t] += jobs[i].spec.gpus
        # No room anywhere now: wait where speed / (1 + queue per GPU) is best.
        for i in sorted(leftovers, key=lambda i: jobs[i].submitted_at):
            j = jobs[i]
            cur = current.get(j.job_id)
            opts = value.get(i, {})
            if cur is not None and cur in opts:
                t = cur
            else:
                t = max(opts, key=lambda t: opts[t] / (1.0 + load[t] / max(cap[t], 1)))
            out[j.job_id] = t
            load[t] += j.spec.gpus
        return out


class BudgetedByType(ByType):
    """``ByType`` over a policy that plans within tenant budgets (``protocols.BudgetedPolicy``):
    the budget goes to every instance, present and future (``ByType.__setattr__``), each
    type's instance getting its part (``_budget_for``)."""

    def set_budget(self, budget: dict[str, float] | None) -> None:
        self.budget = budget


def by_type(factory, name: str, chooser: str = "balance", restart_cost: float = 0.0, min_run_time: float = 0.0,
            primary=None) -> ByType:
    """``ByType`` with the capabilities of the policy it runs per type."""
    primary = primary if primary is not None else factory()
    cls = BudgetedByType if isinstance(primary, BudgetedPolicy) else ByType
    return cls(factory, name, chooser, restart_cost, min_run_time, primary)
