"""The simulator takes dependencies from a trace's ``after`` column."""

from __future__ import annotations

import pytest

from gearshift.policies.registry import make_policy
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.loaders import load_tiresias

HEADER = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval,after\n"


def trace(tmp_path, rows):
    p = tmp_path / "t.csv"
    p.write_text(HEADER + "".join(rows))
    return load_tiresias(p)


def test_a_job_starts_only_after_what_it_names_completed(tmp_path):
    # the cluster (16x4) could run all four at once; 2 waits for 0 and 1, 3 for 2
    t = trace(tmp_path, ["0,4,0,100,vgg19,100,1,\n", "1,4,0,100,vgg19,300,1,\n", "2,4,10,100,vgg19,50,1,0;1\n",
                         "3,4,10,100,vgg19,50,1,2\n"])
    assert [d.job for d in t.jobs[2].spec.after] == ["t0", "t1"]
    res = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=0, noise=0))
    by = {r.job.job_id: r for r in res.records}
    assert all(r.finish is not None for r in res.records)
    assert by["t2"].first_start >= max(by["t0"].finish, by["t1"].finish)
    assert by["t3"].first_start >= by["t2"].finish
    assert by["t0"].first_start == by["t1"].first_start == 0  # what waits on nothing is not held
    # without the column the same jobs start at once
    free = simulate(trace(tmp_path, ["0,4,0,100,vgg19,100,1,\n", "1,4,0,100,vgg19,300,1,\n",
                                     "2,4,10,100,vgg19,50,1,\n"]), make_policy("fifo"),
                    config=SimConfig(restart_cost=0, noise=0))
    assert {r.job.job_id: r for r in free.records}["t2"].first_start < by["t0"].finish


def test_a_cycle_or_an_unknown_id_is_refused(tmp_path):
    with pytest.raises(ValueError, match="cycle"):
        simulate(trace(tmp_path, ["0,1,0,10,vgg19,10,1,1\n", "1,1,0,10,vgg19,10,1,0\n"]), make_policy("fifo"))
    with pytest.raises(ValueError, match="not in the trace"):
        simulate(trace(tmp_path, ["0,1,0,10,vgg19,10,1,7\n"]), make_policy("fifo"))
