"""Generates docs/evaluation.md: every number in it comes from a run made here.

    python -m sim.evaluation [--out docs/evaluation.md] [--workers 2] [--quick]

Each run is exactly a ``gearshift simulate`` command (``sim.cli.run`` on the parsed
arguments), printed beside its table so it can be repeated from outside:

1. the *measured* regime on rubick-base, rubick-bp, rubick-mt (rubick and the best-of
   baselines, ``sim.baselines``: sia, synergy, synergy-srtf, antman, pollux where
   registered): every policy may choose only measured configurations or the job's request;
2. the *extended* regime at its defaults on the same traces;
3. a sweep of the extended regime's knobs on rubick-base (rubick and sia);
4. a held-out workload nobody tuned on: rubick-base resampled with seed 1, both regimes;
5. per model, where rubick gains and loses against the best baseline, and the share of
   each policy's allocations that ran at a measured speed.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from gearshift.sim.baselines import best_baselines  # noqa: E402

# The baselines a user could pick (issue 21): sia, synergy, synergy-srtf, antman and pollux
# (its whole-trace runs finish since its search has adaptdl's min_replicas,
# policies/pollux_search.py; 230-430 CPU s a run).
PEERS = tuple(best_baselines())
POLICIES = ",".join(("rubick", *PEERS))
MEASURED_FLOOR = 1.3  # issue 21's floors: measured 1.3x, extended 1.5x
EXTENDED_FLOOR = 1.5
TRACES = ("rubick-base", "rubick-bp", "rubick-mt")
HELD_OUT = "rubick-base:resample=1"
SWEEP = [("--systematic", "0"), ("--systematic", "0.3"), ("--distance-slowdown", "0"),
         ("--distance-slowdown", "0.25"), ("--headroom", "0"), ("--headroom", "0.2")]


def command(trace: str, regime: str, policies: str = POLICIES, extra: tuple[str, ...] = ()) -> list[str]:
    return ["--trace", trace, "--policies", policies, "--regime", regime, *extra, "-o", "json", "--no-progress"]


# one min_run_time pin for every job in every round, as before per-job pins and before pins only
# where something may outrank a running job (policies/rubick.py, pin_window, pins_needed)
FLAT_PIN = '{"pin_restarts": 0, "pin_always": true}'
# per-job pins in every round, as before pins_needed
PIN_ALWAYS = '{"pin_always": true}'
# pinned jobs fixed against every job, as before pins guarded against guarantees only (pin_scope)
PIN_ALL = '{"pin_scope": "all"}'
# a running job's utilities without the restart it pays to resume (rubick_rules.resume_weights)
NO_RESUME = '{"resume_charge": false}'
ABLATIONS = [("rubick as before issue 10's start fix: a pending job's start charged the restart relative to its "
              "whole run (and no resume charge, which came later)", '{"start_unavoidable": false, "resume_charge": false}'),
             ("rubick without the completion weight (Smith's rule, beta = 1 by default)", '{"completion_weight": 0}'),
             ("rubick without the resume charge (preempting a job free of the restart it pays to resume)",
              NO_RESUME),
             ("rubick with pins in every round, as before: a job switched less than 10 of its own restarts ago "
              "(at most 600 s) keeps its allocation with no guarantee and one priority class too", PIN_ALWAYS),
             ("rubick with one pin for every job in every round, the minimum run time (600 s), instead of 10 of "
              "its own restarts", FLAT_PIN),
             ("rubick without giving moves back: a running job sent with the same plan and shape to a node like "
              "its own stays sent, and the job that took its node keeps it (policies/rubick_moves.py)",
              '{"give_back": false}')]
# rubick-mt (measured): policies/rubick_rules.py's rules, one changed at a time
MT_ABLATIONS = [("with the bounded guarantee wait (an option, off)", '{"guarantee_wait_bound": true}'),
                ("with the bounded wait, without the resume charge", '{"guarantee_wait_bound": true, "resume_charge": false}'),
                ("without the starved best-effort seed (rubick before it)", '{"starved_seed": 0}'),
                ("without the room held for the queue's head (policies/rubick_reserve.py)", '{"reserve": false}'),
                ("without keeping admitted starved jobs", '{"keep_starved": false}'),
                ("with the queue by run time, not GPU-time", '{"queue_key": "time"}'),
                ("without the efficiency floor for best-effort shrinks", '{"min_efficiency": 0}'),
                ("without the resume charge", NO_RESUME),
                ("with one 600 s pin for every job, not 10 of its own restarts", FLAT_PIN),
                ("with pinned best-effort jobs fixed against every job from their last switch, as before, not "
                 "guarded against guarantees from their last (re)start", PIN_ALL)]
# the same option in the extended regime, where it costs rubick's JCT lead (policies/rubick_rules.py)
MT_EXT_BOUND = '{"guarantee_wait_bound": true}'


# The Rubick artifact's own simulator on its three traces (issue 21 item 7): its defaults,
# 8x8 A800, 60 s rounds, a flat 260 s per reallocation (`simulator/job.py::reallocate`);
# figures from ../shared/reference/baseline-fidelity.md, "The Rubick artifact's own
# simulator, on its traces" (AlibabaPAI/reconfigurable-dl-scheduler at 80e8524).
ARTIFACT = {"rubick-base": (1.01, 16.30), "rubick-bp": (1.01, 16.30), "rubick-mt": (1.12, 16.88)}
ARTIFACT_RESTART_S = "260"


def artifact_command(trace: str) -> list[str]:
    return command(trace, "measured", "rubick", ("--restart-cost", ARTIFACT_RESTART_S))


def _artifact(res) -> list[str]:
    """rubick beside the artifact's own figures, each trace run with its flat 260 s restart."""
    got = [(t, res(artifact_command(t))) for t in TRACES]
    if not any(r for _, r in got):
        return []
    out = ["## Beside the Rubick artifact's own simulator", "",
           "The artifact's figures are its own simulator running its own policy on the same three traces, "
           "with its defaults (8x8 A800, 60 s rounds, a flat 260 s per reallocation). Ours: rubick in the "
           "measured regime with the same flat 260 s restart (`--restart-cost 260`).", "",
           "| trace | artifact avg JCT h | ours avg JCT h | artifact makespan h | ours makespan h | ours restarts | command |",
           "|---|---:|---:|---:|---:|---:|---|"]
    for t, r in got:
        if r is None:
            continue
        a = next(s for s in r[0] if s["policy"] == "rubick")
        jct, mk = ARTIFACT[t]
        out.append(f"| `{t}` | {jct:.2f} | {_h(a['avg_jct_s'])} | {mk:.2f} | {_h(a['makespan_s'])} | "
                   f"{a['restarts']} | `{_cmd(artifact_command(t))}` |")
    out += ["", "What differs between the two simulators (so the rows are not a fidelity check):",
            "- the artifact lets a preempted job keep its GPUs (a reallocation costs time, not capacity); ours "
            "frees them and the job restarts later;",
            "- the artifact's policy searches GPUs only (threads 1, bandwidth level 0) and stops shrinking a job "
            "after 5 restarts; ours also sizes CPUs and locality and pays each job's restart;",
            "- the artifact's speed is its measured trace rows; ours is a measured row x per-run noise (sigma "
            "0.05) and the policy acts on a belief fitted on at most 7 profiled configurations per model, learning "
            "as jobs run;",
            "- its performance model hard-codes 20 GB/s between nodes; ours is fitted;",
            "- its rounds come every 60 s; ours also on each arrival and completion.", ""]
    return out


def _mt_ext_bound() -> list[str]:
    return command("rubick-mt", "extended", "rubick", ("--policy-options", MT_EXT_BOUND))


def _run(argv: list[str]):
    from gearshift.sim.cli import build_parser, run

    args = build_parser().parse_args(argv)
    t0 = time.time()
    results, summaries, rat = run(args)
    from gearshift.sim.compare import compare

    vs_best = compare(results, summaries)
    return argv, summaries, rat, per_model_means(results), time.time() - t0, vs_best


def per_model_means(results) -> dict[str, dict[str, tuple[float, int, float]]]:
    """Per policy and model: (avg JCT, finished jobs, avg queueing delay), in seconds."""
    per_model = {}
    for res in results:
        by: dict[str, list[tuple[float, float]]] = {}
        for r in res.records:
            if r.finish is not None:
                by.setdefault(r.job.truth_key or r.job.spec.model.name, []).append(
                    (r.finish - r.job.submit, r.first_start - r.job.submit))
        per_model[res.policy] = {m: (sum(x for x, _ in v) / len(v), len(v), sum(q for _, q in v) / len(v))
                                 for m, v in by.items()}
    return per_model


def _slug(argv: list[str]) -> str:
    keep = [a.lstrip("-").replace(":", "_").replace("=", "") for a in argv if a not in ("-o", "json", "--no-progress")]
    import re

    name = "_".join(k for k in keep if k not in ("trace", "policies", "regime")).replace(",", "+")
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("_")[:120] or "run"


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


CLASS_FLOOR = 0.95  # issue 21: every model class at least 0.95x the best baseline's


def judge(summaries: list[dict], rat: dict, pm: dict, floor: float) -> dict | None:
    """Issue 21's floors for one run: rubick's avg JCT >= ``floor`` x the best baseline's, its
    median no worse than the best baseline median, every model class >= 0.95x against the
    best baseline (by avg JCT), makespan no worse than the shortest, no unfinished job for
    any policy, every accepted guarantee kept. The per-job geometric mean (against the best
    baseline) is reported beside them."""
    by = {s["policy"]: s for s in summaries}
    ru = by.get("rubick")
    peers = [s for s in summaries if s["policy"] in PEERS and s["unfinished"] == 0]
    if ru is None or not peers:
        return None
    jx, mx = rat["rubick"]["jct_x"], rat["rubick"]["makespan_x"]
    med = min(peers, key=lambda s: s["median_jct_s"])
    medx = med["median_jct_s"] / ru["median_jct_s"] if ru["median_jct_s"] else math.nan
    best = min(peers, key=lambda s: s["avg_jct_s"])["policy"]
    r, b = pm.get("rubick", {}), pm.get(best, {})
    classes = {m: b[m][0] / r[m][0] for m in set(r) & set(b) if r[m][0]}
    worst = min(classes.items(), key=lambda kv: kv[1]) if classes else ("-", math.nan)
    unf = {p: s["unfinished"] for p, s in by.items() if s["unfinished"]}
    kept = not ru["guaranteed_jobs"] or ru["guarantees_kept"] == ru["guaranteed_accepted"]
    ok = (not math.isnan(jx) and jx >= floor and medx >= 1.0 and not (worst[1] < CLASS_FLOOR)
          and not math.isnan(worst[1]) and mx >= 1.0 and not unf and kept)
    return {"ok": ok, "jct_x": jx, "makespan_x": mx, "median_x": medx, "median_best": med["policy"],
            "worst_class": worst, "geomean_x": rat["rubick"].get("geomean_x", math.nan), "unfinished": unf,
            "best": best}


def _verdict(summaries: list[dict], rat: dict, pm: dict, floor: float) -> str:
    j = judge(summaries, rat, pm, floor)
    if j is None:
        return ""
    r = next(s for s in summaries if s["policy"] == "rubick")
    parts = [f"rubick avg JCT {_x(j['jct_x'])} the best baseline's (floor {floor:g}x)",
             f"median {_x(j['median_x'])} the best median ({j['median_best']}; floor 1.0x)",
             f"worst model class {j['worst_class'][0]} {_x(j['worst_class'][1])} against {j['best']} "
             f"(floor {CLASS_FLOOR:g}x)", f"makespan {_x(j['makespan_x'])} (floor 1.0x)",
             f"per-job geometric mean {_x(j['geomean_x'])} against {j['best']} (reported, no floor)"]
    if j["unfinished"]:
        parts.append(f"unfinished: {j['unfinished']}")
    if r["guaranteed_jobs"]:
        parts.append(f"guarantees kept {r['guarantees_kept']}/{r['guaranteed_accepted']}")
    return f"**{'Floor met' if j['ok'] else 'Floor NOT met'}**: " + "; ".join(parts) + "."


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


def _over(a, b) -> float:
    """a / b, nan where either is missing (a class with no finished job: NaN, saved as null) or b is 0."""
    return a / b if a is not None and b and not math.isnan(a) else math.nan


def _by_guarantee(summaries: list[dict]) -> str:
    """Where jobs are guaranteed: each policy's guarantees kept, and rubick's avg and median JCT
    against it over every job, the guaranteed ones and the best-effort ones (``by_guarantee``,
    ``sim/metrics.py``; > 1: rubick better). A policy that keeps fewer guarantees may give its
    best-effort jobs what the guaranteed ones were promised."""
    ru = next((s for s in summaries if s["policy"] == "rubick"), None)
    if ru is None or "by_guarantee" not in ru:
        return ""
    g, b = ru["by_guarantee"]["guaranteed"], ru["by_guarantee"]["best_effort"]
    rows = [f"Guaranteed and best-effort jobs apart ({g['finished']} guaranteed, {b['finished']} best-effort jobs "
            "finished by rubick): rubick's average / median JCT against each policy's (> 1: rubick better).", "",
            "| policy | guarantees kept | all jobs | guaranteed jobs | best-effort jobs |", "|---|---:|---:|---:|---:|"]

    def pair(mine: dict, theirs: dict) -> str:
        return f"{_x(_over(theirs['avg_jct_s'], mine['avg_jct_s']))} / {_x(_over(theirs['median_jct_s'], mine['median_jct_s']))}"

    for s in summaries:
        if s["policy"] == "rubick" or "by_guarantee" not in s or s["unfinished"]:
            continue
        t = s["by_guarantee"]
        rows.append(f"| {s['policy']} | {s['guarantees_kept']}/{s['guaranteed_accepted']} | {pair(ru, s)} | "
                    f"{pair(g, t['guaranteed'])} | {pair(b, t['best_effort'])} |")
    return "\n".join(rows)


def _guarantee_split(res) -> list[str]:
    """rubick-mt's floors, where they are lost: against the best baseline on the guaranteed and
    the best-effort jobs apart, beside the guarantees each keeps (``by_guarantee``)."""
    parts = []
    for regime in ("measured", "extended"):
        r = res(command("rubick-mt", regime))
        by = {s["policy"]: s for s in r[0]} if r is not None else {}
        peers = [s for s in by.values() if s["policy"] in PEERS and s["unfinished"] == 0 and "by_guarantee" in s]
        if "by_guarantee" not in by.get("rubick", {}) or not peers:
            continue
        ru, b = by["rubick"], min(peers, key=lambda s: s["avg_jct_s"])
        keep = max(peers, key=lambda s: (s["guarantees_kept"], -s["avg_jct_s"]))

        def vs(s: dict, c: str) -> str:
            return _x(_over(s["by_guarantee"][c]["avg_jct_s"], ru["by_guarantee"][c]["avg_jct_s"]))

        parts.append(f"{regime.capitalize()}: against {b['policy']} (keeps {b['guarantees_kept']}/{b['guaranteed_accepted']}) "
                     f"rubick's avg JCT is {vs(b, 'guaranteed')} on the guaranteed jobs and {vs(b, 'best_effort')} on "
                     f"the best-effort ones; against {keep['policy']}, the baseline that keeps the most "
                     f"({keep['guarantees_kept']}/{keep['guaranteed_accepted']}), {vs(keep, 'guaranteed')} and "
                     f"{vs(keep, 'best_effort')}")
    if not parts:
        return []
    return ["- **rubick-mt, guaranteed and best-effort jobs apart** (the tables under each rubick-mt run). rubick "
            "runs every accepted guarantee at its request's speed; a policy that does not may give the GPUs to "
            "best-effort jobs, or start a guaranteed one on fewer GPUs than it asked for (a 1-step llama7 "
            "guarantee asking for 32 GPUs waits for 32 free GPUs under rubick, where sia may start it at once on "
            "8, slower than asked: a guarantee it does not keep). " + "; ".join(parts) + "."]


def _floor_row(t: str, regime: str, r) -> str:
    summaries, rat, pm = r
    by = {s["policy"]: s for s in summaries}
    ru = by["rubick"]
    floor = MEASURED_FLOOR if regime == "measured" else EXTENDED_FLOOR
    j = judge(summaries, rat, pm, floor)
    unf = ", ".join(f"{p} {s['unfinished']}" for p, s in by.items())
    g = f"{ru['guarantees_kept']}/{ru['guaranteed_accepted']}" if ru["guaranteed_jobs"] else "-"
    mx = j["makespan_x"] if j else math.nan
    mxs = "-" if math.isnan(mx) else f"{mx:.3f}x"
    cls = f"{j['worst_class'][0]} {_x(j['worst_class'][1])}" if j else "-"
    return (f"| {t} | {regime} | {_x(j and j['jct_x'])} (floor {floor:g}x) | {_x(j and j['median_x'])} | {cls} | "
            f"{_x(j and j['geomean_x'])} | {mxs} | {unf} | {g} | {'met' if j and j['ok'] else '**not met**'} |")


def _summary(res) -> list[str]:
    rows = [f"## Summary: rubick against the best of {', '.join(PEERS[:-1])} and {PEERS[-1]}", "",
            "| trace | regime | rubick avg JCT vs best | median vs best median | worst model class | per-job geomean "
            "| makespan vs best | unfinished jobs | rubick guarantees kept | floor |",
            "|---|---|---:|---:|---|---:|---:|---|---:|---|"]
    for regime in ("measured", "extended"):
        for t in (*TRACES, HELD_OUT):
            r = res(command(t, regime))
            if r is not None:
                rows.append(_floor_row(t, regime, r))
    return rows + ["", "Ratios are the best baseline's value over rubick's (> 1: rubick better). The floor "
                   "(issue 21) is all of: avg JCT at least the regime's floor against the best baseline; median no "
                   "worse than the best baseline median; every model class at least 0.95x against the best "
                   "baseline; makespan no worse than the shortest; no unfinished job for any policy; every "
                   "accepted guarantee kept. The per-job geometric mean (each job's JCT under the best baseline "
                   "over rubick's) is reported beside them. The held-out workload has no floor of its own; it is "
                   "judged by the same ones. The share of allocations that ran a measured configuration is in "
                   "each run's table below.", ""]


def _learned(res) -> list[str]:
    """What the runs say, computed from them (so the text cannot drift from the tables)."""
    out = ["## What we learned", ""]
    base = res(command("rubick-base", "measured"))
    if base is not None:
        summaries, rat, pm = base
        peers = [s for s in summaries if s["policy"] in PEERS and s["unfinished"] == 0]
        best = min(peers, key=lambda s: s["avg_jct_s"])["policy"]
        r, b = pm["rubick"], pm[best]
        gap = sum(b[m][0] * b[m][1] for m in b) - sum(r[m][0] * r[m][1] for m in r)
        if "llama30" in r and gap:
            share = (b["llama30"][0] - r["llama30"][0]) * r["llama30"][1] / gap
            out.append(f"- **Where the measured lead comes from.** On rubick-base (measured) rubick's average JCT is "
                       f"{_x(rat['rubick']['jct_x'])} {best}'s. llama30 ({r['llama30'][1]} jobs asking for 24, 40 or 48 GPUs) is "
                       f"{100 * share:.0f}% of the difference: its jobs queue {_h(r['llama30'][2])} h on average "
                       f"under rubick against {_h(b['llama30'][2])} h under {best}. Most llama30 jobs in the trace "
                       "have minutes of work and a restart of ~9 minutes; rubick starts them on the smallest "
                       "measured configuration (24 GPUs, even when they asked for 40 or 48), two at a time, while "
                       "the baselines run them at their request (sia may grow them) in a FIFO-like queue behind "
                       "hours-long ones.")
        loses = [m for m in r if m in b and r[m][0] > b[m][0]]
        if loses:
            out.append(f"- **Where rubick loses.** Against {best}, rubick's average JCT is worse on "
                       + ", ".join(f"{m} ({_x(b[m][0] / r[m][0])})" for m in sorted(loses))
                       + ": small jobs, which sia often runs on more GPUs (it may grow a job to twice its "
                       "request) where rubick's concave utility (alpha 0.5) keeps GPUs for other jobs. Their JCTs are minutes, so the average "
                       "barely moves.")
        old = res(_ablation(ABLATIONS[0][1]))
        bs = next(s for s in summaries if s["policy"] == best)
        ratio = bs['avg_jct_s'] / old[0][0]['avg_jct_s'] if old is not None else 1.14
        was = (f"{_x(ratio)} (the ablation below)" if old is not None else
               "1.14x (the same command at commit a7678b3, before the change)")
        out.append("- **The fix that made the difference.** Until this evaluation rubick charged a job that "
                   "was not running the restart relative to its whole run, T/(T+R), when ranking its start: "
                   "that ranks starts by length, longest first, so llama30 jobs with minutes of work waited "
                   f"hours. With that rule rubick's lead on rubick-base (measured) was {was}, "
                   f"{'short of' if ratio < MEASURED_FLOOR else 'above'} the {MEASURED_FLOOR:g}x floor; now a pending job's restart only decides which allocation it gets "
                   "(`policies/rubick.py`, `start_unavoidable`). It uses nothing the live system lacks: the job's "
                   "declared steps and the belief's (or an observed) speed.")
        flat, always = res(_ablation(FLAT_PIN)), res(_ablation(PIN_ALWAYS))
        if flat is not None and always is not None:
            f0, a0, me = flat[0][0], always[0][0], next(s for s in summaries if s["policy"] == "rubick")
            out.append("- **Pins only where something may outrank a job.** A job switched less than 10 of its own "
                       "restarts ago (at most the 600 s minimum run time) keeps its allocation only in rounds with a "
                       "guaranteed job (whose wait the pins bound) or more than one priority class (which never "
                       "preempts a job inside its minimum run time); among best-effort jobs of one class the restart "
                       "charges alone decide (`pins_needed`, `policies/rubick.py`). With pins in every round, three "
                       "long jobs switched minutes before a burst of short arrivals held all 64 GPUs while 25 jobs of "
                       "a few minutes waited. On rubick-base (measured) the median JCT is "
                       f"{me['median_jct_s']:.0f} s against {a0['median_jct_s']:.0f} s with pins in every round and "
                       f"{f0['median_jct_s']:.0f} s with one 600 s pin for every job, the average "
                       f"{_h(me['avg_jct_s'])} h against {_h(a0['avg_jct_s'])} h and {_h(f0['avg_jct_s'])} h, for "
                       f"{me['restarts']} restarts against {a0['restarts']} and {f0['restarts']} (the ablations "
                       "below): more restarts, each paid at its own cost in the simulator.")
    mt = res(command("rubick-mt", "measured"))
    if mt is not None:
        summaries, rat, _ = mt
        ru = next(s for s in summaries if s["policy"] == "rubick")
        peers = [s for s in summaries if s["policy"] in PEERS and s["unfinished"] == 0]
        bm = min(peers, key=lambda s: s["makespan_s"])
        if rat["rubick"]["makespan_x"] < 1:
            out.append(f"- **rubick-mt's makespan.** rubick's is {_h(ru['makespan_s'])} h against {bm['policy']}'s "
                       f"{_h(bm['makespan_s'])} h ({rat['rubick']['makespan_x']:.4f}x, "
                       f"{ru['makespan_s'] - bm['makespan_s']:.0f} s longer): the floor's \"no worse\" is missed by "
                       "that much. On rubick-mt most llama30 jobs are guaranteed and run exactly their "
                       "request (24, 40 or 48 of the 64 GPUs), so the 40- and 48-GPU ones run one after another "
                       "whatever the policy; the few best-effort llama30 jobs fill in around them, are preempted "
                       "when a guaranteed one needs their GPUs, and the last of them finish after that chain: "
                       "the makespan is set by how those last jobs pack, which rubick's greedy allocation does not "
                       "plan ahead for.")
        else:
            before = res(_ablation(NO_RESUME, "rubick-mt"))
            was_mt = (f"{bm['makespan_s'] / before[0][0]['makespan_s']:.4f}x without it" if before is not None
                      and before[0][0]["unfinished"] == 0 else "0.9986x (commit a7a0409, before it)")
            out.append(f"- **rubick-mt's makespan.** rubick's is {_h(ru['makespan_s'])} h against {bm['policy']}'s "
                       f"{_h(bm['makespan_s'])} h ({rat['rubick']['makespan_x']:.4f}x). Most llama30 jobs there are "
                       "guaranteed and run exactly their request (40 or 48 of the 64 GPUs), one after another "
                       "whatever the policy; the makespan is when that chain and the best-effort llama30 jobs after "
                       f"it end. One rule (`policies/rubick_rules.py`, table below) moved it from {was_mt}: a running "
                       "job's utilities carry the restart it would pay to resume if preempted (before, one-step jobs "
                       "displaced jobs a few steps from done, which then restarted for ~9 minutes). It uses only "
                       "declared steps, the belief's speeds and the restart cost.")
            bound, ext = res(_ablation(MT_ABLATIONS[0][1], "rubick-mt")), res(command("rubick-mt", "extended"))
            bext = res(_mt_ext_bound())
            if bound is not None and ext is not None and bext is not None:
                b = bound[0][0]
                bj = min(x["avg_jct_s"] for x in peers)
                epeers = [x for x in ext[0] if x["policy"] in PEERS and x["unfinished"] == 0]
                ej = min(x["avg_jct_s"] for x in epeers)
                eru = next(x for x in ext[0] if x["policy"] == "rubick")
                eb = bext[0][0]
                out.append(f"- **A second rule, left off:** a pending guarantee that has waited the minimum run time "
                           "goes before pinned best-effort jobs (`guarantee_wait_bound`; small jobs re-pinned at every "
                           "switch kept 40-GPU guarantees waiting for hours). On rubick-mt (measured) it gives a "
                           f"makespan of {bm['makespan_s'] / b['makespan_s']:.4f}x and {bj / b['avg_jct_s']:.2f}x avg "
                           "JCT, but in the extended regime, with the learning oracle's OOM rule, it preempts "
                           f"{eb['preemptions']} times against {eru['preemptions']} and rubick's avg-JCT lead falls "
                           f"from {ej / eru['avg_jct_s']:.2f}x to {ej / eb['avg_jct_s']:.2f}x (the floor is 1.5x).")
        starve = res(_ablation(MT_ABLATIONS[2][1], "rubick-mt"))
        if starve is not None and starve[0][0]["unfinished"] == 0:
            sb = starve[0][0]
            bj = min(x["avg_jct_s"] for x in peers)
            out.append("- **Best-effort jobs behind the guarantee queue.** Pending guarantees are seeded before "
                       "best-effort jobs, and on rubick-mt 40- and 48-GPU llama30 guarantees follow one another all "
                       "day, so best-effort llama30 jobs with minutes of work queued for hours. A best-effort job "
                       "that has never started and has waited as long as its own predicted run (restart included) "
                       "now joins the guarantees' queue, shortest predicted run first (`starved_seed`, "
                       "`policies/rubick_rules.py`). Without it rubick's avg JCT here is "
                       f"{_h(sb['avg_jct_s'])} h ({bj / sb['avg_jct_s']:.2f}x the best baseline's), with it "
                       f"{_h(ru['avg_jct_s'])} h ({bj / ru['avg_jct_s']:.2f}x); guarantees kept "
                       f"{sb['guarantees_kept']}/{sb['guaranteed_accepted']} and {ru['guarantees_kept']}/"
                       f"{ru['guaranteed_accepted']}. With no guarantee pending (rubick-base, rubick-bp) it does nothing.")
        fixed = res(_ablation(PIN_ALL, "rubick-mt"))
        if fixed is not None:
            fx = fixed[0][0]
            out.append("- **Pins that guard against guarantees only.** Pins are on in rounds with a guaranteed job. "
                       "There a pinned best-effort job now keeps its place only against the guarantees seeded after "
                       "it, and only within its window from its last (re)start, not from a resize; among best-effort "
                       "jobs the restart charges decide, and one that loses its place to them loses the guard, so the "
                       "guarantees go first (`pin_scope`, `policies/rubick.py`). Fixed against every job and renewed "
                       "at every resize, small jobs kept 40- and 48-GPU guarantees out for hours. On rubick-mt "
                       f"(measured) the avg JCT is {_h(ru['avg_jct_s'])} h against {_h(fx['avg_jct_s'])} h as before, "
                       f"the median {ru['median_jct_s']:.0f} s against {fx['median_jct_s']:.0f} s, the makespan "
                       f"{_h(ru['makespan_s'])} h against {_h(fx['makespan_s'])} h, for {ru['restarts']} restarts "
                       f"against {fx['restarts']}; guarantees kept {ru['guarantees_kept']}/{ru['guaranteed_accepted']} "
                       f"and {fx['guarantees_kept']}/{fx['guaranteed_accepted']}.")
        if ru["guaranteed_jobs"]:
            out.append(f"- **Guarantees on rubick-mt**: rubick keeps {ru['guarantees_kept']} of "
                       f"{ru['guaranteed_accepted']} accepted; "
                       + ", ".join(f"{s['policy']} {s['guarantees_kept']}/{s['guaranteed_accepted']}"
                                   for s in summaries if s["policy"] != "rubick") + ".")
    out += _guarantee_split(res)
    ho = res(command(HELD_OUT, "measured"))
    if ho is not None:
        summaries, rat, _ = ho
        ru = next(s for s in summaries if s["policy"] == "rubick")
        peers = [s for s in summaries if s["policy"] in PEERS and s["unfinished"] == 0]
        bm = min(peers, key=lambda s: s["makespan_s"])
        out.append(f"- **Held-out workload (measured).** rubick's average JCT is {_x(rat['rubick']['jct_x'])} the "
                   f"best baseline's, {'but' if rat['rubick']['makespan_x'] < 1 else 'and'} its makespan is {_h(ru['makespan_s'])} h against {bm['policy']}'s "
                   f"{_h(bm['makespan_s'])} h ({rat['rubick']['makespan_x']:.3f}x)"
                   + (": the makespan floor is not met there. " if rat["rubick"]["makespan_x"] < 1 else ". ")
                   + f"{bm['policy']} ran {100 * bm['measured_share']:.0f}% of its allocations measured (the rest "
                   "are requests placed in shapes nobody measured, at the extended truth); rubick, which may choose "
                   "only measured configurations, ran 100%. Nobody tuned on this workload.")
    ext = res(command("rubick-base", "extended"))
    if ext is not None:
        ru = next(s for s in ext[0] if s["policy"] == "rubick")
        m = f", against {_x(base[1]['rubick']['jct_x'])} measured" if base is not None else ""
        out.append(f"- **Extended regime.** rubick's lead is {_x(ext[1]['rubick']['jct_x'])} on rubick-base{m}, "
                   f"but only {100 * ru['measured_share']:.0f}% of its allocations there ran a measured "
                   "configuration or the request: the rest of the lead rests on the extended truth, whose knobs "
                   "the sweep below varies.")
    sweep = []
    for k in [("defaults", "-")] + SWEEP:
        r = res(sweep_command(k) if k[0] != "defaults" else
                command("rubick-base", "extended", "rubick,sia", ("--jobs", str(SWEEP_JOBS))))
        if r is not None:
            by = {s["policy"]: s for s in r[0]}
            sweep.append((k, by["sia"]["avg_jct_s"] / by["rubick"]["avg_jct_s"], by["rubick"]["stalled_allocations"]))
    if sweep:
        lo, hi = min(sweep, key=lambda x: x[1]), max(sweep, key=lambda x: x[1])
        oom = max(sweep, key=lambda x: x[2])
        out.append(f"- **The extended lead depends on its knobs.** On rubick-base's first {SWEEP_JOBS} jobs rubick vs "
                   f"sia ranges from {_x(lo[1])} ({' '.join(lo[0])}) to {_x(hi[1])} ({' '.join(hi[0])}); rubick's "
                   f"out-of-memory starts peak at {oom[2]} ({' '.join(oom[0])}, {_x(oom[1])}). Where the independent "
                   "memory estimate is stricter than the belief's, rubick tries configurations nobody measured that "
                   "do not fit. Each out-of-memory start rules out every configuration that needs at least as much "
                   "weight, gradient, optimizer and activation memory per GPU by the belief's own accounting; what "
                   "still fails are configurations that accounting does not order against one that failed "
                   "(another layout, or ZeRO-3, whose saving the independent estimate does not credit) and several "
                   "jobs of one model trying the same untried configuration in the same round.")
    meas = [s for t in TRACES for s in ((res(command(t, "measured")) or ([],))[0]) if s["measured_share"] < 1]
    if meas:
        out.append("- **Measured share below 100% in the measured regime**: "
                   + ", ".join(sorted({s["policy"] for s in meas}))
                   + " place some requests over more nodes than packing needs (a shape nobody measured); those "
                   "allocations run at the extended truth.")
    return out + [""]


def _ablation(opts: str, trace: str = "rubick-base") -> list[str]:
    return command(trace, "measured", "rubick", ("--policy-options", opts))


SWEEP_JOBS = 60  # the knob sweep runs on rubick-base's first 60 jobs (a full extended run takes tens of minutes on 2 busy cores)


def sweep_command(k: tuple[str, str]) -> list[str]:
    return command("rubick-base", "extended", "rubick,sia", (*k, "--jobs", str(SWEEP_JOBS)))


def all_runs() -> list[list[str]]:
    runs = [command(t, reg) for reg in ("measured", "extended") for t in TRACES]
    runs += [command(HELD_OUT, reg) for reg in ("measured", "extended")]
    runs += [_ablation(o) for _, o in ABLATIONS]
    runs += [_ablation(o, "rubick-mt") for _, o in MT_ABLATIONS]
    runs += [_mt_ext_bound()]
    runs += [artifact_command(t) for t in TRACES]
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
        got[tuple(argv)] = (summaries, _with_geomean(rat, d.get("vs_best_baseline", {})), pm)
    return got


def _saved(argv, summaries, rat, per_model, wall, vs_best) -> dict:
    """A run as ``--json-dir`` saves it: what `gearshift simulate ... -o json` prints, plus the per-model means."""
    from gearshift.sim.cli import _clean

    doc = {"command": _cmd(argv), "wall_s": round(wall, 1), "results": summaries,
           "ratios_vs_best_baseline": rat, "vs_best_baseline": vs_best,
           "per_model": {p: {m: {"avg_jct_s": v[0], "jobs": v[1], "avg_queue_s": v[2]}
                             for m, v in pm.items()} for p, pm in per_model.items()}}
    return _clean(doc)


def _timeless(x):
    """A saved run less its wall-clock times (``wall_s``), the only part that may differ when it is run again."""
    if isinstance(x, dict):
        return {k: _timeless(v) for k, v in x.items() if k != "wall_s"}
    if isinstance(x, list):
        return [_timeless(v) for v in x]
    return x


def check(json_dir: Path, workers: int = 2, only: str | None = None) -> dict:
    """Run every saved run of ``json_dir`` again (those whose command contains ``only``) and
    compare: every result, ratio and per-model mean must be the same, wall-clock times aside
    (issue 22: "every committed docs/evaluation-runs/*.json reproduces")."""
    import json

    saved = {d["command"]: d for d in (json.loads(f.read_text()) for f in sorted(json_dir.glob("*.json")))}
    runs = [a for a in all_runs() if _cmd(a) in saved and (not only or only in _cmd(a))]
    unknown = sorted(set(saved) - {_cmd(a) for a in all_runs()})
    differ, same = [], []
    with ProcessPoolExecutor(max_workers=workers) as ex:
        for argv, summaries, rat, per_model, wall, vs_best in ex.map(_run, runs):
            now = json.loads(json.dumps(_saved(argv, summaries, rat, per_model, wall, vs_best)))
            ok = _timeless(now) == _timeless(saved[_cmd(argv)])
            (same if ok else differ).append(_cmd(argv))
            print(f"  {'same' if ok else 'DIFFERS'}: {_cmd(argv)} ({wall:.0f} s)", file=sys.stderr, flush=True)
    return {"checked": len(runs), "same": len(same), "differ": differ, "not_in_the_generator": unknown,
            "ok": bool(runs) and not differ and not unknown}


def _with_geomean(rat: dict, vs_best: dict) -> dict:
    """``rat`` with rubick's per-job geometric-mean ratio (``sim.compare``) beside its avg ratios."""
    out = {p: dict(v) for p, v in rat.items()}
    g = vs_best.get("rubick", {}).get("per_job_geomean_ratio")
    if "rubick" in out:
        out["rubick"]["geomean_x"] = math.nan if g is None else g
    return out


def generate(out: Path, workers: int = 2, quick: bool = False, json_dir: Path | None = None,
             only: str | None = None, from_json: bool = False) -> str:
    import json

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
        for argv, summaries, rat, per_model, wall, vs_best in ex.map(_run, runs):
            got[tuple(argv)] = (summaries, _with_geomean(rat, vs_best), per_model)
            print(f"  {_cmd(argv)}: rubick {_x(rat.get('rubick', {}).get('jct_x'))} ({wall:.0f} s)", flush=True)
            if json_dir is not None:
                doc = _saved(argv, summaries, rat, per_model, wall, vs_best)
                (json_dir / f"{_slug(argv)}.json").write_text(json.dumps(doc, indent=1))

    def res(argv):
        return got.get(tuple(argv))

    doc = ["# gearshift evaluation", "",
           "Generated by `make evaluation` (`python -m sim.evaluation`; each run is also saved as JSON with "
           "`--json-dir`, and the page can be rebuilt from saved runs with `--from-json`). Every number comes "
           "from the `gearshift simulate` command printed above its table; nothing is typed in by hand.", "",
           "Sharing the cluster among tenants (quotas, borrowing and reclaim, fair share within 10% of each "
           "tenant's entitlement both ways, priorities, backfill, a mixed A100/V100 cluster) is evaluated on its "
           "own page, [evaluation-fairness.md](evaluation-fairness.md), written by `python -m loadtest.fairness "
           "--json --markdown docs/evaluation-fairness.md`.", "",
           *_summary(res), *_learned(res),
           "## What is compared, and how honestly", "",
           "- **Belief** (what every policy is told): the performance model fitted only on each model's "
           "profiling runs plus at most 7 configurations chosen by the profiler's fixed rule "
           "(`perfmodel.validate.profiled_data`, as `gearshift perfmodel validate` fits its held-out model). "
           "The optimizer service uses the same fit. It never sees the other measured rows.",
           "- **Learning**: every model-driven policy (rubick, sia, synergy's CPU sizing) gets the belief through "
           "`policies.learning.LearningOracle`: an observed speed replaces the prediction for that configuration "
           "and refits a per-(model, plan family) scale; an out-of-memory start rules out that plan and every plan "
           "that needs at least as much weight, gradient, optimizer and activation memory per GPU by the belief's "
           "accounting (a plan that ran, or needs no more than one that ran, stays in). In the "
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
           "(`policies/`). On rubick-base and rubick-bp no job is guaranteed, so antman reduces to FIFO with "
           "backfill (issue 10, defect 7): on rubick-base it gives exactly synergy's numbers (\"best of three\" "
           "is the best of two), on rubick-bp it differs from synergy only by the CPUs per GPU (synergy sizes "
           "them, antman keeps the request's).", ""]
    for regime, floor in (("measured", MEASURED_FLOOR), ("extended", EXTENDED_FLOOR)):
        doc += [f"## {regime.capitalize()} regime", ""]
        for t in TRACES:
            argv = command(t, regime)
            r = res(argv)
            if r is None:
                continue
            summaries, rat, per_model = r
            doc += [f"### {t}", "", f"`{_cmd(argv)}`", "", _table(summaries, rat), "",
                    _verdict(summaries, rat, per_model, floor), "",
                    "Per model, against the best baseline (sorted by where rubick gains most):", "",
                    _per_model(per_model, summaries), ""]
            split = _by_guarantee(summaries)
            if split:
                doc += [split, ""]
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
                "| rubick variant | avg JCT h | median JCT s | makespan h | reconf | JCT vs best baseline |",
                "|---|---:|---:|---:|---:|---:|",
                f"| default (`{_cmd(command('rubick-base', 'measured'))}`) | {_h(rub['avg_jct_s'])} | "
                f"{rub['median_jct_s']:.0f} | {_h(rub['makespan_s'])} | {rub['reconfigurations']} | "
                f"{_x(best['avg_jct_s'] / rub['avg_jct_s'] if best else None)} |"]
        for what, opts, r in abl:
            if r is None:
                continue
            a = r[0][0]
            ratio = best["avg_jct_s"] / a["avg_jct_s"] if best and a["unfinished"] == 0 else None
            doc.append(f"| {what} (`--policy-options '{opts}'`) | {_h(a['avg_jct_s'])} | {a['median_jct_s']:.0f} | "
                       f"{_h(a['makespan_s'])} | {a['reconfigurations']} | {_x(ratio)} |")
        doc.append("")
    mt = res(command("rubick-mt", "measured"))
    mabl = [(what, opts, res(_ablation(opts, "rubick-mt"))) for what, opts in MT_ABLATIONS]
    if mt is not None and any(a[2] for a in mabl):
        peers = [s for s in mt[0] if s["policy"] in PEERS and s["unfinished"] == 0]
        bj = min(s["avg_jct_s"] for s in peers)
        bm = min(s["makespan_s"] for s in peers)
        rub = next(s for s in mt[0] if s["policy"] == "rubick")
        doc += ["## rubick-mt: the rules, one at a time (measured)", "",
                "Rubick run alone with one of `policies/rubick_rules.py`'s rules changed, against the best "
                f"baselines of the rubick-mt run above (avg JCT {_h(bj)} h, makespan {_h(bm)} h).", "",
                "| rubick variant | avg JCT h | median JCT s | makespan h | restarts | guarantees kept | JCT vs best | "
                "makespan vs best |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for what, opts, r in [("default", None, mt)] + mabl:
            if r is None:
                continue
            a = rub if opts is None else r[0][0]
            ok = a["unfinished"] == 0
            label = f"{what} (`--policy-options '{opts}'`)" if opts else f"{what} (`{_cmd(command('rubick-mt', 'measured'))}`)"
            doc.append(f"| {label} | {_h(a['avg_jct_s'])} | {a['median_jct_s']:.0f} | {_h(a['makespan_s'])} | "
                       f"{a['restarts']} | {a['guarantees_kept']}/{a['guaranteed_accepted']} | {_x(bj / a['avg_jct_s'] if ok else None)} | "
                       f"{('%.4fx' % (bm / a['makespan_s'])) if ok else '-'} |")
        doc.append("")
    doc += _artifact(res)
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
                    _verdict(r[0], r[1], r[2], MEASURED_FLOOR if regime == "measured" else EXTENDED_FLOOR), ""]
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
    ap.add_argument("--check", action="store_true",
                    help="run the runs saved in --json-dir again and say (JSON) whether each reproduces, wall times aside")
    a = ap.parse_args(argv)
    if (a.from_json or a.check) and not a.json_dir:
        ap.error("--from-json and --check need --json-dir")
    if a.check:
        import json

        from gearshift.sim.cli import stdout_to_stderr

        with stdout_to_stderr(True):  # the workers inherit it: HiGHS's notes (Sia's MILP) go to stderr
            got = check(Path(a.json_dir), a.workers, a.only)
        print(json.dumps(got, indent=1))
        return 0 if got["ok"] else 1
    generate(Path(a.out), a.workers, a.quick, Path(a.json_dir) if a.json_dir else None, a.only, a.from_json)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
