"""The optimizer's round at scale without NATS: job records to views to rubick's decision.

``python -m loadtest.live_rounds --live 5000,12000 --nodes 2000 --json``

Per live-job count: the scale test's job mix (its models, 1-8 GPUs) as ``JobRecord``s
on ``--nodes`` nodes x 8 GPUs x 64 CPUs. Every round runs what the optimizer's round
does between reading its views and writing (``services.policy_bridge.PolicyStep.views``,
``Rubick.schedule`` with a learning oracle, ``check_decision``) twice on the same
records: "kept", as shipped (job views and rubick's per-job rows kept across rounds),
and "rebuilt" (both dropped before every round: every view and row built anew, as
before issue 11's caches). Between rounds the decision is applied as the optimizer
writes it (a new record per job whose allocation changed, preempted jobs pending
again), ``--checkpoints`` of the running jobs get a new record (progress written),
a twentieth of the running jobs finish, ``--arrivals`` jobs arrive, and
``--observations`` running jobs teach both oracles a step time (each model's
revision moves: its jobs' curves are rebuilt). Reported: median round time of each
(round 0 excluded), their ratio measured in the same run, the live and running
jobs, and whether every round's decisions were identical.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import msgspec

from gearshift.bus_schema.messages import JobRecord, JobSpec, JobState, NodePlacement
from gearshift.policies.api import NodeState
from gearshift.policies.decision import check_decision
from gearshift.policies.learning import LearningOracle
from gearshift.policies.oracle import PerfModelOracle
from gearshift.policies.rubick import Rubick
from gearshift.services.policy_bridge import JobViews, PolicyStep
from loadtest.optimality_gap import BATCH, MODELS


class _NoModels:
    def observe_progress(self, *a) -> bool:
        return False


def _digest(d) -> list:
    return (sorted((k, v.placement, v.plan, v.predicted_throughput, v.predicted_gain, v.reason)
                   for k, v in d.allocations.items()) + sorted(d.waiting.items()))


def _spec(rng: random.Random, i: int) -> JobSpec:
    m = rng.choice(MODELS)
    g = rng.choice([1, 1, 2, 2, 4, 8])
    return JobSpec(name=f"s{i}", model=m, global_batch=BATCH[m.name], steps=rng.randint(200, 4000), gpus=g,
                   step_time=2.0 / g)


def _rebuild(step: PolicyStep, pol: Rubick) -> None:
    step.cache = JobViews()
    pol.problems.rows.clear()
    if pol.problems.cache is not None:
        pol.problems.cache._keys.clear()
        pol.problems.cache._intern.clear()


def _apply(recs: dict[str, JobRecord], d, now: float, rng: random.Random, checkpoints: float) -> None:
    for jid, rec in list(recs.items()):
        a = d.allocations.get(jid)
        if a is None:
            if rec.state == JobState.RUNNING:
                recs[jid] = msgspec.structs.replace(rec, state=JobState.PENDING, placement=[], plan=None)
            continue
        have = [(p.node, len(p.gpus), p.cpus) for p in rec.placement]
        if rec.state != JobState.RUNNING or rec.plan != a.plan or have != [(p.node, p.gpus, p.cpus) for p in a.placement]:
            recs[jid] = msgspec.structs.replace(
                rec, state=JobState.RUNNING, plan=a.plan, generation=rec.generation + 1, last_switch_at=now,
                started_at=rec.started_at or now,
                placement=[NodePlacement(node=p.node, gpus=list(range(p.gpus)), cpus=p.cpus) for p in a.placement])
        elif rng.random() < checkpoints:
            recs[jid] = msgspec.structs.replace(rec, steps_done=min(rec.spec.steps, rec.steps_done + 100))


def run(live: int, nodes: int, rounds: int, arrivals: int, checkpoints: float, observations: int, seed: int) -> dict:
    rng = random.Random(seed)
    cluster = [NodeState(f"n{i:04d}", 8, 8, 64, 64) for i in range(nodes)]
    alive = {n.name for n in cluster}
    recs = {f"j{i}": JobRecord(job_id=f"j{i}", spec=_spec(rng, i), submitted_at=float(i)) for i in range(live)}
    n = live
    sides = ("kept", "rebuilt")
    oracles = {k: LearningOracle(PerfModelOracle()) for k in sides}
    pols = {k: Rubick() for k in sides}
    steps = {k: PolicyStep(pols[k], _NoModels()) for k in sides}
    times: dict[str, list[float]] = {k: [] for k in sides}
    same, now, seen = True, 1000.0, []
    for r in range(rounds):
        got = {}
        for k in (sides if r % 2 else sides[::-1]):  # alternate who goes first
            if k == "rebuilt":
                _rebuild(steps[k], pols[k])
            t0 = time.perf_counter()
            views = steps[k].views(recs, alive, now)
            got[k] = pols[k].schedule(now, cluster, views, oracles[k])
            check_decision(got[k], cluster, {v.job_id: v for v in views})
            times[k].append(time.perf_counter() - t0)
        same = same and _digest(got["kept"]) == _digest(got["rebuilt"])
        d = got["kept"]
        seen.append((len(views), len(d.allocations)))
        _apply(recs, d, now, rng, checkpoints)
        for j in [j for j, rec in recs.items() if rec.state == JobState.RUNNING and rng.random() < 0.05]:
            del recs[j]
        for _ in range(arrivals):
            recs[f"j{n}"] = JobRecord(job_id=f"j{n}", spec=_spec(rng, n), submitted_at=now)
            n += 1
        running = [v for v in views if v.running]
        for v in rng.sample(running, min(observations, len(running))):
            pred = oracles["kept"].base.throughput(v, v.plan, v.placement)
            if pred > 0:
                st = v.spec.global_batch / (pred * rng.uniform(0.7, 1.3))
                for o in oracles.values():
                    o.observe(v.spec, v.plan, v.placement, step_time=st)
        now += 5.0
    med = {k: statistics.median(v[1:]) * 1e3 for k, v in times.items()}
    return {"live": live, "nodes": nodes, "rounds": rounds, "live_jobs_per_round": [s[0] for s in seen],
            "running_per_round": [s[1] for s in seen], "revision": oracles["kept"].revision,
            "round_ms_kept": round(med["kept"], 1), "round_ms_rebuilt": round(med["rebuilt"], 1),
            "speedup": round(med["rebuilt"] / med["kept"], 2), "identical_decisions": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--live", default="5000,12000", help="live jobs at the start, or a comma list")
    ap.add_argument("--nodes", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--arrivals", type=int, default=200, help="jobs arriving between rounds")
    ap.add_argument("--checkpoints", type=float, default=0.05, help="share of running jobs whose record changes a round")
    ap.add_argument("--observations", type=int, default=10, help="step times observed between rounds")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    try:
        counts = [int(x) for x in a.live.split(",")]
    except ValueError:
        ap.error(f"--live: expected a number or a comma list of numbers, got {a.live!r}")
    if min(counts) < 1 or a.nodes < 1 or a.rounds < 2 or a.arrivals < 0 or a.observations < 0 \
            or not 0 <= a.checkpoints <= 1:
        ap.error("--live and --nodes must be positive, --rounds at least 2, --arrivals and --observations "
                 "not negative, --checkpoints in [0, 1]")
    out = [run(c, a.nodes, a.rounds, a.arrivals, a.checkpoints, a.observations, a.seed) for c in counts]
    if a.json:
        print(json.dumps({"runs": out}, indent=2))
    else:
        for r in out:
            print(f"{r['live']:6d} live: kept {r['round_ms_kept']:8.1f} ms  rebuilt {r['round_ms_rebuilt']:8.1f} ms"
                  f"  x{r['speedup']}  identical={r['identical_decisions']}")
    return 0 if all(r["identical_decisions"] for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
