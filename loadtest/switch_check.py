"""Plan switches of a real training job through a real local cluster, across the plan space.

    python -m loadtest.switch_check [--json] [--every 10] [--margin 10] [--model llama|gpt2|bert]

Starts ``LocalCluster`` (nats-server, admission, optimizer, perfmodel, two
agents with two fake GPUs each), submits the PyTorch reference workload
(``gearshift.agent.reference.train``, through the plan library) pinned to DP1 and forces plan switches with the
operator request ``gs.optimizer.reconfigure``, one every ``--every`` steps::

    DP1 -> DP2+ZeRO-3 -> TP2 -> PP2 (GA2) over 2 nodes -> DP2+ZeRO-3+offload over 2 nodes
        -> DP2+ZeRO-2+GA2+GC -> DP1

Deterministic: switches are requested by step, not by time. The job runs
with ``GEARSHIFT_HOLD_AT`` = the switch steps: on reaching one, its ranks wait
for the stop request, so each switch happens exactly at its step however slow
the machine is, and the job (``--margin`` steps past the last switch) cannot
end first.

Both run on the plan library (``agent/torchplan``: DDP/FSDP2/DTensor/pipelining,
offload as FSDP2's CPUOffloadPolicy, one Distributed Checkpoint): the restore
parts include the DCP load (``dcp_load_s``) and each checkpoint's DCP save is
reported. ``--model llama`` (or ``gpt2``, ``bert``) runs a tiny Hugging Face
model (``gearshift.agent.torchplan.train``) instead of the reference model; for
GPT-2 (no TP plan: fused q/k/v) DP2+ZeRO-2+GC where the others run TP2.

Every switch is checkpoint (SIGTERM, agreed step) -> all ranks exit ->
relaunch with the new plan -> resharded restore -> first step. Then it
trains the same job uninterrupted twice (local processes: DP1, and TP2 for
the spread that TP's reduction order alone causes) and compares every step's
loss (``GEARSHIFT_LOSS_LOG``): before any TP/PP plan ran, to 1e-6 relative;
from the first TP/PP plan on, to max(1e-3, the DP1-vs-TP2 spread). It reads
the ``job.switched`` events for the switch cost by phase and the steps lost.
Exit status 0 when every switch happened at its step, no step was lost or
repeated, and the losses are within tolerance.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from gearshift.agent import reference, torchplan
from gearshift.bus.client import call
from gearshift.bus_schema import codec
from gearshift.bus_schema import subjects as subj
from gearshift.bus_schema.messages import (
    JobProgress,
    JobSpec,
    JobState,
    JobSwitched,
    Plan,
    ReconfigureReply,
    ReconfigureRequest,
)
from gearshift.client import Client
from gearshift.cluster import LocalCluster

PHASES = ("checkpoint_s", "teardown_s", "launch_s", "restore_s", "first_step_s", "total_s")
START = (Plan(dp=1), [("node0", 1)], "DP1")
# switch to: plan, placement, label
SCHEDULE = [
    (Plan(dp=2, zero=3), [("node0", 2)], "DP2+ZeRO-3"),
    (Plan(tp=2), [("node0", 2)], "TP2"),
    (Plan(pp=2, ga=2), [("node0", 1), ("node1", 1)], "PP2+GA2 over 2 nodes"),
    (Plan(dp=2, zero=3, offload=True), [("node0", 1), ("node1", 1)], "DP2+ZeRO-3+offload over 2 nodes"),
    (Plan(dp=2, zero=2, ga=2, grad_ckpt=True), [("node1", 2)], "DP2+ZeRO-2+GA2+GC"),
    START,
]
EXACT, REORDERED = 1e-6, 1e-3
# the plan library's Hugging Face models (agent/torchplan)
HF_MODELS = ("llama", "gpt2", "bert")


def schedule_for(model: str) -> list:
    """The switches run for ``model``: the same for every model (each runs DP, ZeRO, TP, PP
    and offload; GPT-2 had DP2+ZeRO-2+GC in place of TP before its layers became
    ``nn.Linear``, ``agent/torchplan/gpt2_layers.py``)."""
    return SCHEDULE


async def _reconfigure(nc, job_id: str, plan: Plan, placement, label: str) -> ReconfigureReply:
    req = codec.convert({"job_id": job_id, "plan": codec.to_builtins(plan), "reason": f"switch_check: {label}",
                         "placement": [{"node": n, "gpus": g} for n, g in placement]}, ReconfigureRequest)
    return await call(nc, subj.OPTIMIZER + ".reconfigure", req, ReconfigureReply, timeout=10)


WARM_MODULE = "gearshift.agent.reference.train"
WARM_WAIT_S = 300.0


def warm_ready(agents: Path, placement, module: str = WARM_MODULE) -> bool:
    """Every node of ``placement`` has as many warm workers ready as ranks to start there."""
    for node, gpus in placement:
        try:
            st = json.loads((agents / node / "warm.json").read_text())
        except (OSError, ValueError):
            return False
        if st.get("ready", {}).get(module, 0) < gpus:
            return False
    return True


async def seed_hf_model(nc, spec: dict) -> None:
    """A fitted performance model for an HF model's shape (the reference
    workload's parameters under its key), so the job starts without profiling runs."""
    from gearshift.bus_schema.perfmodel import model_kv_key
    from gearshift.demo import TORCH_MODEL
    from gearshift.perfmodel.catalog import shape_from_spec

    data = json.loads(TORCH_MODEL.read_text())
    data["model_key"] = shape_from_spec(codec.convert(spec, JobSpec).model).key
    kv = await nc.jetstream().key_value(subj.MODELS_BUCKET)
    await kv.put(model_kv_key(data["model_key"]), json.dumps(data).encode())


async def drive(url: str, spec: dict, holds: list[int], log, timeout: float,
                agents: Path | None = None, schedule: list | None = None,
                module: str = WARM_MODULE) -> tuple[str, list[JobSwitched], dict]:
    schedule = schedule or SCHEDULE
    client = await Client.connect(url, retry_for=10)
    nc = client.nc
    switched: list[JobSwitched] = []
    progress: dict[str, int] = {"step": 0, "gen": 0}
    try:
        from gearshift.demo import seed_models

        await seed_models(nc)  # the workload's fitted model, as the demo does: no profiling runs first
        if module != WARM_MODULE:
            await seed_hf_model(nc, spec)
        reply = await client.submit(codec.convert(spec, JobSpec), token=f"switch-check-{time.time_ns()}")
        job_id = reply.job_id
        await _reconfigure(nc, job_id, *START)  # pinned before its first round: it starts as DP1

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
        pending = list(zip(holds, schedule))
        requested: list[dict] = []
        start_gen = None
        while True:
            rec = await client.job(job_id)
            if rec.terminal:
                break
            if start_gen is None and rec.state == JobState.RUNNING and rec.plan == START[0]:
                start_gen = rec.generation
            if pending and start_gen is not None and rec.state == JobState.RUNNING \
                    and progress["gen"] == rec.generation and progress["step"] >= pending[0][0]:
                at, (plan, placement, label) = pending.pop(0)
                waited = time.monotonic()
                # the job holds at its step meanwhile: measure switches with the agents' warm pool ready, as in
                # steady state (refilling takes `import torch` once, ~2 s idle, 10-25 s on a loaded 2-core box)
                while agents is not None and not warm_ready(agents, placement, module) \
                        and time.monotonic() - waited < WARM_WAIT_S:
                    await asyncio.sleep(0.2)
                r = await _reconfigure(nc, job_id, plan, placement, label)
                requested.append({"at_step": at, "seen_step": progress["step"], "to": plan.label(),
                                  "from_generation": r.generation, "warm_wait_s": round(time.monotonic() - waited, 1),
                                  "warm_ready": agents is not None and warm_ready(agents, placement, module)})
                log(f"step {progress['step']}: reconfigure to {label} (generation {r.generation})")
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"switch_check did not finish in {timeout:.0f} s")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # a last event in flight
        for s in subs:
            await s.unsubscribe()
        if rec.state != JobState.COMPLETED:
            raise RuntimeError(f"job ended {rec.state.value}: {rec.reason}")
        switched = [ev for ev in switched if start_gen is None or ev.from_generation >= start_gen]
        return job_id, switched, {"requested": requested, "start_generation": start_gen,
                                  "run_s": time.monotonic() - t0}
    finally:
        await client.close()


def uninterrupted(model: str, plan: dict, steps: int, global_batch: int, ckpt: Path, loss_log: Path) -> dict:
    """Train the same job without the cluster; its final manifest."""
    env = {"GEARSHIFT_LOSS_LOG": str(loss_log)}
    if model not in HF_MODELS:
        return reference.run_local(plan, steps, global_batch, ckpt, extra_args=("--ckpt-every", "100000"), env=env)
    codes, err = torchplan.run_local(model, plan, steps, global_batch, ckpt, extra_args=("--ckpt-every", "100000"),
                                     env=env)
    if any(codes):
        raise RuntimeError(f"uninterrupted {model} run failed: exit codes {codes}: {err.strip()[-300:]}")
    return json.loads((Path(ckpt) / "manifest.json").read_text())


def restore_parts(agents: Path, job_id: str) -> dict[int, dict]:
    """generation -> rank 0's restore broken down (launch -> main -> import -> rendezvous -> state)."""
    out = {}
    for f in agents.glob(f"*/run/{job_id}/g*/progress-0.json"):
        try:
            got = json.loads(f.read_text()).get("restore_parts")
        except (OSError, ValueError):
            continue
        if got:
            out[int(f.parent.name[1:])] = got
    return out


def dcp_save_times(agents: Path, job_id: str) -> list[float]:
    """Rank 0's DCP save at each switch's checkpoint (the plan library reports it when it stops)."""
    out = []
    for f in agents.glob(f"*/run/{job_id}/g*/progress-0.json"):
        try:
            got = json.loads(f.read_text()).get("dcp_save_s")
        except (OSError, ValueError):
            continue
        if got is not None:
            out.append(float(got))
    return out


def read_losses(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


def compare(switched_log: list[dict], base: list[dict], tp_run: list[dict], holds: list[int],
            schedule: list | None = None) -> dict:
    """Per step: relative difference to the uninterrupted DP1 run; tolerance
    1e-6 until the first TP/PP plan ran, then max(1e-3, DP1-vs-TP2 spread)."""
    ref = {r["step"]: r["loss"] for r in base}
    spread = max((rel(r["loss"], ref[r["step"]]) for r in tp_run if r["step"] in ref), default=0.0)
    reordered_from = None  # the first step trained under TP or PP
    for i, (plan, _, _) in enumerate(schedule or SCHEDULE):
        if plan.tp > 1 or plan.pp > 1:
            reordered_from = holds[i] + 1
            break
    steps = [r["step"] for r in switched_log]
    worst = {"exact": 0.0, "reordered": 0.0}
    for r in switched_log:
        if r["step"] not in ref:
            continue
        kind = "reordered" if reordered_from is not None and r["step"] >= reordered_from else "exact"
        worst[kind] = max(worst[kind], rel(r["loss"], ref[r["step"]]))
    tol = {"exact": EXACT, "reordered": max(REORDERED, spread)}
    # the step's sample indices (a hash; the plan library's workers log it): the same samples in the same order
    ref_samples = {r["step"]: r.get("samples") for r in base}
    same = None
    if any("samples" in r for r in switched_log):
        same = all(r.get("samples") is not None and r.get("samples") == ref_samples.get(r["step"])
                   for r in switched_log)
    return {
        "steps_logged": len(steps), "distinct_steps": len(set(steps)),
        "max_rel_diff_dp_zero_only": worst["exact"], "tolerance_dp_zero_only": tol["exact"],
        "max_rel_diff_after_tp_pp": worst["reordered"], "tolerance_after_tp_pp": tol["reordered"],
        "tp_spread_uninterrupted": spread,
        "same_samples": same,
        "ok": worst["exact"] <= tol["exact"] and worst["reordered"] <= tol["reordered"] and same is not False,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.switch_check")
    ap.add_argument("--every", type=int, default=10, help="steps between switches")
    ap.add_argument("--margin", type=int, default=10, help="steps the job trains after the last switch")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    ap.add_argument("--cold", action="store_true", help="no warm workers: every generation imports torch anew")
    ap.add_argument("--model", default="torchref", choices=("torchref", *HF_MODELS),
                    help="torchref: the reference workload; llama/gpt2/bert: a tiny HF model through agent/torchplan")
    args = ap.parse_args(argv)
    if args.model in HF_MODELS and args.global_batch == 64:
        args.global_batch = 16
    if args.every < 1 or args.margin < 1:
        print("switch_check: --every and --margin must be >= 1", file=sys.stderr)
        return 2
    if not reference.have_torch():
        print("switch_check needs torch: pip install -e '.[torch]' (make venv-torch)", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[switch_check] {msg}", file=sys.stderr, flush=True)

    hf = args.model in HF_MODELS
    schedule = schedule_for(args.model)
    holds = [args.every * (i + 1) for i in range(len(schedule))]
    steps = holds[-1] + args.margin
    started = time.monotonic()
    module = torchplan.MODULE if hf else WARM_MODULE
    with tempfile.TemporaryDirectory(prefix="switch-check-") as tmp:
        losses = Path(tmp) / "losses.jsonl"
        env = {"GEARSHIFT_HOLD_AT": ",".join(map(str, holds)), "GEARSHIFT_HOLD_TIMEOUT": str(args.timeout),
               "GEARSHIFT_LOSS_LOG": str(losses)}
        if hf:
            spec = torchplan.job_spec("switch-check", args.model, steps=steps, global_batch=args.global_batch,
                                      gpus=1, plan={"dp": 1}, extra_args=("--ckpt-every", "100000"), env=env)
        else:
            spec = reference.job_spec("switch-check", steps=steps, global_batch=args.global_batch, gpus=1,
                                      plan={"dp": 1}, extra_args=("--ckpt-every", "100000"), env=env)
        # agents keep warm workers for the workload from the start (agent/warm.py), so even a
        # node's first generation of the job skips `import torch`; --cold measures without them
        os.environ["GEARSHIFT_WARM"] = "" if args.cold else module
        with LocalCluster(nodes=2, gpus_per_node=2, cpus_per_node=8, interval=0.25, grace=30.0,
                          data_dir=str(Path(tmp) / "cluster")) as cluster:
            log(f"cluster up at {cluster.url}; logs in {cluster.log_dir}; switches at steps {holds}, {steps} steps")
            try:
                agents = None if args.cold else Path(tmp) / "cluster" / "agents"
                job_id, switched, info = asyncio.run(drive(cluster.url, spec, holds, log, args.timeout, agents,
                                                           schedule, module))
            except (TimeoutError, RuntimeError) as exc:
                print(json.dumps({"ok": False, "error": str(exc)}) if args.json else f"FAILED: {exc}")
                return 1
            manifest = json.loads((Path(tmp) / "cluster" / "ckpt" / job_id / "manifest.json").read_text())
            parts = restore_parts(Path(tmp) / "cluster" / "agents", job_id)
            saves = dcp_save_times(Path(tmp) / "cluster" / "agents", job_id)
        # the spread TP's (or, without TP, PP's) reduction order alone causes
        other = {"tp": 2}
        log(f"training the same job uninterrupted: DP1 and {other} (local processes)")
        t = time.monotonic()
        runs = {"dp1": {"dp": 1}, "tp2": other}
        logs = {k: Path(tmp) / f"base-{k}.jsonl" for k in runs}
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            futs = {k: ex.submit(uninterrupted, args.model, p, steps, args.global_batch, Path(tmp) / f"base-{k}",
                                 logs[k]) for k, p in runs.items()}
            base = {k: f.result() for k, f in futs.items()}
        base_s = time.monotonic() - t
        cmp = compare(read_losses(losses), read_losses(logs["dp1"]), read_losses(logs["tp2"]), holds, schedule)
    final, ref = float(manifest["loss"]), float(base["dp1"]["loss"])
    lost = sum(ev.steps_lost for ev in switched)
    repeated = sum(max(0, ev.checkpoint_step - ev.resumed_step) for ev in switched) + \
        cmp["steps_logged"] - cmp["distinct_steps"]
    at_steps = [ev.resumed_step for ev in switched]
    per_switch = [
        {"from": ev.from_plan.label() if ev.from_plan else None, "to": ev.plan.label() if ev.plan else None,
         "from_gpus": ev.from_gpus, "gpus": ev.gpus, "nodes": ev.nodes, "requested_at_step": h,
         "at_step": ev.resumed_step, "steps_lost": ev.steps_lost, **{k: round(getattr(ev, k), 3) for k in PHASES},
         "restore_parts_s": parts.get(ev.generation), **{k: req.get(k) for k in ("warm_wait_s", "warm_ready")}}
        for ev, h, req in zip(switched, holds, info["requested"] + [{}] * len(holds))
    ]
    got_parts = [p["restore_parts_s"] for p in per_switch if p["restore_parts_s"]]
    mean_parts = {k: round(sum(p[k] for p in got_parts) / len(got_parts), 3) for k in got_parts[0]} if got_parts else {}
    mean = {k: round(sum(getattr(ev, k) for ev in switched) / len(switched), 3) for k in PHASES} if switched else {}
    ran = [p for p, _, _ in schedule]
    not_applicable: list[str] = []  # every model switch_check runs has TP and PP
    kinds = {"dp": any(p.dp > 1 for p in ran), "tp": any(p.tp > 1 for p in ran),
             "pp": any(p.pp > 1 for p in ran), "zero3": any(p.zero == 3 for p in ran),
             "offload": any(p.offload for p in ran),
             "two_nodes": any(len(pl) > 1 for _, pl, _ in schedule), "back_to_start": ran[-1] == START[0]}
    checks = {
        "every_switch_happened": len(switched) == len(schedule),
        "each_at_its_step": at_steps == holds,
        "no_step_lost": lost == 0,
        "no_step_repeated": repeated == 0,
        "all_steps_trained": manifest["step"] == steps and cmp["distinct_steps"] == steps,
        "losses_within_tolerance": cmp["ok"],
        "plan_space_covered": all(v for k, v in kinds.items() if k not in not_applicable),
    }
    ok = all(checks.values())
    result = {
        "ok": ok,
        "checks": checks,
        "steps": steps,
        "switch_steps": holds,
        "global_batch": args.global_batch,
        "final_loss": final,
        "uninterrupted_final_loss": ref,
        "relative_difference": rel(final, ref),
        "loss_comparison": cmp,
        "switches": len(switched),
        "warm_workers": not args.cold,
        "model": args.model,
        "same_samples_in_order": cmp.get("same_samples"),
        "covers": kinds,
        "not_applicable": not_applicable,
        "steps_lost": lost,
        "steps_repeated": repeated,
        "switch_cost_mean_s": mean,
        "restore_mean_by_part_s": mean_parts,
        "dcp_save_mean_s": round(sum(saves) / len(saves), 3) if saves else None,
        "switch_cost": per_switch,
        "run_s": round(info["run_s"], 1),
        "uninterrupted_s": round(base_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"final loss {final:.10f}  uninterrupted {ref:.10f}")
        print(f"switches {len(switched)} at steps {at_steps} (requested {holds})  lost {lost}  repeated {repeated}")
        print(f"max rel diff: DP/ZeRO-only {cmp['max_rel_diff_dp_zero_only']:.2e} (tol {EXACT:.0e}), after TP/PP "
              f"{cmp['max_rel_diff_after_tp_pp']:.2e} (tol {cmp['tolerance_after_tp_pp']:.0e})")
        for s in per_switch:
            print(f"  {s['from']} -> {s['to']} at step {s['at_step']}: " +
                  "  ".join(f"{k[:-2]} {s[k]:.2f}s" for k in PHASES))
        print("mean: " + "  ".join(f"{k[:-2]} {v:.2f}s" for k, v in mean.items()))
        print("OK" if ok else "FAILED: " + ", ".join(k for k, v in checks.items() if not v))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
