"""Parts: placement ledger and orderings."""

from policy_helpers import job, nodes

from gearshift.policies.api import NodeState, Placement
from gearshift.policies.ordering import TiresiasQueues, las_key, srtf_key
from gearshift.policies.placement import Ledger


def test_ledger_best_fit_keeps_large_blocks_whole():
    led = Ledger(nodes(3))
    led.take((Placement("n1", 6, 6),))  # n1 has 2 free, n0/n2 have 8
    pl = led.place(2, 1)
    assert pl == (Placement("n1", 2, 2),)


def test_ledger_symmetric_shape_and_cpu_limit():
    led = Ledger(nodes(4, gpus=8, cpus=16))
    pl = led.place(8, 2, nodes=2)
    assert [p.gpus for p in pl] == [4, 4] and len({p.node for p in pl}) == 2
    assert led.place(8, 3) is None or all(p.cpus <= 16 for p in led.place(8, 3))
    assert led.place(6, 1, nodes=4) is None  # 6 does not split evenly over 4 nodes


def test_ledger_refuses_at_once_what_all_free_gpus_cannot_hold():
    led = Ledger(nodes(2, gpus=4))
    led.take((Placement("n0", 4, 4), Placement("n1", 3, 3)))  # 1 GPU free in all
    assert led.place(1, 1) == (Placement("n1", 1, 1),)
    assert led.place(2, 1) is None and led.place(2, 1, nodes=2) is None
    led.give((Placement("n0", 4, 4),))
    led.take((Placement("n1", 4, 4),))  # n1 at -3 (an over-committed amount): n0's 4 still count
    assert led.place(4, 1) == (Placement("n0", 4, 4),)
    assert led.place(2, 1, nodes=2) is None


def test_ledger_prefers_own_then_unreserved_nodes():
    led = Ledger(nodes(3))
    led.reserve((Placement("n0", 8, 8),))
    assert led.place(4, 1)[0].node == "n1"  # avoids capacity a running job still holds
    assert led.place(4, 1, prefer=("n2",))[0].node == "n2"


def test_ledger_keeps_multi_node_job_in_one_domain():
    ns = [NodeState("a0", 8, 8, 64, 64, "A"), NodeState("b0", 8, 8, 64, 64, "B"), NodeState("b1", 8, 8, 64, 64, "B")]
    led = Ledger(ns)
    pl = led.place(16, 1, nodes=2)
    assert {p.node for p in pl} == {"b0", "b1"}


def test_las_and_srtf_orders():
    a, b = job("a", 1, t=0, attained=500), job("b", 1, t=10, attained=100)
    assert sorted([a, b], key=lambda j: las_key(j, 0))[0].job_id == "b"
    short, long = job("s", 1, t=5, steps=100), job("l", 1, t=0, steps=10_000)
    assert sorted([long, short], key=lambda j: srtf_key(j, 0))[0].job_id == "s"


def test_tiresias_queue_demotion_at_threshold():
    q = TiresiasQueues(thresholds=(3600.0, 36000.0))
    assert q.queue_of(job("a", 1, attained=3599)) == 0
    assert q.queue_of(job("a", 1, attained=3600)) == 1
    assert q.queue_of(job("a", 1, attained=40000)) == 2
