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
