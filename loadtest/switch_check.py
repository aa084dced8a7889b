"""Plan switches of a real training job through a real local cluster.

    python -m loadtest.switch_check [--json] [--steps 120]

Starts ``LocalCluster`` (nats-server, admission, optimizer, perfmodel, two
agents with two fake GPUs each), submits the PyTorch reference workload
(``agent.reference.train``) as DP1 and forces plan switches with the
operator request ``gs.optimizer.reconfigure`` as training passes given
steps:

    DP1 -> DP2 + ZeRO-1 (one node) -> DP1 + GA2 + GC -> DP2 across both nodes (gang)

Every switch is checkpoint (SIGTERM, agreed step) -> all ranks exit ->
relaunch with the new plan -> resume. It then trains the same job without
interruption (local processes, DP1) and compares the final losses, and reads
the ``job.switched`` events for the switch cost by phase and the steps lost.
Exit status 0 when the relative loss difference is <= 1e-4, no step was lost
and every switch happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from agent import reference
from bus_schema import codec, subjects as subj
from bus_schema.messages import JobProgress, JobState, JobSwitched, Plan, ReconfigureReply, ReconfigureRequest
from gearshift.client import Client
from gearshift.cluster import LocalCluster
from services.runtime import call

PHASES = ("checkpoint_s", "teardown_s", "launch_s", "restore_s", "first_step_s", "total_s")

# (train past this fraction of the steps, then switch to) plan, placement
SCHEDULE = [
    (0.2, Plan(dp=2, zero=1), [("node0", 2)], "DP2+ZeRO-1"),
    (0.45, Plan(dp=1, ga=2, grad_ckpt=True), [("node0", 1)], "DP1+GA2+GC"),
    (0.7, Plan(dp=2), [("node0", 1), ("node1", 1)], "DP2 over 2 nodes (gang)"),
]


async def drive(url: str, steps: int, global_batch: int, log) -> tuple[str, list[JobSwitched], float]:
    client = await Client.connect(url, retry_for=10)
    nc = client.nc
    switched: list[JobSwitched] = []
    progress: dict[str, int] = {"step": 0, "gen": 0}
    try:
        spec = reference.job_spec("switch-check", steps=steps, global_batch=global_batch, gpus=1, plan={"dp": 1})
        reply = await client.submit(codec.convert(spec, __import__("bus_schema.messages", fromlist=["JobSpec"]).JobSpec),
                                    token=f"switch-check-{int(time.time())}")
        job_id = reply.job_id

        async def on_progress(msg):
            p = codec.decode(msg.data, JobProgress)
            if p.generation >= progress["gen"]:
                progress.update(step=p.steps_done, gen=p.generation)

        async def on_switched(msg):
            ev = codec.decode_event(msg.data)
            if isinstance(ev, JobSwitched):
                switched.append(ev)
                log(f"switched to {ev.plan.label() if ev.plan else '?'} at step {ev.resumed_step}: "
                    f"total {ev.total_s:.2f}s (checkpoint {ev.checkpoint_s:.2f} teardown {ev.teardown_s:.2f} "
                    f"launch {ev.launch_s:.2f} restore {ev.restore_s:.2f} first step {ev.first_step_s:.2f})")

        subs = [await nc.subscribe(subj.job_progress(job_id), cb=on_progress),
                await nc.subscribe(subj.job_event(job_id, "job.switched"), cb=on_switched)]
        t0 = time.monotonic()
        pending = list(SCHEDULE)
        while True:
            rec = await client.job(job_id)
            if rec.terminal:
                break
            if pending and rec.state == JobState.RUNNING and len(switched) == len(SCHEDULE) - len(pending) \
                    and progress["gen"] == rec.generation and progress["step"] >= pending[0][0] * steps:
                frac, plan, placement, label = pending.pop(0)
                req = ReconfigureRequest(job_id=job_id, plan=plan,
                                         placement=[{"node": n, "gpus": g} for n, g in placement],  # type: ignore
                                         reason=f"switch_check: {label}")
                req = codec.convert(codec.to_builtins(req), ReconfigureRequest)
                r = await call(nc, subj.OPTIMIZER_RECONFIGURE, req, ReconfigureReply, timeout=5)
                log(f"step {progress['step']}: reconfigure to {label} (generation {r.generation})")
            if time.monotonic() - t0 > 900:
                raise TimeoutError("switch_check did not finish in 15 minutes")
            await asyncio.sleep(0.25)
        await asyncio.sleep(0.5)  # a last event in flight
        for s in subs:
            await s.unsubscribe()
        if rec.state != JobState.COMPLETED:
            raise RuntimeError(f"job ended {rec.state.value}: {rec.reason}")
        return job_id, switched, time.monotonic() - t0
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.switch_check")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    if not reference.have_torch():
        print("switch_check needs torch: pip install -e '.[torch]' (make venv-torch)", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[switch_check] {msg}", file=sys.stderr, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="switch-check-") as tmp:
        with LocalCluster(nodes=2, gpus_per_node=2, cpus_per_node=8, interval=1.0, grace=30.0,
                          data_dir=str(Path(tmp) / "cluster")) as cluster:
            log(f"cluster up at {cluster.url}; logs in {cluster.log_dir}")
            job_id, switched, run_s = asyncio.run(drive(cluster.url, args.steps, args.global_batch, log))
            manifest = json.loads((Path(tmp) / "cluster" / "ckpt" / job_id / "manifest.json").read_text())
        log("training the same job uninterrupted (DP1, local processes)")
        t = time.monotonic()
        base = reference.run_local({"dp": 1}, args.steps, args.global_batch, Path(tmp) / "uninterrupted")
        base_s = time.monotonic() - t
    final, ref = float(manifest["loss"]), float(base["loss"])
    rel = abs(final - ref) / abs(ref)
    lost = sum(ev.steps_lost for ev in switched)
    repeated = sum(max(0, ev.checkpoint_step - ev.resumed_step) for ev in switched)
    per_switch = [
        {"from": ev.from_plan.label() if ev.from_plan else None, "to": ev.plan.label() if ev.plan else None,
         "from_gpus": ev.from_gpus, "gpus": ev.gpus, "nodes": ev.nodes, "at_step": ev.resumed_step,
         "steps_lost": ev.steps_lost, **{k: round(getattr(ev, k), 3) for k in PHASES}}
        for ev in switched
    ]
    mean = {k: round(sum(getattr(ev, k) for ev in switched) / len(switched), 3) for k in PHASES} if switched else {}
    ok = rel <= 1e-4 and lost == 0 and repeated == 0 and len(switched) >= len(SCHEDULE) and manifest["step"] == args.steps
    result = {
        "ok": ok,
        "steps": args.steps,
        "global_batch": args.global_batch,
        "final_loss": final,
        "uninterrupted_final_loss": ref,
        "relative_difference": rel,
        "switches": len(switched),
        "steps_lost": lost,
        "steps_repeated": repeated,
        "switch_cost_mean_s": mean,
        "switch_cost": per_switch,
        "run_s": round(run_s, 1),
        "uninterrupted_s": round(base_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"final loss {final:.10f}  uninterrupted {ref:.10f}  relative difference {rel:.2e}")
        print(f"switches {len(switched)}  steps lost {lost}  repeated {repeated}")
        for s in per_switch:
            print(f"  {s['from']} -> {s['to']} at step {s['at_step']}: " +
                  "  ".join(f"{k[:-2]} {s[k]:.2f}s" for k in PHASES))
        print("mean: " + "  ".join(f"{k[:-2]} {v:.2f}s" for k, v in mean.items()))
        print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
