"""The reference workload (through the plan library) under TP, PP, ZeRO-3 and
offload (real torch processes over gloo), its Distributed Checkpoint resharded
between plans, a pipeline's profiled step time, and the warm worker."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from gearshift.agent import reference, torchplan
from gearshift.agent.reference import train
from gearshift.agent.torchplan.space import PlanRefused, check_plan
from gearshift.agent.warm import WarmPool, warm_key

needs_torch = pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")
ARGS = ("--ckpt-every", "1000", "--hidden", "32", "--layers", "3", "--dataset", "1024")


def test_the_reference_models_plan_space_follows_its_blocks_and_heads():
    shape = train.shape(train.parse_args(["--hidden", "32", "--layers", "3"]))
    assert check_plan({"pp": 3, "ga": 3}, shape, world_size=3, global_batch=6)["micro_batch"] == 2
    assert check_plan({"dp": 2, "zero": 1, "offload": True}, shape)["offload"]  # as FSDP2 without resharding
    for plan, field in (({"pp": 4}, "pp"), ({"tp": 3}, "tp"), ({"dp": 2, "offload": True}, "offload")):
        with pytest.raises(PlanRefused) as exc:
            check_plan(plan, shape)
        assert exc.value.field == field
    args = train.parse_args(["--crash-at", "7", "--device", "cpu", "--noise", "0"])
    assert (args.crash_at, args.device) == (7, "cpu") and train.model_of(args).noise is None
    assert train.model_of(train.parse_args([])).family.tp_plan == {"up": "colwise", "down": "rowwise"}


def test_warm_key_only_for_python_m_without_import_variables():
    assert warm_key([sys.executable, "-m", "gearshift.agent.reference.train", "--x"], {}) == (sys.executable, "gearshift.agent.reference.train")
    assert warm_key([sys.executable, "train.py"], {}) is None
    assert warm_key(["python", "-m", "m"], {}) is None  # not an absolute interpreter path
    # a job's import variables are part of the key (tests/test_warm_env.py)
    assert warm_key([sys.executable, "-m", "m"], {"PYTHONPATH": "/elsewhere"}) == (sys.executable, "m", (("PYTHONPATH", "/elsewhere"),))


@needs_torch
@pytest.mark.timeout(600)
def test_checkpoint_reshards_between_tp_pp_zero3_and_offload_and_keeps_the_trajectory(tmp_path):
    """TP2 -> PP2 (GPipe, GA2) -> DP2 + ZeRO-3 + offload -> DP2 + ZeRO-1 + offload,
    each resuming the last one's checkpoint, ends where an uninterrupted DP1 run ends."""
    ck = tmp_path / "switched"
    chain = [({"tp": 2}, 2), ({"pp": 2, "ga": 2}, 4), ({"dp": 2, "zero": 3, "offload": True}, 6),
             ({"dp": 2, "zero": 1, "offload": True}, 8)]
    for plan, steps in chain:
        m = reference.run_local(plan, steps, 32, ck, extra_args=ARGS)
        assert m["step"] == steps and {k: m["plan"][k] for k in plan} == plan
    base = reference.run_local({"dp": 1}, 8, 32, tmp_path / "base", extra_args=ARGS)
    assert abs(m["loss"] - base["loss"]) <= 1e-9 * abs(base["loss"])
    assert m["format"] == "gearshift-dcp-v1"
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (ck / m["path"]).iterdir()}  # each rank its shards


@needs_torch
def test_bad_plan_is_refused_with_a_clear_message(tmp_path):
    import subprocess

    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"dp": 1, "pp": 4}), "WORLD_SIZE": "4",
           "GEARSHIFT_STEPS": "2", "GEARSHIFT_GLOBAL_BATCH": "32", "GEARSHIFT_CKPT_DIR": str(tmp_path)}
    r = subprocess.run(reference.command(*ARGS), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 78 and "Traceback" not in r.stderr
    assert "plan field 'pp': pp 4 is more stages than the 3 layers of torchref" in r.stderr


@needs_torch
@pytest.mark.timeout(300)
def test_crash_at_exits_once_and_the_rerun_resumes_from_the_checkpoint(tmp_path):
    cmd = reference.command(*ARGS, "--ckpt-every", "1", "--crash-at", "2")
    env = {"GEARSHIFT_LOSS_LOG": str(tmp_path / "losses.jsonl")}
    (first,) = torchplan.launch_local(cmd, {"dp": 1}, 3, 32, tmp_path / "ck", env=env)
    assert first.wait(timeout=240) == 1
    assert "crashing on purpose at step 2" in open(first.stderr_path).read()
    (again,) = torchplan.launch_local(cmd, {"dp": 1}, 3, 32, tmp_path / "ck", env=env, generation=2)
    assert again.wait(timeout=240) == 0  # the marker says it crashed there once
    trained = [(r["generation"], r["step"]) for r in map(json.loads, open(tmp_path / "losses.jsonl"))]
    assert trained == [(1, 1), (1, 2), (2, 3)]  # resumed from step 2's checkpoint


@needs_torch
@pytest.mark.timeout(300)
def test_a_pipelines_profiled_step_time_puts_the_bubble_back(tmp_path):
    """Thread CPU time leaves out a stage's waiting: a GPipe plan's step time is
    its schedule replayed on both stages' measured busy times (gathered from
    every rank, so each reports the same one)."""
    import subprocess

    prog = tmp_path / "progress-{}.json"
    procs = []
    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"pp": 2, "ga": 4}), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(torchplan.free_port()), "GEARSHIFT_STEPS": "100", "GEARSHIFT_GLOBAL_BATCH": "32",
           "GEARSHIFT_CKPT_DIR": str(tmp_path / "ck"), "GEARSHIFT_PROFILE_STEPS": "3", "GEARSHIFT_PROFILE_CLOCK": "cpu"}
    for r in range(2):
        renv = {**env, "RANK": str(r), "LOCAL_RANK": str(r), "GEARSHIFT_PROGRESS_FILE": str(prog).format(r)}
        procs.append(subprocess.Popen(reference.command(*ARGS, "--warmup", "1"), env=renv, stderr=subprocess.PIPE,
                                      text=True))
    for p in procs:
        assert p.wait(timeout=240) == 0, p.stderr.read()[-2000:]
    got = [json.loads(open(str(prog).format(r)).read()) for r in range(2)]
    assert [g["profiled"] for g in got] == [3, 3] and got[0]["step"] == 4
    it = got[0]["phases"]["iteration"]
    assert it == got[1]["phases"]["iteration"] > 0  # every rank reports the same replayed step time
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


@needs_torch
@pytest.mark.timeout(300)
async def test_warm_worker_runs_a_rank_and_modules_without_heavy_imports_are_not_kept_warm(tmp_path):
    class Log:
        def __init__(self):
            self.lines = []

        def info(self, msg, **kw):
            self.lines.append((msg, kw))

        warning = info

    async def spawn(argv):
        return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, start_new_session=True)

    log = Log()
    status = tmp_path / "warm.json"
    pool = WarmPool(1, spawn=spawn, log=log, prewarm=["gearshift.agent.reference.train", "gearshift.agent.emulated_worker"],
                    status_file=status)
    await pool.refill()
    assert json.loads(status.read_text())["ready"] == {"gearshift.agent.reference.train": 1}
    cmd = reference.command(*ARGS)
    emulated = [sys.executable, "-m", "gearshift.agent.emulated_worker"]
    assert pool.take(emulated, {}) is None and (sys.executable, "gearshift.agent.emulated_worker") in pool.refused
    proc = pool.take(cmd, {})
    assert proc is not None and pool.take(cmd, {}) is None  # one per slot
    assert json.loads(status.read_text())["ready"] == {"gearshift.agent.reference.train": 0}
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731",
           "GEARSHIFT_PLAN": json.dumps({"dp": 1}), "GEARSHIFT_STEPS": "3", "GEARSHIFT_GLOBAL_BATCH": "32",
           "GEARSHIFT_CKPT_DIR": str(tmp_path / "ck"), "GEARSHIFT_JOB_ID": "warm"}
    assert await pool.hand_off(proc, cmd, env, str(tmp_path), str(tmp_path / "rank-0.log"))
    assert await asyncio.wait_for(proc.wait(), 240) == 0
    manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["done"]
    assert "resuming from step 0 of 3" in (tmp_path / "rank-0.log").read_text()
    pool.close()


def test_pipeline_makespan_replays_the_gpipe_schedule():
    from gearshift.agent.torchplan.profiling import pipeline_makespan

    # equal stages: (m + pp - 1) * (f + b), the textbook GPipe step
    assert pipeline_makespan([[1, 1], [1, 1]], [[2, 2], [2, 2]], [0, 0]) == 9
    # the slow stage sets the pace; the optimizer step after the last backward adds once
    assert pipeline_makespan([[1, 1, 1], [3, 3, 3]], [[1, 1, 1], [3, 3, 3]], [0.5, 0.5]) == 1 + 9 + 9 + 1 + 0.5


def test_profiler_includes_tp_and_pp_where_the_model_and_node_allow_them():
    from gearshift.bus_schema.messages import Plan
    from gearshift.services.profiler import MAX_PLANS, profiling_plans

    got = profiling_plans(64, 2, heads=4, layers=3)
    assert len(got) <= MAX_PLANS and Plan(tp=2) in got and Plan(pp=2) in got and Plan(pp=2, ga=4) in got
    assert all(64 % (p.dp * p.ga) == 0 and p.gpus <= 2 for p in got)
    assert not any(p.tp > 1 or p.pp > 1 for p in profiling_plans(64, 1, heads=4, layers=3))  # one GPU per node
    assert not any(p.tp > 1 for p in profiling_plans(64, 2, heads=3, layers=3))  # TP2 does not divide 3 heads
