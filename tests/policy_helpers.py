"""Hand-made scenarios for the policy tests: small clusters, simple oracles."""

from __future__ import annotations

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, NodeState, Placement

MODEL = ModelSpec(name="toy", params=100, layers=8, hidden=512, seq_len=128)


def nodes(n: int, gpus: int = 8, cpus: int = 64, domain: str = "") -> list[NodeState]:
    return [NodeState(f"n{i}", gpus, gpus, cpus, cpus, domain) for i in range(n)]


def model(name: str) -> ModelSpec:
    return ModelSpec(name=name, params=100, layers=8, hidden=512, seq_len=128)


def job(jid: str, gpus: int, *, t: float = 0.0, guaranteed: bool = False, steps: int = 10_000, batch: int = 64,
        cpg: int | None = 2, running_on: tuple[Placement, ...] = (), since: float | None = None,
        attained: float = 0.0, done: float = 0.0, plan: Plan | None = None, curve: str | None = None) -> JobView:
    """A job; ``curve`` names its model, which is what ``CurveOracle`` keys on."""
    spec = JobSpec(name=jid, model=model(curve) if curve else MODEL, global_batch=batch, steps=steps, gpus=gpus, cpus_per_gpu=cpg,
                   guaranteed=guaranteed, plan=plan)
    jv = JobView(jid, spec, submitted_at=t, steps_done=done, attained_service=attained)
    if running_on:
        jv.placement = running_on
        jv.plan = plan or Plan(dp=sum(p.gpus for p in running_on))
        jv.started_at = jv.last_switch_at = since if since is not None else t
    return jv


class CurveOracle:
    """Throughput as a function of GPUs only (any plan), from a table per
    model name (``job(..., curve=name)``); other models scale linearly. Multi-node placements lose
    ``spread_penalty``; CPUs below ``cpu_knee`` per GPU slow a job down."""

    def __init__(self, curves: dict[str, dict[int, float]] | None = None, spread_penalty: float = 0.1,
                 cpu_knee: int = 0):
        self.curves = curves or {}
        self.spread_penalty = spread_penalty
        self.cpu_knee = cpu_knee

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        g = sum(p.gpus for p in placement)
        if g != plan.gpus or g == 0:
            return 0.0
        curve = self.curves.get(job.spec.model.name)
        if curve is None:
            t = float(g)
        else:
            ks = [k for k in curve if k <= g]
            if not ks:
                return 0.0
            t = curve[max(ks)]
        if len(placement) > 1:
            t *= 1 - self.spread_penalty
        if self.cpu_knee:
            cpg = sum(p.cpus for p in placement) / g
            t *= min(1.0, 0.5 + 0.5 * cpg / self.cpu_knee)
        return t


def apply(decision, jobs: list[JobView], now: float, dt: float = 0.0, perf=None) -> list[str]:
    """Carry a decision out on the job views, as a simulator would; return the
    ids of jobs whose allocation changed (started, switched or preempted)."""
    changed = []
    for j in jobs:
        d = decision.allocations.get(j.job_id)
        if d is None:
            if j.running:
                j.placement, j.plan = (), None
                j.last_switch_at = now
                changed.append(j.job_id)
            continue
        if d.placement != j.placement or d.plan != j.plan:
            changed.append(j.job_id)
            if j.running:
                j.restarts += 1
            j.placement, j.plan = d.placement, d.plan
            j.last_switch_at = now
            if j.started_at is None:
                j.started_at = now
        if perf is not None and dt:
            j.steps_done += perf.throughput(j, j.plan, j.placement) * dt / j.spec.global_batch
        j.attained_service += j.gpus * dt
    return changed
