"""Rubick round latency at scale: numba kernels vs the numpy reference.

``python -m loadtest.round_latency --jobs 1000 --nodes 1024 --gpus-per-node 8 --json``

Builds a synthetic cluster and job set (Rubick's model mix and request
sizes, about half the jobs already running with consistent placements, a
quarter guaranteed, some inside their minimum run time), runs one warm-up
round (fills the candidate cache and compiles or loads the kernels), then
times full rounds (``Rubick.schedule``: building the problem, the search,
the decision with its explanations) with the numba kernel and with the
numpy reference, on the same input. Also reports the search alone.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from gearshift.bus_schema.messages import JobSpec
from gearshift.policies.api import JobView, NodeState, NodeStates, Placement, default_plan
from gearshift.policies.decision import check_decision
from gearshift.policies.kernels import greedy_allocate, warm_up
from gearshift.policies.oracle import AnalyticOracle
from gearshift.policies.rubick import Rubick
from loadtest.optimality_gap import BATCH, MODELS


def build(jobs: int, nodes: int, gpus_per_node: int, cpus_per_node: int, seed: int, now: float):
    rng = random.Random(seed)
    cluster = [NodeState(f"n{i:04d}", gpus_per_node, gpus_per_node, cpus_per_node, cpus_per_node) for i in range(nodes)]
    free = [[gpus_per_node, cpus_per_node] for _ in range(nodes)]
    perf = AnalyticOracle(gpus_per_node=gpus_per_node)
    out = []
    cursor = 0
    for i in range(jobs):
        m = rng.choice(MODELS)
        gpus = rng.choice([1, 2, 4, 4, 8, 8, 16, 32])
        cpg = rng.choice([2, 4, 8])
        spec = JobSpec(
            name=f"j{i}", model=m, global_batch=BATCH[m.name], steps=rng.randint(500, 50_000), gpus=gpus,
            cpus_per_gpu=cpg, guaranteed=rng.random() < 0.25,
        )
        jv = JobView(f"j{i}", spec, submitted_at=rng.uniform(0, now), steps_done=rng.uniform(0, 400))
        if rng.random() < 0.5:
            # Place it on consecutive nodes with room (whole GPUs per node).
            need = gpus
            place = []
            start = cursor
            while need > 0 and cursor < start + nodes:
                n = cursor % nodes
                g = min(free[n][0], need, free[n][1] // cpg)
                if g > 0:
                    place.append((n, g))
                    need -= g
                cursor += 1
            if need == 0:
                for n, g in place:
                    free[n][0] -= g
                    free[n][1] -= g * cpg
                jv.placement = tuple(Placement(cluster[n].name, g, g * cpg) for n, g in place)
                jv.plan = default_plan(spec)
                jv.started_at = jv.last_switch_at = now - rng.choice([120.0, 3000.0, 9000.0])
                jv.attained_service = gpus * 1000.0
        out.append(jv)
    return cluster, out, perf


def timed(fn, repeat: int) -> list[float]:
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return ts


def run(jobs: int, nodes: int, gpus_per_node: int, cpus_per_node: int, repeat: int, seed: int) -> dict:
    now = 100_000.0
    cluster, views, perf = build(jobs, nodes, gpus_per_node, cpus_per_node, seed, now)
    plain = cluster
    cluster = NodeStates(cluster, object())  # as the optimizer and the simulator hand them: one shape kept
    t0 = time.perf_counter()
    warm_up()
    compile_s = time.perf_counter() - t0
    fast = Rubick(use_numba=True)
    ref = Rubick(use_numba=False)
    t0 = time.perf_counter()
    d_fast = fast.schedule(now, cluster, views, perf)  # fills the candidate cache
    cold_s = time.perf_counter() - t0
    ref.problems = fast.problems  # same warm caches
    d_ref = ref.schedule(now, cluster, views, perf)
    check_decision(d_fast, cluster, {j.job_id: j for j in views})
    same = {k: (v.plan, v.placement) for k, v in d_fast.allocations.items()} == {
        k: (v.plan, v.placement) for k, v in d_ref.allocations.items()
    }
    # Interleave the two so that load from other processes hits both alike;
    # ratios use the best of the repeats (timeit's convention), medians are reported too.
    round_numba, round_numpy = [], []
    for _ in range(repeat):
        round_numba += timed(lambda: fast.schedule(now, cluster, views, perf), 1)
        round_numpy += timed(lambda: ref.schedule(now, cluster, views, perf), 1)
    pb = fast.build_problem(now, cluster, views, perf)
    args = pb.kernel_args()
    search_numba, search_numpy = [], []
    for _ in range(repeat):
        search_numba += timed(lambda: greedy_allocate(*args, use_numba=True), 1)
        search_numpy += timed(lambda: greedy_allocate(*args, use_numba=False), 1)
    build_s = timed(lambda: fast.build_problem(now, cluster, views, perf), repeat)
    # the same round on a plain list: what depends on the nodes alone is read afresh (api.ShapeMemo)
    plain_s = timed(lambda: fast.schedule(now, plain, views, perf), repeat)
    med = statistics.median
    return {
        "jobs": jobs,
        "nodes": nodes,
        "gpus": nodes * gpus_per_node,
        "running_jobs": sum(j.running for j in views),
        "allocated": len(d_fast.allocations),
        "candidates": int(pb.nk.sum()),
        "kernel_compile_or_load_s": compile_s,
        "cold_round_s": cold_s,
        "round_numba_s": min(round_numba),
        "round_numpy_s": min(round_numpy),
        "round_speedup": min(round_numpy) / min(round_numba),
        "round_numba_median_s": med(round_numba),
        "round_numpy_median_s": med(round_numpy),
        "search_numba_s": min(search_numba),
        "search_numpy_s": min(search_numpy),
        "search_speedup": min(search_numpy) / min(search_numba),
        "build_problem_s": min(build_s),
        "round_numba_plain_list_s": min(plain_s),
        "numba_equals_numpy": same,
        "targets": {"round_speedup_min": 10.0, "search_speedup_min": 10.0, "round_numba_max_s": 1.0},
        "pass": bool(
            same
            and min(round_numpy) / min(round_numba) >= 10.0
            and min(search_numpy) / min(search_numba) >= 10.0
            and med(round_numba) < 1.0
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--cpus-per-node", type=int, default=96)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    out = run(a.jobs, a.nodes, a.gpus_per_node, a.cpus_per_node, a.repeat, a.seed)
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(
            f"round {out['round_numba_s'] * 1000:.0f} ms (numba) vs {out['round_numpy_s'] * 1000:.0f} ms (numpy); "
            f"search {out['search_speedup']:.1f}x faster"
        )
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
