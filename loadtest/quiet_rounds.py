"""How many rounds of a Blox load-8 run could reuse the last decision (issue 22's
"rounds that do only what changed")?

    python -m loadtest.quiet_rounds [POLICY ...]     # default fifo srtf tiresias

A round is *still* when nothing happened since the round before and that round
changed nothing: the same jobs in the same order, each holding the same placement and
plan as then, and the decision then kept every running job as it was and started
nobody (``policies.decision.diff``). Only time moved (running jobs' progress, timers).
For each policy: the share of still rounds, how many of them got the same decision as
the round before (allocations in order with placement, plan and reason; waiting jobs
in order with their words: what ``loadtest.decision_digest`` hashes), the share of
rounds whose decision equals the last one at all, and the CPU seconds the policy
spent in still rounds (the most a shortcut that skipped them could save of the
policy's time; the simulator's views, diff and check in those rounds come on top).
Judged from what the policy is handed, so the simulator is run unchanged.
"""

from __future__ import annotations

import argparse
import json
import time

from gearshift.policies.decision import diff
from gearshift.policies.registry import make_policy
from gearshift.sim import load_named, simulate
from loadtest.sim_speed import blox_config

POLICIES = ("fifo", "srtf", "tiresias")


class RoundWatch:
    """Wraps a policy's ``schedule``: classifies each round (see the module) and times it."""

    def __init__(self, policy):
        self.schedule = policy.schedule
        self.rounds = self.still = self.still_same = self.same = 0
        self.live = self.running = 0
        self.cpu = self.still_cpu = 0.0
        self._held: list | None = None  # last round's (job, placement, plan), in order
        self._kept_all = False  # did the last decision keep every running job and start nobody?
        self._last: tuple | None = None  # last decision's signature

    def __call__(self, now, nodes, jobs, perf):
        held = [(j.job_id, j.placement, j.plan) for j in jobs]
        still = self._kept_all and held == self._held
        c0 = time.process_time()
        d = self.schedule(now, nodes, jobs, perf)
        cpu = time.process_time() - c0
        sig = ([(k, v.placement, v.plan, v.reason) for k, v in d.allocations.items()], list(d.waiting.items()))
        change = diff({j.job_id: j for j in jobs if j.placement}, d)
        same = sig == self._last
        self.rounds += 1
        self.live += len(jobs)
        self.running += sum(1 for j in jobs if j.placement)
        self.cpu += cpu
        self.same += same
        if still:
            self.still += 1
            self.still_same += same
            self.still_cpu += cpu
        self._held, self._last = held, sig
        self._kept_all = not (change.preempt or change.changed)
        return d

    def report(self) -> dict:
        n = max(self.rounds, 1)
        return {"rounds": self.rounds, "still": self.still, "still_same_decision": self.still_same,
                "same_decision": self.same, "still_share": round(self.still / n, 3),
                "same_share": round(self.same / n, 3), "avg_live": round(self.live / n, 1),
                "avg_running": round(self.running / n, 1), "policy_cpu_s": round(self.cpu, 3),
                "policy_cpu_in_still_rounds_s": round(self.still_cpu, 3)}


def watch(policy_name: str) -> dict:
    policy = make_policy(policy_name)
    w = RoundWatch(policy)
    policy.schedule = w
    c0 = time.process_time()
    simulate(load_named("blox-load8"), policy, config=blox_config())
    return {"policy": policy_name, **w.report(), "run_cpu_s": round(time.process_time() - c0, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("policies", nargs="*", default=list(POLICIES))
    args = p.parse_args(argv)
    for name in args.policies:
        print(json.dumps(watch(name)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
