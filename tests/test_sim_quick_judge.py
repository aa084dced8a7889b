"""``sim.quick_judge``: rubick alone against cached baseline runs gives the verdict a full
run of the row's command gives, and runs the baselines once."""

from __future__ import annotations

import json
import math

import pytest

from gearshift.sim import evaluation
from gearshift.sim import quick_judge as qj

ROW = "rubick-mt:measured"  # guarantees, and five baselines, in a few seconds on 20 jobs
JOBS = 20


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


def test_the_quick_verdict_is_the_full_runs_and_the_baselines_run_once(tmp_path):
    argv, summaries, rat, pm, _, vs_best = evaluation._run(
        evaluation.command("rubick-mt", "measured", evaluation.POLICIES, ("--jobs", str(JOBS))))
    full = evaluation.judge(summaries, evaluation._with_geomean(rat, vs_best), pm, evaluation.MEASURED_FLOOR)

    logs: list[str] = []
    (got,) = qj.run_rows([ROW], None, 0, JOBS, tmp_path, refresh=False, workers=2, log=logs.append)
    for key, mine in (("jct_x", "avg_x"), ("median_x", "median_x"), ("makespan_x", "makespan_x"),
                      ("geomean_x", "geomean_x"), ("best", "best"), ("median_best", "median_best")):
        assert _same(full[key], got[mine]), (key, full[key], got[mine])
    assert (got["worst_class"], got["worst_class_x"]) == full["worst_class"]
    assert got["met"] == full["ok"]
    rubick = next(s for s in summaries if s["policy"] == "rubick")
    assert got["guarantees"] == f"{rubick['guarantees_kept']}/{rubick['guaranteed_accepted']}"
    assert sum("--policies sia" in m for m in logs) == 1  # the baselines ran, once

    (cached,) = list(tmp_path.glob("*.json"))
    doc = json.loads(cached.read_text())
    assert {s["policy"] for s in doc["summaries"]} == set(evaluation.PEERS) and doc["rev"]

    logs.clear()
    (again,) = qj.run_rows([ROW], None, 0, JOBS, tmp_path, refresh=False, workers=2, log=logs.append)
    assert not any("--policies sia" in m for m in logs) and any("--policies rubick" in m for m in logs)
    assert all(_same(again[k], got[k]) for k in got)


@pytest.mark.parametrize("args, field", [
    (["--rows", "rubick-base:sideways"], "--rows"),
    (["--rows", ","], "--rows"),
    (["--policy-options", "{not json"], "--policy-options"),
    (["--policy-options", "[1]"], "--policy-options"),
    (["--jobs", "0"], "--jobs"),
])
def test_bad_arguments_name_the_field_and_run_nothing(args, field, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        qj.main([*args, "--cache", str(tmp_path / "c")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert field in err and "Traceback" not in err
    assert not (tmp_path / "c").exists()


def test_explain_agrees_with_a_full_runs_per_model_ratios_and_medians(tmp_path):
    """``--explain``'s classes, put back together per model, give ``sim.compare``'s per-model
    ratios of a full run, and its medians are the full run's summaries'."""
    _, summaries, _, _, _, vs_best = evaluation._run(
        evaluation.command("rubick-mt", "measured", evaluation.POLICIES, ("--jobs", str(JOBS))))
    (got,) = qj.run_rows([ROW], None, 0, JOBS, tmp_path, refresh=False, workers=2, log=lambda *_: None, why=True)
    e = got["explain"]
    best = e["best"]
    assert best == vs_best["rubick"]["best_baseline"]
    sums: dict[str, list[float]] = {}
    for c in e["classes"]:
        s = sums.setdefault(c["model"], [0.0, 0.0, 0])
        s[0] += c["rubick_mean_s"] * c["jobs"]
        s[1] += c[f"{best}_mean_s"] * c["jobs"]
        s[2] += c["jobs"]
    full = vs_best["rubick"]["per_model"]
    assert set(sums) == set(full)
    for m, (mine, theirs, n) in sums.items():
        assert n == full[m]["jobs"]
        assert theirs / mine == pytest.approx(full[m]["ratio"], rel=1e-9)
    by = {s["policy"]: s for s in summaries}
    m = e["median"]
    assert m["rubick_s"] == pytest.approx(by["rubick"]["median_jct_s"])
    assert m["baseline"] == got["median_best"] and m["baseline_s"] == pytest.approx(by[m["baseline"]]["median_jct_s"])
    assert len(m["worst"]) == min(10, m["rubick_above_only"])
    assert all(w["rubick_s"] > m["rubick_s"] and w["baseline_s"] <= m["baseline_s"] for w in m["worst"])
    text = qj.explained(got)
    assert f"rubick against {best}" in text and "median" in text
