"""Which plans a model can run (no torch import: the scheduler side uses it too).

A model is described by its ``ModelShape``: how many layers the pipeline can
split, how many attention heads (and key/value heads) tensor parallelism must
divide, and whether its family has a TP plan and a PP split at all.
``check_plan`` refuses a plan that torch or the model cannot run, naming the
plan field (``PlanRefused.field``), before any rank builds anything;
``plan_space`` lists the plans a model supports on up to ``max_gpus`` GPUs
(the job's plan space).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Iterator, Mapping

from gearshift.bus_schema.plan_support import model_refusal

PLAN_FIELDS = ("dp", "tp", "pp", "zero", "offload", "ga", "micro_batch", "grad_ckpt", "pp_schedule")
PP_SCHEDULES = ("gpipe", "1f1b")


class PlanRefused(ValueError):
    """A plan this model (or torch) cannot run; ``field`` names the plan field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"plan field {field!r}: {message}")
        self.field = field


@dataclass(frozen=True)
class ModelShape:
    family: str
    layers: int  # what PP splits
    heads: int  # what TP divides
    kv_heads: int = 0  # 0: as heads
    hidden: int = 0
    intermediate: int = 0
    tp: bool = True  # the family has a TP plan
    pp: bool = True  # the family splits into stages by layers
    why_no_tp: str = ""
    why_no_pp: str = ""


def _int(plan: Mapping[str, Any], key: str, default: int) -> int:
    v = plan.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "zero" else 1):
        raise PlanRefused(key, f"must be a positive integer, got {v!r}")
    return v


def check_plan(plan: Mapping[str, Any], shape: ModelShape, *, world_size: int | None = None,
               global_batch: int | None = None) -> dict[str, Any]:
    """The plan with its defaults filled in, or ``PlanRefused`` naming the field."""
    unknown = sorted(set(plan) - set(PLAN_FIELDS))
    if unknown:
        raise PlanRefused(unknown[0], "not a plan field")
    tp, pp = _int(plan, "tp", 1), _int(plan, "pp", 1)
    dp = _int(plan, "dp", max(1, (world_size or tp * pp) // (tp * pp)))
    zero, ga = _int(plan, "zero", 0), _int(plan, "ga", 1)
    if zero > 3:
        raise PlanRefused("zero", f"must be 0-3, got {zero}")
    sched = str(plan.get("pp_schedule") or "gpipe").lower()
    if sched not in PP_SCHEDULES:
        raise PlanRefused("pp_schedule", f"must be one of {', '.join(PP_SCHEDULES)}, got {sched!r}")
    offload = bool(plan.get("offload"))
    if world_size is not None and dp * tp * pp != world_size:
        raise PlanRefused("dp", f"dp {dp} * tp {tp} * pp {pp} = {dp * tp * pp} != world size {world_size}")
    if tp > 1 and not shape.tp:
        raise PlanRefused("tp", f"{shape.family} has no tensor-parallel plan{': ' + shape.why_no_tp if shape.why_no_tp else ''}")
    if pp > 1 and not shape.pp:
        raise PlanRefused("pp", f"{shape.family} cannot be split into pipeline stages{': ' + shape.why_no_pp if shape.why_no_pp else ''}")
    got = model_refusal(shape, SimpleNamespace(tp=tp, pp=pp))  # layers, heads, kv heads, hidden: as admission
    if got is not None:
        raise PlanRefused(got[0].removeprefix("plan."), f"{got[1]} of {shape.family}")
    if tp > 1 and shape.intermediate and shape.intermediate % tp:
        raise PlanRefused("tp", f"tp {tp} does not divide the {shape.intermediate} intermediate size of {shape.family}")
    if pp > 1:
        if sched == "1f1b" and ga < pp:
            raise PlanRefused("ga", f"1F1B needs at least as many micro-batches (ga {ga}) as stages (pp {pp})")
        if zero == 1:
            raise PlanRefused("zero", "ZeRO-1 (ZeroRedundancyOptimizer over DDP) does not combine with pp; use zero 2 or 3")
    if zero == 1 and tp > 1:
        raise PlanRefused("zero", "ZeRO-1 (ZeroRedundancyOptimizer over DDP) does not combine with tp; use zero 2 or 3")
    if offload and zero == 0:
        raise PlanRefused("offload", "offload needs zero 1, 2 or 3 (FSDP2's CPUOffloadPolicy), got zero 0")
    mb = plan.get("micro_batch")
    if global_batch is not None:
        if mb is None:
            if global_batch % (dp * ga):
                raise PlanRefused("ga", f"dp {dp} * ga {ga} does not divide the global batch {global_batch}")
            mb = global_batch // (dp * ga)
        elif dp * ga * int(mb) != global_batch:
            raise PlanRefused("micro_batch", f"dp {dp} * ga {ga} * micro_batch {mb} != global batch {global_batch}")
    return {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "offload": offload, "ga": ga,
            "micro_batch": None if mb is None else int(mb), "grad_ckpt": bool(plan.get("grad_ckpt")),
            "pp_schedule": sched}


def declared_support(shape: ModelShape) -> dict[str, Any]:
    """The ``JobSpec.plan_support`` a job of this model declares: the plan
    dimensions its family cannot run at all (no TP plan: ``tp`` [1]; no
    split into stages: ``pp`` [1]), so the policies, the profiler and
    ``reconfigure`` never offer them. What depends on the degree (TP
    dividing the heads, PP within the layers) they check from the job's
    model shape."""
    out: dict[str, Any] = {}
    if not shape.tp:
        out["tp"] = [1]
    if not shape.pp:
        out["pp"] = [1]
    return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_space(shape: ModelShape, max_gpus: int, *, global_batch: int | None = None,
               ga_options: tuple[int, ...] = (1, 2, 4)) -> Iterator[dict[str, Any]]:
    """Every plan the model supports on 1..max_gpus GPUs (one entry per
    dp/tp/pp/zero/offload/ga/grad_ckpt combination that ``check_plan`` accepts)."""
    for world in range(1, max_gpus + 1):
        for tp in _divisors(world):
            for pp in _divisors(world // tp):
                dp = world // (tp * pp)
                for zero in (0, 1, 2, 3):
                    for offload in (False, True):
                        for ga in ga_options:
                            for gc in (False, True):
                                plan = {"dp": dp, "tp": tp, "pp": pp, "zero": zero, "offload": offload, "ga": ga,
                                        "grad_ckpt": gc}
                                try:
                                    yield check_plan(plan, shape, world_size=world, global_batch=global_batch)
                                except PlanRefused:
                                    continue
