"""Every registered policy, on random instances over several rounds, only ever
emits decisions that ``check_decision`` accepts (the simulator and the
optimizer service refuse the others).

Regression: on the Pollux workload (16 nodes x 4 GPUs, a 6-GPU job) rubick
chose ``TP4-DP1`` for a 6-GPU candidate (3 + 3 GPUs): the plan enumerator let
tensor parallelism exceed what divides the job's GPUs, and an oracle that does
not check the plan's GPU count scored it, so plan (4 GPUs) and placement
(6 GPUs) disagreed.
"""

from __future__ import annotations

import random
import zlib

import pytest
from policy_helpers import apply

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies import check_decision, make_policy
from gearshift.policies.api import JobView, NodeState, Placement, default_plan
from gearshift.policies.candidates import CandidateSpace, build_candidates
from gearshift.policies.plans import candidate_plans
from gearshift.policies.registry import policy_names

MODELS = [
    ModelSpec(name="small", params=60, layers=12, hidden=768, seq_len=128),
    ModelSpec(name="mid", params=350, layers=24, hidden=1024, seq_len=512),
    ModelSpec(name="big", params=1300, layers=24, hidden=2048, seq_len=1024),
]


class LenientOracle:
    """Like a fitted predictor that scores a plan by its shape alone: it does
    not check that the plan uses the placement's GPUs (what let the bug through)."""

    def throughput(self, job: JobView, plan: Plan, placement: tuple[Placement, ...]) -> float:
        g = sum(p.gpus for p in placement)
        if g == 0:
            return 0.0
        t = g ** 0.9 * (1.0 + 0.05 * plan.tp)  # prefers tensor parallelism, ignores plan.gpus
        return t * (0.9 if len(placement) > 1 else 1.0)


def _instance(rng: random.Random, gpn: int):
    n_nodes = rng.randint(1, 6)
    nodes = [NodeState(f"n{i}", gpn, gpn, 8 * gpn, 8 * gpn) for i in range(n_nodes)]
    jobs = []
    for i in range(rng.randint(2, 14)):
        gpus = rng.choice([1, 2, 3, 4, 5, 6, 8, 12])
        plan = None
        if gpus % 2 == 0 and rng.random() < 0.3:
            plan = Plan(dp=gpus // 2, tp=2, ga=1, micro_batch=None)
        spec = JobSpec(
            name=f"j{i}", model=rng.choice(MODELS), global_batch=rng.choice([48, 96, 192, 2048, 240]),
            steps=rng.randint(50, 5000), gpus=gpus, cpus_per_gpu=rng.choice([1, 2, 4]),
            guaranteed=rng.random() < 0.25, plan=plan,
        )
        jobs.append(JobView(f"j{i}", spec, submitted_at=rng.uniform(0, 500)))
    return nodes, jobs


@pytest.mark.parametrize("name", policy_names())
@pytest.mark.parametrize("gpn", [4, 8])
def test_every_policy_emits_only_valid_decisions(name, gpn):
    rng = random.Random(zlib.crc32(f"{name}-{gpn}".encode()))
    for inst in range(12):
        nodes, jobs = _instance(rng, gpn)
        perf = LenientOracle() if inst % 2 else None
        pol = make_policy(name)
        now = 1000.0
        for _ in range(4):
            d = pol.schedule(now, nodes, jobs, perf)
            check_decision(d, nodes, {j.job_id: j for j in jobs})
            for a in d.allocations.values():
                assert sum(p.gpus for p in a.placement) == a.plan.gpus
            apply(d, jobs, now)
            now += 700.0


def test_candidate_plans_use_exactly_their_gpus():
    for gpus in range(1, 17):
        for share in (1, 2, 3, 4, 8):
            for p in candidate_plans(2048, 24, gpus, share):
                assert p.gpus == gpus and min(gpus, share) % p.tp == 0, (gpus, share, p)


def test_pollux_shape_six_gpus_on_four_gpu_nodes():
    """The exact failing case: 6 GPUs as 3 + 3 on 4-GPU nodes."""
    spec = JobSpec(name="cifar10-75", model=MODELS[0], global_batch=2048, steps=100, gpus=6, cpus_per_gpu=1)
    job = JobView("cifar10-75", spec, submitted_at=0.0)
    space = CandidateSpace(gpus_per_node=4, cpus_per_node=32, total_gpus=64, n_nodes=16)
    for c in build_candidates(job, LenientOracle(), space):
        assert c.plan.gpus == c.gpus, c
        assert default_plan(spec).gpus == 6


@pytest.mark.parametrize("name", ["rubick", "rubick-r", "rubick-n"])
def test_rubick_six_gpu_job_on_four_gpu_nodes(name):
    """The Pollux case end to end: the decision for a 6-GPU job on 4-GPU nodes is valid."""
    nodes = [NodeState(f"n{i}", 4, 4, 32, 32) for i in range(2)]
    spec = JobSpec(name="cifar10-75", model=MODELS[0], global_batch=2048, steps=100, gpus=6, cpus_per_gpu=1)
    jobs = [JobView("cifar10-75", spec, submitted_at=0.0)]
    for i in range(2):  # one pinned 1-GPU job per node leaves 3 + 3 GPUs free
        s = JobSpec(name=f"p{i}", model=MODELS[0], global_batch=64, steps=10**6, gpus=1, cpus_per_gpu=1)
        jobs.append(JobView(f"p{i}", s, submitted_at=0.0, placement=(Placement(f"n{i}", 1, 1),), plan=Plan(dp=1),
                            started_at=5.0, last_switch_at=5.0))
    d = make_policy(name).schedule(10.0, nodes, jobs, LenientOracle())
    check_decision(d, nodes, {j.job_id: j for j in jobs})
    assert "cifar10-75" in d.allocations
