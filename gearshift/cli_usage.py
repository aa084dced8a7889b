"""``gearshift usage``: GPU-hours held and used productively, waits, restarts,
switches and their cost, and steps lost by cause, of the jobs that finished in
a window (``services.usage``), by tenant, job or model; a tenant's identity
sees its own jobs only."""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import re
import sys
import time
from typing import Any

from gearshift import render
from gearshift.bus_schema import codec
from gearshift.spec_file import SpecFileError

_AGO = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhdw])$")
_UNIT = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
COLUMNS = ["key", "jobs", "gpu_hours", "productive_gpu_hours", "wait_hours", "restarts", "switches",
           "switch_hours", "switch_gpu_hours", "steps_lost"]


def parse_time(text: str, flag: str, now: float | None = None) -> float:
    """``1h`` / ``30m`` / ``2d`` ago, an ISO date-time (local time unless it says),
    or epoch seconds."""
    now = time.time() if now is None else now
    t = text.strip()
    m = _AGO.match(t)
    if m:
        return now - float(m.group(1)) * _UNIT[m.group(2)]
    try:
        return float(t)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(t).timestamp()
    except ValueError:
        raise SpecFileError(f"{flag}: {text!r} is not a time: give 1h / 30m / 2d (ago), an ISO date-time "
                            "(2026-12-01T08:00) or epoch seconds") from None


def add_usage(p: argparse.ArgumentParser) -> None:
    p.add_argument("--since", default="24h", help="start of the window: 1h/30m/2d ago, ISO date-time or epoch (default 24h)")
    p.add_argument("--until", default=None, help="end of the window (default now, with the live jobs' use so far)")
    p.add_argument("--by", choices=["tenant", "job", "model"], default="tenant", help="group by")
    p.add_argument("--tenant", default=None, help="only this tenant (admin)")
    p.add_argument("-o", "--output", choices=["table", "json", "csv"], default="table", help="output format")


def _steps(lost: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(lost.items())) or "-"


async def cmd_usage(args: argparse.Namespace) -> int:
    from gearshift.cli_ops import _connected

    since = parse_time(args.since, "--since")
    until = parse_time(args.until, "--until") if args.until else None

    async def go(c: Any) -> int:
        rep = await c.usage(since, until, by=args.by, tenant=args.tenant)
        if args.output == "json":
            print(json.dumps(codec.to_builtins(rep), indent=2))
            return 0
        rows = [*rep.groups, rep.total]
        if args.output == "csv":
            w = csv.writer(sys.stdout)
            w.writerow(COLUMNS)
            for g in rows:
                w.writerow([g.key, g.jobs, *(f"{getattr(g, k):.6f}" for k in COLUMNS[2:5]), g.restarts, g.switches,
                            f"{g.switch_hours:.6f}", f"{g.switch_gpu_hours:.6f}", _steps(g.steps_lost)])
            return 0
        fmt = lambda ts: time.strftime("%Y-%m-%d %H:%M", time.localtime(ts))  # noqa: E731
        print(f"jobs finished {fmt(rep.since)} .. {fmt(rep.until)}" + (f", and {rep.live} live" if rep.live else ""))
        print(render.table([[g.key, str(g.jobs), f"{g.gpu_hours:.2f}", f"{g.productive_gpu_hours:.2f}",
                             f"{g.wait_hours:.2f}", str(g.restarts), str(g.switches), f"{g.switch_gpu_hours:.2f}",
                             _steps(g.steps_lost)] for g in rows],
                           [args.by.upper(), "JOBS", "GPU-H", "PRODUCTIVE GPU-H", "WAIT H", "RESTARTS", "SWITCHES",
                            "SWITCH GPU-H", "STEPS LOST"]))
        return 0

    return await _connected(args, go)
