"""Trace loaders: the documented mappings to JobSpec, and ground-truth lookups."""

from __future__ import annotations

import pytest

from gearshift.bus_schema.messages import Plan
from gearshift.policies.api import Placement
from gearshift.sim.loaders import load_named, load_trace_file, trace_names
from gearshift.sim.rubick_catalog import placement_key, plan_from_rubick, rubick_family
from gearshift.sim.synthetic import parse_options, synthetic_trace
from gearshift.sim.truth import GroundTruth, packed


def test_rubick_rows_map_to_jobspecs():
    t = load_named("rubick-base")
    assert len(t.jobs) == 406 and t.cluster.label() == "8x8"
    vit = next(j for j in t.jobs if j.job_id == "vit-0")
    # vit-0,0,3163.091667,vit,2,16,0,zero-dp,37239,0
    assert vit.submit == 0 and vit.truth_key == "vit"
    assert vit.spec.gpus == 2 and vit.spec.cpus_per_gpu == 8 and vit.spec.steps == 37239
    assert vit.spec.plan == Plan(dp=2, zero=2) and vit.spec.global_batch == 64
    assert vit.spec.step_time == pytest.approx(3163.091667 / 37239)
    llama = next(j for j in t.jobs if j.job_id == "llama30-1")
    assert llama.spec.plan == Plan(pp=3, tp=4, dp=4) and llama.spec.gpus == 48
    mt = load_named("rubick-mt")
    assert sum(j.spec.guaranteed for j in mt.jobs) == 194
    bp = load_named("rubick-bp")
    assert sum(a.spec.plan != b.spec.plan for a, b in zip(sorted(t.jobs, key=lambda j: j.job_id),
                                                           sorted(bp.jobs, key=lambda j: j.job_id))) == 276


def test_other_formats_keep_durations_exactly():
    blox = load_named("blox-load8")
    assert len(blox.jobs) == 16000 and len(blox.tracked) == 1001 and blox.cluster.label() == "32x4"
    j = blox.jobs[0]  # 0,65,35424.3471980879,1
    assert j.job_id == "b0" and j.submit == 65 and j.spec.gpus == 1
    assert j.spec.steps * j.spec.step_time == pytest.approx(35424.3471980879)
    tir = load_named("tiresias-60")  # 0,1,0,606,vgg19,164,30
    t0 = next(j for j in tir.jobs if j.job_id == "t0")
    assert t0.spec.steps == 606 and t0.spec.steps * t0.spec.step_time == pytest.approx(164)
    assert t0.spec.model.name == "vgg19"
    itp = load_named("itp-c10")
    assert min(j.submit for j in itp.jobs) == 0 and len(itp.jobs) == 260
    philly = load_named("philly-10k")
    assert len(philly.jobs) == 10000 and philly.cluster.gpus == 1024
    pw = load_named("pollux-w6")
    assert len(pw.jobs) == 160 and all(j.spec.steps >= 1 for j in pw.jobs)


def test_trace_file_and_errors(tmp_path):
    p = tmp_path / "jobs.csv"
    p.write_text("job_id,arrival_time_s,duration_s,num_gpus\n0,5,100.5,2\n1,1,10,1\n")
    t = load_trace_file(p, "blox")
    assert [j.job_id for j in t.jobs] == ["b1", "b0"]  # sorted by submit
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace_file(p, "nope")
    with pytest.raises(ValueError, match="unknown trace"):
        load_named("nope")
    assert "rubick-base" in trace_names()


def test_synthetic_generator_is_seeded_and_follows_its_mix():
    a = synthetic_trace(jobs=60, rate_per_hour=20, size_mix={1: 1, 8: 1}, guaranteed_fraction=0.5, seed=7)
    b = synthetic_trace(jobs=60, rate_per_hour=20, size_mix={1: 1, 8: 1}, guaranteed_fraction=0.5, seed=7)
    c = synthetic_trace(jobs=60, rate_per_hour=20, size_mix={1: 1, 8: 1}, guaranteed_fraction=0.5, seed=8)
    key = lambda t: [(j.job_id, j.submit, j.spec.steps, j.spec.guaranteed) for j in t.jobs]
    assert key(a) == key(b) and key(a) != key(c)
    assert {j.spec.gpus for j in a.jobs} <= {1, 8}
    assert 15 <= sum(j.spec.guaranteed for j in a.jobs) <= 45
    span_h = a.jobs[-1].submit / 3600
    assert 1.5 < span_h < 6  # 60 jobs at 20/h
    assert parse_options("jobs=5,sizes=1:2/8:1,models=gpt2:1")["size_mix"] == {1: 2.0, 8: 1.0}


def test_plan_strings_round_trip_to_families():
    for s, g in [("zero-dp", 4), ("zero-offload", 8), ("ga", 2), ("gc", 1), ("244", 32), ("151", 5)]:
        assert rubick_family(plan_from_rubick(s, g)) == s
    assert placement_key([3, 2, 3]) == "233" and placement_key([16]) is None
    assert packed(20, 8) == (8, 8, 4)


def test_ground_truth_uses_measured_rows_then_documented_fallbacks():
    t = load_named("rubick-base")
    gt = GroundTruth(8, noise=0.0)
    vit = next(j for j in t.jobs if j.job_id == "vit-0")
    # Measured: vit zero-dp on one node with 2 GPUs.
    st, src = gt.step_time(vit, Plan(dp=2, zero=2), (Placement("n0", 2),))
    assert src == "measured" and st == pytest.approx(0.08493947982788086)
    # The same row whatever the node order of a multi-node placement ("233" vs "323").
    a = gt.step_time(vit, Plan(dp=8, zero=2), (Placement("n0", 3), Placement("n1", 2), Placement("n2", 3)))
    b = gt.step_time(vit, Plan(dp=8, zero=2), (Placement("n0", 2), Placement("n1", 3), Placement("n2", 3)))
    assert a == b and a[1] == "measured"
    # Plain DP was never measured: bounded by the GA row on the same placement.
    st, src = gt.step_time(vit, Plan(dp=2), (Placement("n0", 2),))
    assert src == "proxy" and st == pytest.approx(gt.tables["vit"][("ga", "2")])
    # LLaMA-30B has no data-parallel rows at all: a DP plan is out of memory.
    llama = next(j for j in t.jobs if j.job_id == "llama30-1")
    assert gt.step_time(llama, Plan(dp=8, zero=2), (Placement("n0", 8),)) == (0.0, "infeasible")
    # A 3D plan that shards the model less than any measured one is infeasible too.
    assert gt.step_time(llama, Plan(tp=8, dp=1), (Placement("n0", 8),)) == (0.0, "infeasible")


def test_ground_truth_noise_is_deterministic_and_seeded():
    t = load_named("tiresias-60")
    j = t.jobs[0]
    pl = (Placement("n0", 1), Placement("n1", 1))
    a = GroundTruth(4, noise=0.1, seed=1).step_time(j, Plan(dp=2), pl)
    b = GroundTruth(4, noise=0.1, seed=1).step_time(j, Plan(dp=2), pl)
    c = GroundTruth(4, noise=0.1, seed=2).step_time(j, Plan(dp=2), pl)
    assert a == b and a[0] != c[0] and a[1] == "scaled"
    # The request itself is measured: no noise.
    assert GroundTruth(4, noise=0.1, seed=1).step_time(j, j.spec.plan, (Placement("n0", j.spec.gpus),)) == (
        j.spec.step_time, "request")


def test_predictor_is_ground_truth_only_where_unmeasured_and_calibrated_for_generic_models():
    calls = []

    def fake(spec, plan, per_node):  # "fitted model": time halves with twice the GPUs
        calls.append((spec.name, plan.gpus, per_node))
        return 4.0 / sum(per_node)

    rub = load_named("rubick-base")
    vit = next(j for j in rub.jobs if j.job_id == "vit-0")
    gt = GroundTruth(8, noise=0.0, predictor=fake)
    # Measured rows win over the model.
    assert gt.step_time(vit, Plan(dp=2, zero=2), (Placement("n0", 2),))[1] == "measured"
    # Unmeasured plan of a Rubick model: the model's absolute prediction.
    assert gt.step_time(vit, Plan(dp=2, zero=2, grad_ckpt=True), (Placement("n0", 1), Placement("n1", 1))) == (2.0, "perfmodel")
    # Generic model (Tiresias): the model's ratio to the request, times the measured request.
    tj = load_named("tiresias-60").jobs[0]  # 1 GPU, 164 s / 606 steps
    st, src = GroundTruth(4, noise=0.0, predictor=fake).step_time(tj, Plan(dp=2), (Placement("n0", 2),))
    assert src == "perfmodel" and st == pytest.approx(tj.spec.step_time / 2)
    # Slowdown knob only touches unmeasured sources.
    g2 = GroundTruth(8, noise=0.0, predictor=fake, unmeasured_slowdown=1.5)
    assert g2.step_time(vit, Plan(dp=2, zero=2), (Placement("n0", 2),))[0] == pytest.approx(0.08493947982788086)
    assert g2.step_time(vit, Plan(dp=2, zero=2, grad_ckpt=True), (Placement("n0", 1), Placement("n1", 1)))[0] == pytest.approx(3.0)
