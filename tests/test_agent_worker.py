"""The worker-side library, the emulated worker as a plain process, and the GPU probes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from gearshift.agent import launch
from gearshift.agent import worker as wk
from gearshift.agent.probe import FakeProbe, GpuProbe, NoGpuDriver, NvmlProbe
from gearshift.bus_schema.messages import Allocation, NodePlacement, Plan

PY = sys.executable


def test_manifest_and_progress_files_round_trip(tmp_path):
    assert wk.latest_manifest(tmp_path) is None
    wk.write_manifest(tmp_path, job_id="j", generation=3, step=41)
    m = wk.latest_manifest(tmp_path)
    assert m["step"] == 41 and m["generation"] == 3 and m["done"] is False
    assert [p.name for p in tmp_path.iterdir()] == [wk.MANIFEST]  # no temp file left behind

    rep = wk.ProgressReporter(tmp_path / "p.json", steps=100, min_interval=60)
    rep.report(1, loss=2.5, force=True)
    rep.report(2)  # throttled
    assert wk.read_json(tmp_path / "p.json")["step"] == 1
    rep.report(3, samples_per_s=10.0, phases={"forward": 0.1}, force=True)
    got = wk.read_json(tmp_path / "p.json")
    assert got["step"] == 3 and got["steps"] == 100 and got["samples_per_s"] == 10.0 and got["phases"]["forward"] == 0.1
    (tmp_path / "bad.json").write_text("{half")
    assert wk.read_json(tmp_path / "bad.json") is None


def test_worker_env_reads_the_contract():
    env = wk.WorkerEnv.from_env({
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "2345",
        "GEARSHIFT_JOB_ID": "j1", "GEARSHIFT_GENERATION": "5", "GEARSHIFT_PLAN": '{"dp": 4, "ga": 2}',
        "GEARSHIFT_CKPT_DIR": "/ck", "GEARSHIFT_STEPS": "10", "GEARSHIFT_STEP_TIME": "0.5",
    })
    assert (env.rank, env.world_size, env.local_rank, env.generation, env.master_port) == (3, 4, 1, 5, 2345)
    assert env.plan == {"dp": 4, "ga": 2} and str(env.ckpt_dir) == "/ck" and env.step_time == 0.5
    assert env.progress_file is None


def _emulated(tmp_path, gen: int, steps: int, step_time: float) -> subprocess.Popen:
    env = {
        **os.environ, "PYTHONPATH": os.getcwd(), "RANK": "0", "GEARSHIFT_JOB_ID": "e", "GEARSHIFT_GENERATION": str(gen),
        "GEARSHIFT_CKPT_DIR": str(tmp_path / "ckpt"), "GEARSHIFT_PROGRESS_FILE": str(tmp_path / f"p{gen}.json"),
        "GEARSHIFT_STEPS": str(steps), "GEARSHIFT_STEP_TIME": str(step_time), "GEARSHIFT_GLOBAL_BATCH": "4",
    }
    return subprocess.Popen([PY, "-m", "gearshift.agent.emulated_worker"], env=env, stdout=subprocess.PIPE, text=True)


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_emulated_worker_checkpoints_on_sigterm_and_finishes_from_there(tmp_path):
    proc = _emulated(tmp_path, 1, steps=1000, step_time=0.01)
    _wait_for(lambda: (wk.read_json(tmp_path / "p1.json") or {}).get("step", 0) >= 5)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == wk.EXIT_CHECKPOINTED
    first = wk.latest_manifest(tmp_path / "ckpt")["step"]
    assert first >= 5 and wk.read_json(tmp_path / "p1.json")["step"] == first

    proc = _emulated(tmp_path, 2, steps=first + 5, step_time=0.01)
    assert proc.wait(10) == wk.EXIT_DONE
    assert f"resuming from step {first}" in proc.stdout.read()
    done = wk.latest_manifest(tmp_path / "ckpt")
    assert done["done"] and done["step"] == first + 5 and done["generation"] == 2
    # a later generation of a finished job ends at once
    assert _emulated(tmp_path, 3, steps=first + 5, step_time=10).wait(10) == wk.EXIT_DONE


async def test_fake_probe_shows_claimed_gpus_as_used():
    probe = FakeProbe(3, 1000, "F", node="x")
    assert isinstance(probe, GpuProbe)
    probe.claim([1], [42])
    gpus = await probe.sample()
    assert [g.memory_used > 0 for g in gpus] == [False, True, False]
    assert gpus[1].processes[0].pid == 42 and gpus[1].memory_total == 1000
    probe.release([1])
    assert all(g.memory_used == 0 and not g.processes for g in await probe.sample())


async def test_nvml_probe_without_driver_raises_no_gpu_driver():
    probe = NvmlProbe()
    try:
        await probe.open()
    except NoGpuDriver as exc:
        assert "NVML" in str(exc)
    else:
        await probe.close()
        pytest.skip("this machine has an NVIDIA driver")


@pytest.mark.gpu
async def test_nvml_probe_on_real_hardware():
    probe = NvmlProbe()
    try:
        await probe.open()
    except NoGpuDriver:
        pytest.skip("no NVIDIA driver")
    try:
        gpus = await probe.sample()
        assert gpus and all(g.memory_total > 0 and g.uuid.startswith(("GPU-", "MIG-")) for g in gpus)
        print(json.dumps([{"index": g.index, "name": g.name, "used": g.memory_used, "total": g.memory_total,
                           "util": g.utilization, "procs": len(g.processes)} for g in gpus]))
    finally:
        await probe.close()


def _alloc(command, placement):
    return Allocation(
        job_id="j", generation=4, plan=Plan(dp=4), command=command,
        placement=[NodePlacement(node=n, gpus=g) for n, g in placement],
    )


def test_rank_layout_follows_the_placement():
    a = _alloc(["train"], [("a", [5, 6]), ("b", []), ("c", [0])])  # b is CPU-only: one slot
    b = launch.rank_specs(a, "b")
    assert [(s.rank, s.local_rank, s.gpus) for s in b] == [(2, 0, ())]
    c = launch.rank_specs(a, "c")
    assert [(s.rank, s.world_size, s.node_rank, s.nnodes, s.gpus) for s in c] == [(3, 4, 2, 3, (0,))]
    assert [s.gpus for s in launch.rank_specs(a, "a")] == [(5,), (6,)]
    emulated = launch.rank_specs(_alloc(None, [("a", [5, 6]), ("c", [0])]), "a")
    assert [(s.rank, s.local_world_size, s.gpus) for s in emulated] == [(0, 2, (5, 6))]  # one process per node
    env = launch.environment(a, c[0], node="c", master_addr="10.0.0.1", ckpt_dir="/ck", progress_file="/p",
                             base={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["MASTER_ADDR"] == "10.0.0.1" and env["PATH"] == "/bin"
    assert 20000 <= launch.master_port("j", 4) < 50000 and launch.master_port("j", 4) == int(env["MASTER_PORT"])
    assert launch.master_port("j", 4) != launch.master_port("j", 5)
    assert (launch.exit_status(-15), launch.exit_status(-9), launch.exit_status(3)) == (143, 137, 3)


def test_checkpoint_writer_is_atomic_and_prunes(tmp_path):
    w = wk.CheckpointWriter(tmp_path, keep=2)
    for step in (10, 20, 30):
        with w.stage(step) as tmp:
            (tmp / "state").write_text(str(step))
        w.prune(step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]
    with pytest.raises(RuntimeError):
        with w.stage(40) as tmp:
            (tmp / "state").write_text("half")
            raise RuntimeError("disk full")
    # a failed write leaves neither a step folder nor a temp folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]


def test_phase_timer_quantiles_and_stop_agreement():
    t = wk.PhaseTimer()
    t.history = [{"forward": x / 1e3} for x in (10, 11, 12, 13, 100)]  # one disturbed step
    assert t.median_ms()["forward"] == pytest.approx(12.0)
    assert t.quantile_ms(0.25)["forward"] == pytest.approx(11.0)
    stop = wk.StopSignal()
    assert stop.flags() == (0, 0)
    stop.agreed(1, 0)  # another rank got SIGTERM: this one stops after the same step
    assert stop.requested and stop.requested_at is not None and not stop.checkpoint_requested
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.flags() == (1, 1)
    stop.checkpoint_done()
    assert stop.flags() == (1, 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def test_atomic_writes_and_checkpoint_stages_take_a_name_nobody_holds(tmp_path, monkeypatch):
    """The worker names its temp files and folders itself (``tempfile`` cost every rank
    ~6 ms to import): a name already taken is skipped, and nothing is left behind."""
    import itertools

    monkeypatch.setattr(wk, "_TMP_IDS", itertools.count(5))
    taken = tmp_path / f".state.json.{os.getpid()}-5"
    taken.write_text("someone else's")
    wk.write_json_atomic(tmp_path / "state.json", {"a": 1})
    assert json.loads((tmp_path / "state.json").read_text()) == {"a": 1}
    assert taken.read_text() == "someone else's"  # skipped, not overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([taken.name, "state.json"])  # no temp left

    writer = wk.CheckpointWriter(tmp_path / "ck")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / f"step-00000003.tmp-{os.getpid()}-7").mkdir()  # a stage someone else holds
    monkeypatch.setattr(wk, "_TMP_IDS", itertools.count(7))
    with writer.stage(3) as tmp:
        assert tmp.name == f"step-00000003.tmp-{os.getpid()}-8"
        (tmp / "x").write_text("1")
    assert (tmp_path / "ck" / "step-00000003" / "x").read_text() == "1"
