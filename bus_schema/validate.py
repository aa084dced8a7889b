"""Checks on a JobSpec that types alone cannot express (pure, shared by the
admission service and the CLI so both say the same thing)."""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.bus_schema.gputypes import check_gpu_types
from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.bus_schema.plan_support import model_refusal, plan_refusal


@dataclass
class SpecError(ValueError):
    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


# What the agent sets for every process (the launch contract); a job's env may
# add tunables (e.g. GEARSHIFT_CKPT_INTERVAL) but never override these.
RESERVED_ENV = frozenset({
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
    "GEARSHIFT_JOB_ID", "GEARSHIFT_GENERATION", "GEARSHIFT_PLAN", "GEARSHIFT_NODE", "GEARSHIFT_NODE_RANK",
    "GEARSHIFT_NNODES", "GEARSHIFT_CKPT_DIR", "GEARSHIFT_PROGRESS_FILE", "GEARSHIFT_STEPS",
    "GEARSHIFT_GLOBAL_BATCH", "GEARSHIFT_STEP_TIME", "GEARSHIFT_LAUNCHED_AT", "GEARSHIFT_ARRAY_INDEX",
})


DEFAULT_MAX_CHECKPOINT_GRACE_S = 600.0  # the cluster's bound on JobSpec.checkpoint_grace unless configured


def check_spec(spec: JobSpec, *, max_gpus: int | None = None, max_gpus_per_node: int | None = None,
               max_grace: float = DEFAULT_MAX_CHECKPOINT_GRACE_S) -> None:
    """Raise SpecError naming the first field that is wrong."""
    if max_gpus is not None and spec.gpus > max_gpus:
        raise SpecError("gpus", f"{spec.gpus} GPUs requested but the cluster has at most {max_gpus}")
    if spec.checkpoint_grace is not None and spec.checkpoint_grace > max_grace:
        raise SpecError("checkpoint_grace", f"{spec.checkpoint_grace:g} s is more than this cluster's maximum "
                                            f"of {max_grace:g} s")
    m = spec.model
    if m.kv_heads is not None and (m.heads is None or m.kv_heads > m.heads or m.heads % m.kv_heads):
        raise SpecError("model.kv_heads", f"{m.kv_heads} key/value heads must divide the "
                                          f"{m.heads if m.heads is not None else 'undeclared'} attention heads")
    p = spec.plan
    if p is not None:
        if p.dp * p.tp * p.pp != spec.gpus:
            raise SpecError(
                "plan", f"dp*tp*pp = {p.dp}*{p.tp}*{p.pp} = {p.dp * p.tp * p.pp} differs from gpus = {spec.gpus}"
            )
        got = model_refusal(spec.model, p)  # the model's own shape: layers, heads, kv_heads, hidden
        if got is not None:
            raise SpecError(*got)
        if max_gpus_per_node is not None and p.tp > max_gpus_per_node:
            raise SpecError("plan.tp", f"tp = {p.tp} must fit in one NVLink island: one node, or the nodes of "
                                       f"one nvlink-domain ({max_gpus_per_node} GPUs at most)")
        if p.offload and p.zero == 0:
            raise SpecError("plan.offload", "offload needs a ZeRO stage >= 1")
        if p.micro_batch is not None:
            if p.dp * p.ga * p.micro_batch != spec.global_batch:
                raise SpecError(
                    "plan.micro_batch",
                    f"dp*ga*micro_batch = {p.dp}*{p.ga}*{p.micro_batch} differs from global_batch = {spec.global_batch}",
                )
        elif spec.global_batch % (p.dp * p.ga) != 0:
            raise SpecError(
                "plan.ga", f"global_batch = {spec.global_batch} is not divisible by dp*ga = {p.dp * p.ga}"
            )
    if spec.plan_support is not None:
        # the plan the job starts with must be one its script runs
        got = plan_refusal(spec.plan_support, p if p is not None else Plan(dp=spec.gpus))
        if got is not None:
            field, message = got
            raise SpecError(field if p is not None else "plan", message if p is not None else
                            f"no plan given and the default DP{spec.gpus} is not supported: {message}")
    if spec.gpu_types:
        bad = check_gpu_types(spec.gpu_types)
        if bad is not None:
            field, _, message = bad.partition(": ")
            raise SpecError(field, message)
    for i, arg in enumerate(spec.command or []):
        if "\x00" in arg:  # no process can be started with it (found by tests/test_fuzz.py)
            raise SpecError(f"command[{i}]", "may not contain a NUL character")
    for key, value in (spec.env or {}).items():
        if "\x00" in value:
            raise SpecError(f"env.{key}", "may not contain a NUL character")
    if spec.env:
        for key in spec.env:
            if key in RESERVED_ENV:
                raise SpecError(f"env.{key}", "is set by the agent and may not be overridden")
