"""Room held for the head of rubick's seed queue (policies/rubick_reserve.py), the kernel's
room limits (policies/kernels.py), and the queue rules beside them (policies/rubick_rules.py):
kept starved jobs, the order by GPU-time, the efficiency floor and the completion weight."""

import random

import numpy as np
import pytest
from policy_helpers import CurveOracle, job, nodes
from test_policies_kernels import random_problem

from gearshift.policies import check_decision, make_policy
from gearshift.policies.api import Placement, Plan
from gearshift.policies.kernels import greedy_allocate
from gearshift.policies.rubick_problem import COMPLETION_SCALE_S
from gearshift.policies.rubick_reserve import reservation
from gearshift.policies.rubick_rules import queue_keys


def decide(pol, now, ns, js, perf):
    d = pol.schedule(now, ns, js, perf)
    check_decision(d, ns, {j.job_id: j for j in js})
    return d


# ---------------------------------------------------------------- kernel
@pytest.mark.parametrize("seed", range(20))
def test_room_limits_agree_between_numba_and_numpy_and_hold(seed):
    rng = random.Random(seed)
    args = random_problem(rng, J=rng.randint(1, 40), N=rng.randint(1, 8))
    cg, cc, cm, u, cost, nk, stay = args[:7]
    cap_g, cap_c = args[15], args[16]
    room_g = np.array([rng.choice([0, 2, 4, 8]) for _ in cap_g], np.int64)
    room_c = np.array([rng.choice([0, 8, 32]) for _ in cap_c], np.int64)
    bf = np.array([[rng.random() < 0.3 for _ in range(u.shape[1])] for _ in range(u.shape[0])])
    a = greedy_allocate(*args, None, None, room_g, room_c, bf, use_numba=True)
    b = greedy_allocate(*args, None, None, room_g, room_c, bf, use_numba=False)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    level, out = a
    taken_g = np.zeros(len(cap_g), np.int64)
    taken_c = np.zeros(len(cap_c), np.int64)
    for j, k in enumerate(level.tolist()):
        if k < 0 or k == stay[j] or bf[j, k]:
            continue
        per = cg[j, k] // cm[j, k]
        for q in range(cm[j, k]):
            taken_g[out[j, q]] += per
            taken_c[out[j, q]] += per * cc[j, k]
    assert (taken_g <= room_g).all() and (taken_c <= room_c).all()  # what is not backfill stays in the room


def test_room_is_taken_only_by_backfill_and_never_limits_staying():
    # one node of 8 GPUs, room for 0 of them: job 0 (not backfill) may not start there,
    # job 1 (backfill) may, job 2 keeps the 2 GPUs it holds
    cg = np.array([[4], [2], [2]], np.int64)
    cc = np.ones((3, 1), np.int64)
    cm = np.ones((3, 1), np.int64)
    u = np.array([[5.0], [1.0], [1.0]])
    cost = np.array([[4.0], [2.0], [2.0]])
    nk = np.array([1, 1, 1], np.int64)
    stay = np.array([-1, -1, 0], np.int64)
    hold = (np.array([0, 0, 0, 1]), np.array([0]), np.array([2]), np.array([2]))
    args = (cg, cc, cm, u, cost, nk, stay, *hold, np.zeros(0, np.int64), np.full(3, -1), np.zeros(3, bool),
            np.zeros(3, bool), np.array([8]), np.array([64]))
    bf = np.array([[False], [True], [False]])
    for numba in (True, False):
        free, _ = greedy_allocate(*args, use_numba=numba)
        assert free.tolist() == [0, 0, 0]  # no room kept: the best gain first, everything fits
        held, _ = greedy_allocate(*args, None, None, np.array([0]), np.array([0]), bf, use_numba=numba)
        assert held.tolist() == [-1, 0, 0]


# ---------------------------------------------------------------- reservation (hand-computed)
class _Pb:
    """The fields of a Problem that ``reservation`` reads."""

    def __init__(self, cg, cm, cc, u, cost):
        self.cg, self.cm, self.cc, self.u, self.cost = (np.array(x) for x in (cg, cm, cc, u, cost))
        self.nk = np.array([self.u.shape[1]])


def test_reservation_picks_the_nodes_free_soonest_and_keeps_the_rest_usable():
    # the head needs 8 GPUs (8 CPUs) on each of 2 nodes (its cheapest candidate; the other costs more)
    pb = _Pb(cg=[[16, 24]], cm=[[2, 3]], cc=[[1, 1]], u=[[1.0, 1.2]], cost=[[16.0, 24.0]])
    cap_g, cap_c = np.array([8, 8, 8]), np.array([64, 64, 64])
    blocked = [
        (0, 4, 8, 300.0),  # node 0: a pinned job, 500 s... its pin ends in 300 s
        (0, 2, 4, 900.0),  # and one released in 900 s: 8 GPUs free on node 0 only at 900 s
        (1, 8, 8, 5000.0),  # node 1: a guarantee running for 5000 s
        (2, 3, 6, 200.0),  # node 2: free at 200 s
    ]
    T, room_g, room_c = reservation(pb, 0, blocked, cap_g, cap_c)
    assert T == 900.0  # nodes 2 (200 s) and 0 (900 s); node 1 not before 5000 s
    assert room_g.tolist() == [0, 8, 0] and room_c.tolist() == [56, 64, 56]
    # a head that can never fit (needs 8 GPUs on 4 nodes of 3): no reservation
    pb4 = _Pb(cg=[[32]], cm=[[4]], cc=[[1]], u=[[1.0]], cost=[[32.0]])
    assert reservation(pb4, 0, blocked, cap_g, cap_c) is None


# ---------------------------------------------------------------- the policy
def _blocked_guarantee(short_steps=50):
    """Two nodes; a best-effort job pinned on n0 for 500 s more; a guarantee that needs both
    nodes; a long and a short best-effort job arriving now (n1 is free)."""
    p = job("p", 8, t=0, running_on=(Placement("n0", 8, 16),), since=9_900, steps=10**6)
    g = job("g", 16, t=9_000, guaranteed=True, steps=10**6)
    long = job("long", 8, t=9_950, steps=10**6)
    short = job("short", 8, t=9_960, steps=short_steps)  # 50 x 64 samples at 8/s: 400 s + 30 s restart
    return [p, g, long, short]


def test_a_waiting_guarantee_keeps_its_nodes_from_work_that_would_outlast_the_wait():
    ns, perf = nodes(2), CurveOracle()
    # pinned jobs fixed against every job (pin_scope="all"), so that p holds n0 for 500 s more:
    # by default the short job would take p's node, and then g, first in line, takes both
    pol = lambda **o: make_policy("rubick", restart_cost=30, min_run_time=600, starved_seed=0, pin_scope="all", **o)
    d = decide(make_policy("rubick", restart_cost=30, min_run_time=600, starved_seed=0), 10_000.0, ns,
               _blocked_guarantee(), perf)
    assert "g" in d.allocations and "p" in d.waiting
    d = decide(pol(), 10_000.0, ns, _blocked_guarantee(), perf)
    assert "g" in d.waiting and "long" in d.waiting  # n1 is held for g, which can start in 500 s
    assert d.allocations["short"].placement[0].node == "n1"  # done in 430 s: it backfills
    assert "room held for g" in d.waiting["long"]
    # without the reservation the long job takes n1, pinned past the guarantee's start
    d = decide(pol(reserve=False), 10_000.0, ns, _blocked_guarantee()[:3], perf)
    assert "long" in d.allocations and "g" in d.waiting
    d = decide(pol(), 10_000.0, ns, _blocked_guarantee()[:3], perf)
    assert "long" in d.waiting and "g" in d.waiting
    # a short job that would not end in time waits too
    d = decide(pol(), 10_000.0, ns, _blocked_guarantee(short_steps=70), perf)  # 560 + 30 s > 500 s
    assert "short" in d.waiting and "long" in d.waiting


def test_the_guarantee_starts_when_the_pin_ends():
    ns, perf = nodes(2), CurveOracle()
    js = _blocked_guarantee()
    d = decide(make_policy("rubick", restart_cost=30, min_run_time=600, starved_seed=0), 10_500.0, ns, js, perf)
    assert d.allocations["g"].plan.gpus == 16 and "p" in d.waiting


def test_a_best_effort_job_admitted_as_starved_is_kept_like_a_guarantee():
    """Admitted after waiting its own run, it was evicted by the next guarantee as soon as its
    pin ended (a llama30 restart is ~530 s of a 600 s pin) and never admitted again: on
    rubick-mt two such jobs finished last, 12 h after they came."""
    ns, perf = nodes(1), CurveOracle()
    g1 = job("g1", 8, t=9_000, guaranteed=True, steps=10**6)
    old = job("b", 8, t=0.0, steps=100)  # 800 s + 30 s restart, waited 10,000 s: starved
    pol = make_policy("rubick", restart_cost=30, min_run_time=600)
    d = decide(pol, 10_000.0, ns, [g1, old], perf)
    assert "b" in d.allocations and "g1" in d.waiting
    old.placement, old.plan = d.allocations["b"].placement, d.allocations["b"].plan
    old.started_at = old.last_switch_at = 10_000.0
    g2 = job("g2", 8, t=10_100, guaranteed=True, steps=10)  # a short guarantee arrives
    d = decide(pol, 10_700.0, ns, [g1, g2, old], perf)  # b's pin ended
    assert "b" in d.allocations and "g2" in d.waiting
    pol = make_policy("rubick", restart_cost=30, min_run_time=600, keep_starved=False)
    decide(pol, 10_000.0, ns, [g1, job("b", 8, t=0.0, steps=100)], perf)
    d = decide(pol, 10_700.0, ns, [g1, g2, old], perf)
    assert "g2" in d.allocations and "b" in d.waiting  # evicted for the guarantee


# ---------------------------------------------------------------- queue order, efficiency, completion weight
def test_queue_keys_by_time_run_and_gpu_time():
    left = np.array([800.0, 80.0])  # samples
    speed = np.array([8.0, 1.0])  # samples/s: 100 s and 80 s
    R = np.array([30.0, 530.0])
    gpus = np.array([8.0, 40.0])
    assert queue_keys("time", left, speed, R, gpus).tolist() == [100.0, 80.0]
    assert queue_keys("run", left, speed, R, gpus).tolist() == [130.0, 610.0]
    assert queue_keys("area", left, speed, R, gpus).tolist() == [1040.0, 24400.0]


def test_pending_guarantees_go_by_gpu_time_first():
    """A 2-GPU guarantee with 10 minutes of work goes before a 16-GPU one with 5: it holds
    1,200 GPU-seconds against 4,800 (by time alone the 16-GPU one went first)."""
    ns, perf = nodes(2), CurveOracle()
    wide = job("wide", 16, t=0, guaranteed=True, steps=38)  # 38 x 64 / 14.4 samples/s (2 nodes) = 169 s
    thin = job("thin", 2, t=1, guaranteed=True, steps=19)  # 19 x 64 / 2 = 608 s
    for key, first in (("area", "thin"), ("time", "wide")):
        pb = make_policy("rubick", restart_cost=0, queue_key=key).build_problem(1_000.0, ns, [wide, thin], perf)
        assert [("wide", "thin")[i] for i in pb.seed_order.tolist()][0] == first, key


def test_a_best_effort_job_is_not_shrunk_to_where_it_needs_more_gpu_time():
    """16 GPUs asked; on 1 GPU (offload, say) it runs at 1% of the request's speed: 6x the
    GPU-time. rubick-mt's llama7 jobs were switched every 10 minutes between 1, 2 and 4 GPUs
    (16 restarts, 15,600 s for a 2,100 s job)."""
    perf = CurveOracle({"poor": {1: 0.16, 4: 3.2, 16: 16}})
    ns = nodes(2)
    crowd = [job(f"c{i}", 7, t=0, guaranteed=True, running_on=(Placement(f"n{i}", 7, 14),), since=0) for i in range(2)]
    j = job("j", 16, t=0, curve="poor", steps=10**4)
    d = decide(make_policy("rubick", restart_cost=60, min_run_time=0), 10_000.0, ns, crowd + [j], perf)
    assert "j" in d.waiting  # never the 1-GPU candidate (6.3x the GPU-time); 4 on one node are not free
    d = decide(make_policy("rubick", restart_cost=60, min_run_time=0, min_efficiency=0), 10_000.0, ns, crowd + [j],
               perf)
    assert d.allocations["j"].plan.gpus == 1  # the floor off: one of the two free GPUs (one per node)


def test_the_completion_weight_is_one_scale_for_every_job():
    """Smith's rule: weight COMPLETION_SCALE_S / (time left at the request + restart), the
    same for two jobs that finish equally soon whatever their restarts."""
    ns, perf = nodes(1), CurveOracle()
    pol = make_policy("rubick", restart_cost=0, min_run_time=0)
    a = job("a", 8, steps=100)  # 800 s at 8 samples/s
    b = job("b", 8, steps=75)  # 600 s
    pb = pol.build_problem(0.0, ns, [a, b], perf)
    k = int(np.argmax(pb.thr[0] == 8.0))
    wa, wb = pb.u[0, k], pb.u[1, int(np.argmax(pb.thr[1] == 8.0))]
    assert wa == pytest.approx(COMPLETION_SCALE_S / 800.0) and wb == pytest.approx(COMPLETION_SCALE_S / 600.0)


def test_a_starved_jobs_growth_past_its_request_is_not_kept():
    """Kept like a guarantee, a job admitted as starved keeps its request, and what it grew to
    past that competes like anyone's growth: on rubick-mt (held-out, measured) a llama7 job
    admitted as starved held 32 GPUs for its 16 while a burst of 1-8 GPU jobs, guarantees
    among them, waited 550 s."""
    ns, perf = nodes(1), CurveOracle()
    g1 = job("g1", 8, t=9_000, guaranteed=True, steps=10**6)
    b = job("b", 4, t=0.0, steps=100)  # waited 10,000 s: starved
    pol = make_policy("rubick", restart_cost=30, min_run_time=600)
    d = decide(pol, 10_000.0, ns, [g1, b], perf)
    assert "b" in d.allocations and "g1" in d.waiting
    b.placement, b.plan = (Placement("n0", 8, 16),), Plan(dp=8)  # grown to the whole node
    b.started_at, b.last_switch_at = 10_000.0, 10_050.0
    g2 = job("g2", 4, t=10_650, guaranteed=True, steps=10)
    d = decide(pol, 10_700.0, ns, [g1, g2, b], perf)
    assert d.allocations["g2"].plan.gpus == 4
    assert d.allocations["b"].plan.gpus == 4 and d.allocations["b"].placement[0].node == "n0"
    assert "g1" in d.waiting
