"""Pollux's goodput model and search, and Optimus's marginal-gain step, against hand-computed
cases; a small run of each that finishes every job (the simulator and the Pollux replay)."""

from __future__ import annotations

import numpy as np
import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.policies.api import JobView, NodeState, Placement
from gearshift.policies.decision import check_decision
from gearshift.policies.optimus import Optimus
from gearshift.policies.pollux import Pollux, PolluxJobStats, fixed_batch_split, min_replicas
from gearshift.policies.pollux_goodput import BatchLimits, GoodputModel, PerfParams, efficiency, fit_perf_params, step_time
from gearshift.policies.pollux_search import AllocationSearch, min_layout
from gearshift.policies.registry import make_policy, policy_names

MODEL = ModelSpec(name="toy", params=10.0, layers=2, hidden=64, seq_len=16)
P = PerfParams(alpha_c=0.01, beta_c=0.001, alpha_n=0.05, beta_n=0.01, alpha_r=0.02, beta_r=0.005, gamma=1.0)
LIM = BatchLimits(init_batch=128, max_batch=4096, min_atomic=32, max_atomic=256)


def view(jid: str, gpus: int = 1, steps: int = 100, submitted: float = 0.0, placement=(), plan=None, batch: int = 24) -> JobView:
    spec = JobSpec(name=jid, model=MODEL, global_batch=batch, steps=steps, gpus=gpus, plan=Plan(dp=gpus), step_time=1.0)
    return JobView(job_id=jid, spec=spec, submitted_at=submitted, placement=placement, plan=plan)


# ---------------------------------------------------------------- goodput model by hand
def test_statistical_efficiency_by_hand():
    # scale 4, sqr 1, var 3: gain = (3 + 1) / (3/4 + 1) = 2.2857; efficiency = gain / 4
    assert efficiency(512, 128, 1.0, 3.0) == pytest.approx((4 / 1.75) / 4)
    assert efficiency(128, 128, 1.0, 3.0) == pytest.approx(1.0)
    # no gradient noise: a larger batch gains nothing per sample
    assert efficiency(1024, 128, 2.0, 0.0) == pytest.approx(1 / 8)


def test_step_time_and_throughput_by_hand():
    # one node, 4 GPUs, atomic 32, gamma 1 (no overlap): compute 0.01 + 0.032 = 0.042,
    # network 0.02 + 0.005 x (4 - 2) = 0.03, step 0.072; one accumulation step adds 0.042
    assert step_time(P, 1, 4, 32, 0) == pytest.approx(0.072)
    assert step_time(P, 1, 4, 32, 1) == pytest.approx(0.114)
    # across 2 nodes the inter-node terms: 0.05 + 0.01 x (8 - 2) = 0.11
    assert step_time(P, 2, 8, 32, 0) == pytest.approx(0.042 + 0.11)
    m = GoodputModel(P, 1.0, 3.0, LIM)
    assert m.throughput(1, 4, 32, 1) == pytest.approx(256 / 0.114)
    assert m.goodput(1, 4, 32, 1) == pytest.approx(256 / 0.114 * efficiency(256, 128, 1.0, 3.0))


def test_best_batch_follows_the_noise_scale():
    # no noise: efficiency = init / batch, so the smallest batch (the initial one) is best
    quiet = GoodputModel(P, 1.0, 0.0, LIM)
    g, atomic, accum = quiet.best(1, 1)
    assert (atomic, accum) == (128, 0)
    assert g == pytest.approx(128 / step_time(P, 1, 1, 128, 0))
    # very noisy gradients: efficiency ~ 1 for any batch, so the largest batch wins
    noisy = GoodputModel(P, 1e-9, 1e9, LIM)
    _, atomic, accum = noisy.best(1, 4)
    assert 4 * atomic * (accum + 1) >= 0.9 * LIM.max_batch
    assert LIM.min_atomic <= atomic <= LIM.max_atomic
    # on one GPU above the initial batch AdaptDL keeps at least one accumulation step
    _, atomic1, accum1 = noisy.best(1, 1)
    assert accum1 >= 1


def test_fit_recovers_step_times():
    true = PerfParams(0.02, 0.0008, 0.06, 0.004, 0.015, 0.002, 1.6)
    cfg = [(1, 1, 32), (1, 1, 128), (1, 2, 64), (1, 4, 64), (2, 8, 64), (3, 12, 128), (1, 3, 100)]
    n, r, a = (np.array(c, dtype=float) for c in zip(*cfg))
    st = step_time(true, n, r, a, 0)
    sync = st - (true.alpha_c + true.beta_c * a)
    fit = fit_perf_params(n, r, a, st, sync)
    assert np.allclose(step_time(fit, n, r, a, 0), st, rtol=0.05)


def test_fixed_batch_split_by_hand():
    # 32768 on 1 GPU with atomic <= 256: local 32768, accum ceil(128) - 1 = 127, atomic 256 (capped at 4096/128 = 32)
    assert fixed_batch_split(32768, 1, LIM) == (32, 127)
    # 256 on 2 GPUs: local 128, no accumulation
    assert fixed_batch_split(256, 2, LIM) == (128, 0)


# ---------------------------------------------------------------- the search by hand
def test_search_fitness_by_hand_and_finds_the_fair_optimum():
    # 2 jobs, one 4-GPU node. A scales linearly (speedup r), B is flat (1 on any r >= 1).
    sp = np.zeros((2, 2, 5))
    sp[0, 1, 1:] = [1, 2, 3, 4]
    sp[1, 1, 1:] = 1
    base = np.zeros((2, 1), dtype=int)
    s = AllocationSearch(sp, base, np.array([4]), np.array([4, 4]), ages=np.array([100.0, 100.0]),
                         restarts=np.zeros(2), rng=np.random.default_rng(0), delay=0.0)
    # scaled speedups = s x nodes / GPUs; (3, 1) -> (0.75, 0.25); power mean p = -1 of s + 1e-3
    want = 1 / (((0.751) ** -1 + (0.251) ** -1) / 2)
    assert s.fitness(np.array([[[3], [1]]]))[0] == pytest.approx(want)
    assert s.fitness(np.array([[[3], [1]]]))[0] > s.fitness(np.array([[[2], [2]]]))[0] > s.fitness(np.array([[[4], [0]]]))[0]
    best, _ = s.run(base[None], pop_size=20, generations=30)
    assert best.ravel().tolist() == [3, 1]


def test_restart_factor_by_hand():
    sp = np.zeros((1, 2, 5))
    sp[0, 1, 1:] = [1, 2, 3, 4]
    base = np.array([[2]])
    # age 90, 1 restart, delay 30: factor (90 - 30) / (90 + 30) = 0.5 on a changed row
    s = AllocationSearch(sp, base, np.array([4]), np.array([4]), ages=np.array([90.0]), restarts=np.array([1.0]),
                         rng=np.random.default_rng(0), delay=30.0)
    assert s.fitness(np.array([[[4]]]))[0] == pytest.approx(4 / 4 * 0.5 + 1e-3)
    assert s.fitness(np.array([[[2]]]))[0] == pytest.approx(2 / 4 + 1e-3)


def _rigid(min_replicas):
    """Three jobs that run only as 5 nodes x 8 GPUs, on an empty 8 x 8 cluster."""
    sp = np.zeros((3, 9, 81))
    sp[:, 5, 40] = 1.0
    return AllocationSearch(sp, np.zeros((3, 8), dtype=int), np.full(8, 8), np.full(3, 80), ages=np.full(3, 100.0),
                            restarts=np.zeros(3), rng=np.random.default_rng(0), delay=0.0, min_replicas=min_replicas)


def test_a_job_that_needs_40_gpus_is_reached_through_its_minimum_replicas():
    """adaptdl's min_replicas (policies.pollux_search): without it random raises never make
    5 x 8 and the empty cluster stays idle; with it one of the rigid jobs runs."""
    assert min_replicas(_rigid(None).speedup[0]) == 40
    assert min_replicas(np.array([[0, 0, 0], [0, 1, 2]])) == 0  # runs on one GPU: no bound
    idle, _ = _rigid(None).run(np.zeros((1, 3, 8), dtype=int), pop_size=20, generations=20)
    assert idle.sum() == 0
    best, _ = _rigid(np.array([40, 40, 40])).run(np.zeros((1, 3, 8), dtype=int), pop_size=20, generations=20)
    assert sorted(best.sum(axis=1).tolist()) == [0, 0, 40] and np.count_nonzero(best.sum(axis=0)) == 5
    assert min_layout(np.array([40, 0]), np.full(8, 8)).tolist() == [[8] * 5 + [0] * 3, [0] * 8]


def test_repair_keeps_one_distributed_job_per_node_and_capacity():
    sp = np.zeros((3, 3, 9))
    s = AllocationSearch(sp, np.zeros((3, 2), dtype=int), np.array([4, 4]), np.array([8, 8, 2]),
                         ages=np.ones(3), restarts=np.zeros(3), rng=np.random.default_rng(1))
    states = np.array([[[3, 3], [2, 2], [4, 4]]])
    out = s.repair(states)[0]
    assert out[0].tolist() == [3, 3]          # first distributed job keeps both nodes
    assert out[1].tolist() == [0, 0]          # the second distributed job loses them
    assert out[2].sum() <= 2                  # job 2's cap
    assert (out.sum(axis=0) <= 4).all()


@pytest.mark.parametrize("seed", range(6))
def test_repair_kernel_equals_the_numpy_reference(seed):
    """The compiled repair gives exactly the vectorised reference's states, from the same
    random draw, on crowded random populations (distributed jobs sharing nodes, caps below
    the rows, more than 16 nodes so the node limit bites)."""
    gen = np.random.default_rng(100 + seed)
    wide = seed % 2 == 1  # odd seeds: more than 16 nodes, rows dense enough to pass the limit
    jobs, nodes = int(gen.integers(1, 30)), int(gen.integers(18, 24) if wide else gen.integers(1, 24))
    cap = gen.integers(1, 9, size=nodes)
    states = gen.integers(1 if wide else 0, 9, size=(20, jobs, nodes)) * (gen.random((20, jobs, nodes)) < (0.95 if wide else 0.6))
    mk = lambda: AllocationSearch(np.zeros((jobs, nodes + 1, 9)), np.zeros((jobs, nodes), dtype=int), cap,
                                  gen_caps, ages=np.ones(jobs), restarts=np.zeros(jobs),
                                  rng=np.random.default_rng(seed))
    gen_caps = gen.integers(0, 40, size=jobs) + (gen.integers(0, 2, size=jobs) * 60 if wide else 0)
    fast, ref = mk().repair(states), mk().repair_numpy(states)
    assert fast.dtype == ref.dtype and np.array_equal(fast, ref)
    assert (fast.sum(axis=1) <= cap).all() and (fast.sum(axis=2) <= gen_caps).all()


@pytest.mark.parametrize("seed", range(6))
def test_mutate_kernel_equals_the_numpy_reference(seed):
    """The compiled mutation draws the same numbers in the same order and gives exactly the
    reference's states, nodes full and free, jobs resetting to their base rows and not."""
    gen = np.random.default_rng(200 + seed)
    jobs, nodes = int(gen.integers(1, 30)), int(gen.integers(1, 20))
    cap = gen.integers(1, 9, size=nodes)
    base = np.minimum(gen.integers(0, 3, size=(jobs, nodes)), cap)
    states = np.minimum(gen.integers(0, 5, size=(40, jobs, nodes)), cap) * (gen.random((40, jobs, nodes)) < 0.5)
    mk = lambda: AllocationSearch(np.zeros((jobs, nodes + 1, 9)), base, cap, np.full(jobs, 64),
                                  ages=np.ones(jobs), restarts=np.zeros(jobs), rng=np.random.default_rng(seed))
    fast, ref = mk(), mk()
    a, b = fast.mutate(states), ref.mutate_numpy(states)
    assert a.dtype == b.dtype and np.array_equal(a, b)
    assert fast.rng.random() == ref.rng.random()  # the streams are at the same place
    assert not np.array_equal(a, states)  # something did mutate


# ---------------------------------------------------------------- Optimus by hand
class SpeedOracle:
    """throughput = global batch x speed[job][GPUs]."""

    def __init__(self, speed):
        self.speed = speed

    def throughput(self, job, plan, placement):
        return job.spec.global_batch * self.speed[job.job_id][plan.gpus]


def test_optimus_marginal_gain_by_hand():
    # A: perfect scaling, 100 steps left: gains 1->2 (1 - 1/2) x 100 = 50, 2->3 16.7, 3->4 8.3.
    # B: speeds 1, 1.5, 1.6, 1.62: 200 steps left: 1->2 (1 - 1/1.5) x 200 = 66.7, 2->3 8.3.
    # 4 GPUs: both start with 1; B takes the 3rd (66.7), A the 4th (50).
    speed = {"A": {w: float(w) for w in range(1, 9)}, "B": {1: 1.0, 2: 1.5, 3: 1.6, 4: 1.62, 5: 1.63}}
    a, b = view("A", steps=100, batch=24), view("B", steps=200, submitted=1.0, batch=48)  # batches split 1-4 ways; specs differ
    o = Optimus()
    assert o.allocate([a, b], SpeedOracle(speed), total=4, gpn=4) == {"A": 2, "B": 2}
    # a 5th GPU: A's 2->3 (16.7) beats B's 2->3 (8.3)
    assert Optimus().allocate([a, b], SpeedOracle(speed), total=5, gpn=8) == {"A": 3, "B": 2}
    nodes = [NodeState("n0", 4, 4, 16, 16)]
    d = o.schedule(0.0, nodes, [a, b], SpeedOracle(speed))
    check_decision(d, nodes, {"A": a, "B": b})
    assert {k: v.plan.gpus for k, v in d.allocations.items()} == {"A": 2, "B": 2}


def test_optimus_keeps_a_job_whose_count_is_unchanged():
    speed = {"A": {w: float(w) for w in range(1, 9)}}
    cur = (Placement("n1", 2, 8),)
    a = view("A", gpus=2, placement=cur, plan=Plan(dp=2))
    o = Optimus(max_gpus=lambda v: 2)
    nodes = [NodeState("n0", 4, 4, 16, 16), NodeState("n1", 4, 4, 16, 16)]
    d = o.schedule(0.0, nodes, [a], SpeedOracle(speed))
    assert d.allocations["A"].placement == cur


# ---------------------------------------------------------------- the policy, registered
def test_registered_and_decisions_checked():
    assert {"pollux", "optimus"} <= set(policy_names())
    nodes = [NodeState(f"n{i}", 4, 4, 16, 16) for i in range(2)]
    st = PolluxJobStats(limits=LIM, params=P, grad_sqr=1.0, grad_var=3.0, max_replicas=8)
    jobs = [view(f"j{i}", submitted=float(i)) for i in range(3)]
    pol = Pollux(stats=lambda v: st if v.job_id != "j2" else None, generations=20, restart_cost=30)
    d = pol.schedule(60.0, nodes, jobs, None)
    check_decision(d, nodes, {j.job_id: j for j in jobs})
    assert set(d.allocations) | set(d.waiting) == {"j0", "j1", "j2"}
    for jid in ("j0", "j1"):
        if jid in d.allocations:
            plan = d.allocations[jid].plan
            assert plan.micro_batch and LIM.min_atomic <= plan.micro_batch <= LIM.max_atomic


def test_pollux_and_optimus_finish_every_job_in_the_simulator():
    from gearshift.sim.engine import SimConfig, simulate
    from gearshift.sim.metrics import summarize
    from gearshift.sim.trace import Trace, TraceJob, parse_cluster

    jobs = [TraceJob(f"t{i}", 30.0 * i, view(f"t{i}", gpus=1 + i % 3, steps=200 + 50 * i).spec) for i in range(8)]
    trace = Trace("toy", jobs, parse_cluster("2x4"))
    for name, opts in (("pollux", {"generations": 10}), ("optimus", {})):
        res = simulate(trace, make_policy(name, restart_cost=10, **opts), config=SimConfig(restart_cost=10, noise=0))
        s = summarize(res)
        assert s["unfinished"] == 0, name
        assert s["jobs"] == 8


def test_replay_finishes_a_small_pollux_workload(tmp_path):
    from gearshift.sim.pollux_replay import run_named

    w = tmp_path / "w.csv"
    w.write_text("name,time,application,num_replicas,batch_size\n"
                 "ncf-0,0,ncf,1,32768\ncifar10-1,30,cifar10,2,256\nncf-2,200,ncf,1,32768\nbert-3,400,bert,1,12\n")
    for name in ("pollux", "optimus"):
        r = run_named(name, w, generations=10)
        assert r.unfinished == 0 and len(r.jcts) == 4, name
        assert all(v > 0 for v in r.jcts.values())


def test_baseline_fidelity_names_its_sources_and_refuses_bad_input(capsys):
    from loadtest import baseline_fidelity as bf

    for ref in bf.REFERENCES.values():
        assert ref["avg_jct_s"] > 0 and "osdi21-artifact" in ref["source"]
    assert bf.main(["--generations", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--generations" in err[0]


def test_baseline_fidelity_json_is_one_document(capsys, monkeypatch):
    """``--json`` prints only the JSON document: outside checks parse stdout whole (a
    trailing "ok" line once made it unparseable)."""
    import json

    from loadtest import baseline_fidelity as bf

    fake = {"ok": True, "checks": [], "unchecked": [], "note": "n"}
    monkeypatch.setattr(bf, "run", lambda generations, blox: fake)
    assert bf.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == fake
    assert bf.main([]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "ok"
