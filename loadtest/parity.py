"""Live vs simulated: one scripted trace through the real optimizer and through the simulator.

    python -m loadtest.parity --json

Live: a real ``nats-server``, the real admission service and ``Optimizer`` (policy
rubick, its ``LearningOracle`` fed from run reports), and emulated agents: this
driver plays the agents, publishing STARTED / STEPPED / EXITED run reports on the
real ``GS_REPORTS`` stream (and handing each to the optimizer's report handler at once,
so virtual time cannot overtake it), with speeds from the simulator's own ground truth
(``sim.truth.GroundTruth``, same seed) for the plan and placement the optimizer
chose. Time is virtual: the optimizer's and admission's clock is the driver's
(injected, not slept), so the result does not depend on how busy the machine is.

Simulated: ``sim.engine.Simulator`` on the same trace, cluster, policy options and
truth, with rounds on the same grid (no event rounds: the live optimizer is driven
on the grid too).

A round agrees when both decided the same thing for every job: which jobs run, and
each one's plan and GPU count (node names differ between the two). Each
disagreement is listed with its cause, found by comparing what the two policies
were shown that round (the jobs, their progress, their holdings) and the oracle's
learning state.

Known, modelled difference (not a bug): live, GPUs that a reconfigured job gives up are
handed to another job only once the old generation has exited (the gang barrier; the
optimizer says "waiting for GPUs that other jobs are still releasing"), one round later;
the simulator frees and grants them in the same instant. A job started on such GPUs
finishes one round later live, which shows up as "different live jobs" (on the default
trace: vit-20, placed at t=8040 on GPUs roberta-18 gives up, finishes at 8160.6 simulated
and at 8280.5 live).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import msgspec

from gearshift.bus.clock import ManualClock
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    GpuReport,
    JobRecord,
    JobState,
    NodeReport,
    RunReport,
    RunReportKind,
    SubmitReply,
)
from gearshift.services.capacity import placement_of
from gearshift.sim.engine import SimConfig, Simulator
from gearshift.sim.loaders import load_named
from gearshift.sim.trace import Trace, TraceJob, parse_cluster

ACTIVE = (JobState.SCHEDULED, JobState.RUNNING)


def scripted_trace(jobs: int = 14, max_run_s: float = 2400.0) -> Trace:
    """The first ``jobs`` Rubick base jobs that fit one 8-GPU node, their steps cut so
    each runs at most ``max_run_s`` at its request's speed, on a 2x8 cluster."""
    base = load_named("rubick-base")
    out = []
    for j in base.jobs:
        if len(out) == jobs:
            break
        if j.spec.gpus > 8:
            continue
        steps = max(5, min(j.spec.steps, int(max_run_s / max(j.spec.step_time, 1e-3))))
        out.append(TraceJob(j.job_id, j.submit - base.jobs[0].submit, msgspec.structs.replace(j.spec, steps=steps),
                            truth_key=j.truth_key))
    return Trace("parity", out, parse_cluster("2x8:96"))


def _summary(decision, name_of=lambda j: j) -> dict[str, tuple]:
    return {name_of(j): (d.plan.label(), sum(p.gpus for p in d.placement), len(d.placement))
            for j, d in decision.allocations.items()}


# ------------------------------------------------------------------ simulated side
def run_sim(trace: Trace, cfg: SimConfig, predictor, truth_predictor, policy_options: dict):
    from gearshift.policies.registry import make_policy

    pol = make_policy("rubick", **policy_options)
    rounds: dict[float, dict] = {}
    inputs: dict[float, dict] = {}
    orig = pol.schedule

    def schedule(now, nodes, jobs, perf):
        d = orig(now, nodes, jobs, perf)
        rounds[now] = _summary(d)
        inputs[now] = {j.job_id: (round(j.steps_done), j.running) for j in jobs}
        return d

    pol.schedule = schedule
    sim = Simulator(trace, pol, None, cfg, predictor, None, truth_predictor)
    res = sim.run()
    return rounds, inputs, res, sim


# ------------------------------------------------------------------ live side
class Driver:
    """The emulated agents and the virtual clock around a real optimizer."""

    def __init__(self, trace: Trace, cfg: SimConfig, truth, nc, opt, clock: ManualClock, restart_cost: float):
        self.trace, self.cfg, self.truth, self.nc, self.opt, self.clock = trace, cfg, truth, nc, opt, clock
        self.restart = restart_cost
        self.by_name = {j.job_id: j for j in trace.jobs}
        self.ids: dict[str, str] = {}  # trace name -> live job id
        self.names: dict[str, str] = {}
        self.run: dict[str, dict] = {}  # live id -> state of the generation the agents run
        self.events: list[tuple[float, int, str, str]] = []  # (time, seq, kind, job)
        self.seq = 0
        self.done: set[str] = set()

    async def nodes(self) -> None:
        kv = await self.nc.jetstream().key_value(subj.NODES_BUCKET)
        c = self.trace.cluster
        for i in range(c.nodes):
            rep = NodeReport(node=f"n{i}", ts=self.clock.now(), cpus=c.cpus_per_node,
                             gpus=[GpuReport(index=g, uuid=f"GPU-{i}-{g}") for g in range(c.gpus_per_node)])
            await kv.put(f"n{i}", codec.encode(rep))

    async def submit(self, j: TraceJob) -> None:
        from gearshift.bus.client import call

        spec = msgspec.to_builtins(msgspec.structs.replace(j.spec, name=j.job_id))
        rep = await call(self.nc, subj.ADMISSION_SUBMIT, json.dumps({"spec": spec}).encode(), SubmitReply)
        self.ids[j.job_id] = rep.job_id
        self.names[rep.job_id] = j.job_id

    async def report(self, job_id: str, gen: int, node: str, kind: RunReportKind, **kw) -> None:
        r = RunReport(job_id=job_id, generation=gen, node=node, kind=kind, ts=self.clock.now(), **kw)
        await self.nc.jetstream().publish(subj.run_report(node, job_id), codec.encode(r),
                                          headers={"Nats-Msg-Id": f"{node}:{job_id}:{gen}:{kind.value}"})
        # Applied in order, now, by the optimizer's own report handler (what its
        # GS_REPORTS consumer calls), so the virtual clock cannot run ahead of it.
        async with self.opt._round_lock:
            await self.opt.apply_report(r)
        self.sent += 1

    def _push(self, t: float, kind: str, jid: str) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, jid))

    def _progress(self, st: dict, t: float) -> float:
        if st["rate"] <= 0 or t <= st["from"]:
            return st["steps0"]
        return min(st["steps"], st["steps0"] + (t - st["from"]) * st["rate"])

    async def after_round(self, records: dict[str, JobRecord]) -> None:
        """The agents act on the optimizer's new allocations."""
        t = self.clock.now()
        self.sent = 0
        for jid, rec in records.items():
            st = self.run.get(jid)
            if st is not None and (rec.generation != st["gen"] or rec.state not in ACTIVE):
                # preempted or reconfigured: the old generation checkpoints and exits
                done = self._progress(st, t)
                for node in st["nodes"]:
                    await self.report(jid, st["gen"], node, RunReportKind.EXITED, stopped=True, steps_done=int(done), progress_step=int(done),
                                      checkpoint_step=int(done), rank0=node == st["nodes"][0])
                st["steps_done"] = done
                self.base_steps[jid] = done
                del self.run[jid]
        await self._settle(records)
        records = {r.job_id: r for r, _ in await self.opt.store.all()}
        for jid, rec in records.items():
            if rec.state in ACTIVE and jid not in self.run and not rec.draining:
                tj = self.by_name[self.names[jid]]
                placement = placement_of(rec)
                step_time, _ = self.truth.step_time(tj, rec.plan, placement)
                steps0 = self.base_steps.get(jid, 0.0)
                st = {"gen": rec.generation, "nodes": [p.node for p in rec.placement], "steps": tj.spec.steps,
                      "steps0": steps0, "from": t + self.restart, "rate": 1.0 / step_time if step_time > 0 else 0.0,
                      "step_time": step_time}
                self.run[jid] = st
                await self.report(jid, rec.generation, st["nodes"][0], RunReportKind.STARTED, launched_at=t)
                if st["rate"] > 0:
                    # rank 0 reports STEPPED when its first step is done
                    self._push(st["from"] + step_time, f"stepped:{rec.generation}", jid)
                    self._push(st["from"] + (tj.spec.steps - steps0) / st["rate"], f"done:{rec.generation}", jid)
                else:
                    self._push(st["from"], f"oom:{rec.generation}", jid)
        await self._settle(None)

    async def publish_progress(self) -> None:
        """Rank 0's progress line (``gs.job.<id>.progress``), as agents publish it."""
        from gearshift.bus_schema.messages import JobProgress

        t = self.clock.now()
        want = {}
        for jid, st in self.run.items():
            steps = int(self._progress(st, t))
            want[jid] = (st["gen"], steps)
            p = JobProgress(job_id=jid, generation=st["gen"], node=st["nodes"][0], ts=t, steps_done=steps,
                            steps=st["steps"])
            await self.nc.publish(subj.job_progress(jid), codec.encode(p))
        await self.nc.flush()
        for _ in range(500):  # the optimizer's subscription runs on this loop: let it catch up
            if all(self.opt.progress.get(j) == w for j, w in want.items()):
                break
            await asyncio.sleep(0.01)

    async def _settle(self, _records) -> None:
        """Reports are applied as they are sent (``report``); nothing to wait for."""
        self.sent = 0

    async def advance(self, until: float) -> None:
        """Agents' events (first steps, completions, OOM exits) up to ``until``."""
        self.sent = 0
        while self.events and self.events[0][0] <= until + 1e-9:
            t, _, kind, jid = heapq.heappop(self.events)
            what, gen = kind.split(":")
            st = self.run.get(jid)
            if st is None or st["gen"] != int(gen):
                continue
            self.clock.t = max(self.clock.t, t)
            node = st["nodes"][0]
            if what == "stepped":
                await self.report(jid, st["gen"], node, RunReportKind.STEPPED, start_step=int(st["steps0"]),
                                  launched_at=st["from"] - self.restart, restore_s=self.restart,
                                  first_step_s=st["step_time"])
            elif what == "done":
                for n in st["nodes"]:
                    await self.report(jid, st["gen"], n, RunReportKind.EXITED, exit_code=0, steps_done=st["steps"],
                                      progress_step=st["steps"], rank0=n == node)
                del self.run[jid]
                self.done.add(jid)
            elif what == "oom":
                await self.report(jid, st["gen"], node, RunReportKind.EXITED, exit_code=1,
                                  message="torch.OutOfMemoryError: CUDA out of memory", steps_done=int(st["steps0"]))
                del self.run[jid]
            await self._settle(None)
        self.clock.t = max(self.clock.t, until)


async def run_live(trace: Trace, cfg: SimConfig, truth, policy_options: dict, grid: list[float], data_dir: Path,
                   verbose: bool = False):
    from gearshift.bus.client import connect
    from gearshift.bus.infra import ensure_infra
    from gearshift.bus.natsd import NatsServer
    from gearshift.services.admission import start_admission
    from gearshift.services.optimizer import Optimizer

    # The virtual clock, injected into admission and the optimizer, which hand it to
    # every part that stamps a time (records, allocations, events, the policy's now):
    # a wall-clock stamp there made the live policy see a job switched in the future,
    # pinned forever.
    clock = ManualClock()
    if verbose:
        import signal

        def dump(*_):
            for task in asyncio.all_tasks():
                task.print_stack(file=sys.stderr)

        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    server = NatsServer(data_dir / "js")
    server.start()
    nc = await connect(server.url, name="parity", retry_for=5)
    rounds: dict[float, dict] = {}
    inputs: dict[float, dict] = {}
    try:
        await ensure_infra(nc)
        _, svc = await start_admission(nc, clock=clock)
        # learn_every=0: the simulator teaches its oracle each observation at once, and the
        # two sides are compared on the same inputs (the live default holds lessons 10 s)
        opt = await Optimizer(nc, policy="rubick", interval=1e9, policy_options=policy_options,
                              max_retries=10_000, node_timeout=1e12, clock=clock, learn_every=0.0).open()
        # what Optimizer._lead does on taking the lease: fence the buckets it writes
        # (every allocation write carries the epoch), then subscribe to progress
        await opt.leadership.fence.take()  # what leading does: its writes carry the epoch
        opt.store.fence = opt.leadership.fence
        opt.is_leader = True
        await nc.subscribe("gs.job.*.progress", cb=opt.on_progress)  # what _lead subscribes to
        opt.leader_since = time.monotonic()
        from gearshift.policies.kernels import warm_up

        await asyncio.to_thread(warm_up)
        drv = Driver(trace, cfg, truth, nc, opt, clock, cfg.restart_cost)
        drv.sent, drv.base_steps = 0, {}
        pol_orig = opt.policy.schedule

        def schedule(now, nodes, jobs, perf):
            d = pol_orig(now, nodes, jobs, perf)
            rounds[now] = _summary(d, lambda j: drv.names.get(j, j))
            inputs[now] = {drv.names.get(j.job_id, j.job_id): (round(j.steps_done), j.running) for j in jobs}
            return d

        opt.policy.schedule = schedule
        arrivals = sorted(trace.jobs, key=lambda j: j.submit)
        nxt = 0
        for t in grid:
            # arrivals and agent events before this grid point, in time order
            while nxt < len(arrivals) and arrivals[nxt].submit <= t:
                await drv.advance(arrivals[nxt].submit)
                clock.t = arrivals[nxt].submit
                await drv.nodes()  # the agents' heartbeats: admission sizes jobs by the live nodes
                await drv.submit(arrivals[nxt])
                nxt += 1
            await drv.advance(t)
            clock.t = t
            if len(drv.done) == len(trace.jobs):
                break
            live = nxt > len(drv.done)
            if not live:
                continue
            await drv.nodes()
            await drv.publish_progress()
            if verbose:
                print(f"parity: live round at t={t:.0f}, {len(drv.done)}/{len(trace.jobs)} done", file=sys.stderr,
                      flush=True)
            await opt.round()
            records = {r.job_id: r for r, _ in await opt.store.all()}
            await drv.after_round(records)
        opt.is_leader = False
        await svc.stop()
        return rounds, inputs, len(drv.done)
    finally:
        try:
            await asyncio.wait_for(nc.close(), 10)
        except Exception:  # noqa: BLE001 - the server goes next anyway; never mask the real error
            pass
        server.stop()


# ------------------------------------------------------------------ comparison
def compare(sim_rounds, sim_inputs, live_rounds, live_inputs, tol_steps: float = 0.02) -> dict:
    times = sorted(set(sim_rounds) | set(live_rounds))
    agree, diffs = 0, []
    for t in times:
        a, b = sim_rounds.get(t), live_rounds.get(t)
        if a == b:
            agree += 1
            continue
        if a is None or b is None:
            cause = f"round only {'live' if a is None else 'simulated'} (the other side had no live job then)"
        else:
            ia, ib = sim_inputs.get(t, {}), live_inputs.get(t, {})
            prog = [j for j in set(ia) & set(ib) if ia[j][1] == ib[j][1] and abs(ia[j][0] - ib[j][0]) > 1]
            held = [j for j in set(ia) & set(ib) if ia[j][1] != ib[j][1]]
            if set(ia) != set(ib):
                cause = "different live jobs (a completion or arrival seen at a different time)"
            elif held:
                cause = f"different holdings going in (carried over from an earlier differing round): {sorted(held)[:4]}"
            elif prog:
                cause = ("the live record learns a running job's progress only when a generation exits; the "
                         f"simulator's view is exact: {sorted(prog)[:4]}")
            else:
                cause = "same inputs, different decision: the oracle's learning state differs (see the two decisions)"
        jobs = sorted(set(a or {}) | set(b or {}))
        diffs.append({"t": t, "cause": cause,
                      "jobs": {j: {"sim": (a or {}).get(j), "live": (b or {}).get(j)} for j in jobs
                               if (a or {}).get(j) != (b or {}).get(j)}})
    n = len(times)
    return {"rounds": n, "agree": agree, "agree_share": agree / n if n else math.nan, "disagreements": diffs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.parity", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--jobs", type=int, default=14)
    ap.add_argument("--interval", type=float, default=120.0)
    ap.add_argument("--restart-cost", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = ap.parse_args(argv)
    from gearshift.bus.log import configure_logging

    configure_logging("json", "ERROR")  # stdout carries the report only; log lines go to stderr
    from gearshift.sim.perfmodel_bridge import find_predictor

    trace = scripted_trace(args.jobs)
    cfg = SimConfig(interval=args.interval, restart_cost=args.restart_cost, seed=args.seed, regime="extended",
                    round_on_arrival=False, round_on_completion=False)
    predictor = find_predictor(8)
    truth_predictor = find_predictor(8, "in_sample")
    options = {"restart_cost": args.restart_cost}
    t0 = time.perf_counter()
    sim_rounds, sim_inputs, res, sim = run_sim(trace, cfg, predictor, truth_predictor, options)
    if args.verbose:
        print(f"parity: simulated {len(sim_rounds)} rounds in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    grid = sorted(sim_rounds)
    end = max(grid) if grid else 0.0
    grid = [k * args.interval for k in range(int(end // args.interval) + 40)]
    with tempfile.TemporaryDirectory(prefix="gs-parity-") as d:
        live_rounds, live_inputs, finished = asyncio.run(
            run_live(trace, cfg, sim.truth, options, grid, Path(d), args.verbose))
    rep = compare(sim_rounds, sim_inputs, live_rounds, live_inputs)
    causes: dict[str, int] = {}
    for x in rep["disagreements"]:
        key = x["cause"].split(":")[0]
        causes[key] = causes.get(key, 0) + 1
    out = {
        "trace": f"rubick-base first {args.jobs} jobs, steps cut to <= 40 min, cluster 2x8:96",
        "policy": "rubick", "regime": "extended", "interval_s": args.interval, "restart_cost_s": args.restart_cost,
        "jobs": len(trace.jobs), "finished_sim": sum(1 for r in res.records if r.finish is not None),
        "finished_live": finished, **{k: rep[k] for k in ("rounds", "agree", "agree_share")},
        "pass": bool(rep["agree_share"] >= 0.95), "causes": causes, "disagreements": rep["disagreements"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        print(f"{out['agree']}/{out['rounds']} rounds agree ({100 * out['agree_share']:.1f}%); causes: {causes}")
    return 0 if out["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
