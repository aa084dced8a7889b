"""Rubick's round while the learning oracle learns: remembered base answers vs fresh.

``python -m loadtest.learning_rounds --jobs 1000,2000,4000 --nodes 2000 --json``

Per job count: the scale test's job mix (its models, 1-8 GPUs) on ``--nodes`` nodes
x 8 GPUs x 64 CPUs. Every round, the running jobs' views are rebuilt as the
optimizer builds them (``make_job_view``) and two Rubick policies decide on them:
one with ``LearningOracle(PerfModelOracle())`` as shipped (the model's answers
remembered, an observation re-applies only the correction), one with the oracle as
it was before (``FreshLearningOracle``: the model asked on every call). Between
rounds both oracles receive the same observations: a fifth of the running jobs
report a step time (the model's prediction x a per-(model, plan family) bias x
noise), one in a hundred an out-of-memory exit, so every model's revision moves
every round, as under load live. Reported: median round time of each (round 0,
which fills caches and compiles kernels, excluded), their ratio measured in the
same run, and whether every round's decisions were identical.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import zlib

from gearshift.bus_schema.messages import JobSpec
from gearshift.policies.api import NodeState, make_job_view
from gearshift.policies.learning import LearningOracle
from gearshift.policies.oracle import PerfModelOracle
from gearshift.policies.rubick import Rubick
from loadtest.optimality_gap import BATCH, MODELS


class FreshLearningOracle(LearningOracle):
    """The learning oracle without remembered base answers (its answers before issue 11)."""

    def throughput(self, job, plan, placement):
        return self._adjust(job.spec, plan, placement, self.base.throughput(job, plan, placement))

    def throughput_many(self, job, plans, placement):
        raw = self.base.throughput_many(job, plans, placement)
        return [self._adjust(job.spec, p, placement, float(t)) for p, t in zip(plans, raw)]


def _specs(rng: random.Random, n: int) -> list[JobSpec]:
    out = []
    for i in range(n):
        m = rng.choice(MODELS)
        g = rng.choice([1, 1, 2, 2, 4, 8])
        out.append(JobSpec(name=f"s{i}", model=m, global_batch=BATCH[m.name], steps=rng.randint(100, 5000), gpus=g,
                           step_time=2.0 / g, tenant=f"t{i % 4}"))
    return out


def _digest(d) -> list:
    return sorted((k, v.placement, v.plan, v.predicted_throughput, v.reason) for k, v in d.allocations.items())


def run(jobs: int, nodes: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    cluster = [NodeState(f"n{i:04d}", 8, 8, 64, 64) for i in range(nodes)]
    specs = _specs(rng, jobs)
    oracles = {"remembered": LearningOracle(PerfModelOracle()), "fresh": FreshLearningOracle(PerfModelOracle())}
    policies = {k: Rubick() for k in oracles}
    times: dict[str, list[float]] = {k: [] for k in oracles}
    state: dict[str, tuple] = {}
    same, now = True, 1000.0
    for r in range(rounds):
        views = []
        for i, s in enumerate(specs):
            st = state.get(f"j{i}")
            if st:
                views.append(make_job_view(f"j{i}", s, 0.0, now, steps_done=min(s.steps - 1, (now - st[2]) * 2),
                                           placement=st[0], plan=st[1], last_switch_at=st[2], started_at=st[2]))
            else:
                views.append(make_job_view(f"j{i}", s, 0.0, now))
        got = {}
        for k in (("remembered", "fresh") if r % 2 else ("fresh", "remembered")):  # alternate who goes first
            t0 = time.perf_counter()
            got[k] = policies[k].schedule(now, cluster, views, oracles[k])
            times[k].append(time.perf_counter() - t0)
        same = same and _digest(got["remembered"]) == _digest(got["fresh"])
        for k, v in got["remembered"].allocations.items():
            old = state.get(k)
            if not (old and old[0] == v.placement and old[1] == v.plan):
                state[k] = (v.placement, v.plan, now)
        state = {k: v for k, v in state.items() if k in got["remembered"].allocations}
        running = sorted(state, key=lambda k: int(k[1:]))
        for k in rng.sample(running, min(len(running), max(1, jobs // 5))):
            i = int(k[1:])
            pl, plan, _ = state[k]
            s = specs[i]
            pred = oracles["remembered"].base.throughput(views[i], plan, pl)
            if pred <= 0:
                continue
            oom = rng.random() < 0.01
            bias = 0.7 + 0.6 * (zlib.crc32(f"{s.model.name}{plan.tp}{plan.zero}".encode()) % 100) / 100
            step = s.global_batch / (pred * bias * rng.uniform(0.9, 1.1))
            for o in oracles.values():
                o.observe(s, plan, pl, oom=True) if oom else o.observe(s, plan, pl, step_time=step)
        now += 60.0
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    return {"jobs": jobs, "nodes": nodes, "rounds": rounds, "revision": oracles["remembered"].revision,
            "round_ms_remembered": round(med["remembered"], 1), "round_ms_fresh": round(med["fresh"], 1),
            "speedup": round(med["fresh"] / med["remembered"], 2), "identical_decisions": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="1000,2000,4000", help="live jobs, or a comma list")
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        counts = [int(x) for x in a.jobs.split(",")]
    except ValueError:
        ap.error(f"--jobs: expected a number or a comma list of numbers, got {a.jobs!r}")
    if min(counts) < 1 or a.nodes < 1 or a.rounds < 2:
        ap.error("--jobs and --nodes must be positive and --rounds at least 2")
    out = [run(n, a.nodes, a.rounds, a.seed) for n in counts]
    if a.json:
        print(json.dumps({"runs": out}, indent=2))
    else:
        for r in out:
            print(f"{r['jobs']:6d} jobs: remembered {r['round_ms_remembered']:8.1f} ms  fresh {r['round_ms_fresh']:8.1f} ms"
                  f"  x{r['speedup']}  identical={r['identical_decisions']}")
    return 0 if all(r["identical_decisions"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
