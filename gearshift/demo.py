"""``make demo``: a local cluster, a workload arriving over time, a summary.

Starts a real nats-server, every service and emulated GPU nodes
(``LocalCluster``), submits ``workloads/demo.yaml`` at the offsets it gives,
waits until every job has ended, prints a per-job table (queued, ran, JCT)
with the average JCT and the makespan, and stops everything.

One job of the workload is real training: the PyTorch reference workload
(``gearshift.agent.reference.train``, CPU, gloo; ``{python}`` in a command is this
interpreter). Its performance model was profiled beforehand
(``workloads/torchref_model.json``, from ``python -m loadtest.profile_accuracy``)
and is stored in ``gs_models`` before the workload starts, as a cluster that
profiled the model earlier would have it. Once it has trained
``--switch-at`` steps the demo asks the optimizer to switch it from DP1 to
DP2 with ZeRO-1 (``gs.optimizer.reconfigure``); the job checkpoints, stops,
restarts with the new plan on two GPUs and resumes, and the summary shows
the switch's cost by phase (``job.switched``).
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

from gearshift.bus.client import call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    TERMINAL_STATES,
    JobProgress,
    JobRecord,
    JobSpec,
    JobSwitched,
    Plan,
    ReconfigureReply,
    ReconfigureRequest,
)
from gearshift.bus_schema.perfmodel import model_kv_key as kv_key
from gearshift.client import Client
from gearshift.cluster import LocalCluster

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKLOAD = ROOT / "workloads" / "demo.yaml"
TORCH_MODEL = ROOT / "workloads" / "torchref_model.json"
SWITCH_TO = Plan(dp=2, zero=1)


class WorkloadItem(msgspec.Struct, forbid_unknown_fields=True):
    at: float
    spec: JobSpec


class Workload(msgspec.Struct, forbid_unknown_fields=True):
    jobs: list[WorkloadItem]


def load_workload(path: Path) -> list[WorkloadItem]:
    data = yaml.safe_load(path.read_text())
    for job in data.get("jobs", []):
        cmd = job.get("spec", {}).get("command")
        if cmd:
            job["spec"]["command"] = [sys.executable if a == "{python}" else a for a in cmd]
    return sorted(msgspec.convert(data, Workload).jobs, key=lambda j: j.at)


def is_torch(spec: JobSpec) -> bool:
    return bool(spec.command) and "gearshift.agent.reference.train" in spec.command


async def seed_models(nc) -> None:
    """The reference workload's fitted model, as a cluster that profiled it earlier keeps it."""
    if not TORCH_MODEL.exists():
        return
    kv = await nc.jetstream().key_value(subj.MODELS_BUCKET)
    data = json.loads(TORCH_MODEL.read_text())

    await kv.put(kv_key(data["model_key"]), json.dumps(data).encode())


async def drive(url: str, items: list[WorkloadItem], timeout: float, progress: bool,
                switch_at: int = 60) -> tuple[list[JobRecord], float]:
    client = await Client.connect(url, retry_for=10)
    switches: list[JobSwitched] = []
    steps: dict[str, int] = {}
    torch_jobs: set[str] = set()
    asked: set[str] = set()

    async def on_progress(msg) -> None:
        p = codec.decode(msg.data, JobProgress)
        steps[p.job_id] = p.steps_done

    async def on_switched(msg) -> None:
        ev = codec.decode_event(msg.data)
        if isinstance(ev, JobSwitched):
            switches.append(ev)
            print(f"  switched {ev.job_id} {ev.from_plan.label() if ev.from_plan else '?'} -> "
                  f"{ev.plan.label() if ev.plan else '?'} at step {ev.resumed_step}: {ev.total_s:.1f}s "
                  f"(checkpoint {ev.checkpoint_s:.2f}, teardown {ev.teardown_s:.2f}, launch {ev.launch_s:.2f}, "
                  f"restore {ev.restore_s:.2f}, first step {ev.first_step_s:.2f}), steps lost {ev.steps_lost}",
                  file=sys.stderr, flush=True)

    subs = [await client.nc.subscribe("gs.job.*.progress", cb=on_progress),
            await client.nc.subscribe("gs.evt.job.*.switched", cb=on_switched)]
    await seed_models(client.nc)
    drive.switches = switches  # type: ignore[attr-defined]
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
                if is_torch(item.spec):
                    torch_jobs.add(reply.job_id)
            for job_id in torch_jobs - asked:
                if steps.get(job_id, 0) >= switch_at:
                    asked.add(job_id)
                    req = ReconfigureRequest(job_id=job_id, plan=SWITCH_TO, reason="demo: DP1 -> DP2 + ZeRO-1")
                    r = await call(client.nc, subj.OPTIMIZER_RECONFIGURE, req, ReconfigureReply, timeout=5)
                    print(f"[{now:5.0f}s] torch job {job_id} at step {steps[job_id]}: asked to switch to "
                          f"{SWITCH_TO.label()} (generation {r.generation} -> next)", file=sys.stderr, flush=True)
            jobs = [j for j in await client.jobs(all=True) if j.job_id in set(ids)]  # finished ones move to history
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
        for sub in subs:
            await sub.unsubscribe()
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
    ap.add_argument("--switch-at", type=int, default=60, help="step at which the torch job is switched")
    ap.add_argument("-o", "--output", choices=["table", "json"], default="table")
    args = ap.parse_args(argv)
    items = load_workload(args.workload)
    started = time.monotonic()
    print(f"gearshift demo: {args.nodes} nodes x {args.gpus_per_node} GPUs (emulated), policy {args.policy}, "
          f"{len(items)} jobs from {args.workload.name}", file=sys.stderr, flush=True)
    with LocalCluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node, port=-1, policy=args.policy,
                      interval=1.0, grace=5.0) as cluster:
        print(f"nats-server at {cluster.url}; logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        jobs, _ = asyncio.run(drive(cluster.url, items, args.timeout, progress=True, switch_at=args.switch_at))
    s = summary(jobs)
    s["switches"] = [
        {"job_id": ev.job_id, "from": ev.from_plan.label() if ev.from_plan else None,
         "to": ev.plan.label() if ev.plan else None, "at_step": ev.resumed_step, "steps_lost": ev.steps_lost,
         **{k: round(getattr(ev, k), 2) for k in ("checkpoint_s", "teardown_s", "launch_s", "restore_s",
                                                  "first_step_s", "total_s")}}
        for ev in getattr(drive, "switches", [])
    ]
    s["wall_s"] = round(time.monotonic() - started, 1)
    if args.output == "json":
        print(json.dumps(s, indent=2))
    else:
        print_summary(s)
        for sw in s["switches"]:
            print(f"plan switch of {sw['job_id']}: {sw['from']} -> {sw['to']} at step {sw['at_step']}, "
                  f"{sw['total_s']} s (checkpoint {sw['checkpoint_s']}, teardown {sw['teardown_s']}, launch "
                  f"{sw['launch_s']}, restore {sw['restore_s']}, first step {sw['first_step_s']}), "
                  f"steps lost {sw['steps_lost']}")
        print(f"demo wall time: {s['wall_s']} s")
    torch_ok = not any(is_torch(i.spec) for i in items) or bool(s["switches"])
    return 0 if s["failed"] == 0 and s["completed"] == len(items) and torch_ok else 1


if __name__ == "__main__":
    sys.exit(main())
