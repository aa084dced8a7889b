"""Trace loaders: each maps a public trace's rows to gearshift ``JobSpec``s.

Every format becomes ``TraceJob(job_id, submit, spec, truth_key)``. The mapping per
format (also in sim/README.md):

rubick (Rubick/Morphling workload-{base,bp,mt}.csv)
    name -> job_id and spec.name; submission_time -> submit; application -> model
    (``rubick_catalog.MODELS``) and truth_key; num_gpus -> gpus; num_cpus/num_gpus ->
    cpus_per_gpu; exec_plan -> plan (``rubick_catalog.plan_from_rubick``); steps ->
    steps; is_sla -> guaranteed; duration/steps -> step_time (seconds per step at the
    requested plan and GPUs); global_batch from the paper's Table 1.
blox (Blox's generated job lists: job_id, arrival_time_s, duration_s, num_gpus)
    Blox runs 1-second iterations, so steps = round(duration_s) and
    step_time = duration_s/steps (the exact duration is kept); plan = DP over num_gpus.
tiresias (Tiresias simulator CSV: job_id, num_gpu, submit_time, iterations, model_name,
    duration) -> steps = iterations, step_time = duration/iterations, model = model_name.
itp (Microsoft ITP raw: job_id, submission_time, duration, num_gpu; or ElasticFlow's
    with-deadline files which add num_iteration) -> steps = num_iteration if present else
    round(duration), step_time = duration/steps. Submit times are shifted so the first
    job arrives at 0.
pollux (a) Philly-derived ``philly.csv`` rows (timestamp, duration, num_gpus, ...):
    submit = seconds since the first timestamp; steps/step_time as for itp.
    (b) Pollux workload-N.csv (name, time, application, num_replicas, batch_size): these
    carry no duration (Pollux runs each job to convergence). The duration is drawn,
    deterministically from the job name, log-uniformly from the GPU-time bucket Pollux
    used to assign the application (cifar10/ncf < 1 GPU-h, deepspeech2/bert 1-10,
    yolov3 10-100, imagenet 100-1000) and divided by num_replicas. This is synthetic.
Traces without a model (blox, itp, philly) get a generic model spec; their jobs have
no measured speed table, so the simulator's ground truth for them is the trace's own
duration at the requested GPUs (see ``sim.truth``).
"""

from __future__ import annotations

import csv
import hashlib
import math
import re
from datetime import datetime
from pathlib import Path

from gearshift.bus_schema.messages import Dependency, JobSpec, ModelSpec, Plan
from gearshift.sim import rubick_catalog as rc
from gearshift.sim.collect import fewer_collections
from gearshift.sim.trace import ClusterSpec, Trace, TraceJob, parse_cluster

DATA = Path(__file__).parent / "data"

FORMATS = ("rubick", "blox", "tiresias", "itp", "pollux", "gavel")

_GENERIC_BATCH = 32


def _generic_model(name: str) -> ModelSpec:
    return ModelSpec(name=_safe(name or "generic"), params=100.0, layers=12, hidden=768, seq_len=512)


def _safe(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_-]", "_", str(text).strip())[:64]
    if not s or not s[0].isalnum():
        s = ("j" + s)[:64]
    return s


def _steps_for(duration: float, iterations: float | None = None) -> tuple[int, float]:
    """(steps, seconds per step) that reproduce ``duration`` exactly."""
    duration = max(float(duration), 1e-3)
    steps = int(iterations) if iterations and iterations >= 1 else max(1, round(duration))
    return steps, duration / steps


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _after(r: dict[str, str], job_id) -> list | None:
    """A row's optional ``after`` column: the trace's ids of the jobs it starts after
    (each completed), separated by ``;`` or spaces; ``job_id`` maps a trace id to ours."""
    after = r.get("after")
    if not after:
        return None
    ids = after.replace(";", " ").split()
    return [Dependency(job=job_id(i)) for i in ids] or None


def _make(job_id, submit, model, gpus, steps, step_time, plan=None, guaranteed=False, cpg=None,
          batch=_GENERIC_BATCH, truth_key="", after=None):
    gpus = max(1, int(gpus))
    spec = JobSpec(
        name=job_id, model=model, global_batch=batch, steps=int(steps), gpus=gpus,
        cpus_per_gpu=cpg, plan=plan if plan is not None else Plan(dp=gpus), guaranteed=guaranteed,
        step_time=float(step_time), after=after,
    )
    return TraceJob(job_id=job_id, submit=float(submit), spec=spec, truth_key=truth_key)


# ---------------------------------------------------------------- per format
def load_rubick(path: str | Path, name: str = "") -> Trace:
    jobs = []
    for r in _rows(Path(path)):
        app = r["application"].strip()
        if app not in rc.MODELS:
            raise ValueError(f"{path}: job {r['name']}: unknown application {app!r}")
        gpus = int(r["num_gpus"])
        steps = int(float(r["steps"]))
        jid = _safe(r["name"])
        cpus = int(float(r.get("num_cpus") or 0))
        jobs.append(_make(
            jid, float(r["submission_time"]), rc.MODELS[app], gpus, steps, float(r["duration"]) / steps,
            plan=rc.plan_from_rubick(r["exec_plan"], gpus), guaranteed=str(r.get("is_sla", "0")).strip() in ("1", "1.0", "True"),
            cpg=max(1, cpus // gpus) if cpus else None, batch=rc.GLOBAL_BATCH[app], truth_key=app,
        ))
    return Trace(name or Path(path).stem, jobs, parse_cluster("8x8"), note="Rubick/Morphling artifact workload")


def load_blox(path: str | Path, name: str = "", track: tuple[int, int] | None = (3000, 4000)) -> Trace:
    jobs = []
    model = _generic_model("blox")
    for r in _rows(Path(path)):
        steps, st = _steps_for(float(r["duration_s"]))
        jobs.append(_make(f"b{int(r['job_id'])}", float(r["arrival_time_s"]), model, int(r["num_gpus"]), steps, st,
                          after=_after(r, lambda i: f"b{int(i)}")))
    tracked = None
    if track is not None:
        lo, hi = track
        tracked = frozenset(j.job_id for j in jobs if lo <= int(j.job_id[1:]) <= hi) or None
    # Blox's simulator cluster: 32 machines x 4 GPUs, 16 CPUs each.
    return Trace(name or Path(path).stem, jobs, parse_cluster("32x4:16"), tracked=tracked,
                 note="Blox generated job list (tracked window = Blox's job ids 3000-4000)")


def load_tiresias(path: str | Path, name: str = "") -> Trace:
    jobs = []
    for r in _rows(Path(path)):
        steps, st = _steps_for(float(r["duration"]), float(r.get("iterations") or 0))
        jobs.append(_make(f"t{int(r['job_id'])}", float(r["submit_time"]), _generic_model(r.get("model_name", "")),
                          int(r["num_gpu"]), steps, st, after=_after(r, lambda i: f"t{int(i)}")))
    return Trace(name or Path(path).stem, jobs, parse_cluster("16x4"), note="Tiresias simulator trace")


def load_itp(path: str | Path, name: str = "") -> Trace:
    rows = _rows(Path(path))
    t0 = min((float(r.get("submission_time") or r.get("submit_time")) for r in rows), default=0.0)
    jobs = []
    for i, r in enumerate(rows):
        sub = float(r.get("submission_time") or r.get("submit_time")) - t0
        iters = float(r.get("num_iteration") or r.get("iteration") or 0)
        steps, st = _steps_for(float(r["duration"]), iters)
        jid = _safe(r.get("job_id") or f"itp{i}")
        jobs.append(_make(jid, sub, _generic_model(r.get("model_name", "itp")), int(float(r["num_gpu"])), steps, st))
    return Trace(name or Path(path).stem, jobs, parse_cluster("16x8"), note="Microsoft ITP trace")


# GPU-time buckets (GPU-hours) by which Pollux assigned applications to Philly jobs.
_POLLUX_GPU_HOURS = {"cifar10": (0.1, 1), "ncf": (0.1, 1), "deepspeech2": (1, 10), "bert": (1, 10),
                     "yolov3": (10, 100), "imagenet": (100, 1000)}


def _unit_from(name: str) -> float:
    h = hashlib.sha256(name.encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def load_pollux(path: str | Path, name: str = "") -> Trace:
    rows = _rows(Path(path))
    if not rows:
        raise ValueError(f"{path}: empty trace")
    jobs = []
    if "timestamp" in rows[0]:  # Philly-derived job list
        stamps = [datetime.fromisoformat(r["timestamp"]) for r in rows]
        t0 = min(stamps)
        for i, (r, ts) in enumerate(zip(rows, stamps)):
            steps, st = _steps_for(float(r["duration"]))
            jobs.append(_make(f"p{i}", (ts - t0).total_seconds(), _generic_model("philly"), int(float(r["num_gpus"])), steps, st))
        return Trace(name or Path(path).stem, jobs, parse_cluster("128x8"), note="Philly-derived job list (Pollux artifact)")
    for r in rows:
        app = r["application"].strip()
        lo, hi = _POLLUX_GPU_HOURS.get(app, (1, 10))
        gpu_hours = lo * (hi / lo) ** _unit_from(r["name"])
        gpus = int(r["num_replicas"])
        steps, st = _steps_for(gpu_hours * 3600 / gpus)
        jobs.append(_make(_safe(r["name"]), float(r["time"]), _generic_model(app), gpus, steps, st,
                          batch=int(r.get("batch_size") or _GENERIC_BATCH)))
    return Trace(name or Path(path).stem, jobs, parse_cluster("16x4"),
                 note="Pollux workload; durations drawn from its GPU-time buckets (synthetic)")


LOADERS = {"rubick": load_rubick, "blox": load_blox, "tiresias": load_tiresias, "itp": load_itp, "pollux": load_pollux}


def load_gavel(path: str | Path, name: str = "") -> Trace:
    """Gavel's Philly-derived traces (``msr/seed=N/<vc>.trace``, tab-separated: job_type,
    command, num_steps_arg, needs_data_dir, total_steps, arrival_time, scale_factor).
    The request's speed is Gavel's measured V100 steps/s at its scale factor (scaled by
    GPUs^0.8 from the largest measured one beyond it), moved to the reference GPU by the
    measured A100 : V100 ratio; ``truth_key`` "gavel:<job type>" makes the ground truth
    read Gavel's table on K80/P100/V100 (``sim.gputruth``). Default cluster: Gavel's
    heterogeneous one, scaled down (v100:9x4,p100:9x4,k80:9x4)."""
    from gearshift.sim import gputruth

    jobs = []
    with open(path, newline="") as f:
        for n, line in enumerate(f):
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 7:
                if line.strip():
                    raise ValueError(f"{path}:{n + 1}: expected 7 tab-separated columns, got {len(parts)}")
                continue
            jt, steps, arrival, gpus = parts[0], int(float(parts[4])), float(parts[5]), int(parts[6])
            speed = gputruth.gavel_request_speed(jt, gpus)
            if not speed:
                raise ValueError(f"{path}:{n + 1}: job type {jt!r} has no measured V100 speed in Gavel's table")
            jobs.append(_make(f"g{n}", arrival, _generic_model(jt), gpus, max(1, steps), 1.0 / speed,
                              truth_key=f"gavel:{jt}"))
    return Trace(name or Path(path).stem, jobs, parse_cluster("v100:9x4,p100:9x4,k80:9x4"),
                 note="Gavel Philly-derived trace (MIT); speeds from Gavel's measured throughputs")


LOADERS["gavel"] = load_gavel


def load_trace_file(path: str | Path, fmt: str) -> Trace:
    try:
        loader = LOADERS[fmt]
    except KeyError:
        raise ValueError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}") from None
    return loader(path)


# ---------------------------------------------------------------- named traces
NAMED: dict[str, tuple[str, str]] = {
    "rubick-base": ("rubick", "rubick/workloads/workload-base.csv"),
    "rubick-bp": ("rubick", "rubick/workloads/workload-bp.csv"),
    "rubick-mt": ("rubick", "rubick/workloads/workload-mt.csv"),
    "blox-load8": ("blox", "blox/blox_sim_jobs_load8_seed1.csv"),
    "tiresias-60": ("tiresias", "tiresias/60_job.csv"),
    "pollux-w6": ("pollux", "philly-pollux/workload-6.csv"),
    "philly-10k": ("pollux", "philly-pollux/philly_10k.csv"),
    "itp-c10": ("itp", "microsoft-itp/cluster10.csv"),
    "gavel-2869ce": ("gavel", "gavel/msr_seed0_2869ce.trace"),
}


def trace_names() -> list[str]:
    return sorted(NAMED) + ["synthetic"]


def resample(trace: Trace, seed: int) -> Trace:
    """A held-out workload: the same arrival times, each slot filled with a job drawn
    (with replacement, seeded) from the trace's own jobs."""
    import random

    import msgspec

    rng = random.Random(f"resample|{trace.name}|{seed}")
    jobs = sorted(trace.jobs, key=lambda j: j.submit)
    out = []
    for i, slot in enumerate(jobs):
        t = rng.choice(jobs)
        jid = f"{t.job_id}~{i}"
        out.append(TraceJob(jid, slot.submit, msgspec.structs.replace(t.spec, name=jid), truth_key=t.truth_key))
    return Trace(f"{trace.name}:resample={seed}", out, trace.cluster, note=f"resample of {trace.name}, seed {seed}")


def at_rate(trace: Trace, factor: float) -> Trace:
    """``trace`` with arrivals ``factor`` times as frequent: every submit time divided by
    ``factor`` (x1.5: the same jobs in two thirds of the time; x0.7: spread out)."""
    if not factor > 0 or factor == float("inf"):
        raise ValueError(f"trace {trace.name!r}: rate must be a positive number, got {factor!r}")
    jobs = [TraceJob(j.job_id, j.submit / factor, j.spec, truth_key=j.truth_key) for j in trace.jobs]
    return Trace(f"{trace.name}:rate={factor:g}", jobs, trace.cluster, trace.tracked,
                 note=f"{trace.name} with arrivals x{factor:g} as frequent", extra=dict(trace.extra))


def at_most(trace: Trace, gpus: int) -> Trace:
    """``trace`` without the jobs that ask for more than ``gpus`` GPUs: what a cluster of that
    size admits (admission refuses a request larger than the cluster)."""
    if gpus < 1:
        raise ValueError(f"trace {trace.name!r}: max-gpus must be at least 1, got {gpus}")
    keep = [j for j in trace.jobs if j.spec.plan.gpus <= gpus]
    ids = {j.job_id for j in keep}
    tracked = None if trace.tracked is None else frozenset(trace.tracked & ids)
    return Trace(f"{trace.name}:max-gpus={gpus}", keep, trace.cluster, tracked,
                 note=f"{trace.name} without its {len(trace.jobs) - len(keep)} jobs above {gpus} GPUs",
                 extra=dict(trace.extra))


def _number(name: str, key: str, text: str, kind):
    try:
        return kind(text)
    except ValueError:
        raise ValueError(f"trace {name!r}: {key} needs {'an integer' if kind is int else 'a number'}, "
                         f"got {text!r}") from None


# transforms a trace name may end with, applied left to right: rubick-base:resample=1:rate=1.5
TRANSFORMS = {"resample": (int, resample), "rate": (float, at_rate), "max-gpus": (int, at_most)}


def load_named(name: str, seed: int = 0, **synthetic_options) -> Trace:
    head, *mods = name.split(":")
    if head == "synthetic" and mods:
        head = f"synthetic:{mods.pop(0)}"  # synthetic:jobs=N,rate=R,... (its own options come first)
    if mods:
        trace = load_named(head, seed, **synthetic_options)
        for m in mods:
            key, eq, text = m.partition("=")
            if key not in TRANSFORMS or not eq:
                raise ValueError(f"trace {name!r}: unknown transform {m!r}; known: "
                                 + ", ".join(f"{k}=N" for k in TRANSFORMS))
            kind, fn = TRANSFORMS[key]
            trace = fn(trace, _number(name, key, text, kind))
        return trace
    if name == "synthetic" or name.startswith("synthetic:"):
        from gearshift.sim.synthetic import parse_options, synthetic_trace

        opts = parse_options(name.partition(":")[2]) if ":" in name else {}
        opts.update(synthetic_options)
        return synthetic_trace(seed=seed, **opts)
    try:
        fmt, rel = NAMED[name]
    except KeyError:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(trace_names())}") from None
    with fewer_collections():  # every job's spec made and kept
        trace = LOADERS[fmt](DATA / rel, name=name)
    return trace


__all__ = ["FORMATS", "LOADERS", "NAMED", "load_named", "load_trace_file", "trace_names", "ClusterSpec"]
