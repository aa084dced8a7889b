"""rubick_moves.give_back_moves: a job moved with no change of shape gets its nodes back
when the jobs that took them move or start anyway; never otherwise."""

from types import SimpleNamespace

import numpy as np
from policy_helpers import job

from gearshift.policies.api import NodeState, Placement, Plan
from gearshift.policies.candidates import Candidate
from gearshift.policies.rubick_moves import give_back_moves

P, Q = Plan(dp=8), Plan(dp=8, zero=2)


def _case(b_kept=False, kinds=("", "", ""), a_to=2, b_nodes=(0,)):
    """Three 8-GPU nodes. a runs on n0 and was sent, same plan and shape, to n``a_to``; b
    (new, or kept where it runs) took n0; c is kept on n1."""
    ns = [NodeState(f"n{q}", 8, 0, 64, 0, gpu_type=kinds[q]) for q in range(3)]
    a = job("a", 8, running_on=(Placement("n0", 8, 8),), plan=P)
    c = job("c", 8, running_on=(Placement("n1", 8, 8),), plan=P)
    b = job("b", 8 * len(b_nodes), running_on=(Placement("n0", 8, 8),) if b_kept else (), plan=Q if b_kept else None)
    js = [a, b, c]
    rows = [[Candidate(8, 1, 1, P, 10.0)], [Candidate(8 * len(b_nodes), 1, len(b_nodes), Q, 10.0)],
            [Candidate(8, 1, 1, P, 10.0)]]
    stay = np.array([1, 1 if b_kept else -1, 1])
    level = np.array([0, 1 if b_kept else 0, 1])
    out = np.full((3, 2), -1, np.int64)
    out[0, 0] = a_to
    out[1, :len(b_nodes)] = b_nodes
    pb = SimpleNamespace(rows=rows, stay=stay, running=np.array([True, b_kept, True]),
                         cap_g=np.array([8, 8, 8]), cap_c=np.array([64, 64, 64]))
    return pb, level, out, js, ns


def test_a_moved_job_gets_its_node_back_from_a_start():
    pb, level, out, js, ns = _case()
    assert give_back_moves(pb, level, out, js, ns) == 1
    assert level[0] == pb.stay[0]  # a is kept on n0
    assert out[1, 0] == 2  # b starts on n2 instead
    assert level[2] == pb.stay[2]


def test_a_move_to_the_nodes_it_holds_is_kept():
    pb, level, out, js, ns = _case(a_to=0, b_nodes=(2,))
    assert give_back_moves(pb, level, out, js, ns) == 1 and level[0] == pb.stay[0] and out[1, 0] == 2


def test_nothing_changes_when_the_taker_stays_nodes_differ_or_it_is_already_there():
    for kw in ({"b_kept": True}, {"kinds": ("h100", "h100", "a100")}):
        pb, level, out, js, ns = _case(**kw)
        before = level.copy(), out.copy()
        assert give_back_moves(pb, level, out, js, ns) == 0
        assert (level == before[0]).all() and (out == before[1]).all()
    # b spans n0 and n2: it cannot take a second part on n2
    pb, level, out, js, ns = _case(b_nodes=(0, 2))
    pb.cap_g = np.array([8, 8, 16])
    assert give_back_moves(pb, level, out, js, ns) == 0 and level[0] == 0


def test_a_taker_that_does_not_fit_where_the_job_was_sent_leaves_it_moved():
    pb, level, out, js, ns = _case()
    pb.cap_c = np.array([64, 64, 8])  # n2 has 8 CPUs: a's leave it, b's 8 fit
    assert give_back_moves(pb, level, out, js, ns) == 1
    pb, level, out, js, ns = _case()
    pb.cap_c = np.array([64, 64, 8])
    pb.rows[1] = [Candidate(8, 2, 1, Q, 10.0)]  # b takes 16 CPUs: not on n2
    assert give_back_moves(pb, level, out, js, ns) == 0 and level[0] == 0

