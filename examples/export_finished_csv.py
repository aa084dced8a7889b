"""Export finished gearshift jobs to CSV, from the event stream alone.

    python examples/export_finished_csv.py --server nats://127.0.0.1:4222 --creds tools.creds --out jobs.csv

Replays ``GS_EVENTS`` from the start (read-only: the ``tools`` identity is
enough), folds each job's events into one row, and writes the jobs that
reached a terminal state (completed, failed, cancelled) with their tenant,
GPUs, times, steps, plan switches and reason. Events of one job carry a
gapless ``seq``, so a repeated delivery is skipped.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import sys
from typing import Any

from gearshift.client import Client

COLUMNS = ["job_id", "name", "tenant", "gpus", "state", "submitted_at", "started_at", "finished_at", "wait_s",
           "run_s", "steps_done", "switches", "restarts", "reason"]
TERMINAL = {"job.completed": "completed", "job.failed": "failed", "job.cancelled": "cancelled"}


def fold(rows: dict[str, dict[str, Any]], ev: Any) -> None:
    """One job event into its row (a repeated ``seq`` changes nothing)."""
    job_id = getattr(ev, "job_id", None)
    if job_id is None:
        return  # node and round events
    row = rows.setdefault(job_id, {"job_id": job_id, "switches": 0, "restarts": 0, "seq": 0})
    if ev.seq <= row["seq"]:
        return
    row["seq"] = ev.seq
    kind = ev.__struct_config__.tag
    if kind == "job.submitted":
        row.update(name=ev.name, tenant=ev.tenant, gpus=ev.gpus, submitted_at=ev.ts)
    elif kind == "job.running":
        row.setdefault("started_at", ev.ts)
    elif kind == "job.switched":
        row["switches"] += 1
    elif kind in ("job.preempted", "job.requeued"):
        row["restarts"] += 1
    elif kind in TERMINAL:
        row.update(state=TERMINAL[kind], finished_at=ev.ts, steps_done=getattr(ev, "steps_done", ""),
                   reason=getattr(ev, "reason", ""))


def finished_rows(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows.values():
        if "state" not in row:
            continue
        sub, start, end = row.get("submitted_at"), row.get("started_at"), row["finished_at"]
        row["wait_s"] = round(start - sub, 3) if start and sub else ""
        row["run_s"] = round(end - start, 3) if start else ""
        out.append({k: row.get(k, "") for k in COLUMNS})
    return sorted(out, key=lambda r: (r["finished_at"], r["job_id"]))


async def export(args: argparse.Namespace) -> int:
    client = await Client.connect(args.server, creds=args.creds)
    rows: dict[str, dict[str, Any]] = {}
    try:
        async for _, _, ev in client.events(subject="gs.evt.job.>"):
            fold(rows, ev)
    finally:
        await client.close()
    done = finished_rows(rows)
    out = open(args.out, "w", newline="") if args.out != "-" else sys.stdout
    try:
        w = csv.DictWriter(out, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(done)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"{len(done)} finished jobs of {len(rows)}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default=None, help="NATS URL (default $GEARSHIFT_NATS_URL)")
    ap.add_argument("--creds", default=None, help="credentials file (default $GEARSHIFT_CREDS), e.g. tools.creds")
    ap.add_argument("--out", default="-", help="CSV file (default: standard output)")
    args = ap.parse_args(argv)
    try:
        return asyncio.run(export(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
