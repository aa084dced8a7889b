"""How the CLI shows jobs and nodes (tables, durations); no I/O."""

from __future__ import annotations

import time
from typing import Any

from gearshift.bus_schema.messages import JobRecord, JobState, NodeReport

JOB_HEADERS = ["ID", "NAME", "TENANT", "STATE", "GPUS", "PLAN", "NODES", "STEPS", "SPEED", "RUN TIME", "AGE", "REASON"]
NODE_HEADERS = ["NODE", "MODE", "GPUS", "USED", "UTIL", "MEM", "CPUS", "PROBE", "RUNNING", "SEEN"]


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    lines = ["  ".join(str(h).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for r in rows:
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(r, widths)).rstrip())
    return "\n".join(lines)


def ago(ts: float | None, now: float | None = None) -> str:
    if not ts:
        return "-"
    s = max(0.0, (now or time.time()) - ts)
    return f"{s:.0f}s" if s < 120 else (f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h")


def clock(seconds: float) -> str:
    """squeue's TIME: M:SS, H:MM:SS or D-HH:MM:SS."""
    s = int(max(0.0, seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}-{h:02d}:{m:02d}:{s:02d}"
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def run_time(j: JobRecord, now: float | None = None) -> str:
    """Since it first started (switches included), until it finished."""
    if not j.started_at:
        return "-"
    end = j.finished_at if j.finished_at else (now or time.time())
    return clock(end - j.started_at)


def steps_done(j: JobRecord) -> int:
    """Live steps from the latest progress report, else what the record says."""
    return max(j.steps_done, j.live.steps_done) if j.live is not None else j.steps_done


def speed(j: JobRecord) -> str:
    if j.live is None or j.state != JobState.RUNNING:
        return "-"
    return f"{j.live.samples_per_s:.1f}/s"


def job_row(j: JobRecord, now: float | None = None) -> list[str]:
    plan = j.plan.label() if j.plan else (j.spec.plan.label() if j.spec.plan else "-")
    if j.pinned is not None:
        plan += "*"
    nodes = ",".join(f"{p.node}:{len(p.gpus)}" for p in j.placement) or "-"
    return [
        j.job_id, j.spec.name, j.spec.tenant, j.state.value, str(j.spec.gpus), plan, nodes,
        f"{steps_done(j)}/{j.spec.steps}", speed(j), run_time(j, now), ago(j.submitted_at, now), j.reason[:60],
    ]


def job_rows(jobs: list[JobRecord], now: float | None = None) -> list[list[str]]:
    return [job_row(j, now) for j in jobs]


def node_headers(nodes: list[NodeReport]) -> list[str]:
    """The node table's columns: TOPOLOGY (the node's path) when any node reports one."""
    return NODE_HEADERS + (["TOPOLOGY"] if any(n.topology for n in nodes) else [])


def node_rows(nodes: list[NodeReport], modes: dict[str, Any] | None = None) -> list[list[str]]:
    topo = any(n.topology for n in nodes)
    rows = []
    for n in nodes:
        used = sum(1 for g in n.gpus if g.processes)
        utils = [g.utilization for g in n.gpus if g.utilization is not None]
        util = f"{sum(utils) / len(utils):.0f}%" if utils else "-"
        total = sum(g.memory_total for g in n.gpus)
        mem = f"{sum(g.memory_used for g in n.gpus) / total:.0%}" if total else "-"
        mode = "-" if modes is None else _mode_label(modes.get(n.node))
        rows.append([n.node, mode, str(len(n.gpus)), str(used), util, mem, str(n.cpus), n.probe,
                     ",".join(n.running) or "-", ago(n.ts)] + ([n.topology or "-"] if topo else []))
    return rows


def _mode_label(entry: Any) -> str:
    if entry is None:
        return "active"
    if entry.mode.value == "draining" and not entry.jobs:
        return "drained"
    return entry.mode.value
