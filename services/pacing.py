"""When the leader's next round may start: arrivals that come close together go
into one round, and rounds take at most a share of the optimizer's time.

A round is kicked by every submit, completion and report turn. Run at once for
each, the rounds of a burst ran back to back: at 200 submits a second every round
paid its fixed part (reading the views, asking the policy about every live job,
the stream-info requests, a commit that syncs ``KV_gs_jobs`` to disk) for a handful
of new jobs, so the optimizer's CPU per job was the cost of a whole round divided
by the few jobs it handled, and every commit held up the admission's next write
to the same stream (issue 24). Paced, a round handles what arrived while the
last one ran and the gap after it.

The rule (``RoundPacer.delay``): the next round starts no sooner than ``gap``
seconds after the last one ended, and no sooner than the last round's own time
x (1 - ``duty``) / ``duty`` after it, so rounds take at most ``duty`` of the time
however long they get. A round an operator asks for (``gs.optimizer.round``,
node modes) is not paced. Pure: times come from the caller.
"""

from __future__ import annotations


class RoundPacer:
    def __init__(self, gap: float = 0.1, duty: float = 0.25):
        if gap < 0 or not 0 < duty <= 1:
            raise ValueError("gap must be >= 0 and duty in (0, 1]")
        self.gap = gap
        self.duty = duty
        self.ended_at = float("-inf")  # when the last round ended (the caller's clock)
        self.took = 0.0  # how long it took

    def ended(self, started_at: float, ended_at: float) -> None:
        """A round ran from ``started_at`` to ``ended_at``."""
        self.ended_at = ended_at
        self.took = max(0.0, ended_at - started_at)

    def rest(self) -> float:
        """Seconds to wait after a round before the next: the gap, or the duty's rest."""
        return max(self.gap, self.took * (1.0 - self.duty) / self.duty)

    def delay(self, now: float) -> float:
        """Seconds from ``now`` until the next round may start (0: now)."""
        return max(0.0, self.ended_at + self.rest() - now)
