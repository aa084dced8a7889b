"""The plan library (agent/torchplan): which plans a model can run, and an HF
LLaMA switched between plans through Distributed Checkpoint (real torch
processes over gloo), a refused plan, and refused checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from gearshift.agent import reference, torchplan
from gearshift.agent.torchplan import families
from gearshift.agent.torchplan.space import ModelShape, PlanRefused, check_plan, plan_space
from gearshift.agent.worker import EXIT_PLAN_REFUSED

needs_torch = pytest.mark.skipif(not reference.have_torch(), reason="torch not installed")
ARGS = ("--ckpt-every", "1000", "--layers", "2", "--dataset", "256")
LLAMA = families.shape("llama", layers=2)


@pytest.mark.parametrize("plan, field, words", [
    ({"tp": 3, "dp": 1}, "tp", "does not divide the 4 attention heads"),
    ({"pp": 3}, "pp", "more stages than the 2 layers"),
    ({"dp": 2, "offload": True}, "offload", "zero 1, 2 or 3"),
    ({"dp": 1, "tp": 2, "zero": 1}, "zero", "does not combine with tp"),
    ({"pp": 2, "ga": 1, "pp_schedule": "1f1b"}, "ga", "1F1B needs"),
    ({"dp": 3}, "dp", "!= world size 2"),
    ({"dp": 2, "ga": 3}, "ga", "does not divide the global batch 16"),
    ({"dp": 2, "sp": 2}, "sp", "not a plan field"),
])
def test_a_plan_the_model_cannot_run_is_refused_naming_the_field(plan, field, words):
    with pytest.raises(PlanRefused) as e:
        check_plan(plan, LLAMA, world_size=2 if "tp" not in plan and "pp" not in plan else None, global_batch=16)
    assert e.value.field == field and words in str(e.value)


def test_plan_space_holds_what_the_family_supports():
    no_tp = ModelShape(family="x", layers=2, heads=4, tp=False, why_no_tp="its attention is fused")
    with pytest.raises(PlanRefused, match="x has no tensor-parallel plan: its attention is fused"):
        check_plan({"tp": 2}, no_tp)
    gpt2 = families.shape("gpt2", layers=2)
    llama = list(plan_space(LLAMA, 4, global_batch=16))
    assert {"dp": 2, "tp": 2, "pp": 1, "zero": 2, "offload": True, "ga": 1, "micro_batch": 8, "grad_ckpt": False,
            "pp_schedule": "gpipe"} in llama
    assert all(p["tp"] in (1, 2, 4) and p["pp"] <= 2 and p["dp"] * p["tp"] * p["pp"] <= 4 for p in llama)
    assert not any(p["tp"] > 1 for p in plan_space(no_tp, 4, global_batch=16))
    assert any(p["tp"] == 2 for p in plan_space(gpt2, 4, global_batch=16))  # nn.Linear layers (gpt2_layers)
    assert any(p["pp"] == 2 for p in plan_space(gpt2, 4, global_batch=16))
    odd = ModelShape(family="x", layers=8, heads=6)
    assert {p["tp"] for p in plan_space(odd, 4)} == {1, 2, 3}


@needs_torch
def test_the_worker_exits_plan_refused_before_it_builds_anything(tmp_path):
    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"tp": 3}), "WORLD_SIZE": "3", "GEARSHIFT_STEPS": "2",
           "GEARSHIFT_GLOBAL_BATCH": "16", "GEARSHIFT_CKPT_DIR": str(tmp_path)}
    r = subprocess.run(torchplan.command(*ARGS), env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_PLAN_REFUSED and "'tp'" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not any(tmp_path.iterdir())


def _losses(path):
    return {r["step"]: r["loss"] for r in map(json.loads, open(path))}


@needs_torch
@pytest.mark.slow  # ~2.5 min on a loaded 2-core box: 8 rank launches
@pytest.mark.timeout(900)
def test_llama_switches_zero3_tp_pp_through_dcp_and_keeps_its_trajectory(tmp_path):
    """DP2+ZeRO-3 -> TP2 -> PP2 (1F1B, GA2), each resuming the last one's DCP
    checkpoint, trains the same losses as an uninterrupted single rank (float64);
    a corrupt newest checkpoint, then one of another model, are refused and
    the job resumes from the last good one."""
    ck, log = tmp_path / "switched", tmp_path / "switched.jsonl"
    chain = [({"dp": 2, "zero": 3}, 2), ({"tp": 2}, 4), ({"pp": 2, "ga": 2, "pp_schedule": "1f1b"}, 6)]
    for g, (plan, steps) in enumerate(chain):
        codes, err = torchplan.run_local("llama", plan, steps, 16, ck, extra_args=ARGS, generation=g + 1,
                                         env={"GEARSHIFT_LOSS_LOG": str(log)})
        assert codes == [0, 0], err[-2000:]
    m = json.loads((ck / "manifest.json").read_text())
    assert m["step"] == 6 and m["format"] == "gearshift-dcp-v1" and (ck / m["path"] / ".metadata").exists()
    codes, _ = torchplan.run_local("llama", {"dp": 1}, 6, 16, tmp_path / "base", extra_args=ARGS,
                                   env={"GEARSHIFT_LOSS_LOG": str(tmp_path / "base.jsonl")})
    got, base = _losses(log), _losses(tmp_path / "base.jsonl")
    assert sorted(got) == list(range(1, 7)) and codes == [0]
    assert max(abs(got[s] - base[s]) / base[s] for s in base) < 1e-12

    # the newest checkpoint (step 6) corrupt: refused, resume from step 4 (the one kept before it)
    for f in (ck / m["path"]).glob("*.distcp"):
        f.write_bytes(b"garbage")
    log2 = tmp_path / "again.jsonl"
    codes, err = torchplan.run_local("llama", {"dp": 1}, 6, 16, ck, extra_args=ARGS, generation=9,
                                     env={"GEARSHIFT_LOSS_LOG": str(log2)})
    assert codes == [0] and "refused checkpoint step-00000006: corrupt" in err, err[-2000:]
    again = _losses(log2)
    assert sorted(again) == [5, 6] and all(abs(again[s] - base[s]) / base[s] < 1e-12 for s in again)

    # a checkpoint of another model (gpt2) in this job's folder: refused at load, one line
    other = tmp_path / "other"
    codes, _ = torchplan.run_local("gpt2", {"dp": 1}, 1, 16, other, extra_args=ARGS)
    om = json.loads((other / "manifest.json").read_text())
    shutil.copytree(other / om["path"], ck / "step-00000099")
    (ck / "manifest.json").write_text(json.dumps({**om, "path": "step-00000099"}))
    codes, err = torchplan.run_local("llama", {"dp": 1}, 7, 16, ck, extra_args=ARGS, generation=10)
    assert codes == [0] and "refused checkpoint step-00000099: another model (gpt2" in err, err[-2000:]
    assert json.loads((ck / "manifest.json").read_text())["step"] == 7


@needs_torch
def test_a_profiling_run_reports_its_step_time_and_writes_no_checkpoint(tmp_path):
    prog = tmp_path / "progress.json"
    env = {**os.environ, "GEARSHIFT_PLAN": json.dumps({"dp": 1, "ga": 2}), "GEARSHIFT_STEPS": "100",
           "GEARSHIFT_GLOBAL_BATCH": "16", "GEARSHIFT_CKPT_DIR": str(tmp_path / "ck"), "GEARSHIFT_PROFILE_STEPS": "2",
           "GEARSHIFT_PROGRESS_FILE": str(prog), "MASTER_PORT": str(torchplan.free_port())}
    r = subprocess.run(torchplan.command(*ARGS), env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(prog.read_text())
    assert got["profiled"] == 2 and got["phases"]["iteration"] > 0 and got["step"] == 4
    ph = got["phases"]  # the fit's components: each a part of every step, so below its quantile
    assert all(0 < ph[k] < ph["iteration"] for k in ("forward", "backward", "optimizer")), ph
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


def test_switch_check_schedules_what_each_model_supports_and_catches_other_samples():
    from loadtest.switch_check import SCHEDULE, compare, schedule_for

    from gearshift.agent.reference import train as reference_train

    assert schedule_for("torchref") == SCHEDULE
    for model in ("torchref", "llama", "gpt2", "bert"):
        plans = [p for p, _, _ in schedule_for(model)]
        shape = reference_train.shape(reference_train.parse_args([])) if model == "torchref" else families.shape(model)
        for p in plans:  # every switch is in the model's plan space
            check_plan({k: v for k, v in __import__("msgspec").structs.asdict(p).items() if v is not None}, shape)
        assert any(p.offload and p.zero == 3 for p in plans)
        assert any(p.tp > 1 for p in plans) and any(p.pp > 1 for p in plans)
    base = [{"step": s, "loss": 1.0 / s, "samples": f"h{s}"} for s in range(1, 5)]
    holds = [1, 2, 3, 4, 5, 6, 7]
    assert compare(base, base, base, holds)["ok"]
    swapped = [dict(r, samples=f"h{5 - r['step']}") for r in base]
    got = compare(swapped, base, base, holds)
    assert got["same_samples"] is False and not got["ok"]


@needs_torch
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one rank, no process group: on purpose
def test_a_corrupt_or_another_models_dcp_checkpoint_is_refused_at_load_and_the_last_good_one_restored(tmp_path):
    """The fast, in-process version of the refusals above (one rank, no process
    group): ``ckpt.load_latest`` skips another model's checkpoint and a corrupt
    one with one line each, and restores the newest good one, tensors and step."""
    import torch
    from torch import nn

    from gearshift.agent.torchplan import ckpt
    from gearshift.agent.torchplan.parallel import Parallel
    from gearshift.agent.worker import latest_manifest, write_manifest

    plan = check_plan({"dp": 1}, ModelShape(family="mlp", layers=1, heads=1), world_size=1, global_batch=4)
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 1, dtype=torch.float64)

    def model(width: int, seed: int = 0):
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 1)).double()
        return Parallel(m, plan, loss_fn=nn.functional.mse_loss), ckpt.fingerprint("mlp", m)

    def save(par, fp, step, name="mlp"):
        folder = tmp_path / f"step-{step:08d}"
        folder.mkdir()
        ckpt.save(par, folder, {"model": name, "fingerprint": fp, "step": step})
        write_manifest(tmp_path, job_id="j", generation=1, step=step, fmt=ckpt.FORMAT, path=folder.name)
        return folder

    par, fp = model(8)
    par.train_step([x], [y])
    save(par, fp, 1)
    good = {k: v.clone() for k, v in par.root.state_dict().items()}
    par.train_step([x], [y])
    for f in save(par, fp, 2).glob("*.distcp"):  # the newer one corrupt
        f.write_bytes(b"garbage")
    other, other_fp = model(16)  # another model's, newest, and the manifest names it
    save(other, other_fp, 3, name="mlp-wide")

    fresh, _ = model(8, seed=7)
    lines: list[str] = []
    meta = ckpt.load_latest(fresh, tmp_path, latest_manifest(tmp_path), fp, lines.append)
    assert meta["step"] == 1 and len(lines) == 2 and not any("\n" in ln for ln in lines), lines
    assert lines[0].startswith("refused checkpoint step-00000003: another model (mlp-wide"), lines
    assert lines[1].startswith("refused checkpoint step-00000002: corrupt"), lines
    assert all(torch.equal(v, good[k]) for k, v in fresh.root.state_dict().items())
    # nothing good left: refused with one line, nothing half-applied
    shutil.rmtree(tmp_path / "step-00000001")
    before = {k: v.clone() for k, v in model(8, seed=7)[0].root.state_dict().items()}
    again, _ = model(8, seed=7)
    with pytest.raises(ckpt.CheckpointRefused, match="no loadable checkpoint of this model"):
        ckpt.load_latest(again, tmp_path, latest_manifest(tmp_path), fp, lambda m: None)
    assert all(torch.equal(v, before[k]) for k, v in again.root.state_dict().items())
