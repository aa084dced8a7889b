"""`python -m sim.sweep` (issue 21): the trace transforms its points use, its comparison and
verdict, its cache, and its refusals."""

from __future__ import annotations

import json

import pytest

from gearshift.sim import sweep
from gearshift.sim.loaders import load_named


def test_rate_transform_divides_every_submit_time():
    base, fast = load_named("rubick-base"), load_named("rubick-base:rate=1.5")
    assert fast.name == "rubick-base:rate=1.5" and len(fast.jobs) == len(base.jobs)
    assert [j.submit / 1.5 for j in base.jobs] == [j.submit for j in fast.jobs]
    assert [j.spec for j in base.jobs] == [j.spec for j in fast.jobs]
    both = load_named("rubick-base:resample=1:rate=0.7")  # transforms chain left to right
    assert [j.submit for j in both.jobs] == [j.submit / 0.7 for j in load_named("rubick-base:resample=1").jobs]


def test_max_gpus_transform_leaves_out_only_what_the_cluster_cannot_hold():
    base, small = load_named("rubick-base"), load_named("rubick-base:max-gpus=32")
    assert all(j.spec.plan.gpus <= 32 for j in small.jobs)
    assert len(base.jobs) - len(small.jobs) == sum(j.spec.plan.gpus > 32 for j in base.jobs) > 0


@pytest.mark.parametrize("name,needle", [("rubick-base:rate=0", "rate must be a positive number"),
                                         ("rubick-base:rate=x", "rate needs a number"),
                                         ("rubick-base:max-gpus=0", "max-gpus must be at least 1"),
                                         ("rubick-base:speed=2", "unknown transform 'speed=2'")])
def test_bad_transforms_are_refused_in_one_line(name, needle):
    with pytest.raises(ValueError, match=needle):
        load_named(name)


def test_every_point_is_a_simulate_command_that_changes_one_thing():
    assert len(sweep.POINTS) == 19
    default = sweep.argv_for("default", "rubick,sia", None)
    for p in sweep.POINTS:
        argv = sweep.argv_for(p, "rubick,sia", None)
        changed = set(argv) ^ set(default)
        assert p == "default" or changed, p
        assert argv[argv.index("--regime") + 1] == "extended"
    assert "--cluster" in sweep.argv_for("cluster=4x8", "rubick", None)


def test_sweep_compares_with_the_best_baseline_and_caches(tmp_path, capsys):
    args = ["--json", "--jobs", "12", "--policies", "rubick,synergy,antman", "--points", "default,rate=1.5",
            "--workers", "1", "--cache", str(tmp_path)]
    rc = sweep.main(args)
    doc = json.loads(capsys.readouterr().out)
    assert rc == (0 if doc["ok"] else 1)
    rows = doc["points"]
    assert [r["point"] for r in rows] == ["default", "rate=1.5"]
    for r in rows:
        best = r["best_baseline"]
        assert best in ("synergy", "antman") and r["jobs"] == 12
        assert r["avg_jct_ratio"] == pytest.approx(r["avg_jct_s"][best] / r["avg_jct_s"]["rubick"])
        assert r["command"].startswith("gearshift simulate --trace rubick-base")
    assert doc["worst_avg_jct_ratio"] == min(r["avg_jct_ratio"] for r in rows)
    assert doc["ok"] == (doc["worst_avg_jct_ratio"] >= doc["floor"] and not doc["with_unfinished"])
    # a rerun takes a saved point from the cache instead of simulating it again
    saved = json.loads((tmp_path / "default.json").read_text())
    saved["cpu_s"] = -1.0
    (tmp_path / "default.json").write_text(json.dumps(saved))
    sweep.main(args)
    again = json.loads(capsys.readouterr().out)["points"]
    assert again[0]["cpu_s"] == -1.0 and again[1] == rows[1]


def test_verdict_names_the_worst_point_and_fails_on_unfinished():
    rows = [{"point": "a", "avg_jct_ratio": 1.4, "unfinished": {"rubick": 0}},
            {"point": "b", "avg_jct_ratio": 1.2, "unfinished": {"sia": 2}}]
    v = sweep.verdict(rows, 1.1)
    assert v["worst_point"] == "b" and v["with_unfinished"] == ["b"] and not v["ok"]
    rows[1]["unfinished"] = {"sia": 0}
    assert sweep.verdict(rows, 1.1)["ok"] and not sweep.verdict(rows, 1.3)["ok"]
    rows[0]["avg_jct_ratio"] = None  # no ratio (no baseline finished): the worst of all
    assert sweep.verdict(rows, 1.1)["worst_point"] == "a"


@pytest.mark.parametrize("args,needle", [(["--points", "nope"], "--points: unknown point 'nope'"),
                                         (["--policies", "sia,synergy"], "--policies must include rubick"),
                                         (["--jobs", "0"], "--jobs must be at least 1")])
def test_bad_arguments_are_refused_in_one_line(args, needle, capsys):
    assert sweep.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_sweep_json_is_json_alone_when_native_code_writes_to_stdout(monkeypatch, capfd):
    """HiGHS (Sia's MILP) writes solver notes to file descriptor 1 from C: with --json
    they go to stderr, and stdout is the one JSON document an outside check parses."""
    import os

    def noisy(points, policy_list, jobs, workers, cache, log=None):
        os.write(1, b"HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();\n")
        return []

    monkeypatch.setattr(sweep, "sweep", noisy)
    sweep.main(["--json", "--points", "default"])
    out, err = capfd.readouterr()
    assert "HighsMipSolverData" in err and "Highs" not in out
    assert json.loads(out)["points"] == []
