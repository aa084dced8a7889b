"""The optimizer's round pacing (``services.pacing``): pure, times given."""

import pytest

from gearshift.services.pacing import RoundPacer


def test_a_round_waits_the_gap_after_the_last_one():
    p = RoundPacer(gap=0.1, duty=0.5)
    assert p.delay(100.0) == 0.0  # no round yet: at once
    p.ended(100.0, 100.01)  # a short round: the gap rules
    assert p.delay(100.01) == pytest.approx(0.1)
    assert p.delay(100.06) == pytest.approx(0.05)
    assert p.delay(100.2) == 0.0


def test_long_rounds_take_at_most_their_duty_of_the_time():
    p = RoundPacer(gap=0.1, duty=0.25)
    p.ended(10.0, 12.0)  # a 2 s round: 6 s of rest keeps rounds to a quarter of the time
    assert p.delay(12.0) == pytest.approx(6.0)
    assert 2.0 / (2.0 + p.rest()) == pytest.approx(0.25)
    p.ended(20.0, 20.02)  # the next short one (its duty's rest 0.06 s): back to the gap
    assert p.delay(20.02) == pytest.approx(0.1)


def test_duty_one_and_no_gap_is_no_pacing():
    p = RoundPacer(gap=0.0, duty=1.0)
    p.ended(0.0, 5.0)
    assert p.delay(5.0) == 0.0


@pytest.mark.parametrize("gap,duty", [(-1.0, 0.5), (0.1, 0.0), (0.1, 1.5)])
def test_bad_settings_are_refused(gap, duty):
    with pytest.raises(ValueError):
        RoundPacer(gap=gap, duty=duty)
