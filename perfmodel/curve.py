"""Resource-sensitivity curves (Rubick section 3).

For a job (fitted params, shape, global batch) the curve holds, on a grid of
GPUs g = 1..max_gpus, nodes n = 1..max_nodes (g spread as evenly as possible
over n nodes of at most gpus_per_node GPUs each) and CPU threads per GPU c in
`threads`:

* `tput[g, n, ci]`  best throughput over all plans on exactly that offer (0 if none),
  and `plan_idx` into `plans` (-1 if none);
* `env[g, n, ci]`   the monotone envelope: best throughput using at most g GPUs,
  at most n nodes and at most threads[ci] threads;
* `knee_g/knee_n/knee_ci[g, n, ci]`  the smallest allocation (fewest GPUs, then
  fewest threads, then fewest nodes) whose throughput is within 1% of `env`:
  what the scheduler should actually hand out for that level;
* `saturation`  the smallest allocation within 1% of the curve's maximum.

Index 0 of the g and n axes is unused (kept so that g and n index directly).
Lookups are plain array reads, so a policy can afford thousands per round.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from gearshift.perfmodel.kernels import iteration_time_ms_numba
from gearshift.perfmodel.memory import memory_per_gpu_gb
from gearshift.perfmodel.model import PerfParams, shape_consts
from gearshift.perfmodel.plans import ConcretePlan, PlanArray, ResourceArray, Resources, enumerate_plans
from gearshift.perfmodel.predict import plan_validity
from gearshift.perfmodel.shapes import ModelShape

KNEE_TOLERANCE = 0.01
DEFAULT_THREADS = (1.0, 2.0, 4.0, 8.0)


def balanced_placement(g: int, n: int, gpus_per_node: int) -> tuple[int, ...] | None:
    """g GPUs over n nodes as evenly as possible, or None if it cannot be done."""
    if n < 1 or g < n:
        return None
    q, r = divmod(g, n)
    if q + (1 if r else 0) > gpus_per_node:
        return None
    return (q + 1,) * r + (q,) * (n - r)


@dataclass(frozen=True)
class CurveAllocation:
    """The smallest allocation on a sensitivity curve that reaches a level, with its
    best plan (the bus ``Allocation`` is an allocation the optimizer wrote)."""

    gpus: int
    nodes: int
    threads: float
    throughput: float
    plan: ConcretePlan | None


class SensitivityCurve:
    def __init__(self, model_key, global_batch, threads, gpus_per_node, tput, plan_idx, plans):
        self.model_key = model_key
        self.global_batch = int(global_batch)
        self.threads = np.asarray(threads, dtype=np.float64)
        self.gpus_per_node = int(gpus_per_node)
        self.tput = tput
        self.plan_idx = plan_idx
        self.plans = plans
        self.max_gpus = tput.shape[0] - 1
        self.max_nodes = tput.shape[1] - 1
        self._envelope()

    # -- construction -------------------------------------------------------
    def _envelope(self) -> None:
        G, Nn, T = self.tput.shape
        env = self.tput.copy()
        # Cumulative max along each axis, repeated until stable (3 axes, monotone).
        for axis in (0, 1, 2):
            env = np.maximum.accumulate(env, axis=axis)
        for axis in (0, 1, 2):
            env = np.maximum.accumulate(env, axis=axis)
        self.env = env
        # Knee: smallest dominated allocation (order g, then c, then n) within 1%.
        gg, nn, cc = np.meshgrid(np.arange(G), np.arange(Nn), np.arange(T), indexing="ij")
        order = np.lexsort((nn.ravel(), cc.ravel(), gg.ravel()))  # g major, then c, then n
        cg, cn, cc_, ct = gg.ravel()[order], nn.ravel()[order], cc.ravel()[order], self.tput.ravel()[order]
        ok_c = ct > 0
        cg, cn, cc_, ct = cg[ok_c], cn[ok_c], cc_[ok_c], ct[ok_c]
        tg, tn, tc, tv = gg.ravel(), nn.ravel(), cc.ravel(), env.ravel()
        knee_g = np.zeros(tv.size, dtype=np.int64)
        knee_n = np.zeros(tv.size, dtype=np.int64)
        knee_c = np.zeros(tv.size, dtype=np.int64)
        for s in range(0, tv.size, 512):
            sl = slice(s, s + 512)
            m = (
                (cg[None, :] <= tg[sl, None]) & (cn[None, :] <= tn[sl, None]) & (cc_[None, :] <= tc[sl, None])
                & (ct[None, :] * (1.0 + KNEE_TOLERANCE) >= tv[sl, None]) & (tv[sl, None] > 0)
            )
            has = m.any(axis=1)
            first = np.argmax(m, axis=1)
            knee_g[sl] = np.where(has, cg[first], 0)
            knee_n[sl] = np.where(has, cn[first], 0)
            knee_c[sl] = np.where(has, cc_[first], 0)
        self.knee_g = knee_g.reshape(G, Nn, T)
        self.knee_n = knee_n.reshape(G, Nn, T)
        self.knee_ci = knee_c.reshape(G, Nn, T)
        top = float(env.max()) if env.size else 0.0
        self.max_throughput = top
        if top > 0:
            idx = (self.max_gpus, self.max_nodes, T - 1)
            self.saturation = self.allocation_at(int(self.knee_g[idx]), int(self.knee_n[idx]), int(self.knee_ci[idx]))
        else:
            self.saturation = None

    # -- lookups --------------------------------------------------------------
    def threads_index(self, threads: float) -> int:
        """Index of the largest grid thread count <= threads (0 if below all)."""
        i = int(np.searchsorted(self.threads, float(threads) + 1e-9, side="right")) - 1
        return max(i, 0)

    def min_nodes(self, g: int) -> int:
        return -(-int(g) // self.gpus_per_node)

    def _n(self, g: int, nodes: int | None) -> int:
        n = self.min_nodes(g) if nodes is None else int(nodes)
        return min(max(n, 1), self.max_nodes)

    def throughput(self, gpus: int, nodes: int | None = None, threads: float = 4.0) -> float:
        """Envelope throughput with at most `gpus` GPUs on at most `nodes` nodes
        (default: as few nodes as the GPUs need) and `threads` CPU threads/GPU."""
        g = min(max(int(gpus), 0), self.max_gpus)
        return float(self.env[g, self._n(max(g, 1), nodes), self.threads_index(threads)])

    def exact_throughput(self, gpus: int, nodes: int | None = None, threads: float = 4.0) -> float:
        """Best throughput on exactly this offer (no envelope)."""
        g = min(max(int(gpus), 0), self.max_gpus)
        return float(self.tput[g, self._n(max(g, 1), nodes), self.threads_index(threads)])

    def allocation_at(self, g: int, n: int, ci: int) -> CurveAllocation:
        pi = int(self.plan_idx[g, n, ci])
        return CurveAllocation(int(g), int(n), float(self.threads[ci]), float(self.tput[g, n, ci]),
                          self.plans.plan(pi) if pi >= 0 else None)

    def knee(self, gpus: int, nodes: int | None = None, threads: float = 4.0) -> CurveAllocation | None:
        """Smallest allocation reaching (within 1%) the envelope level at this offer."""
        g = min(max(int(gpus), 1), self.max_gpus)
        n, ci = self._n(g, nodes), self.threads_index(threads)
        if self.env[g, n, ci] <= 0:
            return None
        return self.allocation_at(int(self.knee_g[g, n, ci]), int(self.knee_n[g, n, ci]), int(self.knee_ci[g, n, ci]))

    def best_plan(self, gpus: int, nodes: int | None = None, threads: float = 4.0) -> ConcretePlan | None:
        """Best plan on exactly this offer."""
        g = min(max(int(gpus), 1), self.max_gpus)
        pi = int(self.plan_idx[g, self._n(g, nodes), self.threads_index(threads)])
        return self.plans.plan(pi) if pi >= 0 else None

    def gpu_curve(self, threads: float = 4.0) -> np.ndarray:
        """Envelope throughput for g = 0..max_gpus at the fewest nodes (array)."""
        ci = self.threads_index(threads)
        g = np.arange(self.max_gpus + 1)
        n = np.clip(-(-np.maximum(g, 1) // self.gpus_per_node), 1, self.max_nodes)
        return self.env[g, n, ci]

    def marginal_gain(self, gpus: int, delta: int, threads: float = 4.0) -> float:
        """Throughput gained per extra GPU going from `gpus` to `gpus + delta`."""
        if delta <= 0:
            return 0.0
        return (self.throughput(gpus + delta, threads=threads) - self.throughput(gpus, threads=threads)) / delta


def _params_digest(params: PerfParams) -> str:
    h = hashlib.sha1()
    h.update(params.model_key.encode())
    h.update(np.ascontiguousarray(params.theta).tobytes())
    h.update(np.ascontiguousarray(params.cluster).tobytes())
    h.update(str(params.gpu_mem_gb).encode())
    return h.hexdigest()


_CACHE: "OrderedDict[tuple, SensitivityCurve]" = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_MAX = 256


def build_curve(
    params: PerfParams,
    shape: ModelShape,
    global_batch: int,
    *,
    max_gpus: int = 64,
    gpus_per_node: int = 8,
    max_nodes: int = 8,
    threads=DEFAULT_THREADS,
) -> SensitivityCurve:
    """Compute a curve (uncached; see `curve`)."""
    threads = tuple(sorted(float(t) for t in threads))
    T = len(threads)
    tput = np.zeros((max_gpus + 1, max_nodes + 1, T))
    plan_idx = np.full((max_gpus + 1, max_nodes + 1, T), -1, dtype=np.int64)
    parts: list[PlanArray] = []
    cells: list[tuple[int, int, int, int]] = []  # (g, n, start, stop) into the concatenated plans
    res_parts: list[ResourceArray] = []
    start = 0
    for g in range(1, max_gpus + 1):
        for n in range(1, max_nodes + 1):
            pl = balanced_placement(g, n, gpus_per_node)
            if pl is None:
                continue
            pa = enumerate_plans(shape, global_batch, Resources(pl, threads[0]))
            if len(pa) == 0:
                continue
            parts.append(pa)
            res_parts.append(ResourceArray.broadcast(Resources(pl, threads[0]), len(pa)))
            cells.append((g, n, start, start + len(pa)))
            start += len(pa)
    if not parts:
        return SensitivityCurve(params.model_key, global_batch, threads, gpus_per_node, tput, plan_idx, PlanArray.empty())
    plans = PlanArray.concat(parts)
    base = ResourceArray(
        np.concatenate([r.n_gpus for r in res_parts]), np.concatenate([r.n_nodes for r in res_parts]),
        np.concatenate([r.k_min for r in res_parts]), np.concatenate([r.k_max for r in res_parts]),
        np.concatenate([r.threads for r in res_parts]), np.concatenate([r.odd_nodes for r in res_parts]),
    )
    consts = shape_consts(shape)
    fits = (memory_per_gpu_gb(shape, plans) <= params.gpu_mem_gb) & plan_validity(shape, global_batch, plans, base)
    for ci, c in enumerate(threads):
        base.threads[:] = c
        t_ms = iteration_time_ms_numba(params.theta, params.cluster, consts, plans, base)
        tp = np.where(fits & (t_ms > 0), global_batch * 1000.0 / t_ms, 0.0)
        for g, n, a, b in cells:
            seg = tp[a:b]
            k = int(np.argmax(seg))
            if seg[k] > 0:
                tput[g, n, ci] = seg[k]
                plan_idx[g, n, ci] = a + k
    return SensitivityCurve(params.model_key, global_batch, threads, gpus_per_node, tput, plan_idx, plans)


def curve(
    params: PerfParams,
    shape: ModelShape,
    global_batch: int,
    *,
    max_gpus: int = 64,
    gpus_per_node: int = 8,
    max_nodes: int = 8,
    threads=DEFAULT_THREADS,
) -> SensitivityCurve:
    """The job's sensitivity curve, cached per (model key, fitted params, batch, grid)."""
    key = (shape.key, _params_digest(params), int(global_batch), int(max_gpus), int(gpus_per_node),
           int(max_nodes), tuple(sorted(float(t) for t in threads)))
    with _CACHE_LOCK:
        c = _CACHE.get(key)
        if c is not None:
            _CACHE.move_to_end(key)
            return c
    c = build_curve(params, shape, global_batch, max_gpus=max_gpus, gpus_per_node=gpus_per_node,
                    max_nodes=max_nodes, threads=threads)
    with _CACHE_LOCK:
        _CACHE[key] = c
        while len(_CACHE) > _CACHE_MAX:
            _CACHE.popitem(last=False)
    return c


def clear_curve_cache() -> None:
    with _CACHE_LOCK:
        _CACHE.clear()
