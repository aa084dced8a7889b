"""The T5 and ViT families of the plan library: built from a config (no
download), one training step under DP and under another plan gives the same
loss as one rank (real torch processes over gloo, float64)."""

from __future__ import annotations

import json

import pytest

from gearshift.agent import reference, torchplan
from gearshift.agent.torchplan import families
from gearshift.agent.torchplan.space import PlanRefused, check_plan

needs_torch = pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")
ARGS = ("--ckpt-every", "1000", "--layers", "2", "--dataset", "256")


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


def _same_as_one_rank(tmp_path, family: str, plans: list[dict], steps: int = 2) -> None:
    runs = {}
    for i, plan in enumerate([{"dp": 1}] + plans):
        log = tmp_path / f"{i}.jsonl"
        codes, err = torchplan.run_local(family, plan, steps, 16, tmp_path / f"ck{i}", extra_args=ARGS,
                                         env={"GEARSHIFT_LOSS_LOG": str(log)})
        assert not any(codes), err[-2000:]
        runs[json.dumps(plan)] = _losses(log)
    base = runs.pop(json.dumps({"dp": 1}))
    assert sorted(base) == list(range(1, steps + 1))  # step 2 follows an optimizer step: the update must agree too
    for plan, got in runs.items():
        assert sorted(got) == sorted(base), plan
        assert max(abs(got[s] - base[s]) / base[s] for s in base) < 1e-9, (plan, got, base)


@needs_torch
@pytest.mark.timeout(600)
def test_vit_trains_the_same_under_dp_and_tp_as_one_rank(tmp_path):
    _same_as_one_rank(tmp_path, "vit", [{"dp": 2}, {"tp": 2}])


@needs_torch
@pytest.mark.slow  # two more 2-rank launches
@pytest.mark.timeout(600)
def test_vit_trains_the_same_under_pipeline_and_zero3_as_one_rank(tmp_path):
    _same_as_one_rank(tmp_path, "vit", [{"pp": 2, "ga": 2}, {"dp": 2, "zero": 3, "grad_ckpt": True}])


def test_vit_plan_space_divides_its_heads_and_layers():
    shape = families.shape("vit", layers=2)
    with pytest.raises(PlanRefused) as e:
        check_plan({"tp": 3}, shape)
    assert e.value.field == "tp"
    assert check_plan({"tp": 2, "pp": 2}, shape)["tp"] == 2
