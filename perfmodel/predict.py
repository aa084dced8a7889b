"""Vectorised prediction: plans x resources -> iteration time, throughput,
memory per GPU and feasibility."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from gearshift.perfmodel.memory import memory_per_gpu_gb
from gearshift.perfmodel.model import PerfParams, iteration_time_ms, shape_consts
from gearshift.perfmodel.plans import PlanArray, ResourceArray, Resources, as_plan, enumerate_plans
from gearshift.perfmodel.shapes import ModelShape


@dataclass(frozen=True)
class Prediction:
    iter_time_s: np.ndarray  # seconds per iteration (inf where not valid)
    throughput: np.ndarray  # samples/s (0 where not feasible)
    mem_gb: np.ndarray  # estimated peak memory per GPU, GiB
    feasible: np.ndarray  # valid and fits in GPU memory
    valid: np.ndarray  # plan is well formed for the batch and the resources

    def __len__(self) -> int:
        return int(self.iter_time_s.shape[0])


def as_plan_array(plans: Any, global_batch: int | None = None) -> PlanArray:
    if isinstance(plans, PlanArray):
        return plans
    if (hasattr(plans, "dp") or isinstance(plans, dict)) and not isinstance(plans, (list, tuple)):
        return PlanArray.from_plans([plans], global_batch)
    return PlanArray.from_plans(plans, global_batch)


def as_resource_array(resources: Any, n: int) -> ResourceArray:
    if isinstance(resources, ResourceArray):
        if len(resources) != n:
            raise ValueError(f"{len(resources)} resources for {n} plans")
        return resources
    if isinstance(resources, Resources):
        return ResourceArray.broadcast(resources, n)
    rs = list(resources)
    if len(rs) != n:
        raise ValueError(f"{len(rs)} resources for {n} plans")
    return ResourceArray.from_resources(rs)


def plan_validity(shape: ModelShape, global_batch: int, plans: PlanArray, res: ResourceArray) -> np.ndarray:
    """Plans that are well formed for this batch and these resources: they use
    exactly the offered GPUs, make the global batch, keep TP groups within a
    node's worth of GPUs and have no more stages than layers."""
    ok = (plans.dp >= 1) & (plans.tp >= 1) & (plans.pp >= 1) & (plans.ga >= 1) & (plans.micro_batch >= 1)
    ok &= plans.dp * plans.tp * plans.pp == res.n_gpus
    ok &= plans.dp * plans.ga * plans.micro_batch == int(global_batch)
    ok &= plans.tp <= res.k_max
    ok &= plans.pp <= shape.layers
    ok &= (plans.zero >= 0) & (plans.zero <= 3)
    ok &= ~(plans.offload & (plans.zero == 0))
    return ok


def predict(
    params: PerfParams,
    shape: ModelShape,
    global_batch: int,
    plans: Any,
    resources: Any,
    *,
    engine: str = "numba",
) -> Prediction:
    """Predict every (plan, resources) pair.

    plans: a PlanArray, or plan-like objects (any object/dict with the Plan fields).
    resources: one `Resources` for all plans, a ResourceArray, or one `Resources` per plan.
    engine: "numba" (compiled kernel) or "numpy" (reference).
    """
    pa = as_plan_array(plans, global_batch)
    ra = as_resource_array(resources, len(pa))
    consts = shape_consts(shape)
    if engine == "numba":
        from gearshift.perfmodel.kernels import iteration_time_ms_numba

        t_ms = iteration_time_ms_numba(params.theta, params.cluster, consts, pa, ra)
    elif engine == "numpy":
        t_ms = iteration_time_ms(params.theta, params.cluster, consts, pa, ra)
    else:
        raise ValueError(f"unknown engine {engine!r}")
    valid = plan_validity(shape, global_batch, pa, ra)
    mem = memory_per_gpu_gb(shape, pa)
    feasible = valid & (mem <= params.gpu_mem_gb) & np.isfinite(t_ms) & (t_ms > 0)
    t_s = np.where(valid, t_ms / 1000.0, np.inf)
    tput = np.where(feasible, float(global_batch) / np.where(valid, t_s, 1.0), 0.0)
    return Prediction(t_s, tput, mem, feasible, valid)


def plan_throughput(
    params: PerfParams, shape: ModelShape, global_batch: int, plan: Any, resources: Resources
) -> float:
    """Samples/s of one given plan on one given offer (0 if it cannot run):
    e.g. a guaranteed job's requested plan on its requested GPUs."""
    p = predict(params, shape, global_batch, [as_plan(plan, global_batch)], resources, engine="numpy")
    return float(p.throughput[0])


def best_plan(
    params: PerfParams, shape: ModelShape, global_batch: int, resources: Resources, plans: Iterable[Any] | None = None
):
    """(plan, throughput) of the fastest feasible plan on `resources`
    (over the whole plan space unless `plans` is given); (None, 0.0) if none."""

    pa = enumerate_plans(shape, global_batch, resources) if plans is None else as_plan_array(plans)
    if len(pa) == 0:
        return None, 0.0
    pr = predict(params, shape, global_batch, pa, resources)
    i = int(np.argmax(pr.throughput))
    if pr.throughput[i] <= 0:
        return None, 0.0
    return pa.plan(i), float(pr.throughput[i])
