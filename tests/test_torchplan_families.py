"""The T5, ViT and GPT-2 families of the plan library: built from a config (no
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


def test_t5_plan_space_has_tp_but_refuses_pp_naming_the_field():
    from gearshift.agent.torchplan.space import declared_support, plan_space

    shape = families.shape("t5", layers=2)
    with pytest.raises(PlanRefused, match="two stacks") as e:
        check_plan({"pp": 2}, shape)
    assert e.value.field == "pp"
    with pytest.raises(PlanRefused) as e:
        check_plan({"tp": 3}, shape)
    assert e.value.field == "tp"
    assert check_plan({"tp": 2, "dp": 2, "zero": 3, "offload": True}, shape)["tp"] == 2
    space = list(plan_space(shape, 4, global_batch=16))
    assert {p["pp"] for p in space} == {1} and {p["tp"] for p in space} == {1, 2, 4}
    assert declared_support(shape) == {"pp": [1]}  # what a T5 job tells the scheduler


@needs_torch
@pytest.mark.timeout(600)
def test_t5_trains_the_same_under_tp_with_cross_attention_ga_and_gc_as_one_rank(tmp_path):
    # TP2 splits self- and cross-attention by heads, the relative attention bias table with them
    _same_as_one_rank(tmp_path, "t5", [{"tp": 2, "ga": 2, "grad_ckpt": True}])


@needs_torch
@pytest.mark.slow  # three more 2-rank launches
@pytest.mark.timeout(900)
def test_t5_trains_the_same_under_dp_zero2_offload_and_zero3_as_one_rank(tmp_path):
    _same_as_one_rank(tmp_path, "t5", [{"dp": 2}, {"dp": 2, "zero": 2, "offload": True},
                                       {"dp": 2, "zero": 3, "ga": 2}])


@needs_torch
@pytest.mark.slow  # four launches
@pytest.mark.timeout(900)
def test_a_t5_checkpoint_under_zero3_resumes_under_tp_and_keeps_the_trajectory(tmp_path):
    ck, log = tmp_path / "switched", tmp_path / "switched.jsonl"
    for g, (plan, steps) in enumerate([({"dp": 2, "zero": 3}, 2), ({"tp": 2}, 4), ({"dp": 1, "grad_ckpt": True}, 5)]):
        codes, err = torchplan.run_local("t5", plan, steps, 16, ck, extra_args=ARGS, generation=g + 1,
                                         env={"GEARSHIFT_LOSS_LOG": str(log)})
        assert not any(codes), err[-2000:]
    assert json.loads((ck / "manifest.json").read_text())["step"] == 5
    codes, _ = torchplan.run_local("t5", {"dp": 1}, 5, 16, tmp_path / "base", extra_args=ARGS,
                                   env={"GEARSHIFT_LOSS_LOG": str(tmp_path / "base.jsonl")})
    got, base = _losses(log), _losses(tmp_path / "base.jsonl")
    assert sorted(got) == list(range(1, 6)) and codes == [0]
    assert max(abs(got[s] - base[s]) / base[s] for s in base) < 1e-12, (got, base)


@needs_torch
def test_gpt2_blocks_as_linear_layers_compute_what_transformers_conv1d_blocks_do():
    import torch
    import transformers as tf

    from gearshift.agent.torchplan.gpt2_layers import FusedQKV

    torch.manual_seed(1234)
    plain = tf.GPT2LMHeadModel(families.config("gpt2", layers=2)).to(torch.float64)
    ours = families.build("gpt2", layers=2)  # the same seed: the same init, then linearized
    attn = ours.transformer.h[0].attn
    assert isinstance(attn.c_attn, FusedQKV) and isinstance(attn.c_proj, torch.nn.Linear)
    assert not any(type(m).__name__ == "Conv1D" for m in ours.modules())
    x = torch.randint(0, families.VOCAB, (3, families.SEQ))
    diff = (plain(input_ids=x).logits - ours(input_ids=x).logits).abs().max().item()
    assert diff < 1e-12, diff
    assert families.shape("gpt2").tp and check_plan({"tp": 2}, families.shape("gpt2"))["tp"] == 2


@needs_torch
@pytest.mark.timeout(600)
def test_gpt2_trains_the_same_under_tp_and_tp_with_pp_as_one_rank(tmp_path):
    _same_as_one_rank(tmp_path, "gpt2", [{"tp": 2}, {"tp": 2, "pp": 2, "ga": 2}])
