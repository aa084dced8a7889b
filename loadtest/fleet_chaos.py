"""Fleet chaos: 500 emulated agents, 10 % of them killed mid-run.

    python -m loadtest.fleet_chaos --agents 500 --kill-fraction 0.1 --jobs 1000 --json

Real nats-server, admission and optimizer processes; the fleet emulator
(``loadtest.fleet``) in this process, so agents can be killed outright (kill
-9: no last report, no goodbye, the node's last heartbeat left behind). Jobs
are submitted, and once the cluster is busy the chosen agents die at once,
preferring those that run something. Then every job must still complete:
the optimizer finds the nodes silent by the server's clock, re-queues their
jobs from their last checkpoints, and places them elsewhere.

Checks (``passed``): every acknowledged job completed (0 lost), no job
event published twice and none missing (per-job sequence numbers from the
GS_EVENTS stream), every killed node reported lost, at least one job
re-queued from a killed node.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from nats.js.api import DeliverPolicy

from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import JobList, ListRequest, SubmitReply, SubmitRequest
from loadtest.fleet import Fleet
from loadtest.scale import Procs, Run


async def all_jobs(nc: Any) -> dict[str, Any]:
    out, cursor = {}, None
    while True:
        page = await call(nc, subj.ADMISSION_LIST, ListRequest(all=True, cursor=cursor), JobList, 30)
        out.update({j.job_id: j for j in page.jobs})
        if (cursor := page.next_cursor) is None:
            return out


async def job_events(nc: Any) -> dict[str, list[Any]]:
    js = nc.jetstream()
    info = await js.stream_info(subj.EVENTS_STREAM)
    by_job: dict[str, list[Any]] = defaultdict(list)
    if info.state.messages == 0:
        return by_job
    sub = await js.subscribe("gs.evt.job.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    try:
        while True:
            msg = await sub.next_msg(timeout=10)
            ev = codec.decode_event(msg.data)
            by_job[ev.job_id].append(ev)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return by_job


async def scenario(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    rng = random.Random(a.seed)
    server = NatsServer(workdir / "js")
    server.start()
    env = {**os.environ, "GEARSHIFT_NATS_URL": server.url, "GEARSHIFT_LOG_LEVEL": a.log_level,
           "GEARSHIFT_LOG_FORMAT": "json"}
    procs = Procs()
    nc = fleet = None
    lost_nodes: set[str] = set()
    try:
        nc = await connect(server.url, name="fleet-chaos", retry_for=10)
        await ensure_infra(nc)
        procs.start("admission", ["gearshift.services.admission", "--max-jobs-per-tenant", str(10 * a.jobs)], env,
                    workdir / "admission.log")
        procs.start("optimizer", ["gearshift.services.optimizer", "--policy", a.policy, "--interval", "1",
                                  "--node-timeout", str(a.node_timeout), "--archive-after", "10"], env,
                    workdir / "optimizer.log")
        procs.watch({})
        fleet = await Fleet(nc, a.agents, a.gpus_per_node, heartbeat=a.heartbeat, workdir=str(workdir / "fleet"),
                            grace=2.0).start()

        async def on_lost(msg: Any) -> None:
            lost_nodes.add(msg.subject.split(".")[3])

        sub = await nc.subscribe("gs.evt.node.*.lost", cb=on_lost)  # subj.node_event(node, "node.lost")
        while True:  # the optimizer leads once it answers
            try:
                await nc.request(subj.OPTIMIZER_EXPLAIN, b"", timeout=2)
                break
            except Exception:
                if time.monotonic() - t0 > 240:
                    raise RuntimeError("the optimizer never answered") from None
                await asyncio.sleep(0.5)
        gen = Run(argparse.Namespace(seed=a.seed), a.agents, workdir)
        acked: list[str] = []
        want_busy = min(a.jobs, a.agents) // 2
        victims: list[str] = []
        running_at_kill = runs_killed = 0

        async def kill_now() -> None:
            """The chosen agents die at once, preferring those that run something."""
            nonlocal running_at_kill, runs_killed
            busy = [n for n, ag in fleet.agents.items() if ag.runs]
            idle = [n for n in fleet.agents if n not in set(busy)]
            rng.shuffle(busy)
            rng.shuffle(idle)
            victims.extend((busy + idle)[: max(1, int(a.agents * a.kill_fraction))])
            running_at_kill = fleet.running()
            runs_killed = sum([await fleet.kill(n) for n in victims])

        for i in range(a.jobs):
            reply = await call(nc, subj.ADMISSION_SUBMIT, SubmitRequest(spec=gen.spec(i, a.job_seconds)), SubmitReply, 30)
            acked.append(reply.job_id)
            if not victims and fleet.running() >= want_busy:
                await kill_now()  # mid-submission: on a busy machine jobs may end as fast as they come
        # else once the cluster is busy, or as busy as it gets (the running count past its peak)
        busy_by = time.monotonic() + 120
        peak = 0
        while not victims and time.monotonic() < busy_by:
            now_running = fleet.running()
            if now_running >= want_busy or (peak and now_running < peak):
                break
            peak = max(peak, now_running)
            await asyncio.sleep(0.5)
        if not victims:
            await kill_now()
        killed_at = time.monotonic()
        # every job must finish
        deadline = time.monotonic() + a.deadline
        recs: dict[str, Any] = {}
        while time.monotonic() < deadline:
            recs = await all_jobs(nc)
            if all(j in recs and recs[j].terminal and not recs[j].outbox for j in acked) and set(victims) <= lost_nodes:
                break  # (a killed node is called lost after --node-timeout, also when it ran nothing)
            await asyncio.sleep(2)
        settle_s = time.monotonic() - killed_at
        await sub.unsubscribe()
        events = await job_events(nc)
        dups = gaps = 0
        for j in acked:
            seqs = Counter(e.seq for e in events.get(j, []))
            dups += sum(n - 1 for n in seqs.values() if n > 1)
            gaps += len(set(range(1, max(seqs, default=0) + 1)) - set(seqs))
        states = Counter(recs[j].state.value for j in acked if j in recs)
        lost = [j for j in acked if j not in recs or not recs[j].terminal]
        requeued = [j for j in acked if j in recs and any(
            e.__struct_config__.tag == "job.requeued" and "node lost" in getattr(e, "reason", "")
            for e in events.get(j, []))]
        out = {
            "agents": a.agents, "gpus_per_node": a.gpus_per_node, "jobs": len(acked), "killed_agents": len(victims),
            "running_at_kill": running_at_kill, "runs_killed": runs_killed,
            "killed_nodes_reported_lost": len(set(victims) & lost_nodes),
            "jobs_requeued_after_node_loss": len(requeued), "states": dict(states), "lost_jobs": len(lost),
            "lost": lost[:10], "duplicate_events": dups, "event_gaps": gaps, "settle_s": round(settle_s, 1),
            "peak_rss_mb": {n: round(v / 2**20, 1) for n, v in procs.peak.items()},
            "load_average": [round(x, 2) for x in os.getloadavg()], "wall_s": round(time.monotonic() - t0, 1),
        }
        out["passed"] = (not lost and states.get("completed", 0) == len(acked) and dups == 0 and gaps == 0
                         and out["killed_nodes_reported_lost"] == len(victims) and bool(requeued or runs_killed == 0))
        return out
    finally:
        if fleet is not None:
            await fleet.stop()
        procs.stop()
        if nc is not None:
            await nc.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.fleet_chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=500)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--kill-fraction", type=float, default=0.1)
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--job-seconds", type=float, default=30.0)
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--node-timeout", type=float, default=10.0)
    ap.add_argument("--policy", default="fifo")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds for every job to finish after the kill")
    ap.add_argument("--log-level", default="WARNING")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.agents < 1 or a.jobs < 1 or not 0 < a.kill_fraction < 1:
        ap.error("--agents and --jobs must be positive, --kill-fraction between 0 and 1")
    from gearshift.bus.log import configure_logging

    configure_logging("json", a.log_level)  # the fleet's agents log here
    with tempfile.TemporaryDirectory(prefix="gearshift-fleet-chaos-") as d:
        try:
            out = asyncio.run(scenario(a, Path(d)))
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}", "passed": False}
    print(json.dumps(out, indent=1 if not a.json else None))
    return 0 if out.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
