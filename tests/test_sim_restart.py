"""The restart-cost model measured from plan switches, and the simulator using it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gearshift.bus_schema.messages import JobSpec, ModelSpec, Plan
from gearshift.perfmodel.restart import MEASURED, RestartCostModel, restart_seconds
from gearshift.policies.registry import make_policy
from gearshift.sim.engine import SimConfig, simulate
from gearshift.sim.trace import Trace, TraceJob, parse_cluster


def spec(params_m: float, step_time: float = 1.0) -> JobSpec:
    model = ModelSpec(name="toy", params=params_m, layers=2, hidden=64, seq_len=16)
    return JobSpec(name="a", model=model, global_batch=8, steps=100, gpus=1, plan=Plan(dp=1), step_time=step_time)


def test_cost_is_the_measured_constants_plus_state_io():
    m = RestartCostModel(startup_s=7, teardown_s=2, checkpoint_fixed_s=1, bytes_per_param=16, storage_gbps=2)
    # 1000M params x 16 B = 16 GB, written and read at 2 GB/s = 16 s
    assert m.seconds(1000, step_time=0.5) == pytest.approx(1 + 2 + 7 + 16 + 0.5)
    assert restart_seconds(spec(1)) < restart_seconds(spec(1000)) < restart_seconds(spec(30000))
    # a tiny model costs about what the measured switches cost (~10 s)
    assert 9 < MEASURED.seconds(0.9) < 11


def test_simulator_charges_each_job_its_own_restart_cost():
    small, big = spec(10, step_time=1.0), spec(6740, step_time=1.0)
    t = Trace("toy", [TraceJob("S", 0, small), TraceJob("B", 0, big)], parse_cluster("1x4"))
    res = simulate(t, make_policy("fifo"), config=SimConfig(restart_cost=999, restart_model=restart_seconds, noise=0))
    finish = {r.job.job_id: r.finish for r in res.records}
    assert finish["S"] == pytest.approx(restart_seconds(small) + 100)
    assert finish["B"] == pytest.approx(restart_seconds(big) + 100)


def test_cli_defaults_to_the_measured_model_and_still_takes_seconds():
    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "gearshift.sim.cli", "--trace", "tiresias-60", "--policies", "fifo",
                              "--cluster", "4x4", "-o", "json", *extra], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["config"]

    cfg = run()
    assert cfg["restart_cost"] == "measured" and cfg["restart_cost_charged_s"] > 0
    assert run("--restart-cost", "30")["restart_cost_charged_s"] == 30
    bad = subprocess.run([sys.executable, "-m", "gearshift.sim.cli", "--trace", "tiresias-60", "--restart-cost", "soon"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "neither a number" in bad.stderr
