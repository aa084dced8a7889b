"""rubick alone against cached baseline runs, judged by issue 21's floors.

    python -m sim.quick_judge [--rows rubick-base:measured,...] [--policy-options JSON]
                              [--seed N] [--jobs N] [--cache DIR] [--refresh] [--explain] [--json]

Changing one of rubick's rules and seeing what it does to the evaluation's six rows
(rubick-base, rubick-bp and rubick-mt, measured and extended) took a run of every
baseline again: about 40 minutes on 2 cores, 3 of them rubick's. The baselines do not
change with rubick's options, so their runs are kept here (``--cache``, one JSON file
per row: summaries, per-model means and per-job JCTs, with the git revision they ran
at) and only rubick runs again. The verdict is ``sim.evaluation.judge``'s, on the same
summaries, ratios and per-model means a full run of the row's command would give, and
rubick's per-job geometric mean against the best baseline is ``sim.compare``'s
(``tests/test_sim_quick_judge.py`` checks both against a full run).

``--explain`` says where each row's figures come from: rubick's mean JCT against the best
baseline's per model class and guarantee, and the jobs on the other side of the median
from the baseline with the lowest median (what scratch scripts of stops 43-48 each did
again).

Cached runs are reused whatever changed since; ``--refresh`` runs the baselines again
(do it after changing a baseline, the simulator or the truth). Each row's cache file
names the revision its baselines ran at.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gearshift.sim.cli import _clean, build_parser, ratios, run, stdout_to_stderr
from gearshift.sim.compare import geomean_ratio, job_jcts, model_class
from gearshift.sim.evaluation import (
    CLASS_FLOOR, EXTENDED_FLOOR, MEASURED_FLOOR, PEERS, TRACES, _slug, command, judge, per_model_means,
)

ROWS = tuple(f"{t}:{r}" for r in ("measured", "extended") for t in TRACES)
CACHE = Path(".sim_cache/quick_judge")


def simulate(argv: list[str]) -> dict:
    """One ``gearshift simulate`` command: its summaries, per-model means and each policy's
    per-job JCTs (plain data, for a worker process and a JSON file)."""
    t0 = time.time()
    with stdout_to_stderr(True):  # HiGHS (Sia's MILP) prints to descriptor 1: the output stays the table or JSON
        results, summaries, _ = run(build_parser().parse_args(argv))
    jobs = {r.job.job_id: [model_class(r), bool(r.job.spec.guaranteed)] for r in results[0].records} if results else {}
    return {"argv": argv, "summaries": summaries, "per_model": per_model_means(results),
            "jcts": {res.policy: job_jcts(res) for res in results}, "jobs": jobs, "wall_s": time.time() - t0}


def explain(mine: dict[str, float], best: dict[str, float], median_base: dict[str, float], jobs: dict,
            names: tuple[str, str], top: int = 10) -> dict:
    """Where a row's figures come from: per (model class, guaranteed), rubick's and the best
    baseline's mean JCT over the jobs both finished, and the jobs on the other side of the
    median from ``median_base`` (the baseline of the lowest median), worst first."""
    groups: dict[tuple, list] = {}
    for j, t in mine.items():
        if j in best and j in jobs:
            groups.setdefault(tuple(jobs[j]), []).append((t, best[j]))
    classes = [{"model": m, "guaranteed": g, "jobs": len(v), "rubick_mean_s": sum(a for a, _ in v) / len(v),
                f"{names[0]}_mean_s": sum(b for _, b in v) / len(v),
                "ratio": sum(b for _, b in v) / max(sum(a for a, _ in v), 1e-9)}
               for (m, g), v in sorted(groups.items())]
    out: dict = {"best": names[0], "classes": classes}
    if mine and median_base:
        mm, bm = statistics.median(mine.values()), statistics.median(median_base.values())
        common = [j for j in mine if j in median_base]
        above = sorted((j for j in common if mine[j] > mm and median_base[j] <= bm),
                       key=lambda j: median_base[j] - mine[j])
        below = [j for j in common if mine[j] <= mm and median_base[j] > bm]
        out["median"] = {"baseline": names[1], "rubick_s": mm, "baseline_s": bm, "rubick_above_only": len(above),
                         "rubick_below_only": len(below),
                         "worst": [dict(zip(("model", "guaranteed"), jobs.get(j, ("?", False))), job=j,
                                        rubick_s=mine[j], baseline_s=median_base[j]) for j in above[:top]]}
    return out


def _rev() -> str:
    try:
        got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
        return got.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _row(row: str) -> tuple[str, str]:
    trace, _, regime = row.rpartition(":")
    if not trace or regime not in ("measured", "extended"):
        raise ValueError(f"--rows: {row!r} is not TRACE:measured or TRACE:extended")
    return trace, regime


def verdict(row: str, base: dict, mine: dict, why: bool = False) -> dict:
    """Issue 21's floors for rubick's run ``mine`` against the baselines' run ``base`` of one row."""
    summaries = [s for s in mine["summaries"] if s["policy"] == "rubick"] + [
        s for s in base["summaries"] if s["policy"] != "rubick"]
    pm = {**base["per_model"], "rubick": mine["per_model"].get("rubick", {})}
    floor = MEASURED_FLOOR if _row(row)[1] == "measured" else EXTENDED_FLOOR
    j = judge(summaries, ratios(summaries), pm, floor)
    ru = next(s for s in summaries if s["policy"] == "rubick")
    out = {"row": row, "floor": floor, "baselines_rev": base.get("rev", "unknown"), "met": bool(j and j["ok"])}
    if j is not None:  # the geometric mean against the baseline ``judge`` found best (it reports, no floor)
        out.update(avg_x=j["jct_x"], median_x=j["median_x"], median_best=j["median_best"], best=j["best"],
                   worst_class=j["worst_class"][0], worst_class_x=j["worst_class"][1], makespan_x=j["makespan_x"],
                   geomean_x=geomean_ratio(base["jcts"][j["best"]], mine["jcts"]["rubick"]),
                   unfinished=j["unfinished"])
    if ru["guaranteed_jobs"]:
        out["guarantees"] = f"{ru['guarantees_kept']}/{ru['guaranteed_accepted']}"
    if why and j is not None:
        out["explain"] = explain(mine["jcts"]["rubick"], base["jcts"][j["best"]], base["jcts"][j["median_best"]],
                                 mine.get("jobs", {}), (j["best"], j["median_best"]))
    return out


def run_rows(rows: list[str], opts: str | None, seed: int, jobs: int | None, cache: Path, refresh: bool,
             workers: int = 2, log=print, why: bool = False) -> list[dict]:
    extra = (("--seed", str(seed)) if seed else ()) + (("--jobs", str(jobs)) if jobs else ())
    mine_extra = extra + (("--policy-options", opts) if opts else ())
    base_argv = {row: command(*_row(row), ",".join(PEERS), extra) for row in rows}
    files = {row: cache / f"{_slug(a)}.json" for row, a in base_argv.items()}
    todo = [base_argv[row] for row in rows if refresh or not files[row].exists()]
    mine_argv = {row: command(*_row(row), "rubick", mine_extra) for row in rows}
    cache.mkdir(parents=True, exist_ok=True)
    rev = _rev()
    got: dict[tuple, dict] = {}
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for res in ex.map(simulate, [*todo, *mine_argv.values()]):
            got[tuple(res["argv"])] = res
            log(f"  ran {' '.join(res['argv'][:6])} ({res['wall_s']:.0f} s)")
    out = []
    for row in rows:
        key = tuple(base_argv[row])
        if key in got:
            base = {**got[key], "rev": rev}
            files[row].write_text(json.dumps(base))
        else:
            base = json.loads(files[row].read_text())
        out.append(verdict(row, base, got[tuple(mine_argv[row])], why))
    return out


def _x(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.3f}"


def table(verdicts: list[dict]) -> str:
    lines = [f"| row | avg (floor) | median vs lowest | worst class (floor {CLASS_FLOOR:g}) | makespan | "
             "geomean | unfinished | guarantees | floors |", "|---|---|---|---|---|---|---|---|---|"]
    for v in verdicts:
        lines.append(f"| {v['row']} | {_x(v.get('avg_x'))} ({v['floor']:g}) | {_x(v.get('median_x'))} "
                     f"({v.get('median_best', '-')}) | {v.get('worst_class', '-')} {_x(v.get('worst_class_x'))} | "
                     f"{_x(v.get('makespan_x'))} | {_x(v.get('geomean_x'))} | {v.get('unfinished') or 0} | "
                     f"{v.get('guarantees', '-')} | {'met' if v['met'] else 'not met'} |")
    return "\n".join(lines)


def explained(v: dict) -> str:
    """``--explain``'s text for one verdict."""
    e = v.get("explain")
    if not e:
        return ""
    b = e["best"]
    lines = [f"\n{v['row']}: rubick against {b}, per model class and guarantee (mean JCT, s)",
             f"| model | guaranteed | jobs | rubick | {b} | ratio |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {c['model']} | {'yes' if c['guaranteed'] else 'no'} | {c['jobs']} | {c['rubick_mean_s']:.0f} | "
              f"{c[b + '_mean_s']:.0f} | {c['ratio']:.2f} |" for c in e["classes"]]
    m = e.get("median")
    if m:
        lines.append(f"median {m['rubick_s']:.1f} s against {m['baseline']}'s {m['baseline_s']:.1f} s: "
                     f"{m['rubick_above_only']} jobs above rubick's median and at or below {m['baseline']}'s, "
                     f"{m['rubick_below_only']} the other way; the worst:")
        lines += [f"  {w['job']} ({w['model']}{', guaranteed' if w['guaranteed'] else ''}): rubick {w['rubick_s']:.0f} s, "
                  f"{m['baseline']} {w['baseline_s']:.0f} s" for w in m["worst"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.quick_judge", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="TRACE:REGIME,... (default: the evaluation's six rows)")
    ap.add_argument("--policy-options", default=None, help="rubick's options (JSON), as gearshift simulate takes them")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=None, help="the first N jobs of each trace")
    ap.add_argument("--cache", type=Path, default=CACHE, help="where the baselines' runs are kept")
    ap.add_argument("--refresh", action="store_true", help="run the baselines again")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--explain", action="store_true",
                    help="per model class and guarantee, and the jobs on the other side of the median")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    try:
        for r in rows:
            _row(r)
    except ValueError as exc:
        ap.error(str(exc))
    if not rows:
        ap.error("--rows names no row")
    try:
        if a.policy_options and not isinstance(json.loads(a.policy_options), dict):
            ap.error("--policy-options must be a JSON object")
    except json.JSONDecodeError as exc:
        ap.error(f"--policy-options is not JSON: {exc}")
    if a.jobs is not None and a.jobs < 1:
        ap.error("--jobs must be at least 1")
    verdicts = run_rows(rows, a.policy_options, a.seed, a.jobs, a.cache, a.refresh, a.workers,
                        log=(lambda *_: None) if a.json else lambda m: print(m, file=sys.stderr, flush=True),
                        why=a.explain)
    if a.json:
        print(json.dumps(_clean({"verdicts": verdicts, "met": sum(v["met"] for v in verdicts), "rows": len(verdicts)})))
    else:
        print(table(verdicts))
        print(f"{sum(v['met'] for v in verdicts)} of {len(verdicts)} rows meet every floor")
        for v in verdicts:
            if v.get("explain"):
                print(explained(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
