"""Fitting: synthetic samples from known parameters are recovered within 1%."""

import numpy as np

from gearshift.perfmodel.fit import Sample, fit, fit_joint
from gearshift.perfmodel.model import PARAM_NAMES, default_cluster, default_theta, model_terms, shape_consts
from gearshift.perfmodel.plans import ResourceArray, Resources, enumerate_plans
from gearshift.perfmodel.shapes import ModelShape

SHAPE = ModelShape("synth", 1500.0, 24, 2048, 1024, 16)
TRUE = default_theta() * np.array([1.3, 0.8, 1.1, 0.9, 1.5, 1.2, 0.7, 1.4, 0.9, 1.6, 20, 1.2, 0.8, 1.3, 1.1, 0.9, 1.2, 1.3, 100])


def _samples(theta, cluster, placements=("1", "2", "4", "8", "44", "2222", "35", "17", "11111111", "233")):
    out = []
    for pl in placements:
        for threads in (2.0, 8.0):
            res = Resources.from_placement(pl, threads)
            pa = enumerate_plans(SHAPE, 32, res)
            sub = pa.take(np.arange(0, len(pa), max(1, len(pa) // 12)))
            t = model_terms(theta, cluster, shape_consts(SHAPE), sub, ResourceArray.broadcast(res, len(sub)))
            for i in range(len(sub)):
                p = sub.plan(i)
                dp_family = p.tp == 1 and p.pp == 1
                comp = [float(t[k][i]) if dp_family else np.nan for k in ("fwd", "sync", "opt")]
                out.append(Sample(p, res, 32, float(t["total"][i]), *comp))
    return out


def test_fit_recovers_known_parameters_within_1_percent():
    cl = default_cluster()
    samples = _samples(TRUE, cl)
    p = fit(SHAPE, samples, cluster=cl, prior_weight=1e-6)
    rel = p.theta / TRUE - 1.0
    bad = {n: float(r) for n, r in zip(PARAM_NAMES, rel) if abs(r) > 0.01}
    assert not bad, bad
    assert p.model_key == SHAPE.key


def test_joint_fit_recovers_cluster_constants():
    cl_true = default_cluster() * np.array([0.6, 1.4, 2.0])
    samples = _samples(TRUE, cl_true)
    cl, ths = fit_joint({"synth": (SHAPE, samples)}, prior_weight=1e-6, n_starts=2)
    np.testing.assert_allclose(cl, cl_true, rtol=0.01)
    np.testing.assert_allclose(ths["synth"], TRUE, rtol=0.01)


def test_few_samples_stay_finite_thanks_to_priors():
    cl = default_cluster()
    samples = _samples(TRUE, cl, placements=("4", "8"))[:3]
    p = fit(SHAPE, samples, cluster=cl)
    assert np.all(np.isfinite(p.theta)) and np.all(p.theta > 0)
    # Unidentified 3D terms stay at their prior centres when no 3D sample exists.
    i = PARAM_NAMES.index("c_p2p")
    assert abs(np.log(p.theta[i] / default_theta()[i])) < 0.5
