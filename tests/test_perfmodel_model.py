"""Throughput model: numba kernel == numpy reference, basic physics, predict API."""

from types import SimpleNamespace

import numpy as np

from gearshift.perfmodel.kernels import iteration_time_ms_numba
from gearshift.perfmodel.model import PerfParams, default_cluster, default_theta, iteration_time_ms, shape_consts
from gearshift.perfmodel.plans import PlanArray, ResourceArray, Resources, enumerate_plans
from gearshift.perfmodel.predict import best_plan, plan_throughput, predict
from gearshift.perfmodel.rubick import MODELS, load_placements, load_profile, rows_to_arrays, rubick_shape


def _params(shape, seed=0):
    rng = np.random.default_rng(seed)
    return PerfParams(shape.key, default_theta() * np.exp(rng.normal(0, 0.5, default_theta().size)),
                      default_cluster() * np.exp(rng.normal(0, 0.3, default_cluster().size)))


def test_numba_matches_numpy_on_rows_and_plan_space():
    for i, m in enumerate(MODELS):
        shape = rubick_shape(m)
        p = _params(shape, i)
        pa, ra, _ = rows_to_arrays(load_placements(m) + load_profile(m))
        a = iteration_time_ms(p.theta, p.cluster, shape_consts(shape), pa, ra)
        b = iteration_time_ms_numba(p.theta, p.cluster, shape_consts(shape), pa, ra)
        np.testing.assert_allclose(a, b, rtol=1e-12)
        for res in (Resources((8,), 2.0), Resources((3, 5), 8.0), Resources((4,) * 4, 1.0)):
            pa = enumerate_plans(shape, 16, res)
            ra = ResourceArray.broadcast(res, len(pa))
            np.testing.assert_allclose(iteration_time_ms(p.theta, p.cluster, shape_consts(shape), pa, ra),
                                       iteration_time_ms_numba(p.theta, p.cluster, shape_consts(shape), pa, ra),
                                       rtol=1e-12)


def test_predict_units_and_physics():
    shape = rubick_shape("bert")
    p = _params(shape)
    plans = [SimpleNamespace(dp=8, tp=1, pp=1, zero=2, offload=True, ga=1, micro_batch=4, grad_ckpt=False)]
    few = predict(p, shape, 32, plans, Resources((8,), 1.0))
    many = predict(p, shape, 32, plans, Resources((8,), 8.0))
    assert few.feasible[0] and many.feasible[0]
    assert many.iter_time_s[0] < few.iter_time_s[0]  # more CPU threads speed up offload
    np.testing.assert_allclose(few.throughput, 32 / few.iter_time_s)
    base = dict(dp=8, tp=1, pp=1, zero=0, offload=False, ga=1, micro_batch=4)
    t_gc = predict(p, shape, 32, [dict(base, grad_ckpt=True)], Resources((8,))).iter_time_s[0]
    t_no = predict(p, shape, 32, [dict(base, grad_ckpt=False)], Resources((8,))).iter_time_s[0]
    assert t_gc > t_no
    # Same GPUs spread over two nodes are slower than on one.
    t_2n = predict(p, shape, 32, [dict(base, grad_ckpt=False)], Resources((4, 4))).iter_time_s[0]
    assert t_2n > t_no


def test_predict_marks_invalid_and_engines_agree():
    shape = rubick_shape("gpt2")
    p = _params(shape)
    pa = enumerate_plans(shape, 16, Resources((8,)))
    a = predict(p, shape, 16, pa, Resources((8,)), engine="numpy")
    b = predict(p, shape, 16, pa, Resources((8,)), engine="numba")
    np.testing.assert_allclose(a.iter_time_s, b.iter_time_s, rtol=1e-12)
    bad = predict(p, shape, 16, [dict(dp=4, micro_batch=4)], Resources((8,)))
    assert not bad.valid[0] and bad.throughput[0] == 0 and np.isinf(bad.iter_time_s[0])
    plan, tput = best_plan(p, shape, 16, Resources((8,)))
    assert plan is not None and tput == max(b.throughput)
    assert plan_throughput(p, shape, 16, plan, Resources((8,))) == tput


def test_perf_params_round_trip_and_validation():
    p = _params(rubick_shape("vit"))
    q = PerfParams.from_dict(p.to_dict())
    np.testing.assert_array_equal(p.theta, q.theta)
    np.testing.assert_array_equal(p.cluster, q.cluster)
    import pytest

    with pytest.raises(ValueError):
        PerfParams.from_dict({"model_key": "x", "params": {"bogus": 1.0}})
    # A fit stored before kappa_dp/gamma_z existed predicts as it did: no sync
    # factor, one overlap exponent for DDP and ZeRO.
    old = p.to_dict()
    for n in ("kappa_dp", "gamma_z"):
        del old["params"][n]
    r = PerfParams.from_dict(old)
    assert r.get("kappa_dp") == 1.0 and r.get("gamma_z") == p.get("gamma")
    with pytest.raises(ValueError):
        PerfParams("x", -default_theta())


def test_parallel_numba_kernel_matches_numpy_on_a_large_batch():
    from gearshift.perfmodel.kernels import PARALLEL_MIN

    shape = rubick_shape("gpt2")
    p = _params(shape, 3)
    parts, res = [], []
    for pl in ("1", "8", "35", "2222", "88888888"):
        for thr in (1.0, 8.0):
            r = Resources.from_placement(pl, thr)
            pa = enumerate_plans(shape, 16, r)
            parts.append(pa)
            res.append(ResourceArray.broadcast(r, len(pa)))
    pool = PlanArray.concat(parts)
    rpool = ResourceArray(*[np.concatenate([getattr(r, c) for r in res]) for c in ResourceArray.__slots__])
    idx = np.random.default_rng(0).integers(0, len(pool), size=PARALLEL_MIN + 7)
    pa, ra = pool.take(idx), rpool.take(idx)
    a = iteration_time_ms(p.theta, p.cluster, shape_consts(shape), pa, ra)
    for parallel in (None, True, False):
        b = iteration_time_ms_numba(p.theta, p.cluster, shape_consts(shape), pa, ra, parallel=parallel)
        np.testing.assert_allclose(a, b, rtol=1e-12)
