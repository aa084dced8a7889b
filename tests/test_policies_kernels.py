"""The numba search agrees with the numpy reference, and is close to the MILP optimum."""

import random

import numpy as np
import pytest

from gearshift.policies.kernels import greedy_allocate
from gearshift.policies.optimal import milp_optimum
from gearshift.policies.rubick import Rubick
from loadtest.optimality_gap import random_instance
from loadtest.optimality_gap import run as optimality_run


def random_problem(rng: random.Random, J: int, N: int, G: int = 8, C: int = 32):
    K = 6
    cg = np.zeros((J, K), np.int64)
    cc = np.ones((J, K), np.int64)
    cm = np.ones((J, K), np.int64)
    u = np.full((J, K), -1.0)
    cost = np.zeros((J, K))
    nk = np.zeros(J, np.int64)
    stay = np.full(J, -1, np.int64)
    hold_ptr = [0]
    hold_node, hold_g, hold_c = [], [], []
    free = [[G, C] for _ in range(N)]
    for j in range(J):
        n = rng.randint(1, K - 1)
        gs = sorted(rng.sample([1, 2, 4, 8, 16], min(n, 5)))
        val = 0.0
        for k, g in enumerate(gs):
            m = 1 if g <= G else g // G
            cg[j, k], cm[j, k], cc[j, k] = g, m, rng.choice([1, 2, 4])
            val += rng.uniform(0.1, 1.0) * (g if k == 0 else g - gs[k - 1]) ** 0.7
            u[j, k] = val if rng.random() > 0.1 else -1.0
            cost[j, k] = g + g * cc[j, k] / 4
        nk[j] = len(gs)
        node = rng.randrange(N)
        if rng.random() < 0.4 and free[node][0] >= 2 and free[node][1] >= 4:
            stay[j] = nk[j]
            cg[j, nk[j]], cc[j, nk[j]], cm[j, nk[j]] = 2, 2, 1
            u[j, nk[j]] = rng.uniform(0.5, 2.0)
            cost[j, nk[j]] = 3
            nk[j] += 1
            free[node][0] -= 2
            free[node][1] -= 4
            hold_node.append(node)
            hold_g.append(2)
            hold_c.append(4)
        hold_ptr.append(len(hold_node))
    pinned = np.array([stay[j] >= 0 and rng.random() < 0.3 for j in range(J)])
    seed = np.where(pinned, stay, -1)
    seed_any = np.array([rng.random() < 0.2 for _ in range(J)])
    order = np.array([j for j in range(J) if pinned[j] or seed_any[j]], np.int64)
    cap_g = np.full(N, G)
    cap_c = np.full(N, C)
    return (cg, cc, cm, u, cost, nk, stay, np.array(hold_ptr), np.array(hold_node, np.int64),
            np.array(hold_g, np.int64), np.array(hold_c, np.int64), order, seed, seed_any, pinned, cap_g, cap_c)


@pytest.mark.parametrize("seed", range(25))
def test_numba_equals_numpy_on_random_problems(seed):
    rng = random.Random(seed)
    args = random_problem(rng, J=rng.randint(1, 60), N=rng.randint(1, 12))
    a_level, a_nodes = greedy_allocate(*args, use_numba=True)
    b_level, b_nodes = greedy_allocate(*args, use_numba=False)
    assert np.array_equal(a_level, b_level)
    assert np.array_equal(a_nodes, b_nodes)


@pytest.mark.parametrize("seed", range(15))
def test_numba_equals_numpy_with_unseated_seeds(seed):
    rng = random.Random(100 + seed)
    args = random_problem(rng, J=rng.randint(1, 60), N=rng.randint(1, 12))
    pinned = args[14]
    unseat = pinned & np.array([rng.random() < 0.6 for _ in range(len(pinned))], bool)
    a_level, a_nodes = greedy_allocate(*args, unseat=unseat, use_numba=True)
    b_level, b_nodes = greedy_allocate(*args, unseat=unseat, use_numba=False)
    assert np.array_equal(a_level, b_level)
    assert np.array_equal(a_nodes, b_nodes)


def test_an_unseated_seed_holds_its_place_against_later_seeds_only():
    """One 8-GPU node. A runs on 4 GPUs and is seeded first (pinned); B, a guarantee
    needing all 8, is seeded after it and does not fit; C, waiting, gains more from the
    whole node than A from its 4. Seated, A keeps its GPUs against both; unseated, it
    keeps them against B (B is still not admitted: a seed that failed never enters the
    greedy) and competes with C in the greedy, which gives C the node."""
    cg = np.array([[4, 0], [8, 0], [4, 8]])
    u = np.array([[1.0, -1.0], [1.0, -1.0], [3.0, 5.0]])
    cost = cg.astype(float)
    nk = np.array([1, 1, 2])
    stay = np.array([0, -1, -1])
    ones = np.ones((3, 2), np.int64)
    args = (cg, ones, ones, u, cost, nk, stay, np.array([0, 1, 1, 1]), np.array([0]), np.array([4]),
            np.array([4]), np.array([0, 1]), np.array([0, 0, -1]), np.array([False, True, False]),
            np.array([True, False, False]), np.array([8]), np.array([64]))
    for numba in (True, False):
        seated, _ = greedy_allocate(*args, use_numba=numba)
        assert list(seated) == [0, -1, 0]  # A kept, B not admitted, C on the 4 left
        unseated, _ = greedy_allocate(*args, unseat=np.array([True, False, False]), use_numba=numba)
        assert list(unseated) == [-1, -1, 1]  # C on all 8: 5.0 beats 1.0 + 3.0; B still out


@pytest.mark.parametrize("seed", range(10))
def test_numba_equals_numpy_on_rubick_rounds(seed):
    nodes, jobs, perf = random_instance(random.Random(seed), max_jobs=30, max_nodes=6)
    pb = Rubick().build_problem(10_000.0, nodes, jobs, perf)
    a = greedy_allocate(*pb.kernel_args(), use_numba=True)
    b = greedy_allocate(*pb.kernel_args(), use_numba=False)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def _two_jobs_one_node() -> tuple:
    """One 8-GPU node; A's curve flattens after 4 GPUs, B's keeps climbing."""
    cg = np.array([[1, 2, 4, 8], [1, 2, 4, 8]])
    u = np.array([[1.0, 1.9, 3.5, 3.8], [1.0, 1.9, 3.6, 6.0]])
    ones = np.ones((2, 4), np.int64)
    return (cg, ones, ones, u, cg.astype(float), np.array([4, 4]), np.array([-1, -1]), np.zeros(3), np.zeros(0),
            np.zeros(0), np.zeros(0), np.zeros(0), np.array([-1, -1]), np.zeros(2), np.zeros(2), np.array([8]),
            np.array([64]))


def test_hand_made_split_follows_marginal_gain():
    # one 8-GPU node; A's curve flattens after 4 GPUs, B's keeps climbing
    args = _two_jobs_one_node()
    # steps by gain per GPU: A1, B1, A2, B2, B4 (0.85 > A's 0.8), A4; B8 no longer fits
    for numba in (True, False):
        level, nodes = greedy_allocate(*args, use_numba=numba)
        assert list(level) == [2, 2]  # 4 + 4 GPUs: 3.5 + 3.6 = 7.1, better than B alone on 8 (6.0)
        assert list(nodes[:, 0]) == [0, 0]


def test_greedy_never_beats_the_milp_and_gap_is_small():
    out = optimality_run(instances=15, seed=5, max_jobs=10, max_nodes=3)
    assert out["avg_gap"] <= 0.05
    assert out["worst"]["gap"] >= 0.0


def test_milp_optimum_on_a_tiny_known_case():
    nodes, jobs, perf = random_instance(random.Random(1), max_jobs=4, max_nodes=1)
    pb = Rubick().build_problem(10_000.0, nodes, jobs, perf)
    opt, level = milp_optimum(pb)
    # brute force over every combination of candidates (placement on one node: capacity only)
    import itertools

    best = 0.0
    choices = [[-1] + [k for k in range(pb.nk[j]) if pb.u[j, k] >= 0] for j in range(len(jobs))]
    for combo in itertools.product(*choices):
        g = sum(pb.cg[j, k] for j, k in enumerate(combo) if k >= 0)
        c = sum(pb.cg[j, k] * pb.cc[j, k] if k != pb.stay[j] else pb.hold_c[pb.hold_ptr[j]:pb.hold_ptr[j + 1]].sum()
                for j, k in enumerate(combo) if k >= 0)
        must = [j for j in range(len(jobs)) if pb.pinned[j] or (pb.seed_any[j] and pb.stay[j] >= 0)]
        if any(combo[j] < 0 for j in must) or any(pb.pinned[j] and combo[j] != pb.stay[j] for j in must):
            continue
        if any(pb.cm[j, k] > 1 for j, k in enumerate(combo) if k >= 0):
            continue
        if g <= pb.cap_g[0] and c <= pb.cap_c[0]:
            best = max(best, sum(pb.u[j, k] for j, k in enumerate(combo) if k >= 0))
    assert opt == pytest.approx(best, abs=1e-6)


@pytest.mark.parametrize("seed", range(15))
def test_group_budgets_hold_and_numba_equals_numpy(seed):
    # jobs in budget groups (rubick's tenants): the greedy never takes a group past its
    # budget, beyond what its seeds (pinned, guaranteed) hold; both implementations agree
    rng = random.Random(100 + seed)
    args = random_problem(rng, J=rng.randint(2, 40), N=rng.randint(1, 8))
    J = len(args[5])
    group = np.array([rng.randrange(-1, 3) for _ in range(J)], np.int64)
    budget = np.array([float(rng.randint(0, 24)) for _ in range(3)])
    a_level, a_nodes = greedy_allocate(*args, group, budget, use_numba=True)
    b_level, b_nodes = greedy_allocate(*args, group, budget, use_numba=False)
    assert np.array_equal(a_level, b_level) and np.array_equal(a_nodes, b_nodes)
    cg = args[0]
    s_level, _ = greedy_allocate(*args, group, np.zeros(3))  # with no budget: what the seeds hold
    for g in range(3):
        seeded = sum(cg[j, s_level[j]] for j in range(J) if group[j] == g and s_level[j] >= 0)
        used = sum(cg[j, a_level[j]] for j in range(J) if group[j] == g and a_level[j] >= 0)
        assert used <= max(budget[g], seeded) + 1e-9


def test_a_group_budget_stops_growth_the_greedy_would_make():
    # the hand-made split above: without budgets 4 + 4 GPUs; B's group may hold 2
    args = _two_jobs_one_node()
    for numba in (True, False):
        level, _ = greedy_allocate(*args, np.array([-1, 0]), np.array([2.0]), use_numba=numba)
        assert list(level) == [2, 1]  # B stops at 2 (unbudgeted: 4); A at 4 (8 does not fit beside B)
