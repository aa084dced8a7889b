"""Topology-aware gangs (issue 23 item 1): live against real services, and simulated.

    python -m loadtest.topology [--json] [--skip-sim] [--sim-jobs N]

Live: a real nats-server, the admission service and the optimizer (policy
``fifo``) in this process, and 16 real agents whose ranks are emulated
(``loadtest.fleet``), 8 GPUs each, told their topology path (``--topology``):
4 racks x 4 nodes, 2 NVLink domains of 2 nodes per rack
(``rack=r1/nvlink-domain=r1d0``). Fillers of 6 GPUs leave 2 GPUs free on each of
the first three nodes, so a placement in node order crosses racks. Then:

- ``rackA`` and ``rackB`` (16 GPUs, ``topology: {required: rack}``) start, and are
  each resized and switched 6 times by the operator's ``gs.optimizer.reconfigure``
  (DP 24, 8, 32, 12, 20, 16): a pin fills nodes in name order, so each of these
  generations is one the topology step must move into a rack;
- ``nvl`` (16 GPUs, ``topology: {preferred: nvlink-domain}``) starts, is resized
  to 8 and back to 16, and ``nvl2`` (16 GPUs, preferred the same) starts when no
  NVLink domain has two free nodes any more;
- the blocks and ``nvl2`` are cancelled, and ``wide`` (40 GPUs, required ``rack``:
  more than a rack holds, fewer than the cluster has free) waits, and
  ``gs.optimizer.explain`` says it waits for topology.

Checks (``ok``): every generation of the rack jobs (each ``job.scheduled`` /
``job.reconfigured`` event) lies in one rack, and each has >= 5 switches and
resizes; every grant of a job preferring ``nvlink-domain`` made when an NVLink
domain had room for its shape (the records just before it, its own GPUs counted
free) lies in one domain; a grant made when none had room still runs; ``wide``
waits and explain says "waits for topology". Every step waits on an observable
event (the job's record at its new generation, running), never on a fixed sleep.

Simulated: rubick on ``rubick-base`` with the same topology (16 nodes x 8 GPUs,
``rack=4,nvlink-domain=2``) and cross-rack bandwidth a quarter of in-rack
(``--bandwidth cluster=0.25``), topology-aware against the same rubick placing
flat (``--topology-flat``), for each of ``--seeds`` (default 0-4), in two child
processes while the live part runs. Checks: the aware runs' mean average JCT is
lower, and on every seed they lose fewer GPU-hours to slow links
(``topology_slow_gpu_h``: each grant's held GPU-time x (1 - 1/its slowdown)).
One run's JCT moves by several per cent with any change of rubick's decisions
(its rounds react to every finish), more than topology can move it here: flat
loses only 1-2% of the GPU-time to slow links (14-22 of ~1,265 GPU-hours) and
aware about a third of that; most gangs that must cross racks (5-6 nodes) run
plans the fitted model finds insensitive to inter-node bandwidth (x1.01), and the
ones that pay (2-node DP, 8-node 3D, x1.2-1.7) are few. Hence the mean over seeds
for JCT, and the per-seed check on what placement controls. Per seed: average
and median JCT, slow GPU-hours, and the spans of each run's grants.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gearshift.bus.client import call, connect
from gearshift.bus.infra import ensure_infra
from gearshift.bus.natsd import NatsServer
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    ExplainReply, JobRecord, JobReconfigured, JobScheduled, NodeShare, Plan, ReconfigureReply, ReconfigureRequest, SubmitReply,
    SubmitRequest,
)
from gearshift.bus_schema.topology import group_key, parse_path
from loadtest.fleet import Fleet

MODEL = {"name": "gpt2", "params": 124, "layers": 12, "hidden": 768, "seq_len": 1024}
RACKS, NODES_PER_RACK, GPUS = 4, 4, 8
RESIZES = (24, 8, 32, 12, 20, 16)
SIM_ARGS = ["--trace", "rubick-base", "--policies", "rubick", "--cluster", "16x8", "--topology",
            "rack=4,nvlink-domain=2", "--bandwidth", "cluster=0.25", "-o", "json", "--no-progress"]


def paths(names: list[str]) -> dict[str, str]:
    out = {}
    for i, n in enumerate(names):
        r, d = i // NODES_PER_RACK, (i % NODES_PER_RACK) // 2
        out[n] = f"rack=r{r}/nvlink-domain=r{r}d{d}"
    return out


LAST_EXPLAIN: list[str] = []
NC: list[Any] = []  # what explain said when a wait timed out


async def until(pred: Any, timeout: float, what: str, step: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = await pred()
        if got:
            return got
        await asyncio.sleep(step)
    if NC:
        rep = await call(NC[0], subj.OPTIMIZER_EXPLAIN, None, ExplainReply)
        LAST_EXPLAIN[:] = [f"{e.job_id} {e.state}: {e.reason}" for e in rep.jobs]
    raise TimeoutError(f"{what}: not within {timeout:g} s")


def room(level: str, shape: list[int], free: dict[str, int], topo: dict[str, tuple]) -> bool:
    """Does some group of ``level`` have nodes with room for ``shape`` (GPUs per node)?"""
    groups: dict[tuple, list[str]] = {}
    for n, p in topo.items():
        k = group_key(p, level)
        if k is not None:
            groups.setdefault(k, []).append(n)
    for members in groups.values():
        left = sorted((free[n] for n in members), reverse=True)
        if len(left) >= len(shape) and all(f >= g for f, g in zip(left, sorted(shape, reverse=True))):
            return True
    return False


async def live(workdir: Path) -> dict[str, Any]:
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer

    server = NatsServer(workdir / "js")
    server.start()
    nc = fleet = None
    stop = asyncio.Event()
    tasks: list[asyncio.Task] = []
    try:
        nc = await connect(server.url, name="topology", retry_for=10)
        NC[:] = [nc]
        await ensure_infra(nc)
        await start_admission(nc)
        opt = await Optimizer(nc, policy="fifo", interval=0.5, node_timeout=10, lease_ttl=2).open()
        tasks.append(asyncio.create_task(opt.run(stop)))
        names = [f"fleet-{i:05d}" for i in range(RACKS * NODES_PER_RACK)]
        text = paths(names)
        topo = {n: parse_path(t) for n, t in text.items()}
        events: list[Any] = []

        async def on_event(msg: Any) -> None:
            events.append(codec.decode_event(msg.data))

        await nc.subscribe("gs.evt.job.>", cb=on_event)
        fleet = await Fleet(nc, len(names), GPUS, heartbeat=0.5, progress_interval=0.5, grace=1.0,
                            workdir=str(workdir / "fleet"), topology=text).start()

        async def submit(name: str, gpus: int, topology: dict | None = None) -> str:
            spec = {"name": name, "model": MODEL, "global_batch": 960, "steps": 10**7, "gpus": gpus,
                    "plan": {"dp": gpus}, "step_time": 0.05, "topology": topology}
            req = codec.decode(json.dumps({"spec": spec}).encode(), SubmitRequest)
            return (await call(nc, subj.ADMISSION_SUBMIT, req, SubmitReply)).job_id

        async def get(job: str) -> JobRecord:
            return await call(nc, subj.ADMISSION_GET, {"job_id": job}, JobRecord)

        async def running(job: str, generation: int = 1) -> JobRecord | None:
            r = await get(job)
            return r if r.state.value == "running" and r.generation >= generation else None

        async def free_without(job: str | None) -> dict[str, int]:
            free = {n: GPUS for n in names}
            recs = await call(nc, subj.ADMISSION_LIST, {})
            for r in recs.jobs:
                if r.job_id != job and r.state.value in ("scheduled", "running"):
                    for p in r.placement:
                        free[p.node] -= len(p.gpus)
            return free

        async def all_nodes() -> bool:
            got = await call(nc, subj.ADMISSION_NODES, None)
            return sum(1 for n in got.nodes if n.topology) == len(names)

        await until(all_nodes, 60, "every node reporting its topology")
        fillers = [await submit(f"filler{i}", 6) for i in range(3)]
        for f in fillers:
            await until(lambda: running(f), 60, f"{f} running")
        ids = {"rackA": await submit("rackA", 16, {"required": "rack"})}
        await until(lambda: running(ids["rackA"]), 60, "rackA running")
        ids["rackB"] = await submit("rackB", 16, {"required": "rack"})
        await until(lambda: running(ids["rackB"]), 60, "rackB running")
        grants_nvl: list[dict[str, Any]] = []

        async def grant_nvl(name: str, action: Any, generation: int) -> None:
            """Run ``action`` (a submit or a resize of ``name``), noting whether an NVLink
            domain had room for it just before."""
            job = ids.get(name)
            before = await free_without(job)
            job = await action()
            ids[name] = job
            rec = await until(lambda: running(job, generation), 60, f"{name} generation {generation}")
            shape = [len(p.gpus) for p in rec.placement]
            had = room("nvlink-domain", shape, before, topo)
            inside = len({group_key(topo[p.node], "nvlink-domain") for p in rec.placement}) == 1
            grants_nvl.append({"job": name, "generation": rec.generation, "shape": shape, "domain_had_room": had,
                               "in_one_domain": inside, "nodes": [p.node for p in rec.placement]})

        async def pin(job: str, gpus: int, node: str | None = None) -> None:
            """The operator's resize to DP ``gpus`` (on ``node``); returns when the job runs it."""
            gen = (await get(job)).generation
            where = [NodeShare(node=node, gpus=gpus)] if node else []
            await call(nc, subj.OPTIMIZER_RECONFIGURE, ReconfigureRequest(
                job_id=job, plan=Plan(dp=gpus), placement=where, reason="loadtest.topology"), ReconfigureReply)

            async def there() -> JobRecord | None:
                r = await running(job, gen + 1)
                return r if r is not None and r.plan is not None and r.plan.gpus == gpus else None

            await until(there, 60, f"{job} at DP{gpus}")

        async def resize_to(name: str, gpus: int) -> str:
            await pin(ids[name], gpus)
            return ids[name]

        await grant_nvl("nvl", lambda: submit("nvl", 16, {"preferred": "nvlink-domain"}), 1)
        for gpus in RESIZES:
            for name in ("rackA", "rackB"):
                await resize_to(name, gpus)
        gen = (await get(ids["nvl"])).generation
        await grant_nvl("nvl", lambda: resize_to("nvl", 8), gen + 1)
        await grant_nvl("nvl", lambda: resize_to("nvl", 16), gen + 2)
        # an 8-GPU block pinned on one node of every NVLink domain with two free nodes: none has room
        free = await free_without(None)
        blocks = []
        for i in range(0, len(names), 2):
            a_, b_ = names[i], names[i + 1]
            if free[a_] == GPUS and free[b_] == GPUS:
                blocks.append(await submit(f"block{i}", GPUS))
                rec = await until(lambda: running(blocks[-1]), 60, f"block{i} running")
                if rec.placement[0].node not in (a_, b_):
                    await pin(blocks[-1], GPUS, b_)
                free = await free_without(None)
        await grant_nvl("nvl2", lambda: submit("nvl2", 16, {"preferred": "nvlink-domain"}), 1)
        for job in (*blocks, ids["nvl2"]):  # room for 40 GPUs, though no rack has it
            await call(nc, subj.ADMISSION_CANCEL, {"job_id": job}, JobRecord)
        wide = await submit("wide", 40, {"required": "rack"})

        async def explained() -> str | None:
            rep = await call(nc, subj.OPTIMIZER_EXPLAIN, None, ExplainReply)
            got = [e.reason for e in rep.jobs if e.job_id == wide]
            return got[0] if got and "waits for topology" in got[0] else None

        why = await until(explained, 30, "explain of wide")
        wide_rec = await get(wide)
        await asyncio.sleep(0)  # the last events reach the subscription in order (same connection)
        await nc.flush()
        gens = {}
        ok = True
        for name in ("rackA", "rackB"):
            evs = [e for e in events if isinstance(e, (JobScheduled, JobReconfigured)) and e.job_id == ids[name]]
            racks = [sorted({group_key(topo[p.node], "rack")[-1][1] for p in e.placement}) for e in evs]
            switches = sum(isinstance(e, JobReconfigured) for e in evs)
            one = all(len(r) == 1 for r in racks)
            gens[name] = {"generations": len(evs), "switches_and_resizes": switches, "racks": racks,
                          "gpus": [sum(len(p.gpus) for p in e.placement) for e in evs], "one_rack_each": one}
            ok &= one and switches >= 5
        for g in grants_nvl:
            ok &= g["in_one_domain"] or not g["domain_had_room"]
        ok &= any(g["domain_had_room"] for g in grants_nvl) and any(not g["domain_had_room"] for g in grants_nvl)
        ok &= wide_rec.state.value == "pending" and why is not None
        return {"ok": bool(ok), "rack_jobs": gens, "nvlink_preferred_grants": grants_nvl,
                "wide": {"state": wide_rec.state.value, "explain": why}}
    finally:
        stop.set()
        if fleet is not None:
            for agent in list(fleet.agents.values()):
                agent.grace = 0.5
                try:
                    await asyncio.wait_for(agent.stop(), 20)
                except Exception:
                    pass
        for t in tasks:
            try:
                await asyncio.wait_for(t, 20)
            except BaseException:
                t.cancel()
        if nc is not None:
            await nc.close()
        server.stop()


def simulate(flat: bool, jobs: int | None, seed: int = 0) -> dict[str, Any]:
    """One ``sim.cli`` run (aware, or flat) in a child process: its summary."""
    import contextlib
    import io

    from gearshift.sim import cli

    out = io.StringIO()
    argv = SIM_ARGS + ["--seed", str(seed)] + (["--topology-flat"] if flat else []) + \
        (["--jobs", str(jobs)] if jobs else [])
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    if rc != 0:
        return {"error": f"sim.cli exited {rc}"}
    r = json.loads(out.getvalue())["results"][0]
    return {k: r.get(k) for k in ("avg_jct_s", "median_jct_s", "makespan_s", "finished", "reconfigurations",
                                  "topology_spans", "topology_slow_gpu_h")}


def compare(runs: dict[str, list[dict[str, Any]]], seeds: list[int]) -> dict[str, Any]:
    """The simulated check: aware's mean average JCT over the seeds below flat's, and on
    every seed fewer GPU-hours lost to slow links (what topology-awareness controls; one
    seed's JCT also moves with every other change of rubick's rounds)."""
    def mean(k: str, key: str) -> float | None:
        got = [r.get(key) for r in runs[k]]
        return sum(got) / len(got) if got and all(g is not None for g in got) else None

    jct = {k: mean(k, "avg_jct_s") for k in runs}
    slow = {k: [r.get("topology_slow_gpu_h") for r in rs] for k, rs in runs.items()}
    per_seed = [{"seed": s, "avg_jct_s": {k: runs[k][i].get("avg_jct_s") for k in runs},
                 "median_jct_s": {k: runs[k][i].get("median_jct_s") for k in runs},
                 "slow_gpu_h": {k: slow[k][i] for k in runs}} for i, s in enumerate(seeds)]
    fewer_slow = all(a is not None and f is not None and a < f for a, f in zip(slow["aware"], slow["flat"]))
    ok = jct["aware"] is not None and jct["flat"] is not None and jct["aware"] < jct["flat"] and fewer_slow
    wins = sum(1 for p in per_seed if None not in p["avg_jct_s"].values()
               and p["avg_jct_s"]["aware"] < p["avg_jct_s"]["flat"])
    return {"ok": bool(ok), "args": " ".join(SIM_ARGS), "seeds": seeds, "mean_avg_jct_s": jct,
            "mean_median_jct_s": {k: mean(k, "median_jct_s") for k in runs},
            "mean_slow_gpu_h": {k: mean(k, "topology_slow_gpu_h") for k in runs},
            "aware_fewer_slow_gpu_h_every_seed": fewer_slow, "aware_lower_avg_jct_seeds": wins,
            "aware_over_flat": jct["aware"] / jct["flat"] if jct["aware"] and jct["flat"] else None,
            "per_seed": per_seed, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.topology", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--skip-sim", action="store_true", help="the live part only")
    ap.add_argument("--skip-live", action="store_true", help="the simulated part only")
    ap.add_argument("--sim-jobs", type=int, help="only the first N jobs of rubick-base")
    ap.add_argument("--seeds", default="0,1,2,3,4",
                    help="simulation seeds (noise, restarts); the check compares the mean over them (default 0-4)")
    ap.add_argument("--log-level", default="WARNING")
    a = ap.parse_args(argv)
    from gearshift.bus.log import configure_logging

    configure_logging("json", a.log_level)
    out: dict[str, Any] = {}
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--seeds: {a.seeds!r} is not a comma-separated list of integers")
    if not seeds:
        ap.error("--seeds: give at least one seed")
    with concurrent.futures.ProcessPoolExecutor(2) as pool:
        sims = {} if a.skip_sim else {(k, s): pool.submit(simulate, k == "flat", a.sim_jobs, s)
                                      for s in seeds for k in ("aware", "flat")}
        if not a.skip_live:
            with tempfile.TemporaryDirectory(prefix="gearshift-topology-") as d:
                try:
                    out["live"] = asyncio.run(live(Path(d)))
                except Exception as exc:
                    out["live"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "explain": LAST_EXPLAIN}
        if sims:
            got = {k: f.result() for k, f in sims.items()}
            runs = {k: [got[(k, s)] for s in seeds] for k in ("aware", "flat")}
            out["sim"] = compare(runs, seeds)
    out["ok"] = all(part.get("ok") for part in out.values()) and bool(out)
    print(json.dumps(out, indent=None if a.json else 1))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
