"""Job dependencies in the simulator: a trace's ``after`` column.

A job that names others (``JobSpec.after``) joins the queue when it has
arrived and every job it names has completed (the simulator's jobs only
complete; ``on`` other than ``completed`` cannot be met and is refused). Its
submit time stays the trace's, so its queueing delay includes the wait, as a
user sees it; the live ``services.dependencies`` gate does the same. Pure: no
bus, no I/O.
"""

from __future__ import annotations

from typing import Any


class DependencyHold:
    """Which arrived jobs wait for others, released as those complete."""

    def __init__(self, records: list[Any]):
        ids = {r.job.job_id for r in records}
        self.unmet: dict[str, int] = {}
        self.dependents: dict[str, list[Any]] = {}
        for r in records:
            after = r.job.spec.after or []
            for d in after:
                if d.job not in ids:
                    raise ValueError(f"job {r.job.job_id}: after names {d.job}, which is not in the trace")
                if getattr(d.on, "value", d.on) != "completed":
                    raise ValueError(f"job {r.job.job_id}: after {d.job} on {d.on}: simulated jobs only complete")
            for parent in dict.fromkeys(d.job for d in after):  # a parent named twice counts once
                self.dependents.setdefault(parent, []).append(r)
            if after:
                self.unmet[r.job.job_id] = len({d.job for d in after})
        self._check_acyclic(records)
        self.arrived: set[str] = set()

    def _check_acyclic(self, records: list[Any]) -> None:
        left = dict(self.unmet)
        ready = [r.job.job_id for r in records if r.job.job_id not in left]
        seen = 0
        while ready:
            job = ready.pop()
            seen += 1
            for d in (c.job.job_id for c in self.dependents.get(job, [])):
                left[d] -= 1
                if left[d] == 0:
                    ready.append(d)
        if seen < len(records):
            stuck = sorted(j for j, n in left.items() if n > 0)[:5]
            raise ValueError(f"the trace's dependencies have a cycle (among {', '.join(stuck)})")

    def arrive(self, r: Any) -> bool:
        """``r`` arrived: may it join the queue now?"""
        self.arrived.add(r.job.job_id)
        return self.unmet.get(r.job.job_id, 0) == 0

    def completed(self, job_id: str) -> list[Any]:
        """``job_id`` completed: the arrived jobs that no longer wait."""
        out = []
        for r in self.dependents.pop(job_id, []):
            jid = r.job.job_id
            self.unmet[jid] -= 1
            if self.unmet[jid] == 0 and jid in self.arrived:
                out.append(r)
        return out
