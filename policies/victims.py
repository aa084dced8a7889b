"""Which running job to preempt, among equals (issue 23): the one whose
preemption loses the least work, GPU-seconds since its last checkpoint. Shared
by every policy that preempts by walking its order (``policies.priority``) and
by the priority-class check (``policies.classes.enforce``), so none weighs lost
work its own way. Volcano PR #5999 proposed choosing victims by checkpoint
recency; Slurm's ``GraceTime`` and Kueue #477 ask for the grace that makes it
matter.

A job's ``checkpoint_at`` is what its agents report (``JobProgress``); a job
that reported none loses everything since its allocation started. When no
candidate reported a checkpoint the policy's own order stands unchanged (the
simulator, unless it models checkpoints, decides exactly as before).

Pure: no clock, no NATS.
"""

from __future__ import annotations

from collections.abc import Sequence

from gearshift.policies.api import JobView


def work_since_checkpoint(job: JobView, now: float) -> float:
    """GPU-seconds a preemption of ``job`` at ``now`` would lose."""
    since = job.switched_at
    ck = job.checkpoint_at
    if ck is not None and (since is None or ck > since):
        since = ck
    if since is None:
        return 0.0
    return job.gpus * max(0.0, now - since)


def any_checkpoint(jobs: Sequence[JobView]) -> bool:
    return any(j.checkpoint_at is not None for j in jobs)


def victim_order(candidates: Sequence[JobView], now: float) -> Sequence[JobView]:
    """``candidates`` (the policy's victim order: lowest priority class first)
    with each class's jobs by least work since their last checkpoint; ties and
    classes keep the policy's order."""
    if not any_checkpoint(candidates):
        return candidates
    return sorted(candidates, key=lambda v: (v.spec.priority, work_since_checkpoint(v, now)))
