"""The extended regime's ground truth where nothing was measured: not the belief.

Three parts, each seeded and documented in ``sim/README.md``:

* ``systematic(seed, model, family, sigma)``: one log-normal factor per (model,
  plan family), the same for every configuration of that family: a model error
  that does not average out (the performance model's held-out error is ~10%
  pooled, up to 20% per cell: ``perfmodel validate``).
* ``distance(...)``: how far a configuration lies outside what was measured for
  the model, in GPU-count doublings to the nearest measured configuration plus 1
  if its plan family was never measured for the model; truth is slowed by
  ``1 + slowdown * distance``.
* ``memory_gb(...)``: an independent estimate of GPU memory (not
  ``perfmodel.memory``): mixed-precision states by ZeRO stage, activations after
  Korthikanti et al. (34 bytes per token x hidden per layer, /tp; with
  checkpointing only each layer's input plus one layer), pipeline stage 0 holding
  min(pp, ga) micro-batches, 3 GB of context/buffers. A plan whose estimate
  leaves less than ``headroom`` of the GPU free runs out of memory.
"""

from __future__ import annotations

import math

from gearshift.bus_schema.messages import ModelSpec, Plan
from gearshift.policies.learning import plan_family as family  # Rubick's families: 3D, zero-offload, zero-dp, gc, ga
from gearshift.sim.truth import _unit_normal

GPU_MEM_GB = 80.0
OVERHEAD_GB = 3.0

SYSTEMATIC = 0.15
DISTANCE_SLOWDOWN = 0.10
HEADROOM = 0.10


def systematic(seed: int, model: str, fam: str, sigma: float) -> float:
    return math.exp(sigma * _unit_normal(seed, "systematic", model, fam)) if sigma > 0 else 1.0


def distance(gpus: int, fam: str, measured: list[tuple[str, int]]) -> float:
    """GPU-count doublings to the nearest measured (family, GPUs), + 1 if the family
    was never measured for this model. ``measured`` empty: 0 (nothing to compare)."""
    if not measured:
        return 0.0
    return min(abs(math.log2(gpus / g)) + (0.0 if f == fam else 1.0) for f, g in measured)


def memory_gb(model: ModelSpec, global_batch: int, plan: Plan) -> float:
    """Independent estimate of the busiest GPU's memory for ``plan`` (GB)."""
    P = model.params * 1e6
    tp, pp, dp = max(1, plan.tp), max(1, plan.pp), max(1, plan.dp)
    shard = P / (tp * pp)
    if plan.offload:
        states = 2 * shard + 1e9  # fp16 weights; gradients leave for the CPU through ~1 GB of buckets
    elif plan.zero >= 2:
        states = 2 * shard + 14 * shard / dp
    elif plan.zero == 1:
        states = 4 * shard + 12 * shard / dp
    else:
        states = 16 * shard
    ga = max(1, plan.ga)
    mb = plan.micro_batch or max(1, global_batch // (dp * ga))
    tokens = mb * model.seq_len
    layers = max(1.0, model.layers / pp)
    per_layer = 34.0 * tokens * model.hidden / tp
    if plan.grad_ckpt:
        act = 2.0 * tokens * model.hidden * layers + per_layer
    else:
        act = per_layer * layers
    act *= min(pp, ga) if pp > 1 else 1
    return (states + act) / 1e9 + OVERHEAD_GB


def runs_out_of_memory(model: ModelSpec, global_batch: int, plan: Plan, headroom: float) -> bool:
    return memory_gb(model, global_batch, plan) > GPU_MEM_GB * (1.0 - headroom)
