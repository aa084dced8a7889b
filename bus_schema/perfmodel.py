"""Messages of the perfmodel service (`gs.perfmodel.{fit,predict,curve}`).

User-facing inputs reject unknown fields; replies ignore them on decode so
that a newer service can add fields without breaking older clients.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from gearshift.bus_schema import subjects as _subj
from gearshift.bus_schema.messages import ModelSpec, Plan

PERFMODEL_FIT = f"{_subj.PERFMODEL}.fit"
PERFMODEL_PREDICT = f"{_subj.PERFMODEL}.predict"
PERFMODEL_CURVE = f"{_subj.PERFMODEL}.curve"
# Most candidates (plans x offers) one predict request may carry.
MAX_CANDIDATES = 100_000

PosFloat = Annotated[float, Meta(gt=0)]
GpuShares = Annotated[list[Annotated[int, Meta(ge=1, le=64)]], Meta(min_length=1, max_length=1024)]
GlobalBatch = Annotated[int, Meta(ge=1, le=1 << 24)]


class _In(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class _Out(Struct, kw_only=True, frozen=True):
    pass


class ResourceSpec(_In, kw_only=True, frozen=True):
    """A resource offer: GPUs on each node, CPU threads per GPU."""

    gpus_per_node: GpuShares
    cpu_threads_per_gpu: Annotated[float, Meta(gt=0, le=256)] = 4.0


class ProfileSample(_In, kw_only=True, frozen=True):
    """One profiling run: the plan, where it ran and its measured times (ms)."""

    plan: Plan
    resources: ResourceSpec
    iter_ms: PosFloat
    fwd_ms: PosFloat | None = None
    tcc_ms: PosFloat | None = None  # backward + gradient sync
    opt_ms: PosFloat | None = None


class FitRequest(_In, kw_only=True, frozen=True):
    model: ModelSpec
    global_batch: GlobalBatch
    samples: Annotated[list[ProfileSample], Meta(min_length=1, max_length=1000)]


class FitReply(_Out, kw_only=True, frozen=True):
    model_key: str
    kv_key: str
    revision: int
    samples: int
    params: dict[str, float]
    cluster: dict[str, float]
    train_error: float  # mean relative error of iteration time on the samples


class PredictRequest(_In, kw_only=True, frozen=True):
    model: ModelSpec
    global_batch: GlobalBatch
    plans: Annotated[list[Plan], Meta(min_length=1, max_length=MAX_CANDIDATES)]
    # One offer for every plan, or one per plan.
    resources: Annotated[list[ResourceSpec], Meta(min_length=1, max_length=MAX_CANDIDATES)]


class PredictReply(_Out, kw_only=True, frozen=True):
    model_key: str
    source: str  # "kv" (fitted via gs.perfmodel.fit) or "catalog" (shipped Rubick fit)
    iter_time_s: list[float | None]
    throughput: list[float]
    mem_gb: list[float]
    feasible: list[bool]
    reason: list[str | None]


class CurveRequest(_In, kw_only=True, frozen=True):
    model: ModelSpec
    global_batch: GlobalBatch
    max_gpus: Annotated[int, Meta(ge=1, le=1024)] = 64
    gpus_per_node: Annotated[int, Meta(ge=1, le=64)] = 8
    max_nodes: Annotated[int, Meta(ge=1, le=128)] = 8
    cpu_threads_per_gpu: Annotated[float, Meta(gt=0, le=256)] = 4.0


class CurvePoint(_Out, kw_only=True, frozen=True):
    gpus: int
    throughput: float  # envelope (best with at most this many GPUs)
    knee_gpus: int  # smallest allocation within 1% of that level
    knee_nodes: int
    plan: Plan | None  # best plan at the knee


class CurveReply(_Out, kw_only=True, frozen=True):
    model_key: str
    source: str
    points: list[CurvePoint]
    saturation: CurvePoint | None


PERFMODEL_TYPES = [ResourceSpec, ProfileSample, FitRequest, FitReply, PredictRequest, PredictReply,
                   CurveRequest, CurvePoint, CurveReply]

__all__ = [
    "PERFMODEL_FIT", "PERFMODEL_PREDICT", "PERFMODEL_CURVE", "MAX_CANDIDATES", "ResourceSpec", "ProfileSample",
    "FitRequest", "FitReply", "PredictRequest", "PredictReply", "CurveRequest", "CurvePoint", "CurveReply",
    "PERFMODEL_TYPES",
]


def model_kv_key(model_key: str) -> str:
    """The ``gs_models`` key of a model key (KV keys allow [-/_=.A-Za-z0-9])."""
    return "".join(c if (c.isalnum() or c in "-_=.") else "_" for c in model_key)
