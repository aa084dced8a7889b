"""profile_accuracy --model: an HF model through the plan library is profiled
with the plans its family supports, keyed by its real parameter count, and
the noise between repeated runs is reported."""

from __future__ import annotations

import pytest

from gearshift.agent import reference
from gearshift.agent.torchplan import families
from gearshift.bus_schema.messages import Plan, ProfileResult
from loadtest.profile_accuracy import HELD_OUT, held_out, plan_support, run_spread, workload

needs_torch = pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")


@needs_torch
def test_held_out_plans_are_those_the_family_supports():
    llama = {p.label() for p in held_out("llama")}
    gpt2 = {p.label() for p in held_out("gpt2")}
    assert len(llama) == len(HELD_OUT) and any("TP" in p for p in llama) and any("PP" in p for p in llama)
    assert any("TP" in p for p in gpt2) and any("PP" in p for p in gpt2)  # GPT-2's layers split as nn.Linear
    t5 = {p.label() for p in held_out("t5")}  # T5 runs TP but is refused PP (every decoder layer needs the encoder)
    assert any("TP" in p for p in t5) and not any("PP" in p for p in t5)
    assert held_out("torchref") == HELD_OUT


@needs_torch
def test_an_hf_workload_runs_the_plan_library_with_its_counted_parameters():
    import torch

    spec, cmd, env = workload("llama")
    counted = sum(p.numel() for p in families.build("llama").parameters()) / 1e6
    assert spec["params"] == pytest.approx(counted, rel=1e-5) and spec["name"] == "hf-llama"
    assert cmd[1:] == ["-m", "gearshift.agent.torchplan.train", "--model", "llama"]
    assert env.get("GEARSHIFT_DEVICE") == "cpu" and torch is not None


def test_run_spread_is_the_relative_gap_between_repeats_of_a_plan():
    res = [ProfileResult(ok=True, plan=Plan(dp=1), iter_ms=10.0), ProfileResult(ok=True, plan=Plan(dp=1), iter_ms=12.0),
           ProfileResult(ok=True, plan=Plan(dp=2), iter_ms=5.0), ProfileResult(ok=True, plan=Plan(dp=2), iter_ms=5.5),
           ProfileResult(ok=False, plan=Plan(tp=2), error="x"), ProfileResult(ok=True, plan=Plan(pp=2), iter_ms=7.0)]
    got = run_spread(res)
    assert got == {"plans": 2, "median_spread": 0.2, "max_spread": 0.2}  # DP1 20%, DP2 10%; one run of PP2


def test_the_reference_workload_is_profiled_as_before():
    from gearshift.agent import reference as ref

    assert workload("torchref") == (ref.model_spec(), ref.command(), {"GEARSHIFT_PROFILE_CLOCK": "cpu"})


def test_the_profiler_gives_a_script_without_tp_another_identifying_plan_in_place_of_tp2():
    from gearshift.agent.torchplan.space import ModelShape, check_plan, declared_support
    from gearshift.services.profiler import MAX_PLANS, profiling_plans

    def plans(shape, support):
        got = profiling_plans(64, 2, heads=shape.heads, layers=shape.layers, support=support)
        for p in got:  # each one the shape's plan space holds
            check_plan({k: getattr(p, k) for k in ("dp", "tp", "pp", "zero", "ga", "grad_ckpt")}, shape)
        return got

    llama_shape = families.shape("llama")
    no_tp = ModelShape(family="no-tp", layers=llama_shape.layers, heads=llama_shape.heads, tp=False,
                       why_no_tp="its script has no tensor parallelism")
    from gearshift.bus_schema import codec
    from gearshift.bus_schema.messages import PlanSupport

    assert declared_support(no_tp) == {"tp": [1]} and plan_support("llama") is None and plan_support("gpt2") is None
    support = codec.convert(declared_support(no_tp), PlanSupport)
    without, llama = plans(no_tp, support), plans(llama_shape, None)
    assert len(without) == MAX_PLANS and not any(p.tp > 1 for p in without)
    assert Plan(pp=2) in without and Plan(pp=2, ga=4) in without  # the pipeline terms still come from its own runs
    assert set(without) - set(llama) == {Plan(dp=1, ga=2)} and set(llama) - set(without) == {Plan(tp=2)}
    assert plans(families.shape("gpt2"), None) == llama  # GPT-2 now runs TP: the same plans as LLaMA


def test_a_torchplan_job_declares_what_its_family_cannot_run():
    from gearshift.agent import torchplan

    assert torchplan.job_spec("j", "t5", steps=2)["plan_support"] == {"pp": [1]}
    assert "plan_support" not in torchplan.job_spec("j", "llama", steps=2)
    assert "plan_support" not in torchplan.job_spec("j", "gpt2", steps=2)
