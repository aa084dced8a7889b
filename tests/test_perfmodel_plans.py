"""Plan space, plan/resource arrays and the analytic memory model."""

from types import SimpleNamespace

import numpy as np
import pytest

from gearshift.perfmodel.memory import memory_feasible, memory_per_gpu_gb
from gearshift.perfmodel.plans import ConcretePlan, PlanArray, ResourceArray, Resources, as_plan, enumerate_plans
from gearshift.perfmodel.predict import plan_validity
from gearshift.perfmodel.rubick import MODELS, load_placements, load_profile, map_label, rubick_shape
from gearshift.perfmodel.shapes import ModelShape

TINY = ModelShape("tiny", 10.0, layers=4, hidden=128, seq_len=64, heads=2)


def test_plan_space_counts_small_cases():
    # 2 GPUs on one node, batch 4.  DP family: ga in {1,2}; ZeRO 0 (no offload)
    # plus stages 1-3 with and without offload = 7 variants, x GC on/off = 28.
    # 3D: (tp=1,pp=2) and (tp=2,pp=1), dp=1, ga in {1,2,4}, x GC = 12.
    pa = enumerate_plans(TINY, 4, Resources((2,)))
    fam = pa.families()
    assert len(pa) == 40
    assert fam.count("3D") == 12
    # 3 GPUs, batch 4: no DP plan divides the batch; tp=3 is not a head divisor,
    # so only pp=3 with dp=1 remains: ga in {1,2,4} x GC.
    pa3 = enumerate_plans(TINY, 4, Resources((3,)))
    assert len(pa3) == 6 and set(pa3.families()) == {"3D"}
    assert set(pa3.pp.tolist()) == {3}


def test_plan_space_invariants():
    shape = rubick_shape("llama7")
    for res in (Resources((8,)), Resources((4, 4)), Resources((8,) * 8), Resources((2, 2, 2))):
        pa = enumerate_plans(shape, 8, res)
        assert len(pa) > 0
        assert np.all(pa.dp * pa.ga * pa.micro_batch == 8)
        assert np.all(pa.n_gpus == res.n_gpus)
        assert np.all(pa.tp <= min(res.gpus_per_node))
        assert not np.any(pa.offload & (pa.zero == 0))
        three_d = (pa.tp > 1) | (pa.pp > 1)
        assert np.all(pa.zero[three_d] == 0)  # ZeRO is not combined with TP/PP
        ra = ResourceArray.broadcast(res, len(pa))
        assert plan_validity(shape, 8, pa, ra).all()


def test_plan_array_round_trip_from_foreign_objects():
    objs = [SimpleNamespace(dp=2, tp=2, pp=1, zero=0, offload=False, ga=2, micro_batch=1, grad_ckpt=True),
            {"dp": 4, "zero": 2, "offload": True, "micro_batch": 2}]
    pa = PlanArray.from_plans(objs)
    assert pa.plan(0) == ConcretePlan(2, 2, 1, 0, False, 2, 1, True)
    assert pa.plan(1) == ConcretePlan(dp=4, zero=2, offload=True, micro_batch=2)
    assert as_plan(pa.plan(1)).family == "zero-offload"
    assert PlanArray.concat([pa, pa.take([1])]).to_plans()[-1] == pa.plan(1)


def test_resources_validation_and_odd_nodes():
    with pytest.raises(ValueError):
        Resources(())
    with pytest.raises(ValueError):
        Resources((0, 2))
    ra = ResourceArray.from_resources([Resources.from_placement("1124"), Resources.from_placement("44")])
    assert ra.n_gpus.tolist() == [8, 8] and ra.k_min.tolist() == [1, 4] and ra.odd_nodes.tolist() == [2, 0]


def test_every_measured_row_is_feasible():
    n = 0
    for m in MODELS:
        shape = rubick_shape(m)
        for r in load_placements(m) + load_profile(m):
            _, _, ok = map_label(shape, r.label, r.placement, r.global_batch)
            assert ok, f"{m} {r.name} predicted infeasible"
            n += 1
    assert n == 546


def test_memory_edge_cases():
    llama = rubick_shape("llama7")
    one = lambda **kw: PlanArray.from_plans([ConcretePlan(**kw)])  # noqa: E731
    # Plain DP of a 6.7B model on one 80 GB GPU cannot hold 16 bytes/param.
    assert not memory_feasible(llama, one(dp=1, ga=8, micro_batch=1))[0]
    # ZeRO-Offload keeps only fp16 weights + a grad bucket: fits with mb 1.
    assert memory_feasible(llama, one(dp=1, zero=2, offload=True, ga=8, micro_batch=1))[0]
    # ZeRO stages never increase memory; offload is below stage 2.
    mem = [memory_per_gpu_gb(llama, one(dp=8, zero=z, micro_batch=1))[0] for z in (0, 1, 2, 3)]
    assert mem == sorted(mem, reverse=True) and mem[0] > mem[3]
    off = memory_per_gpu_gb(llama, one(dp=8, zero=2, offload=True, micro_batch=1))[0]
    assert off < mem[2]
    # Checkpointing cuts activation memory; bigger micro-batches cost more.
    gc = memory_per_gpu_gb(llama, one(tp=8, micro_batch=8, grad_ckpt=True))[0]
    nogc = memory_per_gpu_gb(llama, one(tp=8, micro_batch=8))[0]
    assert gc < nogc
    assert memory_per_gpu_gb(llama, one(tp=8, micro_batch=1))[0] < nogc
    # A smaller GPU rules out what a bigger one allows.
    p = one(dp=1, zero=2, offload=True, ga=8, micro_batch=1)
    assert memory_feasible(llama, p, 80.0)[0] and not memory_feasible(llama, p, 16.0)[0]


def test_plan_validity_rejects_bad_plans():
    shape = rubick_shape("gpt2")
    pa = PlanArray.from_plans([
        ConcretePlan(dp=8, micro_batch=2),              # ok: 8 GPUs, batch 16
        ConcretePlan(dp=4, micro_batch=2),              # wrong GPU count
        ConcretePlan(dp=8, micro_batch=1),              # wrong batch
        ConcretePlan(dp=8, micro_batch=2, offload=True),  # offload without ZeRO
        ConcretePlan(dp=1, tp=16, micro_batch=16),      # TP wider than a node
    ])
    ra = ResourceArray.from_resources([Resources((8,))] * 4 + [Resources((8, 8))])
    assert plan_validity(shape, 16, pa, ra).tolist() == [True, False, False, False, False]


def test_model_shape_key_and_validation():
    assert TINY.key == ModelShape("tiny", 10.0, 4, 128, 64, 2).key
    assert TINY.key != ModelShape("tiny", 10.0, 4, 128, 128, 2).key
    assert ModelShape.from_dict(TINY.to_dict()) == TINY
    with pytest.raises(ValueError):
        ModelShape("x", -1.0, 1, 1, 1)


def test_tp_divides_the_key_value_heads_too():
    """Grouped-query attention: 16 heads, 2 key/value heads; each TP rank holds whole k/v
    heads, so TP 4 and 8 are not plans of it (they are of the same model with 16 k/v heads)."""
    mha = ModelShape("gqa", 50.0, 8, 1024, 128, heads=16)
    gqa = ModelShape("gqa", 50.0, 8, 1024, 128, heads=16, kv_heads=2)
    tps = lambda s: set(enumerate_plans(s, 64, Resources((8,))).tp.tolist())
    assert tps(mha) == {1, 2, 4, 8}
    assert tps(gqa) == {1, 2}
    assert gqa.key != mha.key and mha.key == ModelShape("gqa", 50.0, 8, 1024, 128, heads=16).key
    assert ModelShape.from_dict(gqa.to_dict()) == gqa and "kv_heads" not in mha.to_dict()
    with pytest.raises(ValueError, match="kv_heads"):
        ModelShape("gqa", 50.0, 8, 1024, 128, heads=16, kv_heads=3)
