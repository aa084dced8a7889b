"""``gearshift simulate`` end to end: table, JSON, per-job CSV, plots, errors, speed."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
import time

import pytest

from gearshift.sim.cli import main, ratios


def test_json_csv_and_plots(tmp_path, capsys):
    pj = tmp_path / "jobs.csv"
    plots = tmp_path / "plots"
    rc = main(["--trace", "tiresias-60", "--policies", "fifo,tiresias", "--cluster", "4x4", "--perfmodel", "off",
               "-o", "json", "--per-job-csv", str(pj), "--plots", str(plots), "--seed", "2"])
    assert rc == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["cluster"] == "4x4" and [r["policy"] for r in doc["results"]] == ["fifo", "tiresias"]
    for r in doc["results"]:
        assert r["jobs"] == 60 and r["finished"] == 60 and r["avg_jct_s"] > 0
    assert set(doc["ratios_vs_best_baseline"]) == {"fifo", "tiresias"}
    rows = list(csv.DictReader(open(pj)))
    assert len(rows) == 120
    assert {"job", "policy", "submit", "start", "finish", "jct"} <= set(rows[0])
    for r in rows:
        assert float(r["jct"]) == pytest.approx(float(r["finish"]) - float(r["submit"]), abs=2e-3)
    for name in ("jct_cdf.png", "gpu_util.png", "queue_length.png"):
        assert (plots / name).stat().st_size > 1000


def test_table_output(capsys):
    assert main(["--trace", "rubick-base", "--jobs", "40", "--policies", "fifo", "--perfmodel", "off"]) == 0
    out = capsys.readouterr().out
    assert "avgJCT h" in out and "fifo" in out and "40 jobs on 8x8" in out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["--trace", "nope"]) == 2
    assert main(["--trace", "tiresias-60", "--policies", "no-such-policy", "--perfmodel", "off"]) == 2
    assert main(["--trace-file", str(tmp_path / "x.csv")]) == 2
    assert main(["--trace", "tiresias-60", "--cluster", "8by8"]) == 2
    capsys.readouterr()
    # an option one of the policies does not take: one line naming it, no traceback
    assert main(["--trace", "tiresias-60", "--jobs", "3", "--perfmodel", "off", "--policies", "rubick,sia",
                 "--policy-options", '{"starved_seed": 0}']) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--policy-options: policy 'sia' takes no option 'starved_seed'"), err
    assert "Traceback" not in err and "\n" not in err
    with pytest.raises(SystemExit):
        main([])  # argparse: a trace is required


def test_ratios_are_best_baseline_over_policy():
    s = [{"policy": "sia", "avg_jct_s": 100.0, "makespan_s": 10.0, "unfinished": 0},
         {"policy": "fifo", "avg_jct_s": 200.0, "makespan_s": 8.0, "unfinished": 0},
         {"policy": "rubick", "avg_jct_s": 25.0, "makespan_s": 16.0, "unfinished": 0}]
    r = ratios(s)
    assert r["rubick"]["jct_x"] == 4.0 and r["rubick"]["makespan_x"] == 0.5
    assert r["sia"]["jct_x"] == 1.0 and r["fifo"]["makespan_x"] == 1.0
    s[0]["unfinished"] = 3  # a baseline that did not finish is not the yardstick
    assert ratios(s)["rubick"]["jct_x"] == 8.0
    assert math.isnan(ratios([{"policy": "x", "avg_jct_s": math.nan, "makespan_s": 1.0, "unfinished": 1}])["x"]["jct_x"])


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "gearshift.sim.cli", "--trace", "tiresias-60", "--jobs", "5", "--perfmodel", "off",
                          "-o", "json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["results"][0]["jobs"] == 5


@pytest.mark.slow
def test_speed_blox_load8_fifo_under_10s():
    from loadtest.sim_speed import blox_load8

    r = blox_load8("fifo")
    assert r["tracked_finished"] == 1001 and r["total_s"] < 10


@pytest.mark.slow
def test_speed_rubick_trace_under_60s():
    from loadtest.sim_speed import named_trace

    for p in ("fifo", "tiresias", "antman"):
        assert named_trace("rubick-base", p)["total_s"] < 60


def test_evaluation_page_rebuilds_from_saved_runs(tmp_path):
    """docs/evaluation.md can be rebuilt from the runs' saved JSON: every saved command
    is printed beside its table and every floor row states its verdict."""
    import json
    from pathlib import Path

    from gearshift.sim.evaluation import main as evaluation

    runs = Path(__file__).resolve().parent.parent / "docs" / "evaluation-runs"
    out = tmp_path / "evaluation.md"
    assert evaluation(["--from-json", "--json-dir", str(runs), "--only", "no such run", "--out", str(out),
                       "--workers", "1"]) == 0
    text = out.read_text()
    saved = [json.loads(f.read_text()) for f in sorted(runs.glob("*.json"))]
    assert saved
    for d in saved:
        argv = d["command"].split()
        if "--policy-options" in argv:  # an ablation: a row named by the options it changes
            assert d["command"].split("--policy-options ")[1].split(" -o")[0] in text
        elif "--jobs" in argv:  # a sweep run: a row of the sweep table, named by its knob
            knob = [a for a in argv if a in ("--systematic", "--distance-slowdown", "--headroom")]
            row = f"| {knob[0]} | {argv[argv.index(knob[0]) + 1]} |" if knob else "| defaults | - |"
            assert row in text
        else:
            assert d["command"] in text
    rows = [line for line in text.splitlines() if line.startswith("| rubick-")]
    assert rows and all(line.rstrip(" |").endswith(("met", "**not met**")) for line in rows)
    # where jobs are guaranteed, each policy's guarantees kept and rubick against it on the
    # guaranteed and the best-effort jobs apart, from the saved summaries
    split = [d for d in saved if "sia" in d["command"] and "by_guarantee" in d["results"][0]]
    assert split
    for d in split:
        by = {s["policy"]: s for s in d["results"]}
        ru, sia = by["rubick"]["by_guarantee"], by["sia"]["by_guarantee"]
        x = [f"{sia[c]['avg_jct_s'] / ru[c]['avg_jct_s']:.2f}x / {sia[c]['median_jct_s'] / ru[c]['median_jct_s']:.2f}x"
             for c in ("guaranteed", "best_effort")]
        assert f"| sia | {by['sia']['guarantees_kept']}/{by['sia']['guaranteed_accepted']} | " in text
        assert f"| {x[0]} | {x[1]} |" in text


def test_evaluation_check_reruns_a_saved_run_and_tells_a_changed_one(tmp_path, capsys):
    """``python -m sim.evaluation --check`` (issue 22: every committed evaluation run
    reproduces): a committed run run again is the same, wall times aside; the same file
    with one number changed is reported as differing, and the exit status says so."""
    import shutil
    from pathlib import Path

    from gearshift.sim.evaluation import main as evaluation

    runs = Path(__file__).resolve().parent.parent / "docs" / "evaluation-runs"
    name = "rubick-base_rubick+sia_extended_systematic_0_jobs_60.json"
    only = "--systematic 0 --jobs 60"
    shutil.copy(runs / name, tmp_path / name)
    assert evaluation(["--check", "--json-dir", str(tmp_path), "--only", only, "--workers", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["checked"] == 1 and got["same"] == 1 and got["differ"] == [] and got["ok"]

    d = json.loads((tmp_path / name).read_text())
    d["results"][0]["avg_jct_s"] += 1.0
    (tmp_path / name).write_text(json.dumps(d))
    assert evaluation(["--check", "--json-dir", str(tmp_path), "--only", only, "--workers", "1"]) == 1
    got = json.loads(capsys.readouterr().out)
    assert got["differ"] == [d["command"]] and not got["ok"]


def test_guarantee_split_table_reads_a_class_with_no_finished_job():
    """The evaluation page's guaranteed / best-effort table (``sim.evaluation._by_guarantee``):
    ratios are the other policy's JCT over rubick's; a class rubick finished no job of (saved
    as null) reads "-", not an error."""
    from gearshift.sim.evaluation import _by_guarantee

    def summary(policy, kept, g, b):
        return {"policy": policy, "unfinished": 0, "guarantees_kept": kept, "guaranteed_accepted": 1,
                "avg_jct_s": 10.0 if policy == "rubick" else 20.0, "median_jct_s": 10.0 if policy == "rubick" else 20.0,
                "by_guarantee": {"guaranteed": {"finished": int(g is not None), "avg_jct_s": g, "median_jct_s": g},
                                 "best_effort": {"finished": 2, "avg_jct_s": b, "median_jct_s": b}}}

    text = _by_guarantee([summary("rubick", 1, None, 10.0), summary("sia", 0, 5.0, 30.0)])
    assert "(0 guaranteed, 2 best-effort jobs finished by rubick)" in text
    assert "| sia | 0/1 | 2.00x / 2.00x | - / - | 3.00x / 3.00x |" in text
    assert _by_guarantee([{k: v for k, v in summary("rubick", 1, 1.0, 1.0).items() if k != "by_guarantee"}]) == ""
