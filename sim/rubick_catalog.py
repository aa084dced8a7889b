"""The Rubick artifact's models, plan strings and placement strings.

The artifact names a plan with a short string and a placement with one digit per
node; gearshift uses ``bus_schema.Plan`` and ``policies.api.Placement``. This
module converts between the two so that trace rows and measured tables can be
read into gearshift terms and looked up again.

Plan strings (``exec_plan`` column):
  ``zero-dp``          -> Plan(dp=N, zero=2)               (DeepSpeed ZeRO stage 2)
  ``zero-offload``     -> Plan(dp=N, zero=2, offload=True)  (ZeRO-Offload)
  ``zero-offload+gc``  -> the same with grad_ckpt=True
  ``ga``               -> Plan(dp=N, ga=GA_MARKER)         (gradient accumulation)
  ``gc``               -> Plan(dp=N, grad_ckpt=True)        (activation checkpointing)
  ``tp+ga``            -> Plan(tp=N, ga=GA_MARKER)
  ``PTD`` (3 digits)   -> Plan(pp=P, tp=T, dp=D)           (Megatron 3D; P*T*D = N)
The artifact does not record how many micro-steps its ``ga`` rows used (it picks
the largest micro-batch that fits); a gearshift plan with any ``ga > 1`` and no
other feature belongs to the ``ga`` family.
"""

from __future__ import annotations

from collections.abc import Iterable

from gearshift.bus_schema.messages import ModelSpec, Plan

GA_MARKER = 2

# Table 1 of the paper via reference/rubick.md §6.2. LLaMA-30B's config in the
# artifact holds placeholders; the public LLaMA-30B shape is used instead.
MODELS: dict[str, ModelSpec] = {
    "vit": ModelSpec(name="vit", params=86.0, layers=12, hidden=768, seq_len=197, heads=12),
    "roberta": ModelSpec(name="roberta", params=355.4, layers=24, hidden=1024, seq_len=1024, heads=16),
    "bert": ModelSpec(name="bert", params=336.3, layers=24, hidden=1536, seq_len=1024, heads=16),
    "t5": ModelSpec(name="t5", params=1240.0, layers=16, hidden=1280, seq_len=768, heads=20),
    "gpt2": ModelSpec(name="gpt2", params=1560.0, layers=24, hidden=1920, seq_len=1024, heads=20),
    "llama7": ModelSpec(name="llama7", params=6740.0, layers=32, hidden=4096, seq_len=2048, heads=32),
    "llama30": ModelSpec(name="llama30", params=32500.0, layers=60, hidden=6656, seq_len=2048, heads=52),
}

# Global batch per model in the workloads (the placements tables are measured at it).
GLOBAL_BATCH: dict[str, int] = {"vit": 64, "roberta": 64, "bert": 32, "t5": 16, "gpt2": 16, "llama7": 8, "llama30": 4}


def plan_from_rubick(exec_plan: str, gpus: int) -> Plan:
    """The gearshift plan of an artifact plan string on ``gpus`` GPUs."""
    s = exec_plan.strip()
    if s == "zero-dp":
        return Plan(dp=gpus, zero=2)
    if s == "zero-offload":
        return Plan(dp=gpus, zero=2, offload=True)
    if s == "zero-offload+gc":
        return Plan(dp=gpus, zero=2, offload=True, grad_ckpt=True)
    if s == "ga":
        return Plan(dp=gpus, ga=GA_MARKER)
    if s == "gc":
        return Plan(dp=gpus, grad_ckpt=True)
    if s == "tp+ga":
        return Plan(tp=gpus, ga=GA_MARKER)
    if len(s) == 3 and s.isdigit():
        pp, tp, dp = (int(c) for c in s)
        if pp * tp * dp != gpus:
            raise ValueError(f"3D plan {s!r} uses {pp * tp * dp} GPUs, job has {gpus}")
        return Plan(pp=pp, tp=tp, dp=dp)
    raise ValueError(f"unknown Rubick plan string {exec_plan!r}")


def rubick_family(plan: Plan) -> str | None:
    """The artifact plan string that measures exactly ``plan``'s kind, or None.

    The artifact's strings do not record micro-batch or GA steps for ZeRO and 3D
    plans (its ZeRO-DP rows are "ZeRO-DP+GA", Megatron runs several micro-batches
    per pipeline), so those are ignored there. 3D strings exist only for
    single-digit degrees; ZeRO was never combined with TP/PP.
    """
    is_3d = plan.tp > 1 or plan.pp > 1
    if plan.offload:
        if is_3d:
            return None
        return "zero-offload+gc" if plan.grad_ckpt else "zero-offload"
    if plan.zero:
        return None if is_3d or plan.grad_ckpt else "zero-dp"
    if is_3d:
        if plan.grad_ckpt or max(plan.pp, plan.tp, plan.dp) > 9:
            return None
        if plan.pp == 1 and plan.dp == 1 and plan.ga > 1:
            return "tp+ga"
        return f"{plan.pp}{plan.tp}{plan.dp}"
    if plan.ga > 1:
        return None if plan.grad_ckpt else "ga"
    if plan.grad_ckpt:
        return "gc"
    return None  # plain DP was never measured


def proxy_families(plan: Plan) -> tuple[list[str], float]:
    """Measured families that bound an unmeasured plan kind, and a slow-down factor.

    Used when ``rubick_family`` is None: the ground truth takes the slowest of these
    rows (times the factor). Plain DP runs like GA with one micro-step, so the GA row
    (which includes accumulation overhead) bounds it from the slow side; a plan with
    several features is bounded by the slowest feature's row; activation
    checkpointing on a 3D plan recomputes the forward pass (+1/3 of forward+backward).
    """
    is_3d = plan.tp > 1 or plan.pp > 1
    if is_3d:
        base = Plan(pp=plan.pp, tp=plan.tp, dp=plan.dp)
        fam = rubick_family(base)
        if plan.zero or plan.offload or fam is None:
            return [], 1.0
        return [fam], (4 / 3 if plan.grad_ckpt else 1.0)
    fams = []
    if plan.offload:
        fams.append("zero-offload")
    elif plan.zero:
        fams.append("zero-dp")
    if plan.grad_ckpt:
        fams.append("gc")
    if plan.ga > 1 or not fams:
        fams.append("ga")
    return fams, 1.0


def placement_key(gpus_per_node: Iterable[int]) -> str | None:
    """Canonical placement string: per-node GPU counts, ascending, one digit each.

    The tables write the same multiset in different orders ("224", "233"); the
    measured time does not depend on node order, so rows are matched sorted.
    """
    counts = sorted(g for g in gpus_per_node if g > 0)
    if not counts or counts[-1] > 9:
        return None
    return "".join(str(g) for g in counts)
