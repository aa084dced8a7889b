"""The fairness loadtest's checks can fail, and pass on a small honest run."""

from __future__ import annotations

import pytest

from loadtest import fairness as f
from policies.queues import ShareConfig, entitlement
from sim.engine import SimConfig

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


def test_small_fifo_run_keeps_quota_reclaim_and_min_run_time():
    trace = f.workload(scale=0.3)
    pol, res, _ = f.run_policy("fifo", trace, SimConfig(interval=60, restart_cost=120), f.SHARING)
    assert pol.log and f.quota_check(pol.log, CFG)["pass"]
    assert f.min_run_check(pol.log, f.SHARING["min_run_time"])["pass"]
    assert f.reclaim_check(pol.log, res, 60, 120)["pass"]
