"""Sensitivity curves: monotone envelope, knees are the smallest allocations."""

import itertools

import numpy as np

from gearshift.perfmodel.catalog import fitted_model_for, rubick_job
from gearshift.perfmodel.curve import balanced_placement, build_curve, curve
from gearshift.perfmodel.plans import Resources
from gearshift.perfmodel.predict import plan_throughput

TOL = 1.01


def _small_curve(name="gpt2"):
    shape, B = rubick_job(name)
    return fitted_model_for(name), shape, B, build_curve(
        fitted_model_for(name), shape, B, max_gpus=16, max_nodes=3, threads=(1, 4, 8))


def test_balanced_placement():
    assert balanced_placement(12, 2, 8) == (6, 6)
    assert balanced_placement(13, 2, 8) == (7, 6)
    assert balanced_placement(17, 2, 8) is None
    assert balanced_placement(3, 4, 8) is None


def test_envelope_is_monotone_and_dominates():
    for name in ("gpt2", "llama7", "bert"):
        _, _, _, c = _small_curve(name)
        for axis in range(3):
            assert np.all(np.diff(c.env, axis=axis) >= 0), (name, axis)
        assert np.all(c.env >= c.tput)
        assert c.max_throughput == c.env.max() > 0


def test_knees_are_the_smallest_allocations_within_1_percent():
    _, _, _, c = _small_curve("gpt2")
    G, Nn, T = c.tput.shape
    for g, n, ci in itertools.product(range(1, G), range(1, Nn), range(T)):
        level = c.env[g, n, ci]
        if level <= 0:
            continue
        kg, kn, kc = c.knee_g[g, n, ci], c.knee_n[g, n, ci], c.knee_ci[g, n, ci]
        assert kg <= g and kn <= n and kc <= ci
        assert c.tput[kg, kn, kc] * TOL >= level
        # No allocation that is smaller (fewer GPUs, then threads, then nodes) reaches the level.
        for g2, c2, n2 in itertools.product(range(1, G), range(T), range(1, Nn)):
            if (g2, c2, n2) >= (kg, kc, kn):
                break
            if g2 <= g and n2 <= n and c2 <= ci:
                assert c.tput[g2, n2, c2] * TOL < level


def test_saturation_lookups_and_best_plan_consistency():
    params, shape, B, c = _small_curve("gpt2")
    sat = c.saturation
    assert sat is not None and sat.throughput * TOL >= c.max_throughput
    assert sat.plan is not None
    # The stored best plan really gives the stored throughput on its offer.
    for g in (1, 4, 8, 12, 16):
        n = c.min_nodes(g)
        plan = c.best_plan(g)
        res = Resources(balanced_placement(g, n, 8), 4.0)
        assert abs(plan_throughput(params, shape, B, plan, res) - c.exact_throughput(g, n, 4.0)) < 1e-9
    gc = c.gpu_curve(4.0)
    assert gc.shape == (17,) and np.all(np.diff(gc[1:]) >= 0)
    assert c.marginal_gain(2, 2) >= 0
    assert c.knee(16).gpus <= 16


def test_curve_cache_hits():
    params, shape, B, _ = _small_curve("vit")
    a = curve(params, shape, B, max_gpus=8, max_nodes=2)
    b = curve(params, shape, B, max_gpus=8, max_nodes=2)
    assert a is b
