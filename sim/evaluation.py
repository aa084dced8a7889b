"""Generates docs/evaluation.md: every number in it comes from a run made here.

    python -m sim.evaluation [--out docs/evaluation.md] [--workers 2] [--quick]

Each run is exactly a ``gearshift simulate`` command (``sim.cli.run`` on the parsed
arguments), printed beside its table so it can be repeated from outside:

1. the *measured* regime on rubick-base, rubick-bp, rubick-mt (rubick, sia, synergy,
   antman): every policy may choose only measured configurations or the job's request;
2. the *extended* regime at its defaults on the same traces;
3. a sweep of the extended regime's knobs on rubick-base (rubick and sia);
4. a held-out workload nobody tuned on: rubick-base resampled with seed 1, both regimes;
5. per model, where rubick gains and loses against the best baseline, and the share of
   each policy's allocations that ran at a measured speed.
"""

from __future__ import annotations

import argparse
import math
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

PEERS = ("sia", "synergy", "antman")
POLICIES = "rubick,sia,synergy,antman"
TRACES = ("rubick-base", "rubick-bp", "rubick-mt")
HELD_OUT = "rubick-base:resample=1"
SWEEP = [("--systematic", "0"), ("--systematic", "0.3"), ("--distance-slowdown", "0"),
         ("--distance-slowdown", "0.25"), ("--headroom", "0"), ("--headroom", "0.2")]


def command(trace: str, regime: str, policies: str = POLICIES, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--trace", trace, "--policies", policies, "--regime", regime, *extra, "-o", "json", "--no-progress"]


ABLATIONS = [("rubick as before issue 10's last fix: a pending job's start charged the restart relative to its "
              "whole run", '{"start_unavoidable": false}'),
             ("rubick with the completion weight (Smith's rule, beta = 1)", '{"completion_weight": 1}')]


def _run(argv: list[str]):
    from .cli import build_parser, run

    args = build_parser().parse_args(argv)
    t0 = time.time()
    results, summaries, rat = run(args)
    per_model = {}
    for res in results:
        by: dict[str, list[tuple[float, float]]] = {}
        for r in res.records:
            if r.finish is not None:
                by.setdefault(r.job.truth_key or r.job.spec.model.name, []).append(
                    (r.finish - r.job.submit, r.first_start - r.job.submit))
        per_model[res.policy] = {m: (sum(x for x, _ in v) / len(v), len(v), sum(q for _, q in v) / len(v))
                                 for m, v in by.items()}
    return argv, summaries, rat, per_model, time.time() - t0


def _slug(argv: list[str]) -> str:
    keep = [a.lstrip("-").replace(":", "_").replace("=", "") for a in argv if a not in ("-o", "json", "--no-progress")]
    return "_".join(k for k in keep if k not in ("trace", "policies", "regime")).replace(",", "+")[:120] or "run"


def _h(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 3600:.2f}"


def _x(v) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}x"


def _cmd(argv: list[str]) -> str:
    import shlex

    return "gearshift simulate " + " ".join(shlex.quote(a) for a in argv if a != "--no-progress")


def _table(summaries: list[dict], rat: dict) -> str:
    lines = ["| policy | avg JCT h | median h | p99 h | makespan h | queue h | reconf | stalled (OOM) | "
             "guarantees kept | unfinished | measured % | JCT vs best baseline | makespan vs best baseline |",
             "|---|" + "---:|" * 12]
    for s in summaries:
        g = f"{s['guarantees_kept']}/{s['guaranteed_accepted']}" if s["guaranteed_jobs"] else "-"
        r = rat.get(s["policy"], {})
        lines.append(
            f"| {s['policy']} | {_h(s['avg_jct_s'])} | {_h(s['median_jct_s'])} | {_h(s['p99_jct_s'])} | "
            f"{_h(s['makespan_s'])} | {_h(s['avg_queue_delay_s'])} | {s['reconfigurations']} | "
            f"{s['stalled_allocations']} | {g} | {s['unfinished']} | {100 * s['measured_share']:.0f} | "
            f"{_x(r.get('jct_x'))} | {_x(r.get('makespan_x'))} |")
    return "\n".join(lines)


def _verdict(summaries: list[dict], rat: dict, floor: float) -> str:
    by = {s["policy"]: s for s in summaries}
    r = by.get("rubick")
    if r is None:
        return ""
    jx, mx = rat["rubick"]["jct_x"], rat["rubick"]["makespan_x"]
    unf = {p: s["unfinished"] for p, s in by.items() if s["unfinished"]}
    ok = (not math.isnan(jx) and jx >= floor and mx >= 1.0 and not unf
          and (not r["guaranteed_jobs"] or r["guarantees_kept"] == r["guaranteed_accepted"]))
    parts = [f"rubick avg JCT {_x(jx)} the best baseline's (floor {floor:g}x)", f"makespan {_x(mx)} (floor 1.0x)"]
    if unf:
        parts.append(f"unfinished: {unf}")
    if r["guaranteed_jobs"]:
        parts.append(f"guarantees kept {r['guarantees_kept']}/{r['guaranteed_accepted']}")
    return f"**{'Floor met' if ok else 'Floor NOT met'}**: " + "; ".join(parts) + "."


def _per_model(per_model: dict, summaries: list[dict]) -> str:
    peers = [s for s in summaries if s["policy"] in PEERS and s["unfinished"] == 0]
    if not peers or "rubick" not in per_model:
        return ""
    best = min(peers, key=lambda s: s["avg_jct_s"])["policy"]
    rows = [f"Best baseline here: **{best}**. Share of the gap: that model's part of the difference in summed JCT "
            "(negative: rubick loses there).", "",
            "| model | jobs | rubick avg JCT h | " + best + " avg JCT h | ratio | rubick avg queue h | " + best
            + " avg queue h | share of the total gap |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    r, b = per_model["rubick"], per_model[best]
    gap_total = sum(b[m][0] * b[m][1] for m in b) - sum(r[m][0] * r[m][1] for m in r)
    for m in sorted(set(r) & set(b), key=lambda m: -(b[m][0] - r[m][0]) * r[m][1]):
        gap = b[m][0] * b[m][1] - r[m][0] * r[m][1]
        share = f"{100 * gap / gap_total:.0f}%" if gap_total else "-"
        rows.append(f"| {m} | {r[m][1]} | {_h(r[m][0])} | {_h(b[m][0])} | {_x(b[m][0] / r[m][0])} | "
                    f"{_h(r[m][2])} | {_h(b[m][2])} | {share} |")
    return "\n".join(rows)


def _ablation(opts: str) -> list[str]:
    return command("rubick-base", "measured", "rubick", ("--policy-options", opts))


SWEEP_JOBS = 150  # the knob sweep runs on rubick-base's first 150 jobs (a full run takes ~10 min a policy pair)


def sweep_command(k: tuple[str, str]) -> list[str]:
    return command("rubick-base", "extended", "rubick,sia", (*k, "--jobs", str(SWEEP_JOBS)))


def all_runs() -> list[list[str]]:
    runs = [command(t, reg) for reg in ("measured", "extended") for t in TRACES]
    runs += [command(HELD_OUT, reg) for reg in ("measured", "extended")]
    runs += [_ablation(o) for _, o in ABLATIONS]
    runs += [sweep_command(k) for k in SWEEP]
    runs += [command("rubick-base", "extended", "rubick,sia", ("--jobs", str(SWEEP_JOBS)))]
    return runs


def _load(json_dir: Path) -> dict[tuple, tuple]:
    """Runs saved by an earlier ``--json-dir`` (keyed by their command)."""
    import json

    got = {}
    by_cmd = {_cmd(a): a for a in all_runs()}
    for f in sorted(json_dir.glob("*.json")):
        d = json.loads(f.read_text())
        argv = by_cmd.get(d.get("command"))
        if argv is None:
            continue
        nan = lambda x: math.nan if x is None else x
        summaries = [{k: nan(v) if k.endswith("_s") or k == "measured_share" else v for k, v in s.items()}
                     for s in d["results"]]
        rat = {p: {k: nan(v) for k, v in r.items()} for p, r in d["ratios_vs_best_baseline"].items()}
        pm = {p: {m: (v["avg_jct_s"], v["jobs"], v["avg_queue_s"]) for m, v in ms.items()}
              for p, ms in d.get("per_model", {}).items()}
        got[tuple(argv)] = (summaries, rat, pm)
    return got


def generate(out: Path, workers: int = 2, quick: bool = False, json_dir: Path | None = None,
             only: str | None = None, from_json: bool = False) -> str:
    import json

    from .cli import _clean

    t0 = time.time()
    runs = all_runs()
    if only:
        runs = [a for a in runs if only in _cmd(a)]
    if quick:
        runs = [command("rubick-base", "measured", extra=("--jobs", "60"))]
    got: dict[tuple, tuple] = _load(json_dir) if (from_json and json_dir is not None) else {}
    runs = [a for a in runs if tuple(a) not in got]
    if json_dir is not None:
        json_dir.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for argv, summaries, rat, per_model, wall in ex.map(_run, runs):
            got[tuple(argv)] = (summaries, rat, per_model)
            print(f"  {_cmd(argv)}: rubick {_x(rat.get('rubick', {}).get('jct_x'))} ({wall:.0f} s)", flush=True)
            if json_dir is not None:  # what `gearshift simulate ... -o json` prints, plus the per-model means
                doc = {"command": _cmd(argv), "wall_s": round(wall, 1), "results": summaries,
                       "ratios_vs_best_baseline": rat,
                       "per_model": {p: {m: {"avg_jct_s": v[0], "jobs": v[1], "avg_queue_s": v[2]}
                                         for m, v in pm.items()} for p, pm in per_model.items()}}
                (json_dir / f"{_slug(argv)}.json").write_text(json.dumps(_clean(doc), indent=1))

    def res(argv):
        return got.get(tuple(argv))

    doc = ["# gearshift evaluation", "",
           f"Generated by `make evaluation` (`python -m sim.evaluation`, {time.time() - t0:.0f} s). Every number "
           "comes from the `gearshift simulate` command printed above its table; nothing is typed in by hand.", "",
           "## What is compared, and how honestly", "",
           "- **Belief** (what every policy is told): the performance model fitted only on each model's "
           "profiling runs plus at most 7 configurations chosen by the profiler's fixed rule "
           "(`perfmodel.validate.profiled_data`, as `gearshift perfmodel validate` fits its held-out model). "
           "The optimizer service uses the same fit. It never sees the other measured rows.",
           "- **Learning**: every model-driven policy (rubick, sia, synergy's CPU sizing) gets the belief through "
           "`policies.learning.LearningOracle`: an observed speed replaces the prediction for that configuration "
           "and refits a per-(model, plan family) scale; an out-of-memory start rules the plan out. In the "
           "simulator it is fed when a job starts training and when a launch runs out of memory; live, from the "
           "agents' STEPPED/EXITED reports.",
           "- **Truth**: a measured Rubick row for the (model, plan family, placement) x per-run noise (sigma "
           "0.05), or the job's own request at the trace's speed. Elsewhere (extended regime only, or a "
           "baseline that places a request in a shape never measured): the all-rows fit (not the belief) x a "
           "seeded systematic error per (model, plan family) x a slowdown growing with the distance from what "
           "was measured, and out of memory where an independent memory estimate leaves too little headroom "
           "(`sim/extended.py`, knobs in `sim/README.md`).",
           "- **measured regime**: every policy may choose only configurations with a measured row or the job's "
           "request (the oracle answers 0 for any other). **extended regime**: any configuration.",
           "- Defaults: 8x8 GPUs, rounds every 60 s and on arrival/completion, restart cost from the measured "
           "switch model (`perfmodel/restart.py`), seed 0. Baselines as their authors describe them "
           "(`policies/`); on rubick-base and rubick-bp no job is guaranteed, so antman reduces to FIFO with "
           "backfill and gives the same numbers as synergy there: \"best of three\" is then really the best "
           "of two.", ""]
    for regime, floor in (("measured", 1.15), ("extended", 1.5)):
        doc += [f"## {regime.capitalize()} regime", ""]
        for t in TRACES:
            argv = command(t, regime)
            r = res(argv)
            if r is None:
                continue
            summaries, rat, per_model = r
            doc += [f"### {t}", "", f"`{_cmd(argv)}`", "", _table(summaries, rat), "",
                    _verdict(summaries, rat, floor), "",
                    "Per model, against the best baseline (sorted by where rubick gains most):", "",
                    _per_model(per_model, summaries), ""]
    base = res(command("rubick-base", "measured"))
    abl = [(what, opts, res(_ablation(opts))) for what, opts in ABLATIONS]
    if base is not None and any(a[2] for a in abl):
        peers = [s for s in base[0] if s["policy"] in PEERS and s["unfinished"] == 0]
        best = min(peers, key=lambda s: s["avg_jct_s"]) if peers else None
        rub = next(s for s in base[0] if s["policy"] == "rubick")
        doc += ["## Where the measured-regime lead comes from (rubick-base, measured)", "",
                "Rubick run alone with one of its options changed, against the best baseline of the run above "
                f"({best['policy'] if best else '-'}, avg JCT {_h(best['avg_jct_s']) if best else '-'} h, makespan "
                f"{_h(best and min(s['makespan_s'] for s in peers))} h).", "",
                "| rubick variant | avg JCT h | makespan h | reconf | JCT vs best baseline |", "|---|---:|---:|---:|---:|",
                f"| default (`{_cmd(command('rubick-base', 'measured'))}`) | {_h(rub['avg_jct_s'])} | "
                f"{_h(rub['makespan_s'])} | {rub['reconfigurations']} | "
                f"{_x(best['avg_jct_s'] / rub['avg_jct_s'] if best else None)} |"]
        for what, opts, r in abl:
            if r is None:
                continue
            a = r[0][0]
            ratio = best["avg_jct_s"] / a["avg_jct_s"] if best and a["unfinished"] == 0 else None
            doc.append(f"| {what} (`--policy-options '{opts}'`) | {_h(a['avg_jct_s'])} | {_h(a['makespan_s'])} | "
                       f"{a['reconfigurations']} | {_x(ratio)} |")
        doc.append("")
    doc += [f"## Extended regime: knob sweep (rubick-base's first {SWEEP_JOBS} jobs, rubick vs sia)", "",
            "| knob | value | rubick avg JCT h | sia avg JCT h | rubick vs sia | rubick unfinished | rubick OOM starts | "
            "rubick measured % |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for k in [("defaults", "-")] + SWEEP:
        r = res(sweep_command(k) if k[0] != "defaults" else
                command("rubick-base", "extended", "rubick,sia", ("--jobs", str(SWEEP_JOBS))))
        if r is None:
            continue
        by = {s["policy"]: s for s in r[0]}
        ru, si = by["rubick"], by["sia"]
        ratio = si["avg_jct_s"] / ru["avg_jct_s"] if ru["unfinished"] == 0 else math.nan
        doc.append(f"| {k[0]} | {k[1]} | {_h(ru['avg_jct_s'])} | {_h(si['avg_jct_s'])} | {_x(ratio)} | "
                   f"{ru['unfinished']} | {ru['stalled_allocations']} | {100 * ru['measured_share']:.0f} |")
    doc += ["", "Defaults: --systematic 0.15, --distance-slowdown 0.10, --headroom 0.10. Each row changes one knob "
            f"(`{_cmd(sweep_command(('--headroom', '0.2')))}`).", ""]
    doc += ["## Held-out workload", "",
            "rubick-base resampled with seed 1 (`--trace rubick-base:resample=1`: the same arrival times, each "
            "slot filled with a job drawn with replacement from rubick-base). Nobody tuned on it.", ""]
    for regime in ("measured", "extended"):
        argv = command(HELD_OUT, regime)
        r = res(argv)
        if r is not None:
            doc += [f"### {regime}", "", f"`{_cmd(argv)}`", "", _table(r[0], r[1]), "",
                    _verdict(r[0], r[1], 1.15 if regime == "measured" else 1.5), ""]
    text = "\n".join(doc) + "\n"
    out.write_text(text)
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sim.evaluation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/evaluation.md")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="one small run (a smoke test of the generator)")
    ap.add_argument("--json-dir", help="also write each run's summaries, ratios and per-model means here as JSON")
    ap.add_argument("--from-json", action="store_true", help="reuse the runs already saved in --json-dir")
    ap.add_argument("--only", help="run only the commands containing this text (e.g. --jobs for the sweep)")
    a = ap.parse_args(argv)
    if a.from_json and not a.json_dir:
        ap.error("--from-json needs --json-dir")
    generate(Path(a.out), a.workers, a.quick, Path(a.json_dir) if a.json_dir else None, a.only, a.from_json)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
