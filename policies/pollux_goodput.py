"""Pollux's goodput model (OSDI'21, Qiao et al.): goodput = throughput x statistical efficiency.

Written from the paper (section 3) and the authors' code, not copied from it; the rules
follow ``petuum/adaptdl`` (branch ``osdi21-artifact``) ``simulator/goodput.py``:

- throughput (``GoodputFunction.throughput``): a step of ``accum`` accumulation
  micro-steps plus one synchronising step. Compute time is linear in the per-GPU
  ("atomic") batch, ``alpha_c + beta_c * atomic``; network time is ``alpha_n + beta_n *
  max(replicas - 2, 0)`` across nodes, ``alpha_r + beta_r * ...`` inside one node, ~0 on
  one GPU (``_predict_network_time``); the synchronising step overlaps the two as a
  gamma-norm, ``(compute^g + network^g)^(1/g)`` (``_predict_log_optim_time``).
  samples/s = batch / (accum x compute + sync step).
- statistical efficiency (``GoodputFunction.efficiency``) from the gradient noise scale:
  with ``scale = batch / init_batch``, ``gain = (var + sqr) / (var / scale + sqr)`` and
  efficiency = ``gain / scale`` (= (PGNS + init) / (PGNS + batch)).
- the best batch for an allocation (``GoodputFunction.optimize``): 50 batch sizes in
  geometric space between ``max(init, min_atomic x replicas)`` and the job's largest
  batch; the local batch is split into accumulation steps when it exceeds the largest
  atomic batch, with at least one accumulation step on one GPU above the initial batch
  (AdaptDL's gradient statistics need two micro-batches there); configurations whose
  atomic batch is outside its range have goodput 0.
- fitting (``fit_perf_params``): the seven parameters minimise the RMS log error of the
  compute time and of the step time, plus ``1e-3 (gamma-1)^2`` and ``1e-2 ((beta_n /
  alpha_n)^2 + (beta_r/alpha_r)^2)``; parameters no observation can tell apart are held
  (one atomic batch: ``alpha_c`` = half the mean compute time; no multi-node row: the
  inter-node terms; no one-node multi-GPU row: the intra-node terms; never more than 2
  replicas: both retrogression terms), and without a multi-node row the inter-node terms
  are at least 1.1 x the intra-node ones. AdaptDL takes the gradient from autograd; ours
  is written out (``_objective``) for scipy's L-BFGS-B (same objective, same bounds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.optimize

_EPS = 1e-8
_BATCH_SAMPLES = 50  # AdaptDL's np.geomspace default


@dataclass(slots=True, frozen=True)
class PerfParams:
    alpha_c: float
    beta_c: float
    alpha_n: float
    beta_n: float
    alpha_r: float
    beta_r: float
    gamma: float

    def astuple(self) -> tuple[float, ...]:
        return (self.alpha_c, self.beta_c, self.alpha_n, self.beta_n, self.alpha_r, self.beta_r, self.gamma)


def compute_time(p, atomic):
    return p.alpha_c + p.beta_c * np.asarray(atomic, dtype=float)


def network_time(p, nodes, replicas):
    nodes = np.asarray(nodes)
    replicas = np.asarray(replicas)
    conds = [nodes > 1, replicas > 1]
    base = np.select(conds, [p.alpha_n, p.alpha_r], _EPS)
    retro = np.select(conds, [p.beta_n, p.beta_r], _EPS) * np.maximum(replicas - 2, _EPS)
    return base + retro


def sync_step_time(p, compute, network):
    g = p.gamma
    return (np.asarray(compute) ** g + np.asarray(network) ** g) ** (1.0 / g)


def step_time(p, nodes, replicas, atomic, accum):
    """Seconds of one optimiser step: ``accum`` extra micro-steps + the synchronising one."""
    c = compute_time(p, atomic)
    return np.asarray(accum) * c + sync_step_time(p, c, network_time(p, nodes, replicas))


def efficiency(batch, init_batch: float, grad_sqr: float, grad_var: float):
    """Statistical efficiency of ``batch`` relative to ``init_batch`` (<= 1 above it)."""
    scale = np.asarray(batch, dtype=float) / init_batch
    denom = grad_var / scale + grad_sqr
    gain = np.where(denom > 0, (grad_var + grad_sqr) / np.where(denom > 0, denom, 1.0), 1.0)
    return gain / scale


@dataclass(slots=True, frozen=True)
class BatchLimits:
    init_batch: int
    max_batch: int
    min_atomic: int
    max_atomic: int


class GoodputModel:
    """One job's goodput function: its fitted ``PerfParams`` and its current gradient statistics."""

    __slots__ = ("params", "grad_sqr", "grad_var", "limits")

    def __init__(self, params: PerfParams, grad_sqr: float, grad_var: float, limits: BatchLimits):
        self.params = params
        self.grad_sqr = float(grad_sqr)
        self.grad_var = float(grad_var)
        self.limits = limits

    def throughput(self, nodes, replicas, atomic, accum):
        batch = np.asarray(replicas) * np.asarray(atomic) * (np.asarray(accum) + 1)
        return batch / step_time(self.params, nodes, replicas, atomic, accum)

    def goodput(self, nodes, replicas, atomic, accum):
        batch = np.asarray(replicas) * np.asarray(atomic) * (np.asarray(accum) + 1)
        return self.throughput(nodes, replicas, atomic, accum) * efficiency(
            batch, self.limits.init_batch, self.grad_sqr, self.grad_var)

    def best(self, nodes, replicas):
        """(goodput, atomic batch, accumulation steps) of the best batch on each
        (nodes, replicas); arrays of the broadcast shape (scalars for scalars)."""
        lim = self.limits
        scalar = np.isscalar(nodes) and np.isscalar(replicas)
        shape = np.broadcast(nodes, replicas).shape
        n = np.broadcast_to(nodes, shape).ravel().astype(float)
        r = np.broadcast_to(replicas, shape).ravel().astype(float)
        lo = np.maximum(lim.init_batch, lim.min_atomic * r)
        hi = np.maximum(lo, lim.max_batch)
        batch = np.geomspace(lo, hi, _BATCH_SAMPLES)  # (samples, configs)
        local = batch / r
        accum = np.ceil(local / lim.max_atomic - _EPS) - 1
        accum = np.where((r == 1) & (local > lim.init_batch + _EPS), np.maximum(accum, 1), accum).astype(int)
        atomic = np.ceil(local / (accum + 1) - _EPS).astype(int)
        g = self.goodput(n, r, atomic, accum)
        g = np.where((atomic >= lim.min_atomic) & (atomic <= lim.max_atomic), g, 0.0)
        idx = np.argmax(g, axis=0)
        cols = np.arange(g.shape[1])
        out = g[idx, cols].reshape(shape), atomic[idx, cols].reshape(shape), accum[idx, cols].reshape(shape)
        if scalar:
            return float(out[0].item()), int(out[1].item()), int(out[2].item())
        return out


def _objective(x, nodes, replicas, atomic, compute_obs, step_obs):
    """The fitting objective and its gradient (written out: AdaptDL takes it from autograd)."""
    ac, bc, an, bn, ar, br, g = x
    inter = (nodes > 1).astype(float)
    intra = ((nodes <= 1) & (replicas > 1)).astype(float)
    m = np.maximum(replicas - 2, _EPS)
    c = ac + bc * atomic
    net = inter * (an + bn * m) + intra * (ar + br * m) + (1 - inter - intra) * (_EPS + _EPS * m)
    cg, ng = c ** g, net ** g
    tot = cg + ng
    s = np.log(tot) / g
    k = len(c)
    d1 = np.log(c) - np.log(compute_obs)
    d2 = s - np.log(step_obs)
    e1 = np.sqrt(np.mean(d1 ** 2))
    e2 = np.sqrt(np.mean(d2 ** 2))
    f = e1 + e2 + 1e-3 * (g - 1) ** 2 + 1e-2 * ((bn / an) ** 2 + (br / ar) ** 2)
    w1 = d1 / (max(e1, 1e-12) * k)
    w2 = d2 / (max(e2, 1e-12) * k)
    ds_dc = c ** (g - 1) / tot
    ds_dn = net ** (g - 1) / tot
    ds_dg = -np.log(tot) / g ** 2 + (cg * np.log(c) + ng * np.log(net)) / (g * tot)
    dc = w1 / c + w2 * ds_dc  # d f / d c_i
    dn = w2 * ds_dn
    grad = np.array([
        dc.sum(), (dc * atomic).sum(),
        (dn * inter).sum() - 2e-2 * bn ** 2 / an ** 3, (dn * inter * m).sum() + 2e-2 * bn / an ** 2,
        (dn * intra).sum() - 2e-2 * br ** 2 / ar ** 3, (dn * intra * m).sum() + 2e-2 * br / ar ** 2,
        (w2 * ds_dg).sum() + 2e-3 * (g - 1),
    ])
    return f, grad


def fit_perf_params(nodes, replicas, atomic, step_times, sync_times) -> PerfParams:
    """Fit ``PerfParams`` to observed (nodes, replicas, atomic batch) -> (step, sync) seconds."""
    nodes = np.asarray(nodes, dtype=float)
    replicas = np.asarray(replicas, dtype=float)
    atomic = np.asarray(atomic, dtype=float)
    step_obs = np.asarray(step_times, dtype=float)
    compute_obs = np.maximum(step_obs - np.asarray(sync_times, dtype=float), _EPS)
    x0 = [1e-1, 1e-2] * 3 + [1.0 + 1e-3]
    lower = [1e-8, 1e-8] * 3 + [1.0]
    upper = [np.inf, np.inf] * 3 + [10.0]

    def hold(i, v):
        x0[i] = lower[i] = upper[i] = v

    if len(np.unique(atomic)) == 1:
        hold(0, float(np.mean(compute_obs)) / 2)
    if not np.any(nodes > 1):
        hold(2, lower[2])
        hold(3, lower[3])
    if not np.any((nodes == 1) & (replicas > 1)):
        hold(4, lower[4])
        hold(5, lower[5])
    if not np.any(replicas > 2):
        hold(3, lower[3])
        hold(5, lower[5])
    free = [i for i in range(7) if lower[i] != upper[i]]
    x = np.array(x0, dtype=float)
    if free:
        def f(z):
            y = x.copy()
            y[free] = z
            v, gr = _objective(y, nodes, replicas, atomic, compute_obs, step_obs)
            return v, gr[free]

        # adaptdl calls L-BFGS-B with scipy's default tolerances. scipy >= 1.15
        # (its C port of L-BFGS-B) stops far earlier with them on this objective:
        # f 0.033 after 71 iterations against 0.0019 after 156, and step times
        # 5.6% off instead of 0.4% on a noiseless fit (tests/test_pollux_optimus).
        # Tight tolerances give the fit the authors' scipy reached.
        res = scipy.optimize.minimize(f, x[free], jac=True, method="L-BFGS-B",
                                      bounds=[(lower[i], upper[i]) for i in free],
                                      options={"ftol": 1e-15, "gtol": 1e-12})
        x[free] = res.x
    if not np.any(nodes > 1):
        x[2] = max(x[2], x[4] * 1.1)
        x[3] = max(x[3], x[5] * 1.1)
    return PerfParams(*(float(v) for v in x))
