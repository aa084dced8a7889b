"""Issue 10: the belief is fitted only on what profiling measures; the two truth regimes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gearshift.bus_schema.messages import JobSpec, Plan
from gearshift.perfmodel import catalog
from gearshift.perfmodel.model import iteration_time_ms, shape_consts
from gearshift.perfmodel.rubick import MODELS, load_placements, rows_to_arrays, rubick_shape
from gearshift.perfmodel.validate import MAX_TRAINING_ROWS, profiled_data
from gearshift.policies.api import Placement
from gearshift.sim.engine import SimConfig
from gearshift.sim.extended import distance, memory_gb, runs_out_of_memory, systematic
from gearshift.sim.perfmodel_bridge import find_predictor
from gearshift.sim.rubick_catalog import MODELS as SPECS
from gearshift.sim.trace import TraceJob
from gearshift.sim.truth import GroundTruth, with_threads


def test_belief_fit_data_holds_no_truth_row_beyond_the_profilers_seven():
    rows, prof, shapes, training, train = profiled_data()
    for m in MODELS:
        shape, fit_rows = train[m]
        placed = [r for r in fit_rows if r.source == "placement"]
        assert len(placed) <= MAX_TRAINING_ROWS and len(training[m]) <= MAX_TRAINING_ROWS
        assert {r.name for r in placed} == set(training[m])
        assert all(r.source in ("placement", "profile") for r in fit_rows)
        # every other measured row (what the simulator uses as truth) is absent
        truth_only = {r.name for r in rows[m]} - set(training[m])
        assert truth_only and not truth_only & {r.name for r in placed}
        assert len(rows[m]) - len(placed) == len(truth_only) or len(truth_only) < len(rows[m])


def test_belief_is_not_the_in_sample_fit_and_errs_out_of_sample():
    # The stored belief and the all-rows fit differ, and on the held-out rows the belief
    # is measurably worse than the fit that saw them (it never saw them).
    _, ths_b = catalog.belief_fit()
    _, ths_i = catalog.shipped_fit()
    _, _, _, training, _ = profiled_data()
    worse = 0
    for m in MODELS:
        assert not np.allclose(ths_b[m], ths_i[m])
        held = [r for r in load_placements(m) if r.name not in training[m]]
        p, res, y = rows_to_arrays(held)
        b, i = catalog.belief_model_for(m), catalog.fitted_model_for(m)
        eb = np.mean(np.abs(iteration_time_ms(b.theta, b.cluster, shape_consts(rubick_shape(m)), p, res) - y) / y)
        ei = np.mean(np.abs(iteration_time_ms(i.theta, i.cluster, shape_consts(rubick_shape(m)), p, res) - y) / y)
        worse += eb > ei
    assert worse >= 5  # out of 7 models


def test_simulator_and_optimizer_share_the_belief():
    from gearshift.policies.oracle import PerfModelOracle

    spec = JobSpec(name="g", model=SPECS["gpt2"], global_batch=16, steps=10, gpus=8)
    plan = Plan(dp=8, zero=2, micro_batch=2)
    belief = find_predictor(8)(spec, plan, (8,))
    truth_src = find_predictor(8, "in_sample")(spec, plan, (8,))
    from gearshift.policies.api import JobView

    live = PerfModelOracle().throughput(JobView("g", spec, 0.0), plan, (Placement("n", 8, 32),))
    assert belief > 0 and live > 0 and truth_src > 0
    assert belief != truth_src
    assert live == pytest.approx(16 / belief, rel=1e-6)


# ------------------------------------------------------------ extended truth parts
def test_extended_parts():
    assert systematic(0, "gpt2", "3D", 0.15) == systematic(0, "gpt2", "3D", 0.15)
    assert systematic(0, "gpt2", "3D", 0.15) != systematic(1, "gpt2", "3D", 0.15)
    assert systematic(0, "gpt2", "3D", 0.0) == 1.0
    meas = [("3D", 24), ("3D", 64)]
    assert distance(24, "3D", meas) == 0.0
    assert distance(8, "3D", meas) < distance(1, "3D", meas) < distance(1, "zero-offload", meas)
    llama30 = SPECS["llama30"]
    off = Plan(dp=1, zero=2, offload=True, grad_ckpt=True, micro_batch=4)
    assert memory_gb(llama30, 4, off) > 70  # 30B fp16 weights alone are 65 GB
    assert runs_out_of_memory(llama30, 4, off, 0.10) and not runs_out_of_memory(llama30, 4, off, 0.0)


def _llama30_job() -> TraceJob:
    spec = JobSpec(name="l", model=SPECS["llama30"], global_batch=4, steps=10, gpus=32, plan=Plan(pp=4, tp=4, dp=2))
    return TraceJob("l", 0.0, spec, truth_key="llama30")


def test_extended_truth_is_not_the_belief_and_fails_where_memory_is_short():
    belief, source = find_predictor(8), find_predictor(8, "in_sample")
    job = _llama30_job()
    one = (Placement("n0", 1, 12),)
    off = Plan(dp=1, zero=2, offload=True, grad_ckpt=True, micro_batch=4)
    assert belief(job.spec, off, (1,)) > 0  # the belief thinks llama30 fits on one GPU
    tight = GroundTruth(8, noise=0.0, predictor=belief, truth_predictor=source, headroom=0.10)
    assert tight.step_time(job, off, one) == (0.0, "extended")
    loose = GroundTruth(8, noise=0.0, predictor=belief, truth_predictor=source, headroom=0.0,
                        systematic=0.0, distance_slowdown=0.25)
    t, src = loose.step_time(job, off, one)
    assert src == "extended" and t > source(job.spec, off, (1,)) * 1.5  # far from anything measured
    flat = GroundTruth(8, noise=0.0, predictor=belief, truth_predictor=source, headroom=0.0)
    assert flat.step_time(job, off, one)[0] == pytest.approx(source(with_threads(job.spec, one), off, (1,)))
    # a measured row stays the measurement (x this seed's noise), never the model
    row = GroundTruth(8, noise=0.0, predictor=belief, truth_predictor=source)
    pl = tuple(Placement(f"n{i}", 8, 96) for i in range(8))
    assert row.step_time(job, Plan(pp=4, tp=4, dp=4, micro_batch=1), pl)[1] == "measured"


def test_measured_regime_lets_policies_choose_only_measured_or_requested(tmp_path):
    from gearshift.sim.cli import main

    out = tmp_path / "o.json"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--trace", "rubick-base", "--jobs", "30", "--policies", "rubick,sia", "--regime", "measured",
                     "-o", "json"]) == 0
    doc = json.loads(buf.getvalue())
    assert doc["config"]["regime"] == "measured"
    for s in doc["results"]:
        assert s["measured_share"] == 1.0, s["policy"]
        assert s["unfinished"] == 0


def test_regime_is_validated():
    from gearshift.sim.engine import Simulator
    from gearshift.sim.trace import Trace, parse_cluster

    with pytest.raises(ValueError, match="regime"):
        Simulator(Trace("t", [], parse_cluster("1x1")), None, config=SimConfig(regime="bent"))


def test_the_beliefs_batch_answers_what_one_plan_at_a_time_answers():
    """``BeliefOracle.throughput_many`` (one ``predict`` call for the plans it lacks) gives
    bit for bit what ``throughput`` gives plan by plan, in both regimes: plans the measured
    rule refuses and plans of another size answer 0, and a second ask is served from the cache."""
    from gearshift.policies.api import JobView
    from gearshift.policies.oracle import PerfModelOracle
    from gearshift.sim.truth import BeliefOracle

    spec = JobSpec(name="g", model=SPECS["gpt2"], global_batch=16, steps=10, gpus=8)
    job = JobView("g", spec, 0.0)
    where = (Placement("n0", 4, 16), Placement("n1", 4, 16))
    plans = PerfModelOracle().plans(job, where)[:40] + [Plan(dp=4), Plan(dp=8, zero=2, micro_batch=2)]
    assert len(plans) > 10 and any(p.gpus != 8 for p in plans)
    measured = GroundTruth(8, 0.05, 0, find_predictor(8)).measured_config
    for allowed in (None, measured):
        one, many = (BeliefOracle(8, find_predictor(8), allowed=allowed) for _ in range(2))
        expect = [one.throughput(job, p, where) for p in plans]
        got = many.throughput_many(job, plans, where)
        assert got == expect
        assert any(t > 0 for t in got) and any(t == 0 for t in got)
        assert many.throughput_many(job, plans[::-1], where) == expect[::-1]  # from its cache, in any order
    analytic = BeliefOracle(8, None)
    assert analytic.throughput_many(job, plans[:5], where) == [analytic.throughput(job, p, where) for p in plans[:5]]
