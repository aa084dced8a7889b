"""Sharing parts (issue 13): quotas, borrowing, reclaim, priority, fair share, starvation, EASY backfill."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from gearshift.policies import Placement, check_decision, make_policy
from gearshift.policies.backfill import EasyFifo
from gearshift.policies.queues import FairShare, QuotaBook, ShareConfig, ShareConfigError
from tests.policy_helpers import job, nodes

COHORT = {"queues": {"a": {"quota": 8, "weight": 1, "cohort": "c"}, "b": {"quota": 8, "weight": 1, "cohort": "c"}},
          "min_run_time": 600}


def tj(jid, gpus, tenant, *, prio=0, **kw):
    j = job(jid, gpus, **kw)
    j.spec = replace(j.spec, tenant=tenant, priority=prio, step_time=1.0)
    return j


def run(policy, now, ns, jobs):
    d = policy.schedule(now, ns, jobs, None)
    check_decision(d, ns, {j.job_id: j for j in jobs})
    return d


def test_reclaim_takes_the_borrowers_lowest_priority_job_even_inside_its_minimum_run_time():
    ns = nodes(2)
    b1 = tj("b1", 8, "b", prio=5, running_on=(Placement("n0", 8, 16),), since=900.0)
    b2 = tj("b2", 8, "b", prio=0, running_on=(Placement("n1", 8, 16),), since=950.0)
    a1 = tj("a1", 8, "a", t=990.0)
    d = run(make_policy("fifo", sharing=COHORT), 1000.0, ns, [b1, b2, a1])
    assert "a1" in d.allocations and "b1" in d.allocations
    assert "b2" not in d.allocations and "reclaim" in d.waiting["b2"]


def test_reclaim_prefers_a_job_past_its_minimum_run_time():
    ns = nodes(2)
    b1 = tj("b1", 8, "b", running_on=(Placement("n0", 8, 16),), since=0.0)  # ran 1000 s
    b2 = tj("b2", 8, "b", running_on=(Placement("n1", 8, 16),), since=900.0)  # ran 100 s
    d = run(make_policy("fifo", sharing=COHORT), 1000.0, ns, [b1, b2, tj("a1", 8, "a", t=990.0)])
    assert "b1" not in d.allocations and "b2" in d.allocations and "a1" in d.allocations


def test_borrowing_stops_at_the_lending_limit_and_owner_claims_first():
    ns = nodes(2)
    cfg = {"queues": {"a": {"quota": 8, "cohort": "c", "lend_limit": 4}, "b": {"quota": 8, "cohort": "c"}}}
    jobs = [tj(f"b{i}", 4, "b", t=i) for i in range(4)]
    d = run(make_policy("fifo", sharing=cfg), 10.0, ns, jobs)
    assert sum(1 for j in d.allocations if j.startswith("b")) == 3  # 8 own + 4 lent
    assert "quota 8" in d.waiting["b3"]
    # the owner's pending job is claimed before b may borrow
    jobs.append(tj("a0", 8, "a", t=20.0))
    d = run(make_policy("fifo", sharing=cfg), 30.0, ns, jobs)
    assert "a0" in d.allocations and sum(1 for j in d.allocations if j.startswith("b")) == 2


def test_priority_preempts_lower_class_only_past_minimum_run_time():
    ns = nodes(1)
    low = tj("low", 8, "x", prio=0, running_on=(Placement("n0", 8, 16),), since=0.0)
    hi = tj("hi", 8, "x", prio=10, t=500.0)
    pol = make_policy("rubick", sharing={"min_run_time": 600})
    d = run(pol, 550.0, ns, [low, hi])
    assert "low" in d.allocations and "hi" not in d.allocations  # low ran 550 s < 600 s
    d = run(pol, 700.0, ns, [low, hi])
    assert "hi" in d.allocations and "low" not in d.allocations and "priority" in d.waiting["low"]


def test_fair_share_orders_tenants_by_decayed_usage_over_weight():
    fs = FairShare(half_life=3600)
    fs.update(0.0, {})
    fs.update(3600.0, {"a": 8})
    # integral of 8 GPUs over one half-life under decay: 8 * h/ln2 * (1 - 1/2)
    assert fs.usage["a"] == pytest.approx(8 * 3600 / 0.6931471805599453 * 0.5)
    fs.update(7200.0, {})
    assert fs.usage["a"] == pytest.approx(8 * 3600 / 0.6931471805599453 * 0.25)
    ns = nodes(1)
    pol = make_policy("fifo", sharing={"queues": {"a": {"quota": 8, "weight": 1, "cohort": "c"},
                                                  "b": {"quota": 8, "weight": 1, "cohort": "c"}}})
    a_run = tj("a0", 8, "a", running_on=(Placement("n0", 8, 16),), since=0.0)
    run(pol, 0.0, ns, [a_run])
    run(pol, 3000.0, ns, [a_run])
    # a used the node; now both wait: b's later job goes first
    a1, b1 = tj("a1", 8, "a", t=3100.0), tj("b1", 8, "b", t=3200.0)
    d = run(pol, 3300.0, ns, [a1, b1])
    assert "b1" in d.allocations and "a1" not in d.allocations


def test_starvation_guard_preempts_a_better_served_tenant():
    ns = nodes(1)
    cfg = {"starvation_wait": 3600, "min_run_time": 600}
    pol = make_policy("fifo", sharing=cfg)
    hog = tj("hog", 8, "a", running_on=(Placement("n0", 8, 16),), since=0.0)
    small = tj("small", 4, "b", t=10.0)
    d = run(pol, 10.0, ns, [hog, small])
    assert "hog" in d.allocations and "small" not in d.allocations
    d = run(pol, 4000.0, ns, [hog, small])
    assert "small" in d.allocations and "starvation" in d.waiting["hog"]


def test_a_new_policy_object_goes_on_from_the_saved_starvation_timer():
    """What a new leader loads (``memory``/``restore``): the timer is not restarted."""
    import json

    ns = nodes(1)
    cfg = {"starvation_wait": 3600, "min_run_time": 600}
    hog = tj("hog", 8, "a", running_on=(Placement("n0", 8, 16),), since=0.0)
    small = tj("small", 4, "b", t=10.0)
    old = make_policy("fifo", sharing=cfg)
    run(old, 10.0, ns, [hog, small])
    saved = json.loads(json.dumps(old.memory()))  # as it travels through gs_queues
    assert saved["waiting_since"] == {"small": 10.0}
    fresh, restored = make_policy("fifo", sharing=cfg), make_policy("fifo", sharing=cfg)
    restored.restore(saved)
    assert restored.fair.usage == old.fair.usage
    # at 4000 s small has waited 3990 s since 10 s: starved for the restored leader only
    d = run(restored, 4000.0, ns, [hog, small])
    assert "small" in d.allocations and "starvation" in d.waiting["hog"]
    d = run(fresh, 4000.0, ns, [hog, small])
    assert "small" not in d.allocations and "hog" in d.allocations


def test_easy_backfill_fills_the_hole_only_without_delaying_the_head():
    ns = nodes(1)
    big_running = tj("r", 6, "x", running_on=(Placement("n0", 6, 12),), since=0.0, steps=1000)  # 1000 steps left: ends t=1010
    head = tj("head", 8, "x", t=1.0)
    short = tj("short", 2, "x", t=2.0, steps=500)  # ends t=510 < 1000
    long = tj("long", 2, "x", t=3.0, steps=5000)  # would delay the head
    jobs = [big_running, head, long, short]
    strict = run(make_policy("fifo"), 10.0, ns, jobs)
    assert set(strict.allocations) == {"r"}
    pol = EasyFifo(backfill=True)
    d = run(pol, 10.0, ns, jobs)
    assert set(d.allocations) == {"r", "short"}
    assert pol.reservations["head"] == pytest.approx(1010.0)


def test_bad_sharing_config_names_the_field():
    with pytest.raises(ShareConfigError, match=r"queues.a.quota"):
        ShareConfig.from_dict({"queues": {"a": {"quota": -1}}})
    with pytest.raises(ShareConfigError, match=r"queues.a: unknown field 'qouta'"):
        ShareConfig.from_dict({"queues": {"a": {"qouta": 1}}})
    with pytest.raises(ShareConfigError, match=r"sharing.half_life"):
        ShareConfig.from_dict({"half_life": 0})
    with pytest.raises(ValueError, match="only the FIFO family"):
        make_policy("rubick", backfill=True)


def test_quota_book_borrow_limit():
    cfg = ShareConfig.from_dict({"queues": {"a": {"quota": 4, "cohort": "c", "borrow_limit": 2},
                                            "b": {"quota": 8, "cohort": "c"}}})
    book = QuotaBook(cfg, {"a": 4})
    assert book.borrowable("a") == 2
    assert book.borrow("a", 2) and not book.borrow("a", 1)
    book = QuotaBook(cfg, {"a": 7, "b": 0})
    assert book.over_limit() == ["a"]


@pytest.mark.parametrize("name", ["fifo", "fifo-easy", "las", "tiresias", "antman", "rubick", "sia", "gavel"])
def test_every_policy_composes_with_sharing(name):
    ns = nodes(2)
    jobs = [tj("b1", 8, "b", running_on=(Placement("n0", 8, 16),), since=0.0),
            tj("b2", 8, "b", running_on=(Placement("n1", 8, 16),), since=0.0),
            tj("a1", 8, "a", t=990.0), tj("b3", 4, "b", t=991.0)]
    d = run(make_policy(name, sharing=COHORT), 1000.0, ns, jobs)
    held = {"a": 0, "b": 0}
    for jid, dec in d.allocations.items():
        held[jid[0]] += sum(p.gpus for p in dec.placement)
    assert held["a"] == 8 and held["b"] <= 8  # the owner got its quota back


def test_priority_inside_a_full_quota_preempts_its_own_tenants_lower_class():
    ns = nodes(1)
    cfg = {"queues": {"a": {"quota": 4, "cohort": "c"}, "b": {"quota": 4, "cohort": "c"}}, "min_run_time": 0}
    a1 = tj("a1", 4, "a", prio=0, running_on=(Placement("n0", 4, 8),), since=0.0)
    b1 = tj("b1", 4, "b", prio=0, running_on=(Placement("n0", 4, 8),), since=0.0)
    a2 = tj("a2", 4, "a", prio=5, t=10.0)
    d = run(make_policy("fifo", sharing=cfg), 20.0, ns, [a1, b1, a2])
    assert set(d.allocations) == {"a2", "b1"} and "priority" in d.waiting["a1"]


@pytest.mark.parametrize("name", ["fifo", "fifo-easy", "las", "tiresias", "antman", "rubick", "sia", "gavel", "synergy"])
def test_every_policy_with_sharing_emits_valid_decisions_and_keeps_quotas(name):
    """Random tenants, priorities and sizes over several rounds: every decision passes
    check_decision and no cohort borrows more than it lends."""
    import random
    import zlib

    from gearshift.policies.queues import QuotaBook
    from tests.policy_helpers import apply
    from tests.test_policies_decisions import _instance

    cfg = {"queues": {"a": {"quota": 8, "weight": 2, "cohort": "c"}, "b": {"quota": 8, "cohort": "c", "lend_limit": 4},
                      "c": {"quota": 4, "cohort": "c", "borrow_limit": 4}}, "min_run_time": 600, "starvation_wait": 1500}
    share = ShareConfig.from_dict(cfg)
    rng = random.Random(zlib.crc32(name.encode()))
    for inst in range(6):
        ns, jobs = _instance(rng, 4)
        for j in jobs:
            j.spec = replace(j.spec, tenant=rng.choice("abc"), priority=rng.choice([0, 0, 1, 5]))
        pol = make_policy(name, sharing=cfg)
        now = 1000.0
        for _ in range(5):
            d = pol.schedule(now, ns, jobs, None)
            check_decision(d, ns, {j.job_id: j for j in jobs})
            held: dict[str, int] = {}
            by_id = {j.job_id: j for j in jobs}
            for jid, a in d.allocations.items():
                held[by_id[jid].spec.tenant] = held.get(by_id[jid].spec.tenant, 0) + a.plan.gpus
            assert QuotaBook(share, held).over_limit() == [], (held, inst)
            apply(d, jobs, now)
            now += 700.0


def test_rubick_plans_within_each_tenants_share_before_the_rebalance():
    # a's job runs on 1 GPU (its request); b asks for 8. Shares: a 1, b 7. Rubick alone
    # would grow a's job to 4 and start b's smaller, the rebalance would then take it all
    # back (restarts for nothing); told the shares first (Rubick.budget), its own
    # decision already is the final one.
    pol = make_policy("rubick", sharing=COHORT, min_run_time=600)
    inner = pol.inner
    seen = {}
    orig = inner.schedule

    def spy(now, ns, jobs, perf):
        d = orig(now, ns, jobs, perf)
        seen.update({k: sum(p.gpus for p in v.placement) for k, v in d.allocations.items()})
        return d

    inner.schedule = spy
    jobs = [tj("a1", 1, "a", running_on=(Placement("n0", 1, 2),), since=0.0), tj("b1", 4, "b", t=1.0),
            tj("b2", 4, "b", t=2.0)]
    d = run(pol, 5000.0, nodes(1), jobs)
    assert inner.budget == {"a": 1.0, "b": 7.0}
    final = {k: sum(p.gpus for p in v.placement) for k, v in d.allocations.items()}
    assert seen["a1"] == 1 and final == seen
    assert sum(g for k, g in final.items() if k.startswith("b")) <= 7


def test_growth_past_requests_yields_to_the_tenants_own_waiting_job_at_the_borrowing_limit():
    """a (quota 8) runs a1 (asks 4) grown to 8; b (quota 8) holds 6 and so lends 2. a2 (asks 4)
    would borrow 4: past what b lends, but only because of a1's growth. It is shown to the
    inner policy (which starts it on n2 and keeps a1's growth), and a1 goes back to its
    request rather than a2 waiting for it."""
    from gearshift.bus_schema.messages import Plan
    from gearshift.policies.api import Decision, JobDecision
    from gearshift.policies.sharing import Shared

    def tj(jid, gpus, tenant, **kw):
        j = job(jid, gpus, **kw)
        j.spec = replace(j.spec, tenant=tenant)
        return j

    ns = nodes(3)
    a1 = tj("a1", 4, "a", running_on=(Placement("n0", 8, 16),), since=0.0)
    b1 = tj("b1", 6, "b", running_on=(Placement("n1", 6, 12),), since=0.0)
    a2 = tj("a2", 4, "a", t=500.0)
    cfg = ShareConfig.from_dict({"queues": {"a": {"quota": 8, "cohort": "c"}, "b": {"quota": 8, "cohort": "c"}},
                                 "min_run_time": 600})

    class KeepsGrowth:
        name = "keeps-growth"

        def schedule(self, now, nodes, jobs, perf):
            d = Decision({j.job_id: JobDecision(j.placement, j.plan) for j in jobs if j.running})
            if any(j.job_id == "a2" for j in jobs):
                d.allocations["a2"] = JobDecision((Placement("n2", 4, 8),), Plan(dp=4))
            return d

    class BudgetedKeepsGrowth(KeepsGrowth):
        budget = None

        def set_budget(self, budget):  # takes budgets (protocols.BudgetedPolicy, as rubick): it is
            self.budget = budget  # shown jobs admitted against growth

    jobs = [a1, b1, a2]
    d = Shared(BudgetedKeepsGrowth(), cfg).schedule(1000.0, ns, jobs, None)
    check_decision(d, ns, {j.job_id: j for j in jobs})
    assert "a2" in d.allocations
    assert sum(p.gpus for p in d.allocations["a1"].placement) == 4 and "b1" in d.allocations
    # a policy that takes no budgets is not shown a2 (the repair would restart its grown jobs)
    plain = KeepsGrowth()
    d = Shared(plain, cfg).schedule(1000.0, ns, jobs, None)
    assert "a2" not in d.allocations and sum(p.gpus for p in d.allocations["a1"].placement) == 8
