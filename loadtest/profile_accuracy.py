"""How well the fitted performance model predicts plans it was not fitted on.

    python -m loadtest.profile_accuracy [--model torchref|llama|gpt2|bert|vit|t5] [--json]

``--model llama`` (or gpt2, bert, vit, t5) profiles a tiny Hugging Face model trained
through the plan library (``gearshift.agent.torchplan.train``: FSDP2, DTensor
TP, torch.distributed.pipelining) instead of the reference workload: the same
profiler, the same fit, the same held-out plans (the TP ones only where the
family has a TP plan). Its profiling runs time the ranks' thread CPU time too
(``GEARSHIFT_PROFILE_CLOCK=cpu``): with wall clock, on this loaded 2-core box
(load average ~15), two runs of one plan differed by 74% in the median and by
up to 268% (``noise``: the spread between a plan's repeated runs, reported in
every result). Thread CPU time leaves out what a rank waits for (gloo's
collectives run on gloo's threads, a pipeline's bubble), which on dedicated
hardware belongs in the step time: there leave the clock at wall. HF runs
measure 40 steps by default (``--steps``).

Starts a local cluster (one node, two fake GPUs: on a CPU box each "GPU" is
one rank with one torch thread), asks the profiler (``gs.profiler.profile``)
to profile the PyTorch reference workload with its own choice of at most 7
plans (data-parallel ones and TP2, PP2, PP2+GA4) and fit the model
(``gs.perfmodel.fit`` -> KV ``gs_models``), then measures 9 other plans the
same way (agent profiling runs, no fit), TP and PP ones among them, asks
``gs.perfmodel.predict`` for their iteration times and reports the
prediction error per plan, on average, and on the TP/PP plans alone. Exit
status 0 when the average error is <= 15% over at least 8 held-out plans
that include TP and PP ones.

Timing: the reference workload runs one torch thread per rank, and the phase
times are the median over the measured steps of the rank's thread CPU time
(``GEARSHIFT_PROFILE_CLOCK=cpu``): on a shared two-core machine wall time is
mostly a measure of what else runs there. On dedicated hardware leave the
clock at its default (wall). Each plan runs twice (``--repeats``), round-robin over
the plans, and the faster run counts: load from other processes only ever adds
time, and a burst of it rarely hits both runs. A pipeline's bubble is waiting, which thread CPU
time leaves out: PP runs replay their schedule on every stage's measured busy
times to get the step time (``agent/torchplan/profiling.pipeline_makespan``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from gearshift.agent import reference
from gearshift.bus.client import call, connect
from gearshift.bus_schema import codec
from gearshift.bus_schema.messages import ModelSpec, Plan, PlanSupport
from gearshift.cluster import LocalCluster
from gearshift.services.perfmodel_service import PERFMODEL_PREDICT, PredictReply, PredictRequest, ResourceSpec
from gearshift.services.profiler import PROFILER_PROFILE, ProfileReply, ProfileRequest

HELD_OUT = [
    Plan(dp=1, ga=2),
    Plan(dp=1, ga=4, grad_ckpt=True),
    Plan(dp=2, ga=2),
    Plan(dp=2, grad_ckpt=True),
    Plan(dp=2, zero=1, ga=2),
    Plan(tp=2, ga=2),
    Plan(tp=2, grad_ckpt=True),
    Plan(pp=2, ga=2),
    Plan(pp=2, ga=2, grad_ckpt=True),
]


def workload(name: str) -> tuple[dict, list[str], dict[str, str]]:
    """(model spec, command, env) of the workload to profile."""
    if name == "torchref":
        # the ranks' thread CPU time: wall time on a shared 2-core box measures the neighbours (PhaseTimer)
        return reference.model_spec(), reference.command(), {"GEARSHIFT_PROFILE_CLOCK": "cpu"}
    from gearshift.agent.torchplan import families

    return (families.model_spec(name), [sys.executable, "-m", "gearshift.agent.torchplan.train", "--model", name],
            {"GEARSHIFT_DEVICE": "cpu", "GEARSHIFT_PROFILE_CLOCK": "cpu"})


def plan_support(name: str) -> PlanSupport | None:
    """What the workload's job declares it runs (``JobSpec.plan_support``): for an
    HF family, the plan dimensions its plan space lacks (T5: no PP)."""
    if name == "torchref":
        return None
    from gearshift.agent.torchplan import families
    from gearshift.agent.torchplan.space import declared_support

    got = declared_support(families.shape(name))
    return codec.convert(got, PlanSupport) if got else None


def held_out(name: str) -> list[Plan]:
    if name == "torchref":
        return list(HELD_OUT)
    from gearshift.agent.torchplan import families
    from gearshift.agent.torchplan.space import PlanRefused, check_plan

    shape = families.shape(name)
    out = []
    for p in HELD_OUT:
        try:
            check_plan({k: getattr(p, k) for k in ("dp", "tp", "pp", "zero", "ga", "grad_ckpt")}, shape)
        except PlanRefused:
            continue
        out.append(p)
    return out


async def measure(url: str, global_batch: int, steps: int, log, repeats: int = 2, name: str = "torchref") -> dict:
    nc = await connect(url, name="profile-accuracy", retry_for=10)
    try:
        spec, cmd, env = workload(name)
        model = codec.convert(spec, ModelSpec)
        t = time.monotonic()
        support = plan_support(name)
        prof = await call(nc, PROFILER_PROFILE, ProfileRequest(model=model, global_batch=global_batch, command=cmd,
                                                                env=env, max_dp=2, steps=steps, repeats=repeats,
                                                                plan_support=support),
                          ProfileReply,
                          timeout=1800)
        log(f"profiled {len(prof.samples)} plans in {time.monotonic() - t:.0f}s; fit train error "
            f"{prof.fit.train_error:.3f}" if prof.fit else "no fit")
        held = [p for p in held_out(name) if p not in [s.plan for s in prof.samples]]
        t = time.monotonic()
        meas = await call(nc, PROFILER_PROFILE, ProfileRequest(model=model, global_batch=global_batch, command=cmd,
                                                                env=env, plans=held, steps=steps, fit=False,
                                                                repeats=repeats, plan_support=support),
                          ProfileReply, timeout=1800)
        log(f"measured {len(meas.samples)} held-out plans in {time.monotonic() - t:.0f}s")
        pred = await call(nc, PERFMODEL_PREDICT, PredictRequest(
            model=model, global_batch=global_batch, plans=[s.plan for s in meas.samples],
            resources=[ResourceSpec(gpus_per_node=[s.plan.gpus]) for s in meas.samples]), PredictReply, timeout=60)
        return {"profile": prof, "measured": meas, "predicted": pred}
    finally:
        await nc.drain()


def run_spread(results) -> dict:
    """How far apart repeated runs of one plan were: (slowest - fastest) / fastest per plan,
    its median and maximum over the plans (the measurement noise the errors sit on)."""
    runs: dict[str, list[float]] = {}
    for r in results:
        if r.ok and r.iter_ms:
            runs.setdefault(r.plan.label(), []).append(r.iter_ms)
    spread = sorted((max(v) - min(v)) / min(v) for v in runs.values() if len(v) > 1)
    if not spread:
        return {"plans": 0}
    return {"plans": len(spread), "median_spread": round(spread[len(spread) // 2], 4), "max_spread": round(spread[-1], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.profile_accuracy")
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--model", default="torchref", choices=["torchref", "llama", "gpt2", "bert", "vit", "t5"],
                    help="the reference workload, or a tiny HF model through the plan library")
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps per run (after the warm-up steps; default 30, 40 for HF models)")
    ap.add_argument("--repeats", type=int, default=2, choices=range(1, 6),
                    help="runs per plan (round-robin), the fastest counts: other load only adds time")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save-model", type=Path, default=None,
                    help="write the fitted model (gs_models value) here, e.g. workloads/torchref_model.json")
    args = ap.parse_args(argv)
    if not reference.have_torch():
        print("profile_accuracy needs torch: pip install -e '.[torch]'", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(f"[profile_accuracy] {msg}", file=sys.stderr, flush=True)

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="profile-accuracy-") as tmp:
        with LocalCluster(nodes=1, gpus_per_node=2, cpus_per_node=2, interval=1.0,
                          data_dir=str(Path(tmp) / "cluster")) as cluster:
            log(f"cluster up at {cluster.url}")
            steps = args.steps or (30 if args.model == "torchref" else 40)
            got = asyncio.run(measure(cluster.url, args.global_batch, steps, log, args.repeats, args.model))
    prof, meas, pred = got["profile"], got["measured"], got["predicted"]
    rows = []
    for s, t in zip(meas.samples, pred.iter_time_s):
        p_ms = None if t is None else t * 1e3
        err = None if p_ms is None else abs(p_ms - s.iter_ms) / s.iter_ms
        rows.append({"plan": s.plan.label(), "measured_ms": round(s.iter_ms, 2),
                     "predicted_ms": None if p_ms is None else round(p_ms, 2),
                     "error": None if err is None else round(err, 4)})
    if args.save_model and prof.fit:
        args.save_model.write_text(json.dumps({"model_key": prof.model_key, "params": prof.fit.params,
                                               "cluster": prof.fit.cluster, "gpu_mem_gb": 80.0}, indent=2) + "\n")
    errs = [r["error"] for r in rows if r["error"] is not None]
    avg = sum(errs) / len(errs) if errs else float("inf")
    e3d = [r["error"] for r in rows if r["error"] is not None and ("TP" in r["plan"] or "PP" in r["plan"])]
    has = {k: any(k in r["plan"] for r in rows if r["error"] is not None) for k in ("TP", "PP")}
    noise = run_spread(list(prof.results) + list(meas.results))
    ok = avg <= 0.15 and len(prof.samples) <= 7 and len(errs) >= 8 and all(has.values())
    result = {
        "ok": ok,
        "model_key": prof.model_key,
        "profiled_plans": [{"plan": s.plan.label(), "iter_ms": round(s.iter_ms, 2),
                            "fwd_ms": s.fwd_ms and round(s.fwd_ms, 2), "bwd_sync_ms": s.tcc_ms and round(s.tcc_ms, 2),
                            "opt_ms": s.opt_ms and round(s.opt_ms, 2)} for s in prof.samples],
        "fit_train_error": prof.fit.train_error if prof.fit else None,
        "fitted_params": prof.fit.params if prof.fit else None,
        "predicted_plans": rows,
        "average_error": round(avg, 4),
        "held_out_plans": len(errs),
        "held_out_tp_pp_plans": len(e3d),
        "average_error_tp_pp": round(sum(e3d) / len(e3d), 4) if e3d else None,
        "max_error": round(max(errs), 4) if errs else None,
        "noise": noise,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for r in rows:
            print(f"{r['plan']:<16} measured {r['measured_ms']:8.2f} ms  predicted {r['predicted_ms']} ms  "
                  f"error {r['error']}")
        print(f"average error {avg:.1%} over {len(errs)} plans ({'OK' if ok else 'FAILED'})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
