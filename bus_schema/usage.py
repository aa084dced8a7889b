"""Accounting, pure: one job's use from its record (``usage_row``) and the
sum of many by tenant, job or model (``aggregate``). Shared by the archiver
(which writes a finished job's row to ``GS_USAGE``), admission's ``usage``
endpoint (live records' rows so far) and the Prometheus counters
(``bus.observe``), so the three count the same thing.

- GPU-seconds held: the ended allocations' (``attained_gpu_s``) plus the last
  one's, from ``last_switch_at`` to the end (or ``now``).
- Productive: held, less the switches' downtime (``switch_gpu_s``) and the
  GPU-seconds of the steps redone (steps lost x held / steps run), at least 0.
- Wait: submit to first start; a job that never started waited until its end.
"""

from __future__ import annotations

from collections.abc import Iterable

from gearshift.bus_schema.messages import JobRecord, JobState, UsageGroup, UsageRow


def held_gpu_s(rec: JobRecord, now: float | None = None) -> float:
    end = rec.finished_at if rec.finished_at is not None else now
    since = rec.last_switch_at if rec.last_switch_at is not None else rec.scheduled_at
    current = 0.0
    if rec.state != JobState.PENDING and rec.placement and since is not None and end is not None:
        current = sum(len(p.gpus) for p in rec.placement) * max(0.0, end - since)
    return rec.attained_gpu_s + current


def usage_row(rec: JobRecord, now: float | None = None) -> UsageRow:
    """The account of ``rec``: final for a finished job, so far (up to ``now``) for a live one."""
    gpu_s = held_gpu_s(rec, now)
    lost = sum(rec.steps_lost.values())
    ran = rec.steps_done + lost
    redone = gpu_s * lost / ran if ran else 0.0
    end = rec.finished_at if rec.finished_at is not None else now
    start = rec.started_at if rec.started_at is not None else end
    return UsageRow(
        job_id=rec.job_id, tenant=rec.spec.tenant, model=rec.spec.model.name, gpus=rec.spec.gpus,
        state=rec.state.value, submitted_at=rec.submitted_at, finished_at=rec.finished_at, gpu_s=gpu_s,
        productive_gpu_s=max(0.0, gpu_s - rec.switch_gpu_s - redone),
        wait_s=max(0.0, (start or rec.submitted_at) - rec.submitted_at), restarts=rec.restarts,
        switches=rec.switches, switch_s=rec.switch_s, switch_gpu_s=rec.switch_gpu_s, steps_lost=dict(rec.steps_lost),
    )


_H = 3600.0


def aggregate(rows: Iterable[UsageRow], by: str, limit: int = 10_000) -> tuple[list[UsageGroup], UsageGroup]:
    """Rows summed per ``by`` key (tenant, job or model), most GPU-hours first (at
    most ``limit`` groups), and the total of all rows."""
    acc: dict[str, list] = {}
    total = [0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, {}]
    for r in rows:
        key = r.tenant if by == "tenant" else r.job_id if by == "job" else r.model
        for a in (acc.setdefault(key, [0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0, {}]), total):
            a[0] += 1
            a[1] += r.gpu_s
            a[2] += r.productive_gpu_s
            a[3] += r.wait_s
            a[4] += r.restarts
            a[5] += r.switches
            a[6] += r.switch_s
            a[7] += r.switch_gpu_s
            for cause, n in r.steps_lost.items():
                a[8][cause] = a[8].get(cause, 0) + n

    def group(key: str, a: list) -> UsageGroup:
        return UsageGroup(key=key, jobs=a[0], gpu_hours=a[1] / _H, productive_gpu_hours=a[2] / _H,
                          wait_hours=a[3] / _H, restarts=a[4], switches=a[5], switch_hours=a[6] / _H,
                          switch_gpu_hours=a[7] / _H, steps_lost=a[8])

    groups = sorted((group(k, a) for k, a in acc.items()), key=lambda g: (-g.gpu_hours, g.key))
    return groups[:limit], group("total", total)
