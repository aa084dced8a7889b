"""Numba twin of `model.iteration_time_ms`: one compiled loop over candidates.

`iteration_time_ms_numba` fixes dtypes and contiguity and then calls the
`@njit(cache=True)` kernel (serial for small batches, `prange` over candidates
for large ones; fast-math without NaN/Inf assumptions, one pass with no
temporaries); it must agree with the numpy reference (tested).
Call `warm_up()` before serving so that the first request does not compile.
"""

from __future__ import annotations

import math

import numpy as np
from numba import get_num_threads, njit, prange

from gearshift.perfmodel.model import CPU_SERIAL, GPUS_PER_NIC, NICS_PER_NODE, default_cluster, default_theta
from gearshift.perfmodel.plans import PlanArray, ResourceArray

# Fast-math without the no-NaN/no-Inf assumptions: infeasible candidates may
# legitimately produce inf, and those must compare as in the numpy reference.
_FAST = {"nsz", "arcp", "contract", "afn", "reassoc"}
# Below this many candidates the thread pool costs more than it saves; with
# fewer than PARALLEL_MIN_THREADS threads (e.g. a busy 2-core box) the serial
# loop measured as fast or faster (loadtest.perfmodel_bench).
PARALLEL_MIN = 20_000
PARALLEL_MIN_THREADS = 4


@njit(cache=True, fastmath=_FAST, inline="always")
def _nics(k):
    return min(math.ceil(k / GPUS_PER_NIC), NICS_PER_NODE)


@njit(cache=True, fastmath=_FAST, inline="always")
def _smax(x, y, g):
    # As model._smax, with the larger term's (x/m)^g = 1 taken out: two pow calls, not three.
    m = max(max(x, y), 1e-12)
    if x >= y:
        return m * (1.0 + (y / m) ** g) ** (1.0 / g) if x > 1e-12 else m * ((x / m) ** g + (y / m) ** g) ** (1.0 / g)
    return m * ((x / m) ** g + 1.0) ** (1.0 / g) if y > 1e-12 else m * ((x / m) ** g + (y / m) ** g) ** (1.0 / g)


@njit(cache=True, fastmath=_FAST, inline="always")
def _allreduce(V, N, n, kmin, kmax, bw_nvl, bw_nic, lat):
    if n > 1.0:
        return (2.0 * (kmax - 1.0) / kmax * V / bw_nvl
                + 2.0 * (n - 1.0) / n * V / (_nics(kmin) * bw_nic) + lat * n)
    return 2.0 * (N - 1.0) / N * V / bw_nvl


@njit(cache=True, fastmath=_FAST)
def _iter_time_range(lo, hi, theta, cluster, consts, dp_a, tp_a, pp_a, zero_a, off_a, ga_a, mb_a, gc_a,
                     nn_a, kmin_a, kmax_a, thr_a, odd_a, out):
    """out[lo:hi] = iteration time (ms): the scalar twin of `model.model_terms`."""
    t_fwd = theta[0]; c_fwd = theta[1]; k_bwd = theta[2]; r_gc = theta[3]; gamma = theta[4]
    k_opt = theta[5]; k_cpu = theta[6]; c_off = theta[7]; c0 = theta[8]; f_node = theta[9]
    d_odd = theta[10]; t_3d = theta[11]; eta_tp = theta[12]; c_p2p = theta[13]; kappa = theta[14]
    c3 = theta[15]; kappa_dp = theta[16]; gamma_z = theta[17]; c_mb3d = theta[18]
    bw_nvl = cluster[0]; bw_nic = cluster[1]; lat = cluster[2]
    P = consts[0]; gbytes = consts[1]; act_mb = consts[2]; L = consts[3]
    for i in range(lo, hi):
        dp = float(dp_a[i]); tp = float(tp_a[i]); pp = float(pp_a[i])
        ga = float(ga_a[i]); mb = float(mb_a[i]); gc = 1.0 if gc_a[i] else 0.0
        n = float(nn_a[i]); kmin = float(kmin_a[i]); kmax = float(kmax_a[i])
        N = dp * tp * pp
        if tp_a[i] > 1 or pp_a[i] > 1:
            straddle = (kmin % tp != 0.0) or (tp > kmin)
            bw_tp = bw_nic if straddle else bw_nvl
            comp = t_3d * (1.0 + r_gc * gc / (1.0 + k_bwd)) * mb / (tp * pp) * (1.0 + eta_tp * (tp - 1.0))
            tp_comm = math.ceil(L / pp) * 4.0 * 2.0 * (tp - 1.0) / tp * mb * act_mb / bw_tp
            stage = comp + tp_comm + c_mb3d
            n_cross = min(pp - 1.0, n - 1.0)
            hop = 2.0 * mb * act_mb / tp
            hops = n_cross * hop / bw_nic + (pp - 1.0 - n_cross) * hop / bw_nvl + c_p2p * (pp - 1.0)
            pipe = (ga + pp - 1.0) * stage + hops
            Vg = kappa * gbytes * P / (tp * pp)
            j = max(1.0, min(dp, math.floor(kmin / tp)))
            n_dp = math.ceil(dp / j)
            t = pipe + 2.0 * (j - 1.0) / j * Vg / bw_nvl
            if n_dp > 1.0:
                t += kmin * 2.0 * (n_dp - 1.0) / n_dp * (Vg / j) / (_nics(kmin) * bw_nic) + lat * n_dp
            out[i] = t + k_opt * P / (tp * pp) + c3
            continue
        b = ga * mb
        Tf = (t_fwd * b + c_fwd * ga) * (1.0 + (f_node if n > 1.0 else 0.0))
        Tb = k_bwd * Tf
        ar_g = _allreduce(kappa_dp * P * gbytes, N, n, kmin, kmax, bw_nvl, bw_nic, lat)
        zero = zero_a[i]
        if zero == 0:
            Tsync = Tb * (1.0 - 1.0 / ga) + _smax(Tb / ga, ar_g, gamma)
            Topt = k_opt * P
        else:
            Tsync = Tb * (1.0 - 1.0 / ga) + _smax(Tb / ga, 0.5 * ar_g, gamma_z)
            ar_p = _allreduce(2.0 * P, N, n, kmin, kmax, bw_nvl, bw_nic, lat)
            if off_a[i]:
                cpu = CPU_SERIAL + (1.0 - CPU_SERIAL) / thr_a[i]
                Topt = k_cpu * P / N * cpu + c_off
            else:
                Topt = k_opt * P / N
            Topt += 0.5 * ar_p
            if zero >= 3:
                Topt += ar_p
        t = Tf + r_gc * gc * Tf + Tsync + Topt + c0
        if (not off_a[i]) and odd_a[i] > 0 and n > 1.0 and kmin_a[i] != kmax_a[i]:
            t += d_odd
        out[i] = t


@njit(cache=True, fastmath=_FAST)
def _iter_time_kernel(theta, cluster, consts, dp_a, tp_a, pp_a, zero_a, off_a, ga_a, mb_a, gc_a,
                      nn_a, kmin_a, kmax_a, thr_a, odd_a, out):
    _iter_time_range(0, out.shape[0], theta, cluster, consts, dp_a, tp_a, pp_a, zero_a, off_a, ga_a, mb_a, gc_a,
                     nn_a, kmin_a, kmax_a, thr_a, odd_a, out)


@njit(cache=True, parallel=True)
def _iter_time_kernel_par(theta, cluster, consts, dp_a, tp_a, pp_a, zero_a, off_a, ga_a, mb_a, gc_a,
                          nn_a, kmin_a, kmax_a, thr_a, odd_a, out, chunks):
    # A few contiguous chunks per thread: each runs the serial loop, so the
    # parallel and serial kernels share one body and one rounding.
    n = out.shape[0]
    for c in prange(chunks):
        _iter_time_range(c * n // chunks, (c + 1) * n // chunks, theta, cluster, consts, dp_a, tp_a, pp_a, zero_a,
                         off_a, ga_a, mb_a, gc_a, nn_a, kmin_a, kmax_a, thr_a, odd_a, out)


def iteration_time_ms_numba(
    theta: np.ndarray, cluster: np.ndarray, consts: np.ndarray, plans: PlanArray, res: ResourceArray,
    parallel: bool | None = None,
) -> np.ndarray:
    """Compiled equivalent of `model.iteration_time_ms` (same arguments).
    parallel: None = by batch size and threads (>= PARALLEL_MIN candidates and
    >= PARALLEL_MIN_THREADS numba threads), else force it."""
    out = np.empty(len(plans), dtype=np.float64)
    f64 = lambda a: np.ascontiguousarray(a, dtype=np.float64)  # noqa: E731
    i64 = lambda a: np.ascontiguousarray(a, dtype=np.int64)  # noqa: E731
    b = lambda a: np.ascontiguousarray(a, dtype=np.bool_)  # noqa: E731
    if parallel is None:
        parallel = len(out) >= PARALLEL_MIN and get_num_threads() >= PARALLEL_MIN_THREADS
    args = (
        f64(theta), f64(cluster), f64(consts),
        i64(plans.dp), i64(plans.tp), i64(plans.pp), i64(plans.zero), b(plans.offload),
        i64(plans.ga), i64(plans.micro_batch), b(plans.grad_ckpt),
        i64(res.n_nodes), i64(res.k_min), i64(res.k_max), f64(res.threads), i64(res.odd_nodes), out,
    )
    if parallel:
        _iter_time_kernel_par(*args, 4 * get_num_threads())
    else:
        _iter_time_kernel(*args)
    return out


_WARM = False


def warm_up() -> None:
    """Compile (or load from the numba cache) before the first real call."""
    global _WARM
    if _WARM:
        return

    plans = PlanArray([2, 1], [1, 2], [1, 1], [2, 0], [True, False], [1, 1], [1, 1], [False, True])
    res = ResourceArray([2, 2], [2, 1], [1, 2], [1, 2], [4.0, 4.0], [2, 0])
    consts = np.array([100.0, 2.0, 1.0, 12.0])
    iteration_time_ms_numba(default_theta(), default_cluster(), consts, plans, res)  # serial kernel
    iteration_time_ms_numba(default_theta(), default_cluster(), consts, plans, res, parallel=True)
    _WARM = True
