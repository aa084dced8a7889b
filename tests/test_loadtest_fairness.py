"""The fairness loadtest's checks can fail, and pass on a small honest run."""

from __future__ import annotations

import pytest

from gearshift.policies.queues import ShareConfig, entitlement
from gearshift.sim.engine import SimConfig
from loadtest import fairness as f

CFG = ShareConfig.from_dict(f.SHARING)


def test_entitlement_is_weighted_water_filling():
    got = entitlement({"a": 100, "b": 100, "c": 4}, {"a": 2, "b": 1, "c": 1}, 64)
    assert got["c"] == 4 and got["a"] == pytest.approx(40) and got["b"] == pytest.approx(20)
    assert entitlement({"a": 10, "b": 0}, {"a": 1, "b": 1}, 64) == {"a": 10.0, "b": 0.0}


def entry(t, held, demand=None, preempted=(), owed=(), started=()):
    return {"t": t, "held": held, "demand": demand or held, "quota": {}, "preempted": list(preempted),
            "owed": list(owed), "started": list(started)}


def test_checks_catch_violations():
    over = [entry(0.0, {"research": 40, "product": 24, "intern": 8})]  # 16 borrowed, intern lends 8
    assert not f.quota_check(over, CFG)["pass"]
    early = [entry(0.0, {}, preempted=[{"job": "x", "tenant": "a", "kind": "priority", "ran_s": 10.0, "priority": 0}])]
    assert not f.min_run_check(early, 600)["pass"]
    reclaim_ok = [entry(0.0, {}, preempted=[{"job": "x", "tenant": "a", "kind": "reclaim", "ran_s": 10.0, "priority": 0}])]
    assert f.min_run_check(reclaim_ok, 600)["pass"]
    # a tenant held at half its entitlement for 6 h of contention fails the share floor
    log = [entry(3600.0 * h, {"research": 16, "product": 48, "intern": 0},
                 demand={"research": 64, "product": 64, "intern": 0}) for h in range(8)]
    share, _ = f.share_check(log, CFG, 64, 8 * 3600.0)
    assert not share["pass"] and share["worst"]["tenant"] == "research"


def test_the_share_check_is_two_sided():
    # product (entitled 64/3) holds 24 for 8 h of contention, research the rest: product is
    # 12.5% above its share in every window, research 6% below it; the upper side fails too
    log = [entry(3600.0 * h, {"research": 40, "product": 24, "intern": 0},
                 demand={"research": 64, "product": 64, "intern": 0}) for h in range(8)]
    share, _ = f.share_check(log, CFG, 64, 8 * 3600.0)
    assert share["min_ratio"] >= 0.9 and share["max_ratio"] > 1.1
    assert not share["pass"] and share["above_110pct"] > 0 and share["below_90pct"] == 0
    ok = [entry(3600.0 * h, {"research": 43, "product": 21, "intern": 0},
                demand={"research": 64, "product": 64, "intern": 0}) for h in range(8)]
    assert f.share_check(ok, CFG, 64, 8 * 3600.0)[0]["pass"]


def test_small_fifo_run_keeps_quota_reclaim_and_min_run_time():
    trace = f.workload(scale=0.3)
    pol, res, _ = f.run_policy("fifo", trace, SimConfig(interval=60, restart_cost=120), f.SHARING)
    assert pol.log and f.quota_check(pol.log, CFG)["pass"]
    assert f.min_run_check(pol.log, f.SHARING["min_run_time"])["pass"]
    assert f.reclaim_check(pol.log, res, 60, 120)["pass"]


def test_share_windows_start_at_every_round_and_the_upper_side_is_reported():
    # research (weight 2) is entitled to 128/3 of 64, product to 64/3; for one hour product
    # holds 29 and research 35: product's excess is reported as taken while research was short
    log = [entry(3600.0 * h, {"research": 43, "product": 21, "intern": 0},
                 demand={"research": 64, "product": 64, "intern": 0}) for h in range(8)]
    log[3] = entry(3 * 3600.0, {"research": 35, "product": 29, "intern": 0},
                   demand={"research": 64, "product": 64, "intern": 0})
    share, _ = f.share_check(log, CFG, 64, 8 * 3600.0)
    assert share["worst"]["tenant"] == "research" and share["most"]["tenant"] == "product"
    assert share["most_taken"]["taken"] > 0
    assert share["windows"] > 2 * 8  # windows start and end at every round, not hourly from the first
