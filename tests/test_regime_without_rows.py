"""The measured regime on a workload with no measured rows (issue 21 item 6): generic
Tiresias-format jobs (vgg, resnet, inception: no profile of the Rubick traces covers
them). Every policy may still run each job's request, so each finishes what FIFO does."""

from __future__ import annotations

import json
import random

from gearshift.sim.baselines import best_baselines
from gearshift.sim.cli import main


def _workload(path, n=20, seed=0):
    r = random.Random(seed)
    t = 0
    rows = ["job_id,num_gpu,submit_time,iterations,model_name,duration,interval"]
    for i in range(n):
        t += int(r.expovariate(1 / 60))
        d = int(r.lognormvariate(6.5, 1.0))
        rows.append(f"{i},{r.choice([1, 1, 2, 2, 4, 4, 8])},{t},{max(50, 3 * d)},"
                    f"{r.choice(['vgg19', 'resnet50', 'inception4', 'alexnet'])},{d},20")
    path.write_text("\n".join(rows) + "\n")


def test_every_policy_finishes_what_fifo_finishes(tmp_path, capsys):
    f = tmp_path / "generic.csv"
    _workload(f)
    names = ["fifo", "rubick", *best_baselines()]
    rc = main(["--trace-file", str(f), "--format", "tiresias", "--cluster", "4x4", "--policies", ",".join(names),
               "--regime", "measured", "-o", "json", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    res = {s["policy"]: s for s in json.loads(out)["results"]}
    assert set(res) == set(names)
    assert res["fifo"]["unfinished"] == 0
    for name, s in res.items():
        assert s["unfinished"] == 0, (name, s["unfinished"])
        assert s["finished"] == 20
