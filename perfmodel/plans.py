"""Execution plans and resource offers, as single objects and as column arrays.

A ConcretePlan has the same fields as the bus `Plan` (dp, tp, pp, zero, offload, ga,
micro_batch, grad_ckpt).  The global batch is fixed per job (as in Rubick), so
for a plan on `dp` replicas: dp * ga * micro_batch == global_batch.

`PlanArray` / `ResourceArray` hold many candidates as numpy columns so the
throughput model can evaluate them in one vectorised call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

FAMILIES = ("ga", "gc", "zero-dp", "zero-offload", "3D")


@dataclass(frozen=True, slots=True)
class ConcretePlan:
    """A plan with every field concrete (the micro-batch resolved), as the model
    computes on it; the bus form, where the micro-batch may be left to the batch, is
    ``gearshift.bus_schema.messages.Plan`` (``as_plan`` converts)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0  # ZeRO stage 0-3
    offload: bool = False  # ZeRO-Offload: optimizer state and step on the CPU
    ga: int = 1  # gradient-accumulation steps (= micro-batches per iteration)
    micro_batch: int = 1
    grad_ckpt: bool = False

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.ga * self.micro_batch

    @property
    def family(self) -> str:
        return plan_family(self.tp, self.pp, self.zero, self.offload, self.grad_ckpt)

    @property
    def summary(self) -> str:
        """Short human description, e.g. 'zero-dp dp8 ga2 mb1' or '3D pp2 tp4 dp8 mb1'."""
        if self.tp > 1 or self.pp > 1:
            s = f"3D pp{self.pp} tp{self.tp} dp{self.dp}"
        else:
            s = f"dp{self.dp} zero{self.zero}" + (" offload" if self.offload else "")
        s += f" ga{self.ga} mb{self.micro_batch}"
        if self.grad_ckpt:
            s += " gc"
        return s

    def validate(self) -> None:
        for f in ("dp", "tp", "pp", "ga", "micro_batch"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"plan.{f} must be >= 1, got {getattr(self, f)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"plan.zero must be 0..3, got {self.zero}")
        if self.offload and self.zero == 0:
            raise ValueError("plan.offload needs ZeRO stage >= 1")

    def to_dict(self) -> dict:
        return {
            "dp": self.dp, "tp": self.tp, "pp": self.pp, "zero": self.zero,
            "offload": self.offload, "ga": self.ga, "micro_batch": self.micro_batch,
            "grad_ckpt": self.grad_ckpt,
        }


def plan_family(tp: int, pp: int, zero: int, offload: bool, grad_ckpt: bool) -> str:
    """The Rubick plan family a plan belongs to (used for error tables)."""
    if tp > 1 or pp > 1:
        return "3D"
    if offload:
        return "zero-offload"
    if zero > 0:
        return "zero-dp"
    return "gc" if grad_ckpt else "ga"


def as_plan(obj: Any, global_batch: int | None = None) -> ConcretePlan:
    """Convert any object (bus Plan struct, dict, ConcretePlan) with plan fields to a ConcretePlan.
    A missing/None micro_batch is derived from `global_batch` (dp*ga*mb = batch)."""
    if isinstance(obj, ConcretePlan):
        return obj
    get = obj.get if isinstance(obj, dict) else (lambda k, d=None: getattr(obj, k, d))
    dp, ga = int(get("dp", 1) or 1), int(get("ga", 1) or 1)
    mb = get("micro_batch", None)
    if mb is None:
        mb = max(1, int(global_batch) // (dp * ga)) if global_batch else 1
    return ConcretePlan(
        dp=dp, tp=int(get("tp", 1) or 1), pp=int(get("pp", 1) or 1),
        zero=int(get("zero", 0) or 0), offload=bool(get("offload", False)),
        ga=ga, micro_batch=int(mb), grad_ckpt=bool(get("grad_ckpt", False)),
    )


_PLAN_COLS = ("dp", "tp", "pp", "zero", "offload", "ga", "micro_batch", "grad_ckpt")


class PlanArray:
    """Column store of plans: int64 arrays dp, tp, pp, zero, ga, micro_batch and
    bool arrays offload, grad_ckpt, all of the same length."""

    __slots__ = _PLAN_COLS

    def __init__(self, dp, tp, pp, zero, offload, ga, micro_batch, grad_ckpt):
        n = len(dp)
        self.dp = np.ascontiguousarray(dp, dtype=np.int64)
        self.tp = np.ascontiguousarray(tp, dtype=np.int64)
        self.pp = np.ascontiguousarray(pp, dtype=np.int64)
        self.zero = np.ascontiguousarray(zero, dtype=np.int64)
        self.offload = np.ascontiguousarray(offload, dtype=np.bool_)
        self.ga = np.ascontiguousarray(ga, dtype=np.int64)
        self.micro_batch = np.ascontiguousarray(micro_batch, dtype=np.int64)
        self.grad_ckpt = np.ascontiguousarray(grad_ckpt, dtype=np.bool_)
        for c in _PLAN_COLS:
            if getattr(self, c).shape != (n,):
                raise ValueError(f"PlanArray column {c} has shape {getattr(self, c).shape}, want ({n},)")

    def __len__(self) -> int:
        return int(self.dp.shape[0])

    @classmethod
    def from_plans(cls, plans: Iterable[Any], global_batch: int | None = None) -> "PlanArray":
        ps = [as_plan(p, global_batch) for p in plans]
        return cls(*[[getattr(p, c) for p in ps] for c in _PLAN_COLS])

    @classmethod
    def empty(cls) -> "PlanArray":
        return cls(*[[] for _ in _PLAN_COLS])

    def plan(self, i: int) -> ConcretePlan:
        return ConcretePlan(
            dp=int(self.dp[i]), tp=int(self.tp[i]), pp=int(self.pp[i]),
            zero=int(self.zero[i]), offload=bool(self.offload[i]), ga=int(self.ga[i]),
            micro_batch=int(self.micro_batch[i]), grad_ckpt=bool(self.grad_ckpt[i]),
        )

    def to_plans(self) -> list[ConcretePlan]:
        return [self.plan(i) for i in range(len(self))]

    def take(self, idx) -> "PlanArray":
        return PlanArray(*[getattr(self, c)[idx] for c in _PLAN_COLS])

    @staticmethod
    def concat(parts: Sequence["PlanArray"]) -> "PlanArray":
        if not parts:
            return PlanArray.empty()
        return PlanArray(*[np.concatenate([getattr(p, c) for p in parts]) for c in _PLAN_COLS])

    @property
    def n_gpus(self) -> np.ndarray:
        return self.dp * self.tp * self.pp

    def families(self) -> list[str]:
        return [
            plan_family(int(t), int(p), int(z), bool(o), bool(g))
            for t, p, z, o, g in zip(self.tp, self.pp, self.zero, self.offload, self.grad_ckpt)
        ]


@dataclass(frozen=True, slots=True)
class Resources:
    """A resource offer: GPUs on each node (e.g. (4, 4) = 2 nodes x 4 GPUs) and
    CPU threads per GPU (only ZeRO-Offload uses them)."""

    gpus_per_node: tuple[int, ...]
    cpu_threads_per_gpu: float = 4.0

    def __post_init__(self) -> None:
        if not self.gpus_per_node or any(int(k) < 1 for k in self.gpus_per_node):
            raise ValueError(f"gpus_per_node must be non-empty positive ints, got {self.gpus_per_node}")
        if not (self.cpu_threads_per_gpu > 0):
            raise ValueError(f"cpu_threads_per_gpu must be > 0, got {self.cpu_threads_per_gpu}")

    @classmethod
    def from_placement(cls, placement: str | int, cpu_threads_per_gpu: float = 4.0) -> "Resources":
        """Rubick placement string: one digit per node, e.g. '8888'."""
        return cls(tuple(int(c) for c in str(placement)), cpu_threads_per_gpu)

    @classmethod
    def uniform(cls, n_nodes: int, gpus_per_node: int, cpu_threads_per_gpu: float = 4.0) -> "Resources":
        return cls((int(gpus_per_node),) * int(n_nodes), cpu_threads_per_gpu)

    @property
    def n_gpus(self) -> int:
        return int(sum(self.gpus_per_node))

    @property
    def n_nodes(self) -> int:
        return len(self.gpus_per_node)


class ResourceArray:
    """Column store of resource offers, reduced to what the model uses:
    total GPUs, nodes, smallest and largest per-node share, CPU threads/GPU,
    and how many nodes hold an odd number of the job's GPUs."""

    __slots__ = ("n_gpus", "n_nodes", "k_min", "k_max", "threads", "odd_nodes")

    def __init__(self, n_gpus, n_nodes, k_min, k_max, threads, odd_nodes=None):
        self.n_gpus = np.ascontiguousarray(n_gpus, dtype=np.int64)
        self.n_nodes = np.ascontiguousarray(n_nodes, dtype=np.int64)
        self.k_min = np.ascontiguousarray(k_min, dtype=np.int64)
        self.k_max = np.ascontiguousarray(k_max, dtype=np.int64)
        self.threads = np.ascontiguousarray(threads, dtype=np.float64)
        if odd_nodes is None:
            # Uniform shares: odd iff the share is odd.
            odd_nodes = np.where(self.k_min % 2 == 1, self.n_nodes, 0)
        self.odd_nodes = np.ascontiguousarray(odd_nodes, dtype=np.int64)

    def __len__(self) -> int:
        return int(self.n_gpus.shape[0])

    @classmethod
    def from_resources(cls, res: Iterable[Resources]) -> "ResourceArray":
        rs = list(res)
        return cls(
            [r.n_gpus for r in rs], [r.n_nodes for r in rs],
            [min(r.gpus_per_node) for r in rs], [max(r.gpus_per_node) for r in rs],
            [r.cpu_threads_per_gpu for r in rs],
            [sum(1 for k in r.gpus_per_node if k % 2) for r in rs],
        )

    @classmethod
    def broadcast(cls, res: Resources, n: int) -> "ResourceArray":
        return cls(
            np.full(n, res.n_gpus), np.full(n, res.n_nodes),
            np.full(n, min(res.gpus_per_node)), np.full(n, max(res.gpus_per_node)),
            np.full(n, float(res.cpu_threads_per_gpu)),
            np.full(n, sum(1 for k in res.gpus_per_node if k % 2)),
        )

    def take(self, idx) -> "ResourceArray":
        return ResourceArray(
            self.n_gpus[idx], self.n_nodes[idx], self.k_min[idx], self.k_max[idx],
            self.threads[idx], self.odd_nodes[idx],
        )


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_plans(
    shape,
    global_batch: int,
    res: Resources,
    *,
    zero_stages: Sequence[int] = (0, 1, 2, 3),
    with_3d: bool = True,
    max_ga: int | None = None,
) -> PlanArray:
    """Every plan that uses all GPUs of `res` with the fixed global batch.

    Data-parallel family: dp = #GPUs, ZeRO stage in `zero_stages`, offload
    (stages >= 1), GC on/off, every GA count dividing the per-replica batch.
    3D family: pp * tp * dp = #GPUs with tp or pp > 1, tp inside the smallest
    node share (and dividing it, so no TP group straddles nodes), tp dividing
    the heads and the key/value heads, pp <= layers, every micro-batch count; ZeRO is not combined with
    TP/PP (as in Rubick).  Memory is not checked here (see `memory`).
    """
    n = res.n_gpus
    k_min = min(res.gpus_per_node)
    B = int(global_batch)
    cols: dict[str, list] = {c: [] for c in _PLAN_COLS}

    def add(dp, tp, pp, zero, off, ga, mb, gc):
        cols["dp"].append(dp); cols["tp"].append(tp); cols["pp"].append(pp)
        cols["zero"].append(zero); cols["offload"].append(off); cols["ga"].append(ga)
        cols["micro_batch"].append(mb); cols["grad_ckpt"].append(gc)

    if B % n == 0:
        local = B // n
        for ga in divisors(local):
            if max_ga is not None and ga > max_ga:
                continue
            mb = local // ga
            for zero in zero_stages:
                for off in ((False, True) if zero >= 1 else (False,)):
                    for gc in (False, True):
                        add(n, 1, 1, zero, off, ga, mb, gc)
    if with_3d:
        heads, kv = shape.n_heads, shape.n_kv_heads
        for tp in divisors(n):
            if tp > k_min or k_min % tp or heads % tp or kv % tp:
                continue
            for pp in divisors(n // tp):
                if tp == 1 and pp == 1:
                    continue
                if pp > shape.layers:
                    continue
                dp = n // (tp * pp)
                if B % dp:
                    continue
                local = B // dp
                for ga in divisors(local):
                    if max_ga is not None and ga > max_ga:
                        continue
                    for gc in (False, True):
                        add(dp, tp, pp, 0, False, ga, local // ga, gc)
    return PlanArray(*[cols[c] for c in _PLAN_COLS])
