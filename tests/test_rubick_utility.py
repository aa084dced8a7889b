"""rubick's utility never falls for a faster allocation of the same job (issue 21 item 5),
and each job pays its own restart."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gearshift.policies.rubick_utility import restart_speed_utility

pos = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(ref=pos, left=pos, R=st.floats(min_value=0.0, max_value=3600.0), alpha=st.floats(min_value=0.05, max_value=1.0),
       running=st.booleans(), unavoidable=st.booleans(),
       thr=st.lists(pos, min_size=2, max_size=8))
def test_a_faster_allocation_never_has_lower_utility(ref, left, R, alpha, running, unavoidable, thr):
    thr = np.sort(np.array(thr))[None, :]
    u = restart_speed_utility(thr, np.array([ref]), np.array([left]), np.array([R]), np.array([running]), alpha,
                              unavoidable)[0]
    assert np.all(np.diff(u) >= -1e-12 * np.abs(u[1:])), (thr, u)


def test_the_earlier_form_fell_where_the_restart_dominates():
    """What the property guards against: (thr/ref)^a x f/f1 with T << R falls with speed."""
    ref, left, R, a = 1.0, 10.0, 500.0, 0.5
    thr = np.array([1.0, 2.0, 4.0])
    T, T1 = left / thr, left / ref
    old = (thr / ref) ** a * (T / (T + R)) / (T1 / (T1 + R))
    assert old[2] < old[1] < old[0]
    new = restart_speed_utility(thr[None, :], np.array([ref]), np.array([left]), np.array([R]), np.array([False]), a,
                                True)[0]
    assert new[0] < new[1] < new[2]
    # by hand: pending, ((T1 + R) / (T + R))^a; at the request's speed it is 1
    assert new[0] == 1.0 and new[2] == ((10 + 500) / (2.5 + 500)) ** 0.5


def test_long_jobs_keep_the_plain_normalised_speed():
    u = restart_speed_utility(np.array([[2.0]]), np.array([1.0]), np.array([1e9]), np.array([100.0]),
                              np.array([True]), 0.5, True)
    assert abs(u[0, 0] - 2 ** 0.5) < 1e-6


def test_each_job_pays_its_own_restart():
    from msgspec.structs import replace
    from policy_helpers import job

    from gearshift.perfmodel.restart import restart_seconds
    from gearshift.policies import make_policy

    pol = make_policy("rubick", restart_cost=99.0, restart_model=restart_seconds)
    small, big = job("s", 1), job("b", 1)
    big.spec = replace(big.spec, model=replace(big.spec.model, name="big", params=30_000))
    assert pol.restart_of(small) == restart_seconds(small.spec) < pol.restart_of(big) == restart_seconds(big.spec)
    flat = make_policy("rubick", restart_cost=99.0, restart_model=restart_seconds, own_restart=False)
    assert flat.restart_of(big) == 99.0
