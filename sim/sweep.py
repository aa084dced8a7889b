"""rubick against the best baseline at every point of a sweep (issue 21):

    python -m sim.sweep [--json] [--workers 2] [--jobs N] [--policies rubick,sia,...]
                        [--points default,seed=1,...] [--cache DIR]

One point changes one thing from the default run (rubick-base, the extended regime at its
defaults, seed 0, the trace's 8x8 cluster, its own arrival rate): the extended regime's
knobs (headroom 0 and 0.2, systematic error 0 and 0.3, distance slowdown 0 and 0.2), the
seeds 1-4, the resamples 1-3 (``rubick-base:resample=N``), the clusters 4x8, 12x8 and 16x8,
and arrivals x0.7 and x1.5 as frequent (``rubick-base:rate=X``).

On 4x8 (32 GPUs) the jobs that ask for more than the cluster holds (39 of 406: llama30 at 40
and 48 GPUs) are left out (``rubick-base:max-gpus=32``), as admission refuses them; every
other point runs every job.

Every point is exactly a ``gearshift simulate`` command (printed in the output) of rubick
and the best-of baselines (``sim.baselines``: sia, synergy, synergy-srtf, antman, pollux), compared
by ``sim.compare``: the ratio of average JCTs (best baseline over rubick), of medians, the
per-job geometric mean, the worst model class and the makespan. ``ok``: rubick at least
``FLOOR`` x the best baseline on average JCT at every point, and no policy with an
unfinished job. With ``--cache DIR`` each point's result is saved there and a rerun skips it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gearshift.sim.baselines import best_baselines
from gearshift.sim.cli import stdout_to_stderr

FLOOR = 1.1
TRACE = "rubick-base"
POINTS: dict[str, tuple[str, tuple[str, ...]]] = {  # name -> (trace, extra flags)
    "default": (TRACE, ()),
    **{f"headroom={v}": (TRACE, ("--headroom", v)) for v in ("0", "0.2")},
    **{f"systematic={v}": (TRACE, ("--systematic", v)) for v in ("0", "0.3")},
    **{f"distance-slowdown={v}": (TRACE, ("--distance-slowdown", v)) for v in ("0", "0.2")},
    **{f"seed={s}": (TRACE, ("--seed", str(s))) for s in (1, 2, 3, 4)},
    **{f"resample={s}": (f"{TRACE}:resample={s}", ()) for s in (1, 2, 3)},
    "cluster=4x8": (f"{TRACE}:max-gpus=32", ("--cluster", "4x8")),
    **{f"cluster={c}": (TRACE, ("--cluster", c)) for c in ("12x8", "16x8")},
    **{f"rate={r}": (f"{TRACE}:rate={r}", ()) for r in ("0.7", "1.5")},
}


def policies() -> str:
    return ",".join(("rubick", *best_baselines()))


def argv_for(point: str, policy_list: str, jobs: int | None) -> list[str]:
    trace, extra = POINTS[point]
    head = ("--jobs", str(jobs)) if jobs else ()
    return ["--trace", trace, "--policies", policy_list, "--regime", "extended", *extra, *head, "-o", "json",
            "--no-progress"]


def command(argv: list[str]) -> str:
    import shlex

    return "gearshift simulate " + " ".join(shlex.quote(a) for a in argv if a != "--no-progress")


def _num(x):
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else x


def run_point(task: tuple[str, list[str]]) -> dict:
    """One point: the simulate command's summaries and rubick's comparison with the best."""
    import time

    from gearshift.sim.cli import build_parser, run
    from gearshift.sim.compare import compare

    point, argv = task
    t0 = time.process_time()
    results, summaries, _ = run(build_parser().parse_args(argv))
    vs = compare(results, summaries).get("rubick", {})
    return {
        "point": point, "command": command(argv), "cpu_s": round(time.process_time() - t0, 1),
        "best_baseline": vs.get("best_baseline"),
        "avg_jct_ratio": _num(vs.get("avg_jct_ratio")), "median_jct_ratio": _num(vs.get("median_jct_ratio")),
        "per_job_geomean_ratio": _num(vs.get("per_job_geomean_ratio")),
        "makespan_ratio": _num(vs.get("makespan_ratio")),
        "worst_model_ratio": _num(vs.get("worst_model_ratio")),
        "per_model_ratio": {m: _num(v["ratio"]) for m, v in vs.get("per_model", {}).items()},
        "avg_jct_s": {s["policy"]: _num(s["avg_jct_s"]) for s in summaries},
        "unfinished": {s["policy"]: s["unfinished"] for s in summaries},
        "jobs": len(results[0].records) if results else 0,
    }


def verdict(rows: list[dict], floor: float = FLOOR) -> dict:
    """The worst point (lowest average-JCT ratio; a point with no ratio is worst of all) and
    whether every point holds the floor with every job finished."""
    def key(r):
        v = r["avg_jct_ratio"]
        return -math.inf if v is None else v

    worst = min(rows, key=key) if rows else None
    unfinished = [r["point"] for r in rows if any(r["unfinished"].values())]
    below = [r["point"] for r in rows if key(r) < floor]
    return {"floor": floor, "worst_point": worst["point"] if worst else None,
            "worst_avg_jct_ratio": worst["avg_jct_ratio"] if worst else None,
            "below_floor": below, "with_unfinished": unfinished,
            "ok": bool(rows) and not below and not unfinished}


def sweep(points: list[str], policy_list: str, jobs: int | None, workers: int, cache: Path | None,
          log=None) -> list[dict]:
    tasks = [(p, argv_for(p, policy_list, jobs)) for p in points]
    done: dict[str, dict] = {}
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        for p, argv in tasks:
            f = cache / f"{p}.json"
            if f.exists():
                row = json.loads(f.read_text())
                if row.get("command") == command(argv):
                    done[p] = row
    todo = [t for t in tasks if t[0] not in done]
    with ProcessPoolExecutor(max_workers=max(1, workers)) as ex:
        for row in ex.map(run_point, todo):
            done[row["point"]] = row
            if cache is not None:
                (cache / f"{row['point']}.json").write_text(json.dumps(row, indent=1))
            if log:
                log(f"  {row['point']}: rubick {row['avg_jct_ratio'] or float('nan'):.2f}x {row['best_baseline']} "
                    f"({row['cpu_s']:.0f} CPU s)")
    return [done[p] for p, _ in tasks]


def _table(rows: list[dict], v: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.2f}x"
    out = ["| point | best baseline | avg JCT | median | per-job geo-mean | worst class | makespan | unfinished |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        unf = ", ".join(f"{p} {n}" for p, n in r["unfinished"].items() if n) or "none"
        out.append(f"| {r['point']} | {r['best_baseline']} | {f(r['avg_jct_ratio'])} | {f(r['median_jct_ratio'])} | "
                   f"{f(r['per_job_geomean_ratio'])} | {f(r['worst_model_ratio'])} | {f(r['makespan_ratio'])} | {unf} |")
    out.append("")
    out.append(f"worst point: {v['worst_point']} ({f(v['worst_avg_jct_ratio'])}); floor {v['floor']}x: "
               + ("ok" if v["ok"] else f"below at {v['below_floor'] or '-'}, unfinished at {v['with_unfinished'] or '-'}"))
    return "\n".join(out)


def _point_list(text: str | None) -> list[str]:
    if not text:
        return list(POINTS)
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in POINTS]
    if bad:
        raise ValueError(f"--points: unknown point {bad[0]!r}; known: {', '.join(POINTS)}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    ap.add_argument("--workers", type=int, default=2, help="points run in parallel (default 2)")
    ap.add_argument("--jobs", type=int, help="only each trace's first N jobs (a quick look; the floor is for all)")
    ap.add_argument("--policies", help=f"comma-separated (default: {policies()})")
    ap.add_argument("--points", help="comma-separated point names (default: all)")
    ap.add_argument("--cache", type=Path, help="save each point here; a rerun skips the saved ones")
    ap.add_argument("--floor", type=float, default=FLOOR)
    args = ap.parse_args(argv)
    try:
        points = _point_list(args.points)
        if args.jobs is not None and args.jobs < 1:
            raise ValueError(f"--jobs must be at least 1, got {args.jobs}")
        if args.workers < 1:
            raise ValueError(f"--workers must be at least 1, got {args.workers}")
        plist = args.policies or policies()
        if "rubick" not in [p.strip() for p in plist.split(",")]:
            raise ValueError("--policies must include rubick (the policy the sweep compares)")
        # the points' workers inherit it: HiGHS's notes (Sia's MILP) go to stderr, --json stays JSON
        with stdout_to_stderr(args.json):
            rows = sweep(points, plist, args.jobs, args.workers, args.cache,
                         log=None if args.json else (lambda s: print(s, file=sys.stderr, flush=True)))
    except ValueError as e:
        print(f"python -m sim.sweep: {e}", file=sys.stderr)
        return 2
    v = verdict(rows, args.floor)
    if args.json:
        print(json.dumps({"trace": TRACE, "regime": "extended", "policies": plist, "jobs": args.jobs,
                          "points": rows, **v}, indent=1))
    else:
        print(_table(rows, v))
    return 0 if v["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
