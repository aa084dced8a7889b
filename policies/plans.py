"""Candidate execution plans for a job on a number of GPUs.

Used when the oracle does not enumerate plans itself. The space follows
Rubick's: data parallel with ZeRO-0/2 or ZeRO-Offload, gradient accumulation
and checkpointing; or 3D (PP x TP x DP) without ZeRO. The global batch is
fixed; every plan splits it exactly. Memory feasibility is the oracle's job
(it returns 0 for a plan that does not fit).
"""

from __future__ import annotations

from functools import lru_cache

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.policies.api import default_plan


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@lru_cache(maxsize=65536)
def candidate_plans(global_batch: int, layers: int, gpus: int, gpus_per_node: int) -> tuple[Plan, ...]:
    """Plans that use exactly ``gpus`` GPUs; ``gpus_per_node`` is the job's
    (smallest) share of a node, which bounds tensor parallelism."""
    out: list[Plan] = []
    for ga in (1, 2, 4, 8):
        if global_batch % (gpus * ga):
            continue
        mb = global_batch // (gpus * ga)
        for zero, off in ((0, False), (2, False), (2, True)):
            for gc in (False, True):
                out.append(Plan(dp=gpus, zero=zero, offload=off, ga=ga, micro_batch=mb, grad_ckpt=gc))
    # TP groups stay inside a node: tp divides both the job's GPUs and its
    # per-node share (``gpus_per_node``), so dp * tp * pp == gpus always holds.
    for tp in _divisors(min(gpus, gpus_per_node)):
        if gpus % tp:
            continue
        for pp in _divisors(gpus // tp):
            if tp * pp == 1 or pp > layers:
                continue
            dp = gpus // (tp * pp)
            # Pipelines want at least pp micro-batches in flight; when the batch
            # per replica is too small for that (llama30: 4 samples), as many as it
            # splits into (the measured 3D rows of such models run like this).
            per_replica = global_batch // dp if global_batch % dp == 0 else 0
            gas = [g for g in (pp, 2 * pp) if per_replica and per_replica % g == 0]
            if not gas and per_replica:
                gas = [max(g for g in _divisors(per_replica) if g < pp)]
            for ga in gas:
                mb = global_batch // (dp * ga)
                for gc in (False, True):
                    out.append(Plan(dp=dp, tp=tp, pp=pp, ga=ga, micro_batch=mb, grad_ckpt=gc))
    return tuple(out)


def scaled_user_plan(spec: JobSpec, gpus: int) -> Plan | None:
    """The user's plan with its data-parallel degree scaled to ``gpus``.

    This is what schedulers that keep the user's plan do when they resize a
    job (Sia, rubick-n): TP, PP, ZeRO stage, offload and checkpointing stay;
    GA stays when the batch still splits, else the nearest GA that does.
    """
    base = default_plan(spec)
    unit = base.tp * base.pp
    if gpus % unit:
        return None
    dp = gpus // unit
    for ga in (base.ga, *sorted({1, 2, 4, 8, 16, 32} - {base.ga})):
        if spec.global_batch % (dp * ga) == 0:
            return Plan(
                dp=dp, tp=base.tp, pp=base.pp, zero=base.zero, offload=base.offload, ga=ga,
                micro_batch=spec.global_batch // (dp * ga), grad_ckpt=base.grad_ckpt,
            )
    return None
