"""Does a job's script support a plan (pure; ``JobSpec.plan_support``), and can
its model run it (``model_refusal``: the model's own shape)?

One function answers for every caller -- admission (the spec's own plan), the
optimizer's pins (``gearshift reconfigure``), the policies' plan space
(``policies.candidates``) and the profiler's plans -- so each refuses the same
plans with the same words, naming the field of the declaration that rules the
plan out.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gearshift.bus_schema.messages import JobSpec, Plan, PlanSupport

#: A script's exit status for "this plan cannot run this model" (sysexits
#: EX_CONFIG); the same value as ``agent.worker.EXIT_PLAN_REFUSED``.
EXIT_PLAN_REFUSED = 78
#: A job whose script refused this many plans fails instead of trying more.
MAX_REFUSED_PLANS = 8


def plan_shape(p: Plan) -> tuple:
    """What tells two plans apart for a script (the micro-batch follows from the rest)."""
    return (p.dp, p.tp, p.pp, p.zero, p.offload, p.ga, p.grad_ckpt)


def plan_refusal(support: PlanSupport | None, plan: Plan) -> tuple[str, str] | None:
    """``(field, message)`` when ``support`` rules ``plan`` out, else None."""
    if support is None:
        return None
    s = support
    if s.dp_max is not None and plan.dp > s.dp_max:
        return "plan_support.dp_max", f"dp={plan.dp} exceeds plan_support.dp_max={s.dp_max}"
    for name in ("tp", "pp", "zero"):
        allowed = getattr(s, name)
        value = getattr(plan, name)
        if allowed is not None and value not in allowed:
            return f"plan_support.{name}", f"{name}={value} is not in plan_support.{name}={sorted(allowed)}"
    if plan.offload and not s.offload:
        return "plan_support.offload", "offload is not supported (plan_support.offload=false)"
    if s.ga_max is not None and plan.ga > s.ga_max:
        return "plan_support.ga_max", f"ga={plan.ga} exceeds plan_support.ga_max={s.ga_max}"
    if plan.grad_ckpt and not s.grad_ckpt:
        return "plan_support.grad_ckpt", "grad_ckpt is not supported (plan_support.grad_ckpt=false)"
    shape = plan_shape(plan)
    if any(plan_shape(x) == shape for x in s.exclude or ()):
        return "plan_support.exclude", f"plan {plan.label()} was refused by the job's script"
    return None


def model_refusal(model: Any, plan: Any) -> tuple[str, str] | None:
    """``(field, message)`` when the model's own shape rules ``plan`` out, else None.

    ``model``: a ``JobSpec`` (its ``model``), a ``ModelSpec`` or anything with
    ``layers``, ``hidden``, ``heads`` and ``kv_heads`` (an absent or 0 one is
    not checked; a ``name`` is named in the message); ``plan``: anything with ``tp`` and ``pp``. The pipeline
    splits by layers, tensor parallelism splits the attention heads, the
    key/value heads and the hidden size. The same check for admission (the
    spec's plan), ``reconfigure`` (a pin) and the plan library's workers
    (``agent.torchplan.space.check_plan``), so each says the same words.
    """
    model = getattr(model, "model", model)
    of = f" of model {model.name}" if getattr(model, "name", None) else ""
    tp, pp = int(getattr(plan, "tp", 1) or 1), int(getattr(plan, "pp", 1) or 1)
    layers = getattr(model, "layers", None) or 0
    if pp > 1 and layers and pp > layers:
        return "plan.pp", f"pp {pp} is more stages than the {layers} layers{of}"
    if tp > 1:
        heads = getattr(model, "heads", None) or 0
        kv = getattr(model, "kv_heads", None) or heads
        for what, n in (("attention heads", heads), ("key/value heads", kv)):
            if n and n % tp:
                return "plan.tp", f"tp {tp} does not divide the {n} {what}{of}"
        hidden = getattr(model, "hidden", None) or 0
        if hidden and tp > hidden:
            return "plan.tp", f"tp {tp} is more than the hidden size {hidden}{of}"
    return None


def supported(spec: JobSpec, plan: Plan) -> bool:
    return plan_refusal(spec.plan_support, plan) is None


def with_refused(spec: JobSpec, refused: list[Plan]) -> JobSpec:
    """``spec`` whose declaration also excludes ``refused`` (the plans its script
    exited EXIT_PLAN_REFUSED under): what the policies see of a job."""
    if not refused:
        return spec
    base = spec.plan_support or PlanSupport()
    known = {plan_shape(p) for p in base.exclude or ()}
    extra = [p for p in refused if plan_shape(p) not in known]
    if not extra:
        return spec
    return msgspec.structs.replace(spec, plan_support=msgspec.structs.replace(base, exclude=(*(base.exclude or ()), *extra)))
