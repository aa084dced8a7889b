"""``make demo``: a local cluster, a workload arriving over time, a summary.

Starts a real nats-server, every service and emulated GPU nodes
(``LocalCluster``), submits ``workloads/demo.yaml`` at the offsets it gives,
waits until every job has ended, prints a per-job table (queued, ran, JCT)
with the average JCT and the makespan, and stops everything.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec
import yaml

from bus_schema.messages import TERMINAL_STATES, JobRecord, JobSpec

from .client import Client
from .cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT / "workloads" / "demo.yaml"


class WorkloadItem(msgspec.Struct, forbid_unknown_fields=True):
    at: float
    spec: JobSpec


class Workload(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[WorkloadItem]


def load_workload(path: Path) -> list[WorkloadItem]:
    data = yaml.safe_load(path.read_text())
    return sorted(msgspec.convert(data, Workload).jobs, key=lambda j: j.at)


async def drive(url: str, items: list[WorkloadItem], timeout: float, progress: bool) -> tuple[list[JobRecord], float]:
    client = await Client.connect(url, retry_for=10)
    try:
        t0 = time.time()
        ids: list[str] = []
        pending = list(items)
        deadline = time.monotonic() + timeout
        last_line = ""
        while time.monotonic() < deadline:
            now = time.time() - t0
            while pending and pending[0].at <= now:
                item = pending.pop(0)
                reply = await client.submit(item.spec, token=f"demo-{item.spec.name}-{int(t0)}")
                ids.append(reply.job_id)
            jobs = [j for j in await client.jobs() if j.job_id in set(ids)]
            states: dict[str, int] = {}
            for j in jobs:
                states[j.state.value] = states.get(j.state.value, 0) + 1
            line = f"[{now:5.0f}s] submitted {len(ids)}/{len(items)}  " + "  ".join(
                f"{k} {v}" for k, v in sorted(states.items())
            )
            if progress and line != last_line:
                print(line, file=sys.stderr, flush=True)
                last_line = line
            if not pending and len(jobs) == len(items) and all(j.state in TERMINAL_STATES for j in jobs):
                return sorted(jobs, key=lambda j: j.submitted_at), t0
            await asyncio.sleep(0.5)
        raise TimeoutError(f"workload did not finish in {timeout:.0f}s")
    finally:
        await client.close()


def summary(jobs: list[JobRecord]) -> dict:
    rows = []
    for j in jobs:
        queued = (j.started_at or j.finished_at or j.submitted_at) - j.submitted_at
        ran = (j.finished_at - j.started_at) if (j.finished_at and j.started_at) else 0.0
        jct = (j.finished_at - j.submitted_at) if j.finished_at else None
        rows.append({
            "job_id": j.job_id, "name": j.spec.name, "gpus": j.spec.gpus, "state": j.state.value,
            "plan": j.plan.label() if j.plan else "-", "queued_s": round(queued, 1), "ran_s": round(ran, 1),
            "jct_s": round(jct, 1) if jct is not None else None, "restarts": j.restarts,
        })
    done = [r["jct_s"] for r in rows if r["jct_s"] is not None]
    start = min(j.submitted_at for j in jobs)
    end = max(j.finished_at or j.submitted_at for j in jobs)
    return {
        "jobs": rows,
        "completed": sum(1 for r in rows if r["state"] == "completed"),
        "failed": sum(1 for r in rows if r["state"] == "failed"),
        "avg_jct_s": round(sum(done) / len(done), 1) if done else None,
        "makespan_s": round(end - start, 1),
    }


def print_summary(s: dict) -> None:
    hdr = f"{'JOB':<14} {'NAME':<11} {'GPUS':>4} {'PLAN':<14} {'STATE':<10} {'QUEUED':>7} {'RAN':>7} {'JCT':>7}"
    print(hdr)
    print("-" * len(hdr))
    for r in s["jobs"]:
        jct = f"{r['jct_s']:.1f}" if r["jct_s"] is not None else "-"
        print(f"{r['job_id']:<14} {r['name']:<11} {r['gpus']:>4} {r['plan']:<14} {r['state']:<10} "
              f"{r['queued_s']:>6.1f}s {r['ran_s']:>6.1f}s {jct:>6}s")
    print("-" * len(hdr))
    print(f"jobs: {len(s['jobs'])}  completed: {s['completed']}  failed: {s['failed']}  "
          f"average JCT: {s['avg_jct_s']} s  makespan: {s['makespan_s']} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gearshift-demo")
    ap.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds to wait for the workload")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = ap.parse_args(argv)
    items = load_workload(args.workload)
    started = time.monotonic()
    print(f"gearshift demo: {args.nodes} nodes x {args.gpus_per_node} GPUs (emulated), policy {args.policy}, "
          f"{len(items)} jobs from {args.workload.name}", file=sys.stderr, flush=True)
    with LocalCluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, port=-1, policy=args.policy,
                      interval=1.0, grace=5.0) as cluster:
        print(f"nats-server at {cluster.url}; logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        jobs, _ = asyncio.run(drive(cluster.url, items, args.timeout, progress=True))
    s = summary(jobs)
    s["wall_s"] = round(time.monotonic() - started, 1)
    if args.output == "json":
        print(json.dumps(s, indent=2))
    else:
        print_summary(s)
        print(f"demo wall time: {s['wall_s']} s")
    return 0 if s["failed"] == 0 and s["completed"] == len(items) else 1


if __name__ == "__main__":
    sys.exit(main())
