"""examples/torchplan_train.py, a user's own model through the plan library,
as a user runs it: ``gearshift submit`` to a local cluster (real nats-server,
services, agents, torch processes), ``gearshift reconfigure`` to another plan,
and its loss continues from the DCP checkpoint as an uninterrupted run's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import wait_for

from gearshift.agent import reference, torchplan
from gearshift.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = [sys.executable, str(ROOT / "examples" / "torchplan_train.py")]
SPEC = {"name": "example", "model": {"name": "example-mlp", "params": 0.04, "layers": 4, "hidden": 64, "seq_len": 1,
                                      "heads": 64},
        "global_batch": 32, "steps": 24, "gpus": 1, "plan": {"dp": 1}, "command": EXAMPLE}


def cli(url, *args, stdin=None):
    p = subprocess.run([sys.executable, "-m", "gearshift.cli", *args], env={**os.environ, "GEARSHIFT_NATS_URL": url},
                       capture_output=True, text=True, timeout=60, input=stdin)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    return p.stdout


def losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))} if os.path.exists(path) else {}


@pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")
@pytest.mark.timeout(600)
def test_example_is_submitted_pinned_to_another_plan_and_its_loss_continues(tmp_path):
    from loadtest.switch_check import seed_hf_model

    log = tmp_path / "loss.jsonl"
    spec = {**SPEC, "env": {"GEARSHIFT_LOSS_LOG": str(log), "GEARSHIFT_HOLD_AT": "6", "GEARSHIFT_HOLD_TIMEOUT": "300"}}
    with LocalCluster(nodes=1, gpus_per_node=2, cpus_per_node=8, interval=0.25, grace=30.0,
                      data_dir=str(tmp_path / "cluster")) as c:
        async def seed():
            import nats

            nc = await nats.connect(c.url)
            await seed_hf_model(nc, spec)  # a fitted performance model: no profiling runs first
            await nc.close()

        asyncio.run(seed())
        job_id = cli(c.url, "submit", "-", stdin=json.dumps(spec)).strip()
        wait_for(lambda: max(losses(log), default=0) >= 6, timeout=240)  # it holds at step 6
        out = cli(c.url, "reconfigure", job_id, "--plan", "dp=2,zero=3", "--on", "node0:2")
        assert "pinned to DP2-Z3" in out
        done = wait_for(lambda: (j := json.loads(cli(c.url, "get", "job", job_id, "-o", "json")))["state"]
                        in ("completed", "failed") and j, timeout=300)
        assert done["state"] == "completed" and done["plan"]["dp"] == 2, done
        manifest = json.loads((tmp_path / "cluster" / "ckpt" / job_id / "manifest.json").read_text())
    got = losses(log)
    assert manifest["step"] == 24 and manifest["world_size"] == 2 and manifest["format"] == "gearshift-dcp-v1"
    base_log = tmp_path / "base.jsonl"
    procs = torchplan.launch_local(EXAMPLE, {"dp": 1}, 24, 32, tmp_path / "base",
                                   env={"GEARSHIFT_LOSS_LOG": str(base_log)})
    assert [p.wait(timeout=300) for p in procs] == [0]
    base = losses(base_log)
    assert sorted(got) == list(range(1, 25)) and got[24] < got[1]
    assert max(abs(got[s] - base[s]) / base[s] for s in base) < 1e-9
