"""Rubick's per-job rows cached across rounds decide exactly as rows built anew.

``policies.rubick_problem`` keeps each job's part of the problem while its spec,
holding, target and curve stay the same objects, and rebuilds it otherwise. These
tests run two policies on the same rounds (views kept and changed in place as the
simulator and the live optimizer keep them, a learning oracle's revisions moving,
jobs arriving, switching, being preempted, ending, a node leaving): one keeps its
rows, the other drops them (and its candidate keys) before every round. Every
round's decision, reasons included, must be the same."""

from __future__ import annotations

import random
import zlib

import msgspec

from gearshift.bus_schema.messages import JobRecord, JobSpec, JobState, NodePlacement, Plan
from gearshift.policies.api import JobView, NodeState
from gearshift.policies.learning import LearningOracle
from gearshift.policies.oracle import PerfModelOracle
from gearshift.policies.rubick import Rubick
from gearshift.services.policy_bridge import JobViews, PolicyStep, job_view
from loadtest.optimality_gap import BATCH, MODELS


def _spec(rng: random.Random, i: int) -> JobSpec:
    m = MODELS[i % len(MODELS)]
    g = rng.choice([1, 2, 4, 8, 16])
    return JobSpec(name=f"s{i}", model=m, global_batch=BATCH[m.name], steps=rng.randint(200, 3000), gpus=g,
                   cpus_per_gpu=rng.choice([None, 2, 4]), guaranteed=rng.random() < 0.25,
                   reconfigurable=rng.random() > 0.1)


def _digest(pol: Rubick, d) -> list:
    return (sorted((k, v.placement, v.plan, v.predicted_throughput, v.predicted_gain, v.reason)
                   for k, v in d.allocations.items()) + sorted(d.waiting.items()) + [sorted(pol.last_stats.items())])


def _cold(pol: Rubick) -> None:
    """Forget every row and candidate key: the next round builds them all again."""
    b = pol.problems
    b.rows.clear()
    b.memo.clear()
    if b.cache is not None:
        b.cache._keys.clear()
        b.cache._intern.clear()


def test_cached_rows_decide_exactly_as_rows_built_every_round():
    rng = random.Random(7)
    warm, cold = Rubick(min_run_time=500.0), Rubick(min_run_time=500.0)
    oracles = {id(warm): LearningOracle(PerfModelOracle()), id(cold): LearningOracle(PerfModelOracle())}
    cluster = [NodeState(f"n{i}", 8, 8, 64, 64) for i in range(8)]
    views: list[JobView] = []
    now, n, rebuilt, memo = 1000.0, 0, [], []
    for r in range(12):
        for _ in range(rng.randint(3, 8)):  # arrivals
            s = _spec(rng, n)
            target = 0.5 * BATCH[s.model.name] if s.guaranteed and rng.random() < 0.5 else None
            views.append(JobView(f"j{n}", s, submitted_at=now - rng.random(), target_throughput=target))
            n += 1
        nodes = cluster[:-1] if r == 6 else cluster  # a node leaves for one round
        got = []
        for pol in (warm, cold):
            if pol is cold:
                _cold(pol)
            before = dict(pol.problems.rows)
            d = pol.schedule(now, nodes, views, oracles[id(pol)])
            got.append(_digest(pol, d))
            if pol is warm:
                rebuilt.append(sum(1 for k, row in pol.problems.rows.items() if before.get(k) is not row))
                memo.append(pol.problems.from_memo)
        assert got[0] == got[1], f"round {r} differs"
        # the decision runs: views change in place, as the simulator changes them
        for v in views:
            a = d.allocations.get(v.job_id)
            if a is None:
                if v.placement:
                    v.placement, v.plan = (), None
            elif (a.placement, a.plan) != (v.placement, v.plan):
                v.placement, v.plan, v.last_switch_at = tuple(a.placement), a.plan, now
                v.started_at = v.started_at or now
            if v.placement:
                v.steps_done = min(v.spec.steps, v.steps_done + rng.randint(50, 400))
                v.attained_service += 100.0
        # jobs end when done, and some earlier than declared (the learned ratio of steps moves)
        views = [v for v in views if v.steps_done < v.spec.steps and not (v.placement and rng.random() < 0.15)]
        # what ran teaches both oracles the same (a bias per model and plan family), in some
        # rounds only: in the others the warm policy takes what its memo kept
        for v in views:
            if v.placement and r % 3 == 0 and rng.random() < 0.5:
                pred = oracles[id(warm)].base.throughput(v, v.plan, v.placement)
                bias = 0.6 + zlib.crc32(f"{v.spec.model.name}{v.plan.tp}{v.plan.zero}".encode()) % 80 / 100
                for o in oracles.values():
                    if pred > 0:
                        o.observe(v.spec, v.plan, v.placement, step_time=v.spec.global_batch / (pred * bias))
        now += 300.0
    assert oracles[id(warm)].revision > 10
    assert warm.declared.ratio < 1.0  # learned from the jobs that ended early
    # the memo was taken in the rounds without a new revision, and not in the others
    assert sum(1 for m in memo if m > 0) >= 4 and memo[1] == 0
    # rows were kept for some jobs and rebuilt for others (a cache that never
    # invalidated, or never kept anything, would not show both)
    assert min(rebuilt[1:]) < len(views) and max(rebuilt[1:]) > 0


def _rec(**kw) -> JobRecord:
    m = MODELS[0]
    spec = JobSpec(name="a", model=m, global_batch=BATCH[m.name], steps=1000, gpus=2)
    base = dict(job_id="a", spec=spec, state=JobState.RUNNING, generation=1, plan=Plan(dp=2), steps_done=10,
                placement=[NodePlacement(node="n0", gpus=[0, 1], cpus=8)], last_switch_at=100.0,
                attained_gpu_s=50.0, started_at=90.0)
    base.update(kw)
    return JobRecord(**base)


def test_a_kept_view_follows_time_and_is_built_again_when_its_record_changes():
    cache = JobViews()
    rec = _rec()
    v = cache.view(rec, 200.0)
    assert v == job_view(rec, 200.0)
    # the same record later, with progress: the same view, its steps and attained service moved
    again = cache.view(rec, 260.0, 40)
    assert again is v and again == job_view(rec, 260.0, 40) and again.attained_service == 50.0 + 2 * 160.0
    # the record changed (a switch to 4 GPUs on another node): the view follows it
    moved = msgspec.structs.replace(rec, generation=2, plan=Plan(dp=4), last_switch_at=250.0,
                                    placement=[NodePlacement(node="n1", gpus=[0, 1, 2, 3], cpus=16)])
    v2 = cache.view(moved, 300.0)
    assert v2 == job_view(moved, 300.0) and v2.placement[0].node == "n1" and v2.gpus == 4
    # preempted: pending, no placement, attained no longer growing
    pending = msgspec.structs.replace(moved, state=JobState.PENDING, placement=[], attained_gpu_s=400.0)
    v3 = cache.view(pending, 400.0)
    assert v3 == job_view(pending, 400.0) and not v3.running
    assert cache.view(pending, 900.0) is v3 and v3.attained_service == 400.0
    cache.keep(set())
    assert cache.view(pending, 900.0) is not v3  # forgotten once it left the round


class _Models:
    def observe_progress(self, *a) -> bool:
        return False


def test_policy_step_hands_over_live_jobs_on_live_nodes_with_their_progress():
    step = PolicyStep(None, _Models())
    recs = {"a": _rec(), "b": _rec(job_id="b", placement=[NodePlacement(node="gone", gpus=[0, 1], cpus=8)]),
            "c": _rec(job_id="c", state=JobState.PENDING, placement=[]),
            "d": _rec(job_id="d", state=JobState.COMPLETED)}
    step.on_progress(msgspec.structs.replace(_progress(), job_id="a", generation=1, steps_done=70))
    for gone in ("x", "y"):
        step.on_progress(msgspec.structs.replace(_progress(), job_id=gone, generation=1, steps_done=5))
    views = step.views(recs, {"n0"}, 200.0)
    assert [v.job_id for v in views] == ["a", "c"]
    assert views[0].steps_done == 70
    assert set(step.progress) == {"a"}  # jobs no longer live are forgotten


def _progress():
    from gearshift.bus_schema.messages import JobProgress

    return JobProgress(job_id="a", generation=1, node="n0", steps_done=0, ts=0.0)


def test_live_rounds_benchmark_runs_both_paths_and_they_agree(capsys):
    from loadtest import live_rounds

    assert live_rounds.main(["--live", "150", "--nodes", "20", "--rounds", "3", "--arrivals", "20", "--json"]) == 0
    import json

    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["identical_decisions"] and run["round_ms_kept"] > 0 and run["round_ms_rebuilt"] > 0
    assert run["revision"] > 0 and max(run["running_per_round"]) > 0


def test_live_rounds_benchmark_refuses_bad_input(capsys):
    import pytest

    from loadtest import live_rounds

    with pytest.raises(SystemExit):
        live_rounds.main(["--live", "many"])
    assert "--live" in capsys.readouterr().err


def test_on_typed_nodes_the_oracle_is_one_object_round_after_round_and_the_memo_holds():
    """On nodes that report a GPU type the policy is handed ``typed_oracle(perf, type)``: one
    wrapper per oracle and type, kept, so the rows' memo (and the candidate keys, asked by
    the oracle's identity) hold from round to round; the decision is the same as a cold one's."""
    from gearshift.policies import make_policy
    from gearshift.policies.hetero import typed_oracle

    perf = LearningOracle(PerfModelOracle())
    assert typed_oracle(perf, "a100") is typed_oracle(perf, "a100")
    assert typed_oracle(perf, "h100") is not typed_oracle(perf, "a100")
    assert typed_oracle(LearningOracle(PerfModelOracle()), "a100") is not typed_oracle(perf, "a100")
    assert typed_oracle(perf, "") is perf
    rng = random.Random(3)
    cluster = [NodeState(f"n{i}", 8, 8, 64, 64, gpu_type="a100") for i in range(4)]
    views = [JobView(f"j{n}", msgspec.structs.replace(_spec(rng, n), guaranteed=False), submitted_at=float(n))
             for n in range(12)]
    warm, cold = make_policy("rubick"), make_policy("rubick")
    for r in range(3):
        d = warm.schedule(1000.0 + 60 * r, cluster, views, perf)
        inner = warm.inner("a100")
        _cold(cold.inner("a100"))
        assert _digest(inner, d) == _digest(cold.inner("a100"), cold.schedule(1000.0 + 60 * r, cluster, views, perf))
        if r:
            assert inner.problems.from_memo == len(views)  # nothing ran, nothing moved: every job from the memo
