"""An OOM teaches more than the one configuration that failed: every configuration that
needs at least as much memory per GPU by the belief's own accounting (weights, grads,
optimizer state and activations, perfmodel.memory) is ruled out with it, and what ran
stays feasible."""

from __future__ import annotations

from policy_helpers import nodes

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, Placement
from gearshift.policies.learning import LearningOracle
from gearshift.policies.oracle import AnalyticOracle, PerfModelOracle
from gearshift.policies.registry import make_policy

LLAMA30 = ModelSpec(name="llama30", params=32500.0, layers=60, hidden=6656, seq_len=2048, heads=52)
SPEC = JobSpec(name="a", model=LLAMA30, global_batch=4, steps=10_000, gpus=1, cpus_per_gpu=8)
JOB = JobView("a", SPEC, submitted_at=0.0)


def _parts(plan: Plan) -> tuple[float, ...]:
    """The fitted model's accounting, asked directly: (weights + grads + optimizer,
    activations) per GPU; a plan that needs at least as much of each as one that ran
    out needs at least as much of both."""
    from gearshift import perfmodel
    from gearshift.perfmodel.memory import GIB, activation_bytes, model_state_bytes

    pa = perfmodel.PlanArray.from_plans([perfmodel.as_plan(plan, SPEC.global_batch)])
    shape = perfmodel.shape_from_spec(LLAMA30)
    return float(model_state_bytes(shape, pa)[0]) / GIB, float(activation_bytes(shape, pa)[0]) / GIB


def _covers(a: tuple, b: tuple) -> bool:
    return all(x >= y - 1e-6 for x, y in zip(a, b))


def _on(gpus: int) -> tuple[Placement, ...]:
    return (Placement("n0", gpus, 8 * gpus),)


def _off(dp: int, zero: int, ga: int, mb: int, gc: bool = True, offload: bool = True) -> Plan:
    return Plan(dp=dp, zero=zero, offload=offload, ga=ga, micro_batch=mb, grad_ckpt=gc)


def test_an_oom_stops_rubick_choosing_any_plan_that_needs_more_memory_per_gpu():
    oracle = LearningOracle(PerfModelOracle())
    failed = []
    for _ in range(6):
        a = make_policy("rubick", restart_cost=0).schedule(0.0, nodes(1, gpus=1, cpus=16), [JOB], oracle)
        got = a.allocations.get("a")
        if got is None:
            break
        parts = _parts(got.plan)
        for f, plan in failed:  # the old rule retried the same layout at another ZeRO stage
            assert not _covers(parts, f), f"{got.plan.label()} needs as much as {plan.label()}, which ran out"
        failed.append((parts, got.plan))
        assert oracle.observe(JOB, got.plan, got.placement, oom=True)
    assert len(failed) >= 2  # it did choose again, something that needs less


def test_the_rule_crosses_gpu_counts_and_layouts_but_spares_what_needs_less():
    oracle = LearningOracle(PerfModelOracle())
    failed = _off(2, 3, 1, 2)  # ZeRO-3 offload on 2 GPUs, micro-batch 2
    assert oracle.throughput(JOB, failed, _on(2)) > 0  # the belief thought it fits
    oracle.observe(JOB, failed, _on(2), oom=True)
    # fewer shards (1 GPU, larger micro-batch), a lower ZeRO stage: ruled out
    for plan, g in ((_off(1, 3, 1, 4), 1), (_off(2, 2, 1, 2), 2), (_off(2, 1, 1, 2), 2)):
        assert oracle.throughput(JOB, plan, _on(g)) == 0.0, plan.label()
        assert oracle.infeasible(SPEC, plan)
    # a smaller micro-batch, or more shards: not ruled out
    for plan, g in ((_off(2, 3, 2, 1), 2), (_off(4, 3, 1, 1), 4)):
        assert oracle.throughput(JOB, plan, _on(g)) > 0, plan.label()
        assert not oracle.infeasible(SPEC, plan)
    # the cached path answers the same as the per-plan one
    plans = [_off(1, 3, 1, 4), _off(2, 2, 1, 2), _off(2, 3, 2, 1)]
    assert oracle.throughput_many(JOB, [p for p in plans if p.gpus == 2], _on(2)) == [
        oracle.throughput(JOB, p, _on(2)) for p in plans if p.gpus == 2]
    # another GPU type has its own memory: nothing learned there
    typed = (Placement("n0", 1, 8, "h100"),)
    assert oracle.throughput(JOB, _off(1, 3, 1, 4), typed) > 0


def test_a_success_is_not_ruled_out_and_frees_what_needs_no_more():
    base = PerfModelOracle()
    oracle = LearningOracle(base)
    small, big, bigger = _off(1, 2, 4, 1), _off(1, 2, 2, 2), _off(1, 2, 1, 4)
    same_as_big = _off(1, 1, 2, 2)  # ZeRO-1 with offload on one GPU keeps what ZeRO-2 keeps
    assert base.memory_parts(SPEC, [big])[0] == base.memory_parts(SPEC, [same_as_big])[0]
    oracle.observe(JOB, small, _on(1), oom=True)
    assert all(oracle.throughput(JOB, p, _on(1)) == 0.0 for p in (small, big, same_as_big, bigger))
    # big ran after all (say, a job launched it before the OOM was reported)
    rev = oracle.revision
    assert oracle.observe(JOB, big, _on(1), step_time=2.0)
    assert oracle.revision > rev
    assert oracle.throughput(JOB, big, _on(1)) > 0  # observed running: feasible
    assert oracle.throughput(JOB, same_as_big, _on(1)) > 0  # needs no more than what ran
    assert oracle.throughput(JOB, bigger, _on(1)) == 0.0  # needs more than both: still out
    assert oracle.throughput(JOB, small, _on(1)) == 0.0  # observed out of memory itself
    # the same success again changes nothing
    rev = oracle.revision
    assert not oracle.observe(JOB, big, _on(1), step_time=2.0)
    assert oracle.revision == rev


def test_a_success_where_nothing_ran_out_changes_no_answer():
    oracle = LearningOracle(PerfModelOracle())
    plan = _off(1, 2, 2, 2)
    pred = oracle.throughput(JOB, plan, _on(1))
    assert oracle.observe(JOB, plan, _on(1), step_time=SPEC.global_batch / pred)  # first speed: it does change
    rev = oracle.revision
    assert not oracle.observe(JOB, plan, _on(1), step_time=SPEC.global_batch / pred)
    assert oracle.revision == rev


def test_beliefs_expose_their_own_memory_accounting():
    from gearshift.sim.perfmodel_bridge import find_predictor
    from gearshift.sim.truth import BeliefOracle

    plans = [_off(1, 2, 2, 2), Plan(dp=1, ga=4, micro_batch=1)]
    fitted = BeliefOracle(8, find_predictor(8))
    assert fitted.memory_parts(SPEC, plans) == PerfModelOracle().memory_parts(SPEC, plans)
    analytic = BeliefOracle(8, None)
    got = analytic.memory_parts(SPEC, plans)
    assert got == AnalyticOracle().memory_parts(SPEC, plans)
    assert all(len(row) == 4 for row in got)  # weights, grads, optimizer state, activations
    assert got[0][2] == 0.0 < got[1][2]  # offload keeps the optimizer state on the CPU


def test_an_oom_where_the_accounting_is_off_does_not_starve_a_request_that_fits():
    # The belief credits ZeRO-3 with sharding the weights; the GPU (say) does not, and
    # ZeRO-3 offload on 2 GPUs runs out. The 48-GPU tensor/pipeline request keeps more
    # optimizer state and more activations than that plan, but far fewer weights: a
    # rule on (states, activations) ruled it out and rubick-mt's llama30 jobs never ran.
    oracle = LearningOracle(PerfModelOracle())
    z3 = _off(2, 3, 1, 2)
    oracle.observe(JOB, z3, (Placement("n0", 1, 8), Placement("n1", 1, 8)), oom=True)
    request = Plan(dp=4, tp=4, pp=3)
    assert not oracle.infeasible(SPEC, request)
    assert oracle.throughput(JOB, request, tuple(Placement(f"n{i}", 8, 64) for i in range(6))) > 0
    assert oracle.infeasible(SPEC, _off(2, 2, 1, 2))  # ZeRO-2 instead: more weights, the rest as much


def test_a_jobs_own_request_is_ruled_out_only_by_its_own_oom():
    oracle = LearningOracle(PerfModelOracle())
    oracle.observe(JOB, _off(1, 2, 4, 1), _on(1), oom=True)
    bigger = _off(1, 2, 1, 4)
    asked = JobView("b", JobSpec(name="b", model=LLAMA30, global_batch=4, steps=10, gpus=1, cpus_per_gpu=8,
                                 plan=bigger), submitted_at=0.0)
    assert oracle.throughput(JOB, bigger, _on(1)) == 0.0  # inferred: needs more than what ran out
    assert oracle.throughput(asked, bigger, _on(1)) > 0  # ... but it is what b's owner asked for
    assert oracle.throughput_many(asked, [bigger, _off(1, 1, 1, 4)], _on(1))[0] > 0
    assert oracle.spec_key(asked.spec) != oracle.spec_key(JOB.spec)  # policies' caches keep them apart
    oracle.observe(asked, bigger, _on(1), oom=True)
    assert oracle.throughput(asked, bigger, _on(1)) == 0.0  # its own OOM does rule it out
