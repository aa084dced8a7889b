"""Are a simulator change's decisions unchanged? A digest of Blox load-8 runs.

    python -m loadtest.decision_digest --save before.json [POLICY ...]    # on the old tree
    python -m loadtest.decision_digest --against before.json [POLICY ...] # on the new one: exit 1 if any differs

For each policy (default fifo, srtf, tiresias, las) one ``loadtest.sim_speed`` Blox
load-8 run, and two SHA-256 digests: of every job's results (state, first start,
finish, starts, reconfigurations, preemptions, steps, service, GPU-seconds, run
time, restart loss, placement, plan, ...) with the timeline, rounds, events and end
time; and of every round's decision as the policy returned it (allocations in order
with placement, plan and reason; waiting jobs in order with their words). A speed-up
that claims "decisions unchanged" must leave both the same. The committed evaluation
runs (``docs/evaluation-runs``, ``make evaluation``) are the other half of that claim.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

from gearshift.policies.registry import make_policy
from gearshift.sim import load_named, simulate
from loadtest.sim_speed import blox_config

POLICIES = ("fifo", "srtf", "tiresias", "las")
FIELDS = ("state", "first_start", "finish", "starts", "reconfigs", "preemptions", "steps_done", "attained",
          "gpu_seconds", "run_time", "restart_lost", "restart_gpu_seconds", "placement", "plan", "stalled",
          "attained_before", "last_plan_label")


def digest(policy_name: str) -> dict:
    policy = make_policy(policy_name)
    decisions = hashlib.sha256()
    schedule = policy.schedule

    def recorded(now, nodes, jobs, perf):
        d = schedule(now, nodes, jobs, perf)
        decisions.update(repr((now, [(k, v.placement, v.plan, v.reason) for k, v in d.allocations.items()],
                               list(d.waiting.items()))).encode())
        return d

    policy.schedule = recorded
    c0 = time.process_time()
    res = simulate(load_named("blox-load8"), policy, config=blox_config())
    cpu = time.process_time() - c0
    rows = [(r.job.job_id,) + tuple(repr(getattr(r, f)) for f in FIELDS) for r in res.records]
    results = hashlib.sha256(repr((rows, res.timeline, res.rounds, res.events, res.end_time)).encode())
    return {"results": results.hexdigest(), "decisions": decisions.hexdigest(), "rounds": res.rounds,
            "cpu_s": round(cpu, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policies", nargs="*", default=list(POLICIES))
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", metavar="FILE", help="write the digests here")
    g.add_argument("--against", metavar="FILE", help="compare with digests saved before")
    args = p.parse_args(argv)
    before = {}
    if args.against:
        try:
            with open(args.against) as f:
                before = json.load(f)
        except (OSError, ValueError) as e:
            print(f"--against: cannot read {args.against}: {e}", file=sys.stderr)
            return 2
    out, differ = {}, []
    for name in args.policies:
        d = out[name] = digest(name)
        verdict = ""
        if args.against:
            b = before.get(name)
            same = b is not None and b["results"] == d["results"] and b["decisions"] == d["decisions"]
            verdict = "same" if same else ("not in " + args.against if b is None else "DIFFERENT")
            if not same:
                differ.append(name)
        print(f"{name:>9}: results {d['results'][:12]} decisions {d['decisions'][:12]} rounds {d['rounds']} "
              f"cpu {d['cpu_s']} s {verdict}", flush=True)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(out, f, indent=1)
    if differ:
        print(f"different: {', '.join(differ)}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
