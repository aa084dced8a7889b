"""What rubick believes is left of a job when declared steps are only an upper bound
(issue 21 item 4, ``gearshift simulate --declared-noise``).

A user declares a step budget; the job may stop earlier. What the live system can
know: the declaration, the steps done so far, and, when a job finishes, roughly how
many steps it ran. ``DeclaredSteps`` learns, from the jobs it saw finish, the ratio of
steps run to steps declared (a geometric mean over the last ``window`` finished jobs),
and believes a job has ``declared x ratio - done`` steps left, at least ``floor`` of
what its declaration leaves (a job past the typical ratio is still running: it has
work left). Until ``min_samples`` jobs have finished, or while the learned ratio is
within ``trust`` of 1, the declaration is taken as it is (with exact declarations the
belief is the declaration).

A job that leaves the round's job list finished (the simulator and the optimizer drop
finished jobs); its steps at the end are estimated from the steps seen at its last
round plus the predicted speed of its allocation after its restart, and never more
than declared. Memory: the jobs of the last round and a fixed window of ratios.
"""

from __future__ import annotations

import math
from collections import deque


class DeclaredSteps:
    def __init__(self, window: int = 200, min_samples: int = 5, trust: float = 0.05, floor: float = 0.1):
        self.ratios: deque[float] = deque(maxlen=window)  # log(steps run / steps declared)
        self.min_samples = min_samples
        self.trust = trust
        self.floor = floor
        self._last: dict[str, tuple] = {}  # job -> (t, done, declared, rate steps/s, productive from)
        self.ratio = 1.0

    def observe(self, now: float, jobs, restart_of) -> None:
        live = {j.job_id for j in jobs}
        for jid, (t, done, declared, rate, productive) in self._last.items():
            if jid in live or declared <= 0:
                continue
            ran = done + rate * max(0.0, now - max(t, productive))
            ran = min(max(ran, done), declared)
            if ran > 0:
                self.ratios.append(math.log(ran / declared))
        self._last = {k: v for k, v in self._last.items() if k in live}
        if len(self.ratios) >= self.min_samples:
            r = math.exp(sum(self.ratios) / len(self.ratios))
            self.ratio = 1.0 if r > 1.0 - self.trust else r
        self._restart_of = restart_of

    def remember(self, now: float, jobs, decision) -> None:
        """After the round: each job's steps now and its predicted speed from here."""
        last, allocs = self._last, decision.allocations
        for j in jobs:
            a = allocs.get(j.job_id)
            if a is None:  # not running after the round: its rate is 0, so ``observe`` reads only its steps
                m = last.get(j.job_id)
                if m is not None and m[3] == 0.0 and m[1] == j.steps_done and m[2] == j.spec.steps:
                    continue  # (a queue's jobs: the same entry as last round's but for times it never reads)
            thr = (a.predicted_throughput or 0.0) if a is not None else 0.0
            rate = thr / max(j.spec.global_batch, 1)
            changed = a is not None and (a.placement != j.placement or a.plan != j.plan)
            since = now if changed else (j.switched_at if j.switched_at is not None else now)
            last[j.job_id] = (now, j.steps_done, float(j.spec.steps), rate, since + self._restart_of(j))

    def remaining(self, j) -> float:
        left = max(j.spec.steps - j.steps_done, 0.0)
        if self.ratio >= 1.0:
            return left
        return max(j.spec.steps * self.ratio - j.steps_done, self.floor * left)
