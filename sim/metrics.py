"""Metrics of a simulation: summary numbers, per-job rows, time series.

Definitions (all over the tracked jobs; every job unless the trace names a window):
- JCT = finish - submit, for finished jobs; avg / median / p99 (linear interpolation).
- makespan = last finish - first submit (of tracked jobs).
- queueing delay = first start - submit (time before the job first ran); ``wait`` =
  JCT - time holding an allocation (includes waits after preemption).
- GPU utilisation = GPU-seconds allocated / (GPUs x makespan window); ``productive``
  excludes time spent in restarts.
- reconfigurations = allocation changes of a running job (plan or placement);
  preemptions = running job stopped; restarts = every (re)start after the first;
  restart time lost = seconds a job held GPUs while restarting (job-seconds, and
  GPU-hours).
- measured share = allocations whose ground-truth speed was measured (the Rubick
  tables, or the trace's own duration for the job's request) / all allocations.
- guarantee attainment, for guaranteed jobs that started (accepted): ``rate ratio`` =
  worst ground-truth speed over its allocations / the speed of its own request on
  its natural placement; ``kept`` = rate ratio >= 0.99 and never preempted after it
  started; ``jct ratio`` = JCT / (its request's run time + one restart cost).
  Where any job is guaranteed, ``by_guarantee`` gives the finished guaranteed and
  best-effort jobs' count, average and median JCT apart.
"""

from __future__ import annotations

import csv
import io
import math

from gearshift.sim.engine import SimResult

GUARANTEE_TOLERANCE = 0.99


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _tracked(res: SimResult):
    if res.tracked is None:
        return res.records
    return [r for r in res.records if r.job.job_id in res.tracked]


def summarize(res: SimResult) -> dict:
    recs = _tracked(res)
    fin = [r for r in recs if r.finish is not None]
    jct = [r.finish - r.job.submit for r in fin]
    qd = [r.first_start - r.job.submit for r in recs if r.first_start is not None]
    waits = [(r.finish - r.job.submit) - r.run_time for r in fin]
    t0 = min((r.job.submit for r in recs), default=0.0)
    t_end = max((r.finish for r in fin), default=res.end_time)
    span = max(t_end - t0, 1e-9)
    total_gpus = res.cluster.gpus
    # Utilisation over the tracked window, from the cluster timeline (all jobs hold GPUs).
    alloc_gs = _integral(res.timeline, t0, t_end)
    restart_gs = sum(r.restart_gpu_seconds for r in res.records)
    all_gs = sum(r.gpu_seconds for r in res.records)
    prod_fraction = 1 - restart_gs / all_gs if all_gs else 0.0
    guar = [r for r in recs if r.job.spec.guaranteed]
    accepted = [r for r in guar if r.first_start is not None]
    kept = [r for r in accepted if r.min_rate_ratio >= GUARANTEE_TOLERANCE and not r.preempted_after_start]
    cost = res.config.restart_model
    jct_ratio = [(r.finish - r.job.submit)
                 / (r.job.spec.steps * r.request_step_time + (cost(r.job.spec) if cost else res.config.restart_cost))
                 for r in accepted if r.finish is not None and r.request_step_time > 0]
    sources: dict[str, int] = {}
    for r in recs:
        for src, k in r.truth_sources.items():
            sources[src] = sources.get(src, 0) + k
    n_alloc = sum(sources.values())
    measured_share = (sources.get("measured", 0) + sources.get("request", 0)) / n_alloc if n_alloc else math.nan
    out = {
        "policy": res.policy,
        "trace": res.trace,
        "cluster": res.cluster.label(),
        "jobs": len(recs),
        "finished": len(fin),
        "unfinished": len(recs) - len(fin),
        "avg_jct_s": sum(jct) / len(jct) if jct else math.nan,
        "median_jct_s": _pct(jct, 0.5),
        "p99_jct_s": _pct(jct, 0.99),
        "makespan_s": t_end - t0 if fin else math.nan,
        "avg_queue_delay_s": sum(qd) / len(qd) if qd else math.nan,
        "avg_wait_s": sum(waits) / len(waits) if waits else math.nan,
        "gpu_util": alloc_gs / (total_gpus * span),
        "gpu_util_productive": alloc_gs * prod_fraction / (total_gpus * span),
        "reconfigurations": sum(r.reconfigs for r in recs),
        "preemptions": sum(r.preemptions for r in recs),
        "restarts": sum(max(0, r.starts - 1) for r in recs),
        "restart_lost_s": sum(r.restart_lost for r in recs),
        "restart_lost_gpu_h": sum(r.restart_gpu_seconds for r in recs) / 3600,
        "steps_lost_grace_expired": sum(r.steps_lost for r in recs),
        "stalled_allocations": sum(r.stalled for r in recs),
        "guaranteed_jobs": len(guar),
        "guaranteed_accepted": len(accepted),
        "guarantees_kept": len(kept),
        "guarantee_attainment": len(kept) / len(accepted) if accepted else math.nan,
        "guaranteed_avg_jct_ratio": sum(jct_ratio) / len(jct_ratio) if jct_ratio else math.nan,
        "truth_sources": dict(sorted(sources.items())),  # allocations by ground-truth source
        "measured_share": measured_share,
        "rounds": res.rounds,
        "events": res.events,
        "sim_end_s": res.end_time,
        "wall_s": res.wall_s,
    }
    if guar:  # guaranteed and best-effort jobs apart: a policy may buy one with the other
        out["by_guarantee"] = {name: _jcts([r for r in fin if bool(r.job.spec.guaranteed) == g])
                               for name, g in (("guaranteed", True), ("best_effort", False))}
    if res.topology_spans is not None:  # grants by the topology level their nodes span (sim.topology)
        out["topology_spans"] = dict(sorted(res.topology_spans.items()))
        # GPU-hours its grants lost to links slower than the fitted ones (held x (1 - 1/slowdown))
        out["topology_slow_gpu_h"] = res.topology.slow_gpu_s / 3600
    return out


def _jcts(fin: list) -> dict:
    """Finished jobs' count, average and median JCT (s)."""
    jct = [r.finish - r.job.submit for r in fin]
    return {"finished": len(jct), "avg_jct_s": sum(jct) / len(jct) if jct else math.nan, "median_jct_s": _pct(jct, 0.5)}


def _integral(timeline, t0: float, t1: float) -> float:
    """Integral of allocated GPUs over [t0, t1] from the step-function samples."""
    total = 0.0
    for (ta, g, _, _), nxt in zip(timeline, timeline[1:] + [(math.inf, 0, 0, 0)]):
        a, b = max(ta, t0), min(nxt[0], t1)
        if b > a:
            total += g * (b - a)
    return total


PER_JOB_FIELDS = ["job", "policy", "submit", "start", "finish", "jct", "queue_delay", "gpus_requested",
                  "guaranteed", "steps", "steps_done", "restarts", "reconfigurations", "preemptions",
                  "restart_lost_s", "gpu_seconds", "final_plan", "guarantee_kept", "truth"]


def per_job_rows(res: SimResult) -> list[dict]:
    out = []
    for r in _tracked(res):
        s = r.job.submit
        kept = ""
        if r.job.spec.guaranteed and r.first_start is not None:
            kept = int(r.min_rate_ratio >= GUARANTEE_TOLERANCE and not r.preempted_after_start)
        out.append({
            "job": r.job.job_id, "policy": res.policy, "submit": f"{s:.3f}",
            "start": "" if r.first_start is None else f"{r.first_start:.3f}",
            "finish": "" if r.finish is None else f"{r.finish:.3f}",
            "jct": "" if r.finish is None else f"{r.finish - s:.3f}",
            "queue_delay": "" if r.first_start is None else f"{r.first_start - s:.3f}",
            "gpus_requested": r.job.spec.gpus, "guaranteed": int(r.job.spec.guaranteed),
            "steps": r.job.spec.steps, "steps_done": f"{r.steps_done:.3f}",
            "restarts": max(0, r.starts - 1), "reconfigurations": r.reconfigs, "preemptions": r.preemptions,
            "restart_lost_s": f"{r.restart_lost:.3f}", "gpu_seconds": f"{r.gpu_seconds:.3f}",
            "final_plan": r.last_plan_label, "guarantee_kept": kept,
            "truth": "+".join(f"{k}:{v}" for k, v in sorted(r.truth_sources.items())),
        })
    return out


def write_per_job_csv(results: list[SimResult], path_or_file) -> None:
    own = isinstance(path_or_file, (str, bytes)) or hasattr(path_or_file, "__fspath__")
    f = open(path_or_file, "w", newline="") if own else path_or_file
    try:
        w = csv.DictWriter(f, fieldnames=PER_JOB_FIELDS)
        w.writeheader()
        for res in results:
            w.writerows(per_job_rows(res))
    finally:
        if own:
            f.close()


def per_job_csv_text(results: list[SimResult]) -> str:
    buf = io.StringIO()
    write_per_job_csv(results, buf)
    return buf.getvalue()
