"""Fitting the throughput model from samples: bounded least squares in log
space (scipy `least_squares`), with weak log-normal priors so that a model
with few samples still gets sane values for what its samples do not identify.

A sample is any object with attributes `plan`, `resources`, `global_batch`,
`iter_ms` and optionally `fwd_ms`, `tcc_ms`, `opt_ms` (profiled components of
a data-parallel run; NaN when not recorded).  `Sample` is a ready-made one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from scipy.optimize import least_squares
from scipy.sparse import lil_matrix

from gearshift.perfmodel.model import (
    CLUSTER_BOUNDS,
    CLUSTER_NAMES,
    CLUSTER_PRIOR,
    CPU_SERIAL,
    PARAM_BOUNDS,
    PARAM_NAMES,
    PARAM_PRIOR,
    PerfParams,
    default_cluster,
    default_theta,
    model_terms,
    shape_consts,
)
from gearshift.perfmodel.plans import ConcretePlan, PlanArray, ResourceArray, Resources, as_plan
from gearshift.perfmodel.shapes import ModelShape

# Weight of the profiled components relative to iteration time.  Low: the
# per-phase timers are a different instrument (the artifact's placement rows
# and profiles disagree on them, e.g. ViT ga@2 optimizer 51 vs 18 ms, and
# LLaMA's do not sum to the iteration), so they only break ties between
# parameters that iteration times leave unidentified.
COMPONENT_WEIGHT = 0.05
# Weight of one prior residual (per log-sd).
PRIOR_WEIGHT = 0.1
BOUND_SDS = 3.0
C_OFF_PER_MPARAM = 0.1


@dataclass(frozen=True)
class Sample:
    plan: ConcretePlan
    resources: Resources
    global_batch: int
    iter_ms: float
    fwd_ms: float = float("nan")
    tcc_ms: float = float("nan")
    opt_ms: float = float("nan")
    weight: float = 1.0


class _Block:
    """Arrays of one model's samples, prepared once."""

    def __init__(self, shape: ModelShape, samples: Sequence[Any]):
        if not samples:
            raise ValueError(f"no samples for {shape.name}")
        self.shape = shape
        self.consts = shape_consts(shape)
        plans = [as_plan(s.plan) for s in samples]
        for s, p in zip(samples, plans):
            if p.global_batch != int(s.global_batch):
                raise ValueError(f"sample plan {p.summary} does not make global batch {s.global_batch}")
            if p.gpus != s.resources.n_gpus:
                raise ValueError(f"sample plan {p.summary} needs {p.gpus} GPUs, resources have {s.resources.n_gpus}")
            if not (float(s.iter_ms) > 0):
                raise ValueError("sample iter_ms must be > 0")
        self.plans = PlanArray.from_plans(plans)
        self.res = ResourceArray.from_resources([s.resources for s in samples])
        self.log_iter = np.log([float(s.iter_ms) for s in samples])
        self.weight = np.array([float(getattr(s, "weight", 1.0)) for s in samples])
        comp = np.array([[getattr(s, a, np.nan) for a in ("fwd_ms", "tcc_ms", "opt_ms")] for s in samples], dtype=float)
        dp_only = (self.plans.tp == 1) & (self.plans.pp == 1)
        comp[~dp_only] = np.nan
        comp[~(comp > 0)] = np.nan
        self.comp_mask = np.isfinite(comp)
        self.log_comp = np.log(np.where(self.comp_mask, comp, 1.0))
        self.n_res = len(samples) + int(self.comp_mask.sum())

    def residuals(self, theta: np.ndarray, cluster: np.ndarray) -> np.ndarray:
        t = model_terms(theta, cluster, self.consts, self.plans, self.res)
        r_it = (np.log(np.maximum(t["total"], 1e-9)) - self.log_iter) * self.weight
        comp = np.stack([t["fwd"], t["sync"], t["opt"]], axis=1)
        r_c = (np.log(np.maximum(comp, 1e-9)) - self.log_comp)[self.comp_mask] * COMPONENT_WEIGHT
        return np.concatenate([r_it, r_c])


_TH_MU = np.log([PARAM_PRIOR[n][0] for n in PARAM_NAMES])
_TH_SD = np.array([PARAM_PRIOR[n][1] for n in PARAM_NAMES])
_CL_MU = np.log([CLUSTER_PRIOR[n][0] for n in CLUSTER_NAMES])
_CL_SD = np.array([CLUSTER_PRIOR[n][1] for n in CLUSTER_NAMES])
_TH_LO = np.log([PARAM_BOUNDS[n][0] for n in PARAM_NAMES])
_TH_HI = np.log([PARAM_BOUNDS[n][1] for n in PARAM_NAMES])
_CL_LO = np.log([CLUSTER_BOUNDS[n][0] for n in CLUSTER_NAMES])
_CL_HI = np.log([CLUSTER_BOUNDS[n][1] for n in CLUSTER_NAMES])


def _initial_theta(block: _Block) -> np.ndarray:
    """Start from the priors, with the per-sample compute scaled to the data."""
    th = default_theta()
    ms_per_sample = np.exp(block.log_iter) * block.plans.n_gpus / (block.plans.dp * block.plans.ga * block.plans.micro_batch)
    th[PARAM_NAMES.index("t_fwd")] = max(float(np.median(ms_per_sample)) / 3.5, 1e-3)
    th[PARAM_NAMES.index("t_3d")] = max(float(np.median(ms_per_sample)), 1e-3)
    off = block.plans.offload
    if off.any():
        # Let the CPU step start at half of an offload iteration: log-space
        # gradients vanish if it starts (or collapses) near zero.
        P = block.consts[0]
        cpu = CPU_SERIAL + (1.0 - CPU_SERIAL) / block.res.threads[off]
        per = np.exp(block.log_iter[off]) * 0.5 * block.plans.n_gpus[off] / (P * cpu)
        th[PARAM_NAMES.index("k_cpu")] = max(float(np.median(per)), 1e-4)
    return th


def _prior_mu(shape: ModelShape, theta0: np.ndarray) -> np.ndarray:
    mu = _TH_MU.copy()
    # The compute per sample has a data-driven centre (its prior is wide anyway).
    for name in ("t_fwd", "t_3d", "k_cpu"):
        i = PARAM_NAMES.index(name)
        mu[i] = np.log(theta0[i])
    # ZeRO-Offload's per-iteration host cost (PCIe copies of the fp16 weights
    # and gradients, host synchronisation) grows with the model: centre it at
    # C_OFF_PER_MPARAM ms per million parameters (Rubick data: 0.05-0.25).
    mu[PARAM_NAMES.index("c_off")] = np.log(max(C_OFF_PER_MPARAM * shape.params_m, 1e-3))
    return mu


def _theta_bounds(mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # Hard bounds, and no parameter further than BOUND_SDS prior sds from its
    # centre: a term pushed towards zero in log space loses its gradient.
    return np.maximum(_TH_LO, mu - BOUND_SDS * _TH_SD), np.minimum(_TH_HI, mu + BOUND_SDS * _TH_SD)


def _solve(blocks, mus, x0, fit_cluster, fixed_cluster, prior_weight, max_nfev, loss="linear", f_scale=1.0):
    """One bounded least-squares solve in log space.  x = [log cluster?, log thetas]."""
    np_ = len(PARAM_NAMES)
    nc = len(CLUSTER_NAMES) if fit_cluster else 0
    tb = [_theta_bounds(mu) for mu in mus]
    lo = np.concatenate(([_CL_LO] if fit_cluster else []) + [b[0] for b in tb])
    hi = np.concatenate(([_CL_HI] if fit_cluster else []) + [b[1] for b in tb])
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)

    def unpack(x):
        cl = np.exp(x[:nc]) if fit_cluster else fixed_cluster
        ths = [np.exp(x[nc + i * np_: nc + (i + 1) * np_]) for i in range(len(blocks))]
        return cl, ths

    def fun(x):
        cl, ths = unpack(x)
        parts = []
        for b, th, mu in zip(blocks, ths, mus):
            parts.append(b.residuals(th, cl))
            parts.append(prior_weight * (np.log(th) - mu) / _TH_SD)
        if fit_cluster:
            parts.append(prior_weight * (x[:nc] - _CL_MU) / _CL_SD)
        return np.concatenate(parts)

    # Jacobian sparsity: a model's residuals depend on its own block and the cluster.
    n_rows = sum(b.n_res + np_ for b in blocks) + nc
    sp = lil_matrix((n_rows, x0.size), dtype=int)
    r = 0
    for i, b in enumerate(blocks):
        sp[r:r + b.n_res, nc + i * np_: nc + (i + 1) * np_] = 1
        if fit_cluster:
            sp[r:r + b.n_res, :nc] = 1
        r += b.n_res
        for k in range(np_):
            sp[r + k, nc + i * np_ + k] = 1
        r += np_
    for k in range(nc):
        sp[r + k, k] = 1
    sol = least_squares(fun, x0, bounds=(lo, hi), jac_sparsity=sp, method="trf", loss=loss, f_scale=f_scale,
                        max_nfev=max_nfev, xtol=1e-10, ftol=1e-10, gtol=1e-10)
    return sol.x, float(sol.cost)


def _starts(theta0: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
    """Deterministic multi-start points: the data-scaled prior centre, then
    draws from the priors (the model is non-convex through the overlaps)."""
    rng = np.random.default_rng(seed)
    out = [np.log(theta0)]
    for _ in range(n - 1):
        out.append(np.log(theta0) + rng.normal(0.0, 1.0, size=theta0.size) * np.minimum(_TH_SD, 1.0))
    return out


def fit_joint(
    data: Mapping[str, tuple[ModelShape, Sequence[Any]]],
    *,
    cluster: np.ndarray | None = None,
    prior_weight: float = PRIOR_WEIGHT,
    n_starts: int = 6,
    rounds: int = 2,
    seed: int = 0,
    init: tuple[np.ndarray, Mapping[str, np.ndarray]] | None = None,
    loss: str = "linear",
    f_scale: float = 1.0,
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Fit several models at once with shared cluster constants.

    data: {name: (shape, samples)}.  If `cluster` is given it is held fixed,
    otherwise it is fitted jointly: each model is first fitted alone (several
    starts) with the cluster fixed, then everything is refined together, and
    this is repeated `rounds` times.  `init` = (cluster, {name: theta}) from
    an earlier fit adds a warm start.  `loss`/`f_scale` are scipy's robust
    losses on the log residuals ("soft_l1" with f_scale ~0.05: rows off by more
    than ~5% count about linearly, closer to the mean relative error that
    validation reports and less swayed by a few rows the model cannot explain).
    Returns (cluster, {name: theta}).
    """
    names = list(data)
    blocks = [_Block(*data[m]) for m in names]
    th0 = [_initial_theta(b) for b in blocks]
    mus = [_prior_mu(b.shape, t) for b, t in zip(blocks, th0)]
    fit_cluster = cluster is None
    cl = default_cluster() if fit_cluster else np.asarray(cluster, dtype=float)
    xs = [None] * len(blocks)
    if init is not None:
        if fit_cluster:
            cl = np.asarray(init[0], dtype=float)
        xs = [np.log(init[1][m]) if m in init[1] else None for m in names]
    for rnd in range(rounds if fit_cluster else 1):
        for i, b in enumerate(blocks):
            # n_starts=0 with `init`: refine the warm start only.
            cands = (_starts(th0[i], n_starts, seed + i) if n_starts > 0 or xs[i] is None else []) + (
                [xs[i]] if xs[i] is not None else [])
            best = None
            for x0 in cands:
                x, cost = _solve([b], [mus[i]], x0, False, cl, prior_weight, 200, loss, f_scale)
                if best is None or cost < best[1]:
                    best = (x, cost)
            xs[i] = best[0]
        if not fit_cluster:
            break
        x, _ = _solve(blocks, mus, np.concatenate([np.log(cl)] + xs), True, None, prior_weight, 300, loss, f_scale)
        nc = len(CLUSTER_NAMES)
        cl = np.exp(x[:nc])
        xs = [x[nc + i * len(PARAM_NAMES): nc + (i + 1) * len(PARAM_NAMES)] for i in range(len(blocks))]
    return np.array(cl, dtype=float), {m: np.exp(x) for m, x in zip(names, xs)}


def fit(
    shape: ModelShape,
    samples: Iterable[Any],
    *,
    cluster: np.ndarray | None = None,
    prior_weight: float = PRIOR_WEIGHT,
) -> PerfParams:
    """Fit one model's parameters from its samples, holding the cluster
    constants fixed (default: the constants fitted on the shipped Rubick data)."""
    if cluster is None:
        from gearshift.perfmodel.catalog import shipped_cluster

        cluster = shipped_cluster()
    _, ths = fit_joint({shape.name: (shape, list(samples))}, cluster=cluster, prior_weight=prior_weight)
    return PerfParams(shape.key, ths[shape.name], np.asarray(cluster, dtype=float))
