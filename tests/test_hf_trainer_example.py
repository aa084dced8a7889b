"""examples/hf_trainer_train.py, a Hugging Face ``transformers.Trainer`` job, as
a user runs it (issue 20 item 7): ``gearshift submit`` to a local cluster (real
nats-server, services, agent, torch processes), a pin the Trainer cannot run
refused by ``gearshift reconfigure`` naming the field, a pin to another DP
degree with GA and GC carried out by SIGTERM -> Trainer checkpoint -> exit 143
-> ``resume_from_checkpoint``, and its loss continues as an uninterrupted run's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import wait_for

from gearshift.agent import reference, torchplan
from gearshift.agent.worker import EXIT_PLAN_REFUSED
from gearshift.cluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf_trainer_train.py"
EXAMPLE = [sys.executable, str(SCRIPT)]
STEPS, HOLD = 8, 3
needs_torch = pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")


def example_module():
    spec = importlib.util.spec_from_file_location("hf_trainer_train", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def cli(url, *args, stdin=None, ok=True):
    p = subprocess.run([sys.executable, "-m", "gearshift.cli", *args], env={**os.environ, "GEARSHIFT_NATS_URL": url},
                       capture_output=True, text=True, timeout=60, input=stdin)
    assert (p.returncode == 0) == ok and "Traceback" not in p.stderr, (p.returncode, p.stderr)
    return p.stdout if ok else p.stderr


def losses(path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def test_the_script_refuses_a_plan_the_trainer_cannot_run_before_it_imports_torch(tmp_path):
    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"dp": 1, "tp": 2}), "WORLD_SIZE": "2", "GEARSHIFT_STEPS": "4",
           "GEARSHIFT_GLOBAL_BATCH": "16", "GEARSHIFT_CKPT_DIR": str(tmp_path / "ckpt"),
           "GEARSHIFT_PROGRESS_FILE": str(tmp_path / "run" / "progress-0.json")}
    r = subprocess.run(EXAMPLE, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_PLAN_REFUSED and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "plan refused: tp:" in r.stderr, r.stderr
    assert json.loads((tmp_path / "run" / "plan-refused.json").read_text())["field"] == "tp"
    assert not (tmp_path / "ckpt").exists()
    spec = json.loads(subprocess.run([*EXAMPLE, "--spec", "--gpus", "2"], capture_output=True, text=True,
                                     timeout=60, check=True).stdout)
    assert spec["plan_support"] == {"tp": [1], "pp": [1], "zero": [0], "offload": False}
    assert spec["model"]["heads"] == 4 and spec["model"]["kv_heads"] == 2 and spec["plan"] == {"dp": 2}


@needs_torch
@pytest.mark.timeout(600)
def test_trainer_job_is_refused_tp_then_pinned_to_dp1_ga2_gc_and_its_loss_continues(tmp_path):
    from loadtest.switch_check import seed_hf_model

    log, base_log = tmp_path / "loss.jsonl", tmp_path / "base.jsonl"
    spec = example_module().job_spec(gpus=2, steps=STEPS)
    spec["env"] = {"GEARSHIFT_LOSS_LOG": str(log), "GEARSHIFT_HOLD_AT": str(HOLD), "GEARSHIFT_HOLD_TIMEOUT": "300"}
    # the uninterrupted run to compare with, meanwhile (DP2 all the way)
    base = torchplan.launch_local(EXAMPLE, {"dp": 2}, STEPS, 16, tmp_path / "base",
                                  env={"GEARSHIFT_LOSS_LOG": str(base_log)})
    with LocalCluster(nodes=1, gpus_per_node=2, cpus_per_node=8, interval=0.25, grace=30.0,
                      data_dir=str(tmp_path / "cluster")) as c:
        async def seed():
            import nats

            nc = await nats.connect(c.url)
            await seed_hf_model(nc, spec)  # a fitted performance model: no profiling runs first
            await nc.close()

        asyncio.run(seed())
        job_id = cli(c.url, "submit", "-", stdin=json.dumps(spec)).strip()
        wait_for(lambda: any(r["step"] >= HOLD for r in losses(log)), timeout=240)  # it holds at step HOLD
        # its progress reaches the agent and the record (the worker protocol): steps, loss, checkpoint
        before = wait_for(lambda: (j := json.loads(cli(c.url, "get", "job", job_id, "-o", "json"))).get("live")
                          and j["live"]["steps_done"] == HOLD and j, timeout=60)
        assert before["live"]["loss"] == losses(log)[HOLD - 1]["loss"] and before["live"]["steps"] == STEPS
        err = cli(c.url, "reconfigure", job_id, "--plan", "dp=1,tp=2", ok=False)
        assert "plan_support.tp" in err and len(err.strip().splitlines()) == 1, err
        after = json.loads(cli(c.url, "get", "job", job_id, "-o", "json"))
        assert after["generation"] == before["generation"] and not after.get("pinned")  # nothing changed
        out = cli(c.url, "reconfigure", job_id, "--plan", "dp=1,ga=2,grad_ckpt=true", "--on", "node0:1")
        assert "pinned to DP1-GA2-GC" in out
        done = wait_for(lambda: (j := json.loads(cli(c.url, "get", "job", job_id, "-o", "json")))["state"]
                        in ("completed", "failed") and j, timeout=300)
        assert done["state"] == "completed" and (done["plan"]["dp"], done["plan"]["ga"]) == (1, 2), done
        assert done["steps_done"] == STEPS, done
        ckpt = tmp_path / "cluster" / "ckpt" / job_id
        manifest = json.loads((ckpt / "manifest.json").read_text())
    assert [p.wait(timeout=300) for p in base] == [0, 0]
    got, want = losses(log), {r["step"]: r["loss"] for r in losses(base_log)}
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))  # every step exactly once
    assert {r["generation"] for r in got if r["step"] <= HOLD} != {r["generation"] for r in got if r["step"] > HOLD}
    assert manifest["step"] == STEPS and manifest["done"] and manifest["world_size"] == 1
    assert got[-1]["loss"] < got[0]["loss"]
    # The model trains in float64, but the Trainer logs its loss through a float32
    # accumulator (tr_loss): ~6e-8 relative rounding. The same samples per step
    # (fixed global batch, seeded sampler, batches skipped on resume) leave only that.
    assert max(abs(r["loss"] - want[r["step"]]) / want[r["step"]] for r in got) < 1e-6

    # the newest checkpoint corrupt, a newer one of another model: both refused, the last good one chosen
    ex = example_module()
    good = sorted(ckpt.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    newest, older = good[-1], good[-2]
    with open(newest / "optimizer.pt", "r+b") as f:
        f.seek(100)
        f.write(b"\0garbage\0")
    other = ckpt / f"checkpoint-{STEPS + 4}"
    shutil.copytree(older, other)
    meta = json.loads((other / "gearshift.json").read_text())
    (other / "gearshift.json").write_text(json.dumps({**meta, "model": "gpt2", "fingerprint": "0123456789abcdef"}))
    from gearshift.agent.torchplan.ckpt import fingerprint

    chosen, refused = ex.newest_good(ckpt, fingerprint(ex.NAME, ex.build()))
    assert chosen == older and refused == 2
    assert "another model (gpt2" in ex.check(other, meta["fingerprint"])
    assert ex.check(newest, meta["fingerprint"]) == f"checkpoint {newest.name}: corrupt (optimizer.pt changed)"


@needs_torch
@pytest.mark.slow  # ~30 s on a loaded 2-core box: three launches of transformers
@pytest.mark.timeout(600)
def test_trainer_job_skips_a_corrupt_and_another_models_checkpoint_and_resumes_from_the_last_good(tmp_path):
    ck, log, base_log = tmp_path / "ck", tmp_path / "loss.jsonl", tmp_path / "base.jsonl"
    first = torchplan.launch_local(EXAMPLE, {"dp": 2}, 8, 16, ck, env={"GEARSHIFT_LOSS_LOG": str(base_log)})
    assert [p.wait(timeout=300) for p in first] == [0, 0], Path(first[0].stderr_path).read_text()[-2000:]
    assert sorted(p.name for p in ck.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    (ck / "checkpoint-8" / "model.safetensors").write_bytes(b"garbage")  # the manifest's, corrupt
    shutil.copytree(ck / "checkpoint-4", ck / "checkpoint-12")
    meta = json.loads((ck / "checkpoint-12" / "gearshift.json").read_text())
    (ck / "checkpoint-12" / "gearshift.json").write_text(json.dumps({**meta, "model": "gpt2", "fingerprint": "x"}))
    again = torchplan.launch_local(EXAMPLE, {"dp": 1, "ga": 2}, 8, 16, ck, env={"GEARSHIFT_LOSS_LOG": str(log)},
                                   generation=2)
    assert [p.wait(timeout=300) for p in again] == [0]
    err = Path(again[0].stderr_path).read_text()
    refused = [ln for ln in err.splitlines() if ln.startswith("hf_trainer: refused")]
    assert refused == ["hf_trainer: refused checkpoint checkpoint-8: corrupt (model.safetensors changed)",
                       "hf_trainer: refused checkpoint checkpoint-12: another model (gpt2 fingerprint x, this "
                       f"job's is {meta['fingerprint']})"], err[-2000:]
    got, want = losses(log), {r["step"]: r["loss"] for r in losses(base_log)}
    assert [r["step"] for r in got] == [5, 6, 7, 8]  # from checkpoint-4, the last good one
    assert max(abs(r["loss"] - want[r["step"]]) / want[r["step"]] for r in got) < 1e-6
    assert json.loads((ck / "manifest.json").read_text())["path"] == "checkpoint-8"  # written again, good
    assert example_module().check(ck / "checkpoint-8", meta["fingerprint"]) is None


@needs_torch
@pytest.mark.slow  # one launch of transformers
@pytest.mark.timeout(300)
def test_a_profiling_run_reports_its_step_time_and_writes_no_checkpoint(tmp_path):
    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"dp": 1, "ga": 2}), "GEARSHIFT_STEPS": "8",
           "GEARSHIFT_GLOBAL_BATCH": "16", "GEARSHIFT_CKPT_DIR": str(tmp_path / "ckpt"),
           "GEARSHIFT_PROGRESS_FILE": str(tmp_path / "progress-0.json"), "GEARSHIFT_PROFILE_STEPS": "3"}
    r = subprocess.run(EXAMPLE, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads((tmp_path / "progress-0.json").read_text())
    assert got["profiled"] == 3 and got["phases"]["iteration"] > 0 and not (tmp_path / "ckpt").exists()
